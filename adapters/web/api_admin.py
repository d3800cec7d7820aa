"""Admin routes under ``/api/admin/``: personas' soul sections, server guidelines, bot-wide rules, cortex
settings, token spending, the job queue and the users (counts only).

The same services, caps and version rules as the chat commands (``!persona``, ``!guidelines``, ``!rules``,
``!cortex settings``, ``!cortex budgets``): every change is a new version with who and why. Bot-wide things
are for the bot's admins; a server's guidelines and its settings scope for that server's admins, asked
live through the platform's :class:`bot.ports.AdminDirectory` on every request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, get_args

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from adapters.admin_directory import is_server_key
from adapters.web.auth import Caller
from adapters.web.errors import GONE, fail, not_found
from adapters.web.server import WebContext, ok, read_body
from adapters.web.userdata import persona_name
from bot.commands import MAX_NUMBER, CommandError
from bot.config import FREQUENCY_PRESETS, SOUL_SECTIONS
from bot.persona import section_title
from bot.prompt import unfilled
from bot.storage.base import Job, JobStatus
from bot.storage.personas import BOT_WIDE, TextKind, TextVersion
from bot.storage.rows import dt
from cortex.commands import setting_text
from cortex.memory.admin import BUDGET_KEYS
from cortex.personas.commands import MAX_SECTION_CHARS, new_section_refusal, section_key
from cortex.personas.guidelines import MAX_GUIDELINES_CHARS, MAX_RULE_CHARS, RULE_NAME
from cortex.settings import OVERRIDABLE, NotAllowed, SettingError, persona_scope, server_scope
from cortex.tiers import thresholds
from cortex.update import utc_midnight

JOB_STATUSES: tuple[JobStatus, ...] = get_args(JobStatus)
SPENDING_DAYS = 14
DAY = 86_400
MAX_HISTORY = 100  # versions listed per text (the newest)
JOBS_PAGE = 100  # jobs per page of the queue, newest first
MAX_VALUE_CHARS = 200
WEB = "on the web page"
CHANGED = ("it was changed meanwhile (it is at version {live}; your edit was based on version {based_on}): reload it, "
           "then make your change again")

log = logging.getLogger(__name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextBody(_Body):
    text: str
    version: int | None = Field(default=None, ge=0, le=MAX_NUMBER, description="the version the edit is based on")


class RuleChange(_Body):
    text: str | None = None
    enabled: bool | None = None
    version: int | None = Field(default=None, ge=0, le=MAX_NUMBER, description="the version the edit is based on")


class NewRule(_Body):
    name: str
    text: str


class VersionBody(_Body):
    version: int = Field(ge=1, le=MAX_NUMBER)


class SettingChange(_Body):
    persona: str
    server: str | None = None
    key: str
    value: str


# -- JSON shapes -----------------------------------------------------------------------------------


def history_json(versions: Sequence[TextVersion]) -> list[dict[str, Any]]:
    """The newest versions first: who, why, when (no texts: the live one is beside it)."""
    return [{"version": v.version, "author": v.author, "reason": v.reason, "created_at": v.created_at.isoformat(),
             "enabled": v.enabled, "chars": len(v.content)} for v in reversed(versions[-MAX_HISTORY:])]


def section_json(name: str, versions: Sequence[TextVersion]) -> dict[str, Any]:
    live = versions[-1] if versions else None
    return {"name": name, "title": section_title(name), "text": live.content if live else "",
            "version": live.version if live else 0, "position": live.position if live else 0,
            "history": history_json(versions)}


def guidelines_json(server: str, versions: Sequence[TextVersion]) -> dict[str, Any]:
    live = versions[-1] if versions else None
    return {"server": server, "text": live.content if live else "", "version": live.version if live else 0,
            "max_chars": MAX_GUIDELINES_CHARS, "history": history_json(versions)}


def rule_json(rule: TextVersion, versions: Sequence[TextVersion] = ()) -> dict[str, Any]:
    return {"name": rule.name, "text": rule.content, "enabled": rule.enabled, "position": rule.position,
            "version": rule.version, "author": rule.author, "created_at": rule.created_at.isoformat(),
            "history": history_json(versions)}


def job_json(job: Job) -> dict[str, Any]:
    """A job without its payload (ids of pairs and channels are nobody's business on a page)."""
    return {"id": job.id, "kind": job.kind, "key": job.key, "status": job.status, "attempts": job.attempts,
            "max_attempts": job.max_attempts, "last_error": job.last_error,
            "created_at": job.created_at.isoformat(), "run_after": job.run_after.isoformat(),
            "updated_at": job.updated_at.isoformat()}


def by_name(versions: Sequence[TextVersion]) -> dict[str, list[TextVersion]]:
    grouped: dict[str, list[TextVersion]] = {}
    for v in sorted(versions, key=lambda v: (v.name, v.version)):
        grouped.setdefault(v.name, []).append(v)
    return grouped


# -- checks of the URL ------------------------------------------------------------------------------


def server_key(text: str, *, bot_wide: bool = False) -> str:
    """A server key such as ``discord:123`` or ``matrix:!room:example.org`` (``*``, the bot-wide default
    guidelines, where ``bot_wide``); a 400 for anything else."""
    if bot_wide and text == BOT_WIDE:
        return text
    if not is_server_key(text):
        fail(400, f"{text[:60]!r} is no server key the bot uses: discord:<the server's id, digits as Discord "
                  "writes them> or matrix:!<room id> (like discord:123456 or matrix:!room:example.org)")
    return text


def job_id(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or not 1 <= int(text) <= MAX_NUMBER:
        fail(400, f"a job id is a number from 1 up, not {text[:20]!r}")
    return int(text)


def rule_name(text: str) -> str:
    name = text.lower()
    if not RULE_NAME.match(name):
        not_found(f"no rule called {text[:60]!r}")
    return name


def checked_text(text: str, limit: int, what: str, *, required: bool = False) -> str:
    text = text.strip()
    if required and not text:
        fail(422, f"give the {what}'s text")
    if len(text) > limit:
        fail(422, f"a {what} holds at most {limit:,} characters (this is {len(text):,})")
    return text


class AdminApi:
    """The handlers; each checks who may do it before it reads or changes anything."""

    def __init__(self, ctx: WebContext) -> None:
        self.ctx = ctx
        self.auth = ctx.auth
        self.storage = ctx.app.storage
        self.texts = ctx.app.storage.personas
        self.registry = ctx.app.personas
        self.repo = ctx.app.storage.admin

    async def server_admin(self, request: web.Request, raw: str, *, bot_wide: bool = False,
                           caller: Caller | None = None) -> tuple[Caller, str]:
        """The caller (401 without a session; ``caller`` when the handler has it already) and the server key
        (400), if they administer it (403)."""
        caller = caller or await self.auth.require(request)
        key = server_key(raw, bot_wide=bot_wide)
        allowed = self.auth.is_bot_admin(caller) if key == BOT_WIDE else await self.auth.is_server_admin(caller, key)
        if not allowed:
            fail(403, "only that server's admins may see or change this")
        return caller, key

    async def put_text(self, kind: TextKind, scope: str, name: str, text: str, caller: Caller, reason: str,
                       *, enabled: bool | None = None, based_on: int | None = None) -> bool:
        """A new version unless nothing changes; the prompt follows at once (as after a chat command). With
        ``based_on`` (the version the editor started from, 0: none), a 409 when another edit landed since."""
        versions = await self.texts.history(kind, scope, name)
        live = versions[-1] if versions else None
        newest = live.version if live else 0
        if based_on is not None and based_on != newest:
            fail(409, CHANGED.format(live=newest, based_on=based_on))
        if (live.content if live else "") == text and (enabled is None or live is None or enabled == live.enabled):
            return False  # e.g. the same text saved twice, or clearing what was never set
        author = caller.user_key
        if based_on is None:
            await self.texts.put(kind, scope, name, text, author=author, reason=reason, enabled=enabled)
        elif await self.texts.put_based_on(based_on, kind, scope, name, text, author=author, reason=reason,
                                           enabled=enabled) is None:
            latest = await self.texts.history(kind, scope, name)
            fail(409, CHANGED.format(live=latest[-1].version if latest else 0, based_on=based_on))
        await self.registry.load()
        return True

    # -- overview --------------------------------------------------------------------------------

    async def overview(self, request: web.Request) -> web.Response:
        caller = await self.auth.require(request)
        servers: dict[str, str] = {}
        for ref in await self.auth.servers(caller.user_key):
            servers.setdefault(ref.key, ref.name)
        is_bot_admin = self.auth.is_bot_admin(caller)
        if is_bot_admin:
            for text in await self.texts.current_all("guidelines"):
                if text.scope != BOT_WIDE:
                    servers.setdefault(text.scope, text.scope)
        return ok({"is_bot_admin": is_bot_admin, "servers": [{"key": k, "name": n} for k, n in servers.items()],
                   "personas": self.registry.names(), "default_persona": self.registry.default_name})

    # -- personas --------------------------------------------------------------------------------

    async def persona_scope(self, raw: str) -> tuple[str, str]:
        name = persona_name(self.ctx, raw)
        row = await self.texts.get_persona(name)
        if row is None:
            not_found(f"no persona called {raw[:80]!r}")
        return row.name, str(row.id)

    async def personas(self, request: web.Request) -> web.Response:
        await self.auth.require_bot_admin(request)
        found = []
        for row in await self.texts.list_personas():
            history = by_name(await self.texts.history("soul", str(row.id)))
            order = [t.name for t in await self.texts.current("soul", str(row.id))]
            found.append({"name": row.name, "language": row.language, "source": row.source,
                          "sections": [section_json(name, history.get(name, [])) for name in order]})
        return ok({"personas": found, "known_sections": list(SOUL_SECTIONS), "max_chars": MAX_SECTION_CHARS})

    async def section(self, raw_persona: str, raw_section: str, *, new: bool = False) -> tuple[str, str, str]:
        """(persona, its scope, the section's key): a 404 for a persona the bot lacks, or a section it has
        not and that is none of the standard ones; with ``new`` (a save), a name of the admin's own makes a
        new section, as ``!persona edit`` does (a 422 for one this close to a standard name: a typo)."""
        name, scope = await self.persona_scope(raw_persona)
        try:
            key = section_key(raw_section)
        except CommandError as exc:
            if new:
                fail(422, str(exc))
            not_found(f"no section called {raw_section[:60]!r}")
        if key in SOUL_SECTIONS or await self.texts.history("soul", scope, key):
            return name, scope, key
        if not new:
            own = [t.name for t in await self.texts.current("soul", scope) if t.name not in SOUL_SECTIONS]
            not_found(f"{name} has no section {key!r} (sections: {', '.join([*SOUL_SECTIONS, *own])})")
        if (refused := new_section_refusal(name, key)) is not None:
            fail(422, refused)
        return name, scope, key

    async def put_section(self, request: web.Request) -> web.Response:
        caller = await self.auth.require_bot_admin(request)
        body = await read_body(request, TextBody)
        _, scope, key = await self.section(request.match_info["persona"], request.match_info["section"], new=True)
        text = checked_text(body.text, MAX_SECTION_CHARS, "soul section")
        if not text.strip() and key not in SOUL_SECTIONS and not await self.texts.history("soul", scope, key):
            fail(422, f"there is no section {key} to empty (a new section needs its text)")
        changed = await self.put_text("soul", scope, key, text, caller, f"edited {WEB}", based_on=body.version)
        return ok(section_json(key, await self.texts.history("soul", scope, key))
                  | {"changed": changed, "unknown_variables": unfilled(text)})

    async def revert_section(self, request: web.Request) -> web.Response:
        caller = await self.auth.require_bot_admin(request)
        wanted = await read_body(request, VersionBody)
        name, scope, key = await self.section(request.match_info["persona"], request.match_info["section"])
        if await self.texts.revert("soul", scope, key, wanted.version, author=caller.user_key) is None:
            not_found(f"{name} has no version {wanted.version} of section {key}")
        await self.registry.load()
        return ok(section_json(key, await self.texts.history("soul", scope, key)))

    # -- guidelines ------------------------------------------------------------------------------

    async def guidelines(self, request: web.Request) -> web.Response:
        _, key = await self.server_admin(request, request.match_info["server"], bot_wide=True)
        return ok(guidelines_json(key, await self.texts.history("guidelines", key, "")))

    async def put_guidelines(self, request: web.Request) -> web.Response:
        caller, key = await self.server_admin(request, request.match_info["server"], bot_wide=True)
        body = await read_body(request, TextBody)
        text = checked_text(body.text, MAX_GUIDELINES_CHARS, "server's guidelines")
        changed = await self.put_text("guidelines", key, "", text, caller, f"{'set' if text else 'cleared'} {WEB}",
                                      based_on=body.version)
        return ok(guidelines_json(key, await self.texts.history("guidelines", key, "")) | {"changed": changed})

    async def revert_guidelines(self, request: web.Request) -> web.Response:
        caller, key = await self.server_admin(request, request.match_info["server"], bot_wide=True)
        wanted = await read_body(request, VersionBody)
        if await self.texts.revert("guidelines", key, "", wanted.version, author=caller.user_key) is None:
            not_found(f"there is no version {wanted.version} of the guidelines of {key}")
        await self.registry.load()
        return ok(guidelines_json(key, await self.texts.history("guidelines", key, "")))

    # -- rules -----------------------------------------------------------------------------------

    async def live_rules(self) -> list[TextVersion]:
        """The rules as ``!rules list`` shows them (a removed one is a version with no text)."""
        return [r for r in await self.texts.current("rule", BOT_WIDE) if r.content.strip()]

    async def live_rule(self, raw: str) -> TextVersion:
        name = rule_name(raw)
        for rule in await self.live_rules():
            if rule.name == name:
                return rule
        not_found(f"no rule called {name!r}")

    async def rules(self, request: web.Request) -> web.Response:
        await self.auth.require_bot_admin(request)
        history = by_name(await self.texts.history("rule", BOT_WIDE))
        return ok({"rules": [rule_json(r, history.get(r.name, [])) for r in await self.live_rules()],
                   "max_chars": MAX_RULE_CHARS})

    async def rule_response(self, name: str, changed: bool) -> web.Response:
        versions = await self.texts.history("rule", BOT_WIDE, name)
        return ok(rule_json(versions[-1], versions) | {"changed": changed,
                                                       "unknown_variables": unfilled(versions[-1].content)})

    async def put_rule(self, request: web.Request) -> web.Response:
        caller = await self.auth.require_bot_admin(request)
        change = await read_body(request, RuleChange)
        live = await self.live_rule(request.match_info["name"])
        if change.text is None and change.enabled is None:
            fail(422, "give the rule's text, or enabled (true or false), or both")
        text = live.content if change.text is None else checked_text(change.text, MAX_RULE_CHARS, "rule",
                                                                       required=True)
        enabled = live.enabled if change.enabled is None else change.enabled
        reason = f"edited {WEB}" if text != live.content else f"switched {'on' if enabled else 'off'} {WEB}"
        changed = await self.put_text("rule", BOT_WIDE, live.name, text, caller, reason, enabled=enabled,
                                      based_on=change.version)
        return await self.rule_response(live.name, changed)

    async def add_rule(self, request: web.Request) -> web.Response:
        caller = await self.auth.require_bot_admin(request)
        new = await read_body(request, NewRule)
        name = new.name.lower()
        if not RULE_NAME.match(name):
            fail(422, "a rule's name is one word of letters, digits, - or _ (at most 40)")
        if any(r.name == name for r in await self.live_rules()):
            fail(409, f"rule {name!r} exists already")
        text = checked_text(new.text, MAX_RULE_CHARS, "rule", required=True)
        await self.put_text("rule", BOT_WIDE, name, text, caller, f"added {WEB}", enabled=True)
        return await self.rule_response(name, True)

    async def revert_rule(self, request: web.Request) -> web.Response:
        caller = await self.auth.require_bot_admin(request)
        wanted = await read_body(request, VersionBody)
        name = rule_name(request.match_info["name"])
        if await self.texts.revert("rule", BOT_WIDE, name, wanted.version, author=caller.user_key) is None:
            not_found(f"rule {name} has no version {wanted.version}")
        await self.registry.load()
        return await self.rule_response(name, True)

    # -- settings --------------------------------------------------------------------------------

    async def settings_view(self, persona: str, server: str | None) -> dict[str, Any]:
        """What ``!cortex settings`` shows: every effective value and where it comes from, and the tiers."""
        effective = await self.ctx.app.cortex.resolver.effective(persona, server)
        settings = [{"key": key, "value": value, "shown": setting_text(value), "source": effective.sources[key],
                     "overridable": key in OVERRIDABLE, "accepts": OVERRIDABLE.get(key, "")}
                    for key, value in effective.settings.model_dump().items()]
        return {"persona": persona, "server": server, "settings": settings,
                "tiers": [{"percent": pct, "at": at} for pct, at in thresholds(effective.settings)],
                "presets": {name: list(pcts) for name, pcts in FREQUENCY_PRESETS.items()},
                "scope": server_scope(server) if server else persona_scope(persona)}

    async def settings(self, request: web.Request) -> web.Response:
        raw_server, server = request.query.get("server", ""), None
        if raw_server:
            _, server = await self.server_admin(request, raw_server)
        else:
            await self.auth.require_bot_admin(request)
        persona = persona_name(self.ctx, request.query.get("persona", "") or self.registry.default_name)
        return ok(await self.settings_view(persona, server))

    async def put_setting(self, request: web.Request) -> web.Response:
        caller = await self.auth.require(request)
        change = await read_body(request, SettingChange)
        server = None
        if change.server:
            _, server = await self.server_admin(request, change.server, caller=caller)  # one count against the limit
        elif not self.auth.is_bot_admin(caller):
            fail(403, "settings of a persona everywhere are for the bot's admins; give a server you administer")
        if len(change.value) > MAX_VALUE_CHARS:
            fail(422, f"a setting's value has at most {MAX_VALUE_CHARS} characters")
        persona = persona_name(self.ctx, change.persona)
        scope = server_scope(server) if server else persona_scope(persona)
        try:
            changed = await self.ctx.app.cortex.resolver.change(
                scope, change.key, change.value, bot_admin=self.auth.is_bot_admin(caller), author=caller.user_key)
        except NotAllowed as exc:
            fail(403, str(exc))
        except SettingError as exc:  # a value the key does not take (or a model the LLM server refuses)
            fail(422, str(exc))
        return ok(await self.settings_view(persona, server) | {"key": change.key, "note": changed.note})

    # -- spending, jobs, users -------------------------------------------------------------------

    async def spending_days(self, midnight: float) -> list[dict[str, Any]]:
        starts = [midnight - i * DAY for i in range(SPENDING_DAYS)]
        await self.storage.flush_audit()
        days: list[dict[str, Any]] = [{"date": dt(start).date().isoformat(), "by_purpose": {}, "input": 0,
                                       "output": 0, "calls": 0} for start in starts]
        for use in await self.repo.llm_usage(starts, midnight + DAY):
            day = days[use.day]
            day["by_purpose"][use.purpose] = {"input": use.input_tokens, "output": use.output_tokens,
                                              "calls": use.calls}
            day["input"] += use.input_tokens
            day["output"] += use.output_tokens
            day["calls"] += use.calls
        return days

    async def budgets(self, request: web.Request) -> web.Response:
        await self.auth.require_bot_admin(request)
        midnight = utc_midnight(time.time())
        settings = (await self.ctx.app.cortex.resolver.effective(self.registry.default_name)).settings
        spent = await self.ctx.app.cortex.store.tokens_since(midnight)
        c = self.ctx.app.config
        budgets = {
            "cortex": {key: getattr(settings, key) for key in BUDGET_KEYS},
            "cortex_spent_today": spent,
            "bot_remaining_today": max(0, settings.bot_daily_token_budget - spent)
            if settings.bot_daily_token_budget else None,
            "reply_prompt": {"history_tokens": c.history.history_tokens, "summary_tokens": c.history.summary_tokens,
                             "cortex_files": settings.prompt_tokens, "knowledge": c.memory.prompt_tokens,
                             "relevant_items": c.memory.relevant_items,
                             "recalled_messages": c.memory.recalled_messages},
            "persona": self.registry.default_name,
        }
        return ok({"days": await self.spending_days(midnight), "budgets": budgets})

    async def jobs(self, request: web.Request) -> web.Response:
        await self.auth.require_bot_admin(request)
        status = request.query.get("status") or None
        if status is not None and status not in JOB_STATUSES:
            fail(400, f"status is one of {', '.join(JOB_STATUSES)}")
        before = job_id(request.query["before"]) if "before" in request.query else None  # (the next page)
        by_status = (await self.storage.health.queue()).by_status
        found = await self.storage.list_jobs(next((s for s in JOB_STATUSES if s == status), None),
                                             limit=JOBS_PAGE + 1, before=before)
        return ok({"counts": {s: by_status.get(s, 0) for s in JOB_STATUSES},
                   "jobs": [job_json(j) for j in found[:JOBS_PAGE]],
                   "older": found[JOBS_PAGE - 1].id if len(found) > JOBS_PAGE else None})

    async def retry_job(self, request: web.Request) -> web.Response:
        admin = await self.auth.require_bot_admin(request)
        number = job_id(request.match_info["id"])
        job = await self.storage.get_job(number)
        if job is None:
            not_found(f"no job {number}")
        if job.status != "failed":
            fail(409, f"job {number} is {job.status}: only failed jobs are retried")
        if not await self.repo.requeue_failed_job(number):
            fail(409, f"job {number} was not requeued: a job of the same kind and key is queued already, or it "
                      "changed meanwhile")
        requeued = await self.storage.get_job(number)
        if requeued is None:  # a forget-me deleted its user's jobs meanwhile
            fail(409, GONE)
        log.info("job %d (%s, %s) queued again by %s on the web page", number, job.kind, job.key, admin.user_key)
        return ok(job_json(requeued))

    async def users(self, request: web.Request) -> web.Response:
        await self.auth.require_bot_admin(request)
        found = await self.repo.users()
        return ok({"users": [{"key": u.key, "name": u.name, "messages": u.messages, "items": u.items,
                              "pairs": u.pairs, "last_seen": dt(u.last_seen).isoformat()} for u in found],
                   "total": await self.repo.count_users()})


def routes(ctx: WebContext) -> list[web.RouteDef]:
    api = AdminApi(ctx)
    section = "/api/admin/personas/{persona}/sections/{section}"
    guidelines = "/api/admin/servers/{server}/guidelines"
    return [
        web.get("/api/admin/overview", api.overview),
        web.get("/api/admin/personas", api.personas),
        web.put(section, api.put_section),
        web.post(section + "/revert", api.revert_section),
        web.get(guidelines, api.guidelines),
        web.put(guidelines, api.put_guidelines),
        web.post(guidelines + "/revert", api.revert_guidelines),
        web.get("/api/admin/rules", api.rules),
        web.post("/api/admin/rules", api.add_rule),
        web.put("/api/admin/rules/{name}", api.put_rule),
        web.post("/api/admin/rules/{name}/revert", api.revert_rule),
        web.get("/api/admin/settings", api.settings),
        web.put("/api/admin/settings", api.put_setting),
        web.get("/api/admin/budgets", api.budgets),
        web.get("/api/admin/jobs", api.jobs),
        web.post("/api/admin/jobs/{id}/retry", api.retry_job),
        web.get("/api/admin/users", api.users),
    ]
