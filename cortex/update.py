"""The cortex update job: guards, the conversation it reads, the tool loop, the audit row.

Guards (all read from the database, so they hold across restarts): the cortex is enabled for the
persona/server; no other update of the pair ran within ``cooldown_seconds`` (a resumed job does not
block itself); the pair's and the bot's daily token budgets are not spent; the pair has at least
four messages. A guard that stops an update records a *skipped* run with the reason. One update per
pair at a time is the job queue's per-key rule.

The loop is bounded by ``max_rounds``. Each accepted ``write_file`` is a new file version the
moment it is made, so a crash leaves every file at a whole version; the interrupted job is queued
again by the worker pool and runs afresh on the current files, and the run the crash left marked
running is closed as failed (the answer its last round reserved taken back out of its tokens).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial

from bot.config import Config, ConfigError, CortexConfig
from bot.history import in_reply_order, label_tokens
from bot.jobs import LeaseLost
from bot.llm.base import (
    CUT_OFF_CALL,
    MAX_CALL_ARGUMENT_CHARS,
    ChatMessage,
    Completion,
    LLMProvider,
    LLMRequest,
    turn_calls,
)
from bot.llm.errors import LLMBadRequest, LLMError, LLMTimeout
from bot.persona import ConfigPersonas, Persona, PersonaSource
from bot.storage.base import Job, LLMCallRecord, StoredMessage
from bot.storage.engine import is_missing_reference
from bot.summary import TIME_TOKENS
from bot.text import one_line_name, plural
from bot.tokens import PER_MESSAGE_OVERHEAD, TokenEstimator, fit_to_budget
from cortex.files import CortexFiles
from cortex.memory.store import MemoryStore
from cortex.memory.tools import MEMORY_TOOLS, MemoryTools
from cortex.prompts import conversation_message, system_prompt
from cortex.settings import SettingsResolver
from cortex.store import CortexStore, FileVersion, Pair, RunStatus
from cortex.tiers import tier_stage
from cortex.tools import TOOLS, CortexTools, ToolOutcome

log = logging.getLogger(__name__)

MIN_MESSAGES = 4
CUT_MARK = " […]"
PROMPT_OVERHEAD = 1_500  # tokens of an update's system prompt and tool definitions, for the first round's estimate
MAX_CALLS_PER_TURN = 25  # tool calls of one model turn that run; the rest are refused (each result costs input)
BUDGETS = {"pair": "this pair's daily token budget", "bot": "the bot's daily cortex token budget"}
CUT_OFF = CUT_OFF_CALL + " Write one file per turn, and keep it shorter."  # (running it would save half a file)
# An answer the output limit stopped before it called a tool: what it meant to save never came.
def cut_short(archived: int) -> str:
    """Why an update whose answer the output limit cut before it saved anything failed (``archived``: the items
    it archived before that)."""
    done = f"after archiving {plural(archived, 'item')}, " if archived else ""
    return (f"the answer reached the output limit {done}before anything {'else ' if archived else ''}was saved; an "
            "admin may raise the cortex max_tokens")


CUT_SHORT = cut_short(0)


@dataclass(frozen=True, slots=True)
class Outcome:
    status: RunStatus
    reason: str = ""
    run_id: int | None = None


def utc_midnight(now: float) -> float:
    day = datetime.fromtimestamp(now, tz=UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day.timestamp()


class CortexUpdater:
    def __init__(
        self,
        config: Config,
        store: CortexStore,
        files: CortexFiles,
        resolver: SettingsResolver,
        llm: LLMProvider,
        estimator: TokenEstimator,
        memory: MemoryStore | None = None,
        personas: PersonaSource | None = None,
    ) -> None:
        self.memory = memory
        self.personas = personas or ConfigPersonas(config)
        self.config = config
        self.store = store
        self.files = files
        self.resolver = resolver
        self.llm = llm
        self.estimator = estimator
        self._temperature_rejected: set[str] = set()  # models that refused a temperature

    async def guard(self, pair: Pair, settings: CortexConfig, *, job_id: int | None = None) -> str | None:
        """Why an update of ``pair`` must not run now, or None."""
        if not settings.enabled:
            return "the cortex is disabled for this persona or server"
        now = time.time()
        last = await self.store.last_update_started(pair.id, exclude_job=job_id)
        if last is not None and now - last < settings.cooldown_seconds:
            wait = settings.cooldown_seconds - (now - last)
            return f"cooldown: the last update started {now - last:.0f} s ago (wait {wait:.0f} s more)"
        midnight = utc_midnight(now)
        pair_budget = settings.daily_token_budget
        if pair_budget and await self.store.tokens_since(midnight, pair.id) >= pair_budget:
            return f"this pair's daily token budget ({settings.daily_token_budget:,}) is spent"
        bot_budget = settings.bot_daily_token_budget
        if bot_budget and await self.store.tokens_since(midnight) >= bot_budget:
            return f"the bot's daily cortex token budget ({bot_budget:,}) is spent"
        said = len(await self.store.pair_messages(pair.user_id, pair.persona, MIN_MESSAGES))
        if said < MIN_MESSAGES:
            return f"too little conversation to learn from yet ({said} messages; {MIN_MESSAGES} needed)"
        return None

    async def run_job(self, job: Job) -> None:
        pair = await self.store.pair_by_id(int(job.payload["pair_id"]))
        if pair is None:
            log.info("cortex job %d: the pair no longer exists (forgotten); nothing to do", job.id)
            return
        try:
            await self._run_job(job, pair)
        except Exception as exc:
            # A forget-me between the read above and the run's first write: its rows point at a pair gone.
            if is_missing_reference(exc) and await self.store.pair_by_id(pair.id) is None:
                log.info("cortex job %d: the pair was forgotten meanwhile; nothing to do", job.id)
                return
            raise

    async def after_interrupted(self, job: Job) -> None:
        """A job whose worker stopped was queued again or failed: the run it left marked running is closed now (a
        guard may skip the next attempt, or none may come, and only a run's start closed them)."""
        closed = await self.store.close_interrupted(int(job.payload["pair_id"]))
        if closed:
            log.info("cortex job %d: run(s) %s, interrupted with their process, are marked failed", job.id,
                     ", ".join(map(str, closed)))

    async def _run_job(self, job: Job, pair: Pair) -> None:
        tier = str(job.payload.get("tier", "manual"))
        await self.store.close_interrupted(pair.id, own_job=job.id)  # (before a guard: a skip starts no run)
        effective = await self.resolver.effective(pair.persona, job.payload.get("server_key"))
        settings = effective.settings
        reason = await self.guard(pair, settings, job_id=job.id)
        if reason is not None:
            await self.store.record_skip(pair.id, job.id, tier, reason)
            log.info("cortex job %d (pair %d, tier %s) skipped: %s", job.id, pair.id, tier, reason)
            return
        fence = partial(self.store.storage.holds_job, job.id, job.locked_by, job.attempts) if job.locked_by else None
        await self.run(pair, tier, settings, job_id=job.id, fence=fence)

    async def run(self, pair: Pair, tier: str, settings: CortexConfig, *, job_id: int | None = None,
                  fence: Callable[[], Awaitable[bool]] | None = None) -> Outcome:
        try:
            persona = self.personas.persona(pair.persona)
        except ConfigError:
            reason = f"the persona {pair.persona} was deleted"
            return Outcome("skipped", reason, await self.store.record_skip(pair.id, job_id, tier, reason))
        user = await self.store.user_of(pair)
        history, history_tokens = await self._history(pair, settings.history_tokens)
        channel_of = {message.id: channel for message, channel in history}  # (each answer after its message)
        history = [(message, channel_of[message.id]) for message in in_reply_order([m for m, _ in history])]
        if len(history) < MIN_MESSAGES:
            reason = f"too little conversation to learn from ({len(history)} messages; {MIN_MESSAGES} needed)"
            run_id = await self.store.record_skip(pair.id, job_id, tier, reason)
            return Outcome("skipped", reason, run_id)
        estimate = PROMPT_OVERHEAD + history_tokens
        # not even the first round fits (as _reserve counts it: its input and its longest answer)
        if spent := await self._budget_spent(pair, settings, next_round=estimate + settings.max_tokens):
            reason = f"{spent} would run out: the update reads about {estimate:,} tokens and may write " \
                     f"{settings.max_tokens:,}"
            return Outcome("skipped", reason, await self.store.record_skip(pair.id, job_id, tier, reason))
        current = await self.files.ensure(pair, persona.language, user.display_name)
        run_id = await self.store.start_run(pair.id, job_id, tier)
        tools = await self._tools(pair, tier, run_id, settings, current, job_id)
        tools.fence = fence
        started = time.monotonic()
        totals = [0, 0, 0]  # rounds, input tokens, output tokens
        try:
            status, reason = await self._loop(pair, persona, user.display_name, tier, settings, history, tools, totals,
                                              estimate)
        except LLMError as exc:
            await self._failed(exc, tools, totals, started)
            raise  # transient errors are retried by the job queue
        except LeaseLost as exc:  # (the worker that has the job now runs the update)
            await self._finish_failed(tools, totals, started, f"interrupted: {exc}", f"LeaseLost: {exc}")
            raise
        except Exception as exc:  # a bug or the database: the run says so now (not "the process stopped" later)
            await self._broke(exc, tools, totals, started)
            raise
        except BaseException:  # cancelled (shutdown, a lost lease) or a bug: what was spent replaces the estimate
            await asyncio.shield(self.store.record_progress(run_id, totals[0], totals[1], totals[2]))
            raise
        await self.store.finish_run(
            run_id, status, reason=reason, rounds=totals[0], files_read=tools.files_read,
            files_written=tools.files_written, input_tokens=totals[1], output_tokens=totals[2],
            duration_ms=int((time.monotonic() - started) * 1000),
        )
        log.info(
            "cortex run %d (pair %d, tier %s): %s after %d round(s), %d file(s) written, %d/%d tokens",
            run_id, pair.id, tier, status, totals[0], len(set(tools.files_written)), totals[1], totals[2],
        )
        return Outcome(status, reason, run_id)

    async def _tools(self, pair: Pair, tier: str, run_id: int, settings: CortexConfig,
                     current: dict[str, FileVersion], job_id: int | None) -> CortexTools:
        """The run's tools. The earlier attempts of a retried job count: their saves against the write limits,
        and the shrink guard measures a file they saved against the file as the job found it (else each attempt
        after a 529 or a time-out could keep half of what the one before left)."""
        earlier = [r for r in await self.store.job_runs(pair.id, job_id) if r != run_id] if job_id is not None else []
        memory_tools = MemoryTools(self.memory, pair.id, run_id) if self.memory is not None else None
        if memory_tools is not None and earlier:
            await memory_tools.count_earlier(earlier)
        tools = CortexTools(self.files, pair, tier, run_id, settings.file_max_chars, memory_tools,
                            seen={name: version.version for name, version in current.items()})
        for saved in await self.store.versions_of_runs(pair.id, earlier):
            tools.earlier_writes[saved.filename] = tools.earlier_writes.get(saved.filename, 0) + 1
            # (only while the job's save is still the newest: a person's edit since is the new starting point)
            if saved.filename not in tools.started_with and current[saved.filename].run_id in earlier:
                found = await self.store.version(pair.id, saved.filename, saved.version - 1)
                tools.started_with[saved.filename] = found.content if found is not None else ""
        return tools

    async def _failed(self, exc: LLMError, tools: CortexTools, totals: list[int], started: float) -> None:
        await self._finish_failed(tools, totals, started, exc.user_message, f"{type(exc).__name__}: {exc.detail}")
        log.warning("cortex run %d (pair %d) failed: %s", tools.run_id, tools.pair.id, type(exc).__name__)

    async def _broke(self, exc: Exception, tools: CortexTools, totals: list[int], started: float) -> None:
        try:
            await asyncio.shield(self._finish_failed(tools, totals, started, "an internal error stopped the update "
                                                     "(see the bot's log)", f"{type(exc).__name__}: {exc}"))
        except Exception:  # (the database itself may be what failed: the original error is the one to raise)
            log.warning("could not record that cortex run %d failed", tools.run_id, exc_info=True)

    async def _finish_failed(self, tools: CortexTools, totals: list[int], started: float, reason: str, error: str
                             ) -> None:
        """The run recorded as failed: why (for people) and the error (for the log's reader), with what it did."""
        await self.store.finish_run(
            tools.run_id, "failed", reason=reason, rounds=totals[0], files_read=tools.files_read,
            files_written=tools.files_written, input_tokens=totals[1], output_tokens=totals[2],
            duration_ms=int((time.monotonic() - started) * 1000), error=error[:1000],
        )

    async def _history(self, pair: Pair, budget: int) -> tuple[list[tuple[StoredMessage, str]], int]:
        """The pair's newest exchanges within ``budget`` tokens, returned oldest first, and their tokens. When
        fewer than ``MIN_MESSAGES`` fit (long pasted texts), the newest ``MIN_MESSAGES`` come, each cut to its
        share of the budget: the update learns from the conversation instead of being skipped as too short."""
        chosen: list[tuple[StoredMessage, str]] = []
        spent = 0
        before: int | None = None
        while True:
            page = await self.store.pair_messages(pair.user_id, pair.persona, 100, before_id=before)
            for message, channel in page:
                cost = self._entry_cost(message, channel)
                if spent + cost > budget and chosen:
                    if len(chosen) < MIN_MESSAGES <= len(page):  # (on the first page: it holds 100)
                        return self._cut_to_fit(page[:MIN_MESSAGES], budget)
                    chosen.reverse()
                    return chosen, spent
                chosen.append((message, channel))
                spent += cost
            if len(page) < 100:
                chosen.reverse()
                return chosen, spent
            before = page[-1][0].id

    def _entry_cost(self, message: StoredMessage, channel: str) -> int:
        """What a message costs in the update's transcript (:func:`cortex.prompts.conversation_message`): its time,
        channel and speaker before its text, its further lines indented. Its text alone was counted: a hundred
        short messages sent three times the budget."""
        header = TIME_TOKENS + self.estimator.raw_count(f" · {one_line_name(channel)}]")  # (the time as a summary's)
        return self.estimator.scale(message.token_count + header + label_tokens(message, self.estimator)
                                    + PER_MESSAGE_OVERHEAD)

    def _cut_to_fit(self, newest: list[tuple[StoredMessage, str]], budget: int
                    ) -> tuple[list[tuple[StoredMessage, str]], int]:
        """``newest`` (newest first) oldest first, each cut to an equal share of ``budget`` (its time, channel and
        name included, unless they alone take more); their tokens."""
        chosen, spent = [], 0
        for message, channel in reversed(newest):
            cut = self._fit_entry(message, channel, budget // len(newest))
            chosen.append((cut, channel))
            spent += self._entry_cost(cut, channel)
        return chosen, spent

    def _fit_entry(self, message: StoredMessage, channel: str, share: int) -> StoredMessage:
        """``message`` with its text cut so that its transcript entry costs at most ``share`` (the text at least 10
        tokens): cut again, shorter, while the indentation of the cut text's lines still takes it over."""
        target = share - self._entry_cost(replace(message, text="", token_count=0), channel)
        fitted = message
        for _ in range(4):
            if self._entry_cost(fitted, channel) <= share:
                break
            text = fit_to_budget(self.estimator, message.text, max(target, 10), CUT_MARK)  # (in tokens: any script)
            fitted = replace(message, text=text, token_count=self.estimator.raw_count(text))
            if target <= 10:
                break
            target -= max(self._entry_cost(fitted, channel) - share, 0)
        return fitted

    async def _loop(
        self, pair: Pair, persona: Persona, user_name: str, tier: str, settings: CortexConfig,
        history: list[tuple[StoredMessage, str]], tools: CortexTools, totals: list[int], next_round: int,
    ) -> tuple[RunStatus, str]:
        model = settings.model or self.config.model_for(persona)
        zone = self.config.skills.zone  # (the bot's: the reply prompt's date is today's there too)
        system = system_prompt(
            persona, user_name, tier_stage(tier, settings), datetime.now(zone).strftime("%Y-%m-%d"),
            settings.file_max_chars, with_memory=self.memory is not None,
        )
        messages: list[ChatMessage] = [ChatMessage("user", conversation_message(persona, history, user_name, zone))]
        for round_number in range(1, settings.max_rounds + 1):
            if spent := await self._reserve(pair, settings, tools.run_id, totals, next_round):
                return "failed", f"stopped: {spent} would run out {'before' if round_number == 1 else 'during'} " \
                                 "the update"
            try:
                completion = await self._call(model, system, messages, settings)
            except LLMTimeout:  # (the server may have read, and billed, the whole input: counted as read)
                totals[0], totals[1] = round_number, totals[1] + next_round
                raise
            totals[0] = round_number
            used = self._used(completion, next_round)
            totals[1] += used[0]
            totals[2] += used[1]
            next_round = sum(used)  # the next round costs at least as much: its input holds this one's
            # Spending is counted in the database as it happens, so every process (and the next round's
            # check) sees it: two processes cannot each spend a whole daily budget.
            await self.store.record_progress(tools.run_id, totals[0], totals[1], totals[2])
            if completion.stop_reason == "refused":  # what came is no answer ("I'm sorry, but I…")
                return "failed", "the provider's content filter stopped the update"
            if not completion.tool_calls:
                learned = tools.files_written or (tools.memory is not None and tools.memory.written)
                archived = len(tools.memory.forgotten) if tools.memory is not None else 0
                if not learned and completion.stop_reason == "max_tokens":  # (cut short: not "nothing new")
                    return "failed", cut_short(archived)
                if not learned and tools.refused_writes:  # (not "nothing new": it had something, and none of it saved)
                    return "success", refused_writes(tools.refused_writes)
                if learned:
                    return "success", ""
                return "success", (f"it archived {plural(archived, 'item')} and found nothing new to record"
                                   if archived else "the model found nothing new to record")
            # (a whole file is one call's argument: as long as the settings let a file be, JSON's escapes twice over)
            planned = turn_calls(completion, MAX_CALLS_PER_TURN, CUT_OFF,
                                 argument_chars=max(MAX_CALL_ARGUMENT_CHARS, 2 * settings.file_max_chars + 1024))
            messages.append(ChatMessage("assistant", completion.text, tool_calls=tuple(p.echoed for p in planned)))
            for each in planned:
                outcome = ToolOutcome(each.refusal, True) if each.refusal else await tools.execute(each.call)
                messages.append(
                    ChatMessage("tool", outcome.content, tool_call_id=each.echoed.id, is_error=outcome.is_error)
                )
                next_round += self.estimator.count(outcome.content)  # the results are the next input
        return "failed", f"stopped after {settings.max_rounds} rounds without finishing (max_rounds)"

    def _used(self, completion: Completion, expected_input: int) -> tuple[int, int]:
        """The call's (input, output) tokens as its server reports them (a negative count credits nothing);
        where it reports none (an OpenAI-compatible server may send no usage), the bot's own estimate: the
        input it expected, the answer counted. Counted as 0, a run spent free of every budget."""
        reported = max(completion.usage.input_tokens, 0), max(completion.usage.output_tokens, 0)
        said = completion.text + "".join(call.raw_arguments or json.dumps(call.arguments, ensure_ascii=False)
                                         for call in completion.tool_calls)
        return reported[0] or expected_input, reported[1] or (self.estimator.count(said) if said else 0)

    async def _reserve(self, pair: Pair, settings: CortexConfig, run_id: int, totals: list[int],
                       next_round: int) -> str | None:
        """Which daily budget the next round (its input estimated at ``next_round`` tokens, its answer at
        most ``max_tokens``) would exceed; else count that as spent at once (the call's real figures replace
        it), so that the checks of updates running meanwhile, here or in another process, see it. The check
        and the count are one step for the whole fleet: two processes cannot both take the budget's last
        round."""
        over = await self.store.reserve(
            run_id, pair.id, utc_midnight(time.time()),
            (totals[0], totals[1] + next_round, totals[2] + settings.max_tokens),
            cost=next_round + settings.max_tokens, pair_budget=settings.daily_token_budget,
            bot_budget=settings.bot_daily_token_budget, answer=settings.max_tokens)
        return None if over is None else BUDGETS[over]

    async def _budget_spent(self, pair: Pair, settings: CortexConfig, *, next_round: int = 0) -> str | None:
        """Which daily budget (the pair's or the bot's) today's recorded spending plus what the next round
        will likely cost would exceed, if any: a run stops before it overshoots, not after."""
        midnight = utc_midnight(time.time())
        if settings.daily_token_budget and (
                await self.store.tokens_since(midnight, pair.id) + next_round > settings.daily_token_budget):
            return BUDGETS["pair"]
        if settings.bot_daily_token_budget and (
                await self.store.tokens_since(midnight) + next_round > settings.bot_daily_token_budget):
            return BUDGETS["bot"]
        return None

    async def _call(
        self, model: str, system: str, messages: list[ChatMessage], settings: CortexConfig
    ) -> Completion:
        temperature = None if model in self._temperature_rejected else settings.temperature
        request = LLMRequest(
            system=system, messages=tuple(messages), model=model, max_tokens=settings.max_tokens,
            temperature=temperature, tools=TOOLS + MEMORY_TOOLS if self.memory is not None else TOOLS,
            tools_required=True,  # (its work is done through them: a server without tools fails it, visibly)
        )
        started = time.monotonic()
        try:
            completion = await self.llm.complete(request)
        except LLMBadRequest as exc:
            if temperature is None or "temperature" not in exc.detail.lower():
                await self._record_call(model, None, started, type(exc).__name__)
                raise
            # Some models refuse a sampling temperature: use the server's default from now on.
            self._temperature_rejected.add(model)
            log.warning("model %s rejects a temperature; cortex updates use its default from now on", model)
            return await self._call(model, system, messages, settings)
        except LLMError as exc:
            await self._record_call(model, None, started, type(exc).__name__)
            raise
        await self._record_call(model, completion, started, "")
        return completion

    async def _record_call(self, model: str, completion: Completion | None, started: float, error: str) -> None:
        await self.store.storage.record_llm_call(
            LLMCallRecord(
                "cortex_update", completion.model if completion and completion.model else model,
                completion.usage.input_tokens if completion else 0,
                completion.usage.output_tokens if completion else 0,
                int((time.monotonic() - started) * 1000), error,
            )
        )


def refused_writes(reasons: list[str]) -> str:
    """A run whose every file write was refused, in a line: how many, and why the first one was."""
    first = reasons[0].removeprefix("refused: ").split(". ", 1)[0]
    return f"nothing was saved: {plural(len(reasons), 'file write')} refused (the first: {first[:160]})"
