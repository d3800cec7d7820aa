"""The skills offered in one reply, and how a call runs: allowed → within the daily limit → run with a
time limit → result capped → audited.

:class:`SkillTools` is the core's :class:`bot.ports.ToolProvider`: for each reply it picks the skills
that are enabled here (see :mod:`cortex.skills.policy`), admin-only ones only for admins, and those
with trigger words only when the message has one of them. :class:`SkillToolbox.execute` never raises:
an unknown or unoffered skill, arguments that are not a JSON object, a daily limit reached, a
timeout, a skill's own failure or a bug each become a tool error the model sees, and the reply goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bot.config import SkillsConfig
from bot.llm.base import ToolCall, ToolSpec
from bot.ports import PromptContext, ToolOutcome
from bot.storage.core import Storage
from bot.storage.skills import SkillExecution
from bot.text import quoted
from cortex.skills.base import Skill, SkillContext, SkillFailure, SkillResult, admitted, redaction_values
from cortex.skills.policy import SkillPolicy

log = logging.getLogger(__name__)
DAY = 86_400.0
BUILTIN_TIMEOUT = 30.0  # seconds; HTTP and MCP skills have their own configured limits
AUDIT_VALUE_CHARS = 200
STATUS = {"remember": "noting that…", "current_time": "checking the time…"}
# Never offered in an incognito stretch: nothing of it may be kept (an admin's paused words written into a soul or a
# server's guidelines outlived the stretch, as a memory item would).
MEMORY_WRITES = frozenset({"remember", "edit_soul", "edit_guidelines"})
# Every offered tool is sent with every model call of a reply. OpenAI takes at most 128 tools, and an MCP
# server (or several) offering hundreds - each up to 9,000 characters - overflowed any model's context:
# every reply failed. Past either bound the later skills (MCP tools come last) are not offered.
MAX_OFFERED_TOOLS = 128
MAX_OFFERED_CHARS = 200_000


def status_line(name: str) -> str:
    if name in STATUS:
        return STATUS[name]
    return "looking that up…" if name.startswith("search") else f"using {name}…"


def sanitised(arguments: Any, secrets: Sequence[str]) -> str:
    """The arguments as JSON for the audit: secret values replaced, long strings cut."""
    hidden = redaction_values(tuple(secrets))

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            for secret in hidden:
                value = value.replace(secret, "***")
            return value if len(value) <= AUDIT_VALUE_CHARS else value[:AUDIT_VALUE_CHARS] + "…"
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in list(value.items())[:50]}
        if isinstance(value, list):
            return [clean(v) for v in value[:50]]
        return value
    return json.dumps(clean(arguments), ensure_ascii=False)[:4000]


def triggered(triggers: Sequence[str], message: str) -> bool:
    """Whether ``message`` says one of ``triggers`` (any case; a phone's typographic apostrophe is the plain one)."""
    lowered = message.casefold().replace("\u2019", "'")
    return not triggers or any(t.casefold() in lowered for t in triggers if t.strip())


INCOGNITO_ARGUMENTS = json.dumps({"withheld": "called during an incognito stretch"})


@dataclass
class SkillToolbox:
    skills: dict[str, Skill]
    context: SkillContext
    config: SkillsConfig
    storage: Storage
    incognito: bool = False  # the audit keeps no arguments: a pause leaves no trace of what was said

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        return tuple(ToolSpec(s.info.name, s.info.description, s.info.input_schema) for s in self.skills.values())

    @property
    def max_rounds(self) -> int:
        return self.config.max_rounds

    @property
    def token_cap(self) -> int:
        return self.config.reply_token_cap

    def status(self, call: ToolCall) -> str:
        return status_line(call.name)

    async def execute(self, call: ToolCall) -> ToolOutcome:
        skill = self.skills.get(call.name)
        if skill is None:
            named = quoted(call.name)  # as the model sent it, cut: it goes back into the next request
            return ToolOutcome(f"there is no tool {named} here; the tools are {', '.join(self.skills)}", True)
        started = time.monotonic()
        reserved = await self._reserve(skill, call)
        result = await self._run(skill, call) if reserved is not None else SkillResult(
            f"{call.name} was used {self.config.calls_per_user_per_day} times for this person today; that is the "
            "limit. Answer without it.", True)
        cap = self.config.result_max_chars
        content = result.content if len(result.content) <= cap else (
            result.content[:cap] + f"\n[… cut: the result had {len(result.content):,} characters]")
        await self._audit(skill, call, result, int((time.monotonic() - started) * 1000), reserved or 0)
        return ToolOutcome(content, result.is_error)

    async def _reserve(self, skill: Skill, call: ToolCall) -> int | None:
        """With a daily limit, the call counted before it runs (parallel calls cannot all pass the same check):
        its audit row's id, 0 when nothing was reserved (no limit, a call that will be refused anyway, a
        database error: then it is audited after it ran), None at the limit."""
        limit = self.config.calls_per_user_per_day
        if not limit or call.arguments is None or not admitted(
                skill.info, is_admin=self.context.is_admin, is_bot_admin=self.context.is_bot_admin):
            return 0
        since = self.context.now.timestamp() - DAY
        try:  # by key: an MCP tool renamed by a clash counts on
            return await self.storage.skills.reserve(self._row(skill, call, SkillResult("did not finish", True), 0),
                                                     since, limit)
        except Exception:
            log.exception("could not count a call of skill %s against the daily limit", call.name)
            return 0

    async def _run(self, skill: Skill, call: ToolCall) -> SkillResult:
        if call.arguments is None:
            return SkillResult(f"{call.name} needs a JSON object as input; got: {call.raw_arguments[:200]!r}", True)
        if not admitted(skill.info, is_admin=self.context.is_admin, is_bot_admin=self.context.is_bot_admin):
            # (also checked when offered: never trust the model)
            return SkillResult(f"{call.name} is for admins only; the person you answer is not one", True)
        timeout = None if skill.info.origin != "builtin" else BUILTIN_TIMEOUT
        try:
            return await asyncio.wait_for(skill.run(call.arguments, self.context), timeout)
        except SkillFailure as exc:
            return SkillResult(f"{call.name}: {exc}", True)
        except TimeoutError:
            return SkillResult(f"{call.name} timed out; answer without it", True)
        except Exception:
            log.exception("skill %s failed unexpectedly", call.name)
            return SkillResult(f"{call.name} failed because of an internal error; answer without it", True)

    def _row(self, skill: Skill, call: ToolCall, result: SkillResult, duration_ms: int) -> SkillExecution:
        ctx = self.context
        return SkillExecution(
            skill.info.key, ctx.persona, ctx.user_key, ctx.channel_key, ctx.server_key or "",
            INCOGNITO_ARGUMENTS if self.incognito else sanitised(
                call.arguments if call.arguments is not None else call.raw_arguments[:500], skill.info.secrets),
            not result.is_error, result.content[:300] if result.is_error and not self.incognito else "", duration_ms,
            "model", time.time())

    async def _audit(self, skill: Skill, call: ToolCall, result: SkillResult, duration_ms: int, reserved: int
                     ) -> None:
        row = self._row(skill, call, result, duration_ms)
        try:
            if reserved:
                await self.storage.skills.finish(reserved, row.arguments, row.ok, row.error, duration_ms)
            else:
                await self.storage.skills.record(row)
        except Exception:  # the audit must not cost the reply
            log.exception("could not record the execution of skill %s", call.name)


class SkillTools:
    """The core's tool provider: every skill source, filtered per reply."""

    def __init__(self, config: SkillsConfig, storage: Storage, sources: Sequence[Callable[[], Sequence[Skill]]]
                 ) -> None:
        self.config = config
        self.storage = storage
        self.policy = SkillPolicy(config, storage)
        self.sources = list(sources)
        self._skipped: set[tuple[str, str]] = set()  # clashing names already logged (once each)

    def all(self) -> list[Skill]:
        seen: dict[str, Skill] = {}
        for source in self.sources:
            for skill in source():
                info = skill.info
                first = seen.setdefault(info.name, skill)  # built-ins first: a clashing later name is skipped
                if first is not skill and (info.name, info.key) not in self._skipped:
                    self._skipped.add((info.name, info.key))
                    log.warning("skill %s (%s%s) is not offered: a %s skill has that name", info.name, info.origin,
                                f" {info.server}" if info.server else "", first.info.origin)
        return list(seen.values())

    async def toolbox(self, context: PromptContext) -> SkillToolbox | None:
        if not self.config.enabled:
            return None
        chosen: dict[str, Skill] = {}
        incognito = context.incognito
        if incognito is None:
            incognito = await self.storage.incognito.active(context.user_db_id, context.persona)
        for skill in self.all():
            info = skill.info
            if not admitted(info, is_admin=context.is_admin, is_bot_admin=context.is_bot_admin) \
                    or not triggered(info.triggers, context.message) \
                    or not (context.is_dm or triggered(info.group_triggers, context.message)):
                continue
            if incognito and info.origin == "builtin" and info.name in MEMORY_WRITES:
                continue
            if (await self.policy.effective(info, context.persona, context.server_key, context.channel_key,
                                            context.parent_channel_key)).enabled:
                chosen[info.name] = skill
        chosen = self._within_bounds(chosen)
        if not chosen:
            return None
        ctx = SkillContext(context.user_db_id, context.user_key, context.user_name, context.persona,
                           context.channel_key, context.server_key, context.is_dm, context.is_admin, context.now,
                           context.is_bot_admin, context.message_key)
        return SkillToolbox(chosen, ctx, self.config, self.storage, incognito)

    def _within_bounds(self, chosen: dict[str, Skill]) -> dict[str, Skill]:
        """The skills in order (built-ins, http, MCP) while at most :data:`MAX_OFFERED_TOOLS` of them and
        :data:`MAX_OFFERED_CHARS` of their definitions; the log names what was left out (once each)."""
        kept: dict[str, Skill] = {}
        size = 0
        for name, skill in chosen.items():
            info = skill.info
            full = len(kept) >= MAX_OFFERED_TOOLS  # (then its definition is not weighed: thousands cost a reply)
            cost = 0 if full else len(name) + len(info.description) + len(json.dumps(info.input_schema, default=str))
            if not full and size + cost <= MAX_OFFERED_CHARS:
                kept[name] = skill
                size += cost
            elif ("(too many)", info.key) not in self._skipped:
                self._skipped.add(("(too many)", info.key))
                log.warning("skill %s (%s%s) is not offered: a reply offers at most %d tools and %d characters of "
                            "their definitions", name, info.origin, f" {info.server}" if info.server else "",
                            MAX_OFFERED_TOOLS, MAX_OFFERED_CHARS)
        return kept
