"""One message's way through the core: store → assemble → call → stream → store → notify.

:meth:`ConversationCore.reply` returns a :class:`ReplyStream`; iterating it yields the reply's text
as it arrives. The user's message is stored before the model is called, so an LLM failure (raised
as :class:`bot.llm.errors.LLMError` while iterating) loses nothing. After the reply is stored the
core records its metrics and notifies observers (rolling summaries, cortex tiers), which only
enqueue durable jobs: a reply never waits on background work.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import get_args

from bot import metrics
from bot.config import Config
from bot.errors import USER_TOLD, EmptyMessage, MessageTooLong, MessageWithdrawn, StretchEnded
from bot.history import HistoryWindow, build_window, with_late_answers
from bot.llm.base import (
    ChatMessage,
    Completion,
    LLMProvider,
    LLMRequest,
    StreamEnd,
    TextDelta,
    ToolCall,
    Usage,
    turn_calls,
)
from bot.llm.errors import LLMBadResponse, LLMError, LLMNoAnswer, LLMRefused
from bot.persona import ConfigPersonas, Persona, PersonaSource
from bot.ports import (
    Exchange,
    ExchangeObserver,
    IncomingMessage,
    PromptContext,
    PromptSection,
    PromptSectionProvider,
    ReplyPreparer,
    SectionSlot,
    Toolbox,
    ToolOutcome,
    ToolProvider,
)
from bot.prompt import PromptParts, fit_soul, history_turns, render_system
from bot.storage.base import Channel, LLMCallRecord, ReplyStats, Storage, StoredMessage, Summary, User
from bot.storage.engine import StaleReference
from bot.storage.incognito import believable
from bot.storage.sources import ReplySource
from bot.summary import SummaryEngine, budgets_for
from bot.text import error_line, storable, visible
from bot.tokens import PER_MESSAGE_OVERHEAD, TokenEstimator, fit_to_budget
from bot.turns import Turns

log = logging.getLogger(__name__)

SECTION_BUDGET = 2000  # tokens each slot of section providers may use
PREVIOUS_CHARS = 1000  # of a channel's last message kept for ReplyPreparer (they use its start)
SOUL_BUDGET = 3000  # tokens of soul sections (an imported card may hold far more)
MAX_REPLY_CHARS = 40_000  # a reply's text shown and stored: ~20 Discord messages (a broken server sent MBs)
MAX_CALLS_PER_ROUND = 8  # tool calls of one model turn a reply runs; the rest are refused
# A platform message taken back is remembered this long (by key): its deletion may reach the bot before the
# message is stored (a reconnect replaying events, a moderation bot deleting within milliseconds), and then the
# message, stored after, must go too. At most WITHDRAWN_KEPT keys (the oldest go first).
WITHDRAWN_KEPT_SECONDS = 600.0
WITHDRAWN_KEPT = 10_000
CUT_NOTE = "\n\n[… the rest of this reply was cut: it was too long]"
# A reply the model ended at its output limit: without a word, it read as the bot breaking off mid-sentence.
LENGTH_NOTE = "\n\n[… cut here: the reply reached the model's length limit; an admin can raise [llm] max_tokens]"


class _Shown:
    """How much of a reply's text went out: nothing past :data:`MAX_REPLY_CHARS` is shown or stored (a
    reply that long would fill the history window and break the next request)."""

    def __init__(self) -> None:
        self.chars = 0
        self.cut = False
        self._pieces: list[str] = []

    def take(self, text: str) -> str:
        """The part of ``text`` still within the limit (the note, once, where it is crossed)."""
        room = MAX_REPLY_CHARS - self.chars
        self.chars += len(text)
        if self.cut:
            return ""
        if room < len(text):
            self.cut = True
            text = text[:max(room, 0)] + CUT_NOTE
        self._pieces.append(text)
        return text

    @property
    def text(self) -> str:
        """Everything shown so far."""
        return "".join(self._pieces)


def _reads_stretch(window: HistoryWindow, user_id: int, persona: str, since: float) -> bool:
    """Whether ``window`` holds words of the user's running stretch with the persona (a message sent after the
    pause but handled before an older one, or an answer to such a message): a reply that reads them belongs to
    the stretch too."""
    # (an answer stored in the stretch answers one of its messages: one to a message from before, written as the
    # pause began, is stamped at its message's time; see Storage.add_message)
    return any(m.user_id == user_id and m.persona == persona and m.created_at.timestamp() >= since
               and (m.role == "user" or m.reply_to is not None) for m in window.messages)


@dataclass(frozen=True, slots=True)
class ReplyResult:
    text: str
    user_message: StoredMessage
    reply: StoredMessage
    window: HistoryWindow
    summary_used: bool
    prompt_tokens: int
    completion: Completion


class ReplyStream:
    """Async iterator over the reply's text deltas; ``result`` is set once it is exhausted."""

    def __init__(self, core: ConversationCore, message: IncomingMessage, persona: Persona, is_admin: bool,
                 is_bot_admin: bool) -> None:
        self._core = core
        self._message = message
        self._persona = persona
        self._is_admin = is_admin or is_bot_admin
        self._is_bot_admin = is_bot_admin
        self.result: ReplyResult | None = None
        # Set by whoever shows the reply: called with a short line while a tool runs ("looking that up…").
        self.on_status: Callable[[str], Awaitable[None]] | None = None
        self.rounds = 0  # model calls the reply took (more than one when it used tools)
        self.incognito: bool | None = None  # whether its author is incognito with the persona, once known
        self.usage = Usage()  # tokens of the model calls that finished
        # Set once its answer's turn came (bot.turns): a "still working" line shown before it would stand
        # between the pieces of the answer before it.
        self.turn_taken = asyncio.Event()
        # Set by whoever shows the reply: called after its last piece, or with what made it fail (before it is
        # raised), before the next answer here begins.
        self.on_answered: Callable[[], Awaitable[object]] | None = None
        self.on_failed: Callable[[BaseException], Awaitable[object]] | None = None
        # Set by whoever hands messages in: called once the message is stored (the next one it has may go ahead:
        # an adapter keeps a room's messages in the order they came, see ``adapters.matrix_order``).
        self.on_stored: Callable[[], object] | None = None

    def __aiter__(self) -> AsyncIterator[str]:
        return self._core._run(self)

    async def text(self) -> str:
        """Consume the whole stream and return the reply text (also when it was not stored: see ``_finish``)."""
        shown = [piece async for piece in self]
        return self.result.text if self.result is not None else "".join(shown).strip()


class ConversationCore:
    def __init__(
        self,
        config: Config,
        storage: Storage,
        llm: LLMProvider,
        estimator: TokenEstimator,
        summaries: SummaryEngine,
        *,
        section_providers: Sequence[PromptSectionProvider] = (),
        observers: Sequence[ExchangeObserver] = (),
        personas: PersonaSource | None = None,
        tools: ToolProvider | None = None,
        preparers: Sequence[ReplyPreparer] = (),
    ) -> None:
        self.tools = tools
        self.config = config
        self.personas = personas or ConfigPersonas(config)
        self.storage = storage
        self.llm = llm
        self.estimator = estimator
        self.summaries = summaries
        self.section_providers = list(section_providers)
        self.observers = list(observers)
        self.preparers = list(preparers)
        self._window_sizes: dict[int, int] = {}  # channel id -> messages in its last window
        self._last_text: dict[str, str] = {}  # channel key -> the last message stored there (by this process)
        self._withdrawn: dict[str, float] = {}  # platform message key -> when it was taken back (oldest first)
        self.turns = Turns()  # one answer at a time per person and channel
        # Called when a message of an ended incognito stretch was deleted (the app drops its words from its caches).
        self.on_stretch_dropped: Callable[[], None] | None = None

    def reply(self, message: IncomingMessage, persona: str | None = None, *, is_admin: bool = False,
              is_bot_admin: bool = False) -> ReplyStream:
        """Validate ``message`` (raises :class:`bot.errors.UserFacingError`) and prepare its reply;
        ``is_admin``: the author is an admin where it was sent (admin-only skills are offered)."""
        text = storable(message.text).strip()
        if not visible(text):
            raise EmptyMessage()
        limit = self.config.bot.max_message_chars
        if len(text) > limit:
            raise MessageTooLong(
                f"That message is {len(text):,} characters long; the limit is {limit:,}. "
                "Please split it into shorter messages."
            )
        return ReplyStream(self, message, self.personas.persona(persona), is_admin, is_bot_admin)

    async def _run(self, stream: ReplyStream) -> AsyncIterator[str]:
        message, persona = stream._message, stream._persona
        began = time.monotonic()
        text = storable(message.text).strip()  # as it is stored and as the preparers see it
        self._prepare(message, persona, text)
        # In line before it is stored, answered after this person's answer before it here is stored (bot.turns).
        place = self.turns.join((message.channel_key, message.author_key))
        try:
            await place.before_store()  # (stored after the message ahead of it: its history holds that one)
            user, channel, user_msg = await self._store_incoming(message, persona, text)
            place.stored()
            if stream.on_stored is not None:
                stream.on_stored()
            self._remember_last(message.channel_key, user_msg.text)
            await place.wait()
            stream.turn_taken.set()
            try:
                async for piece in self._answer(stream, began + place.waited_seconds, user, channel, user_msg,
                                                place.waited):
                    yield piece
            except Exception as exc:
                if stream.on_failed is not None:  # said before the next answer here begins
                    await self._tell(stream.on_failed, exc, channel.id)
                raise
            if stream.on_answered is not None:  # shown whole before the next answer here begins
                await self._tell(stream.on_answered, None, channel.id)
        finally:
            place.leave()

    SUMMARY_CUT = "\n[… the rest is left out: over this persona's summary budget]"

    def _within(self, summary: Summary | None, budget: int) -> Summary | None:
        """The summary cut to the replying persona's ``summary_tokens``: it was written to the budget of the
        persona whose reply asked for it (a channel's summary is every persona's there), and one of 924 tokens
        went whole into a prompt whose summary budget was 40."""
        if summary is None or summary.token_count <= budget:
            return summary
        text = fit_to_budget(self.estimator, summary.text, budget, self.SUMMARY_CUT)
        if not text.removesuffix(self.SUMMARY_CUT).strip():  # (none of it fits: no section, and not a source)
            return None
        return replace(summary, text=text, token_count=self.estimator.count(text))

    async def _summary_for(self, channel_id: int, history_from: datetime | None) -> Summary | None:
        """The channel's rolling summary, unless it tells of talk before ``history_from`` (what the reply's author
        could not see; a summary whose first message is gone counts as such)."""
        summary = await self.storage.latest_summary(channel_id)
        if summary is None or history_from is None:
            return summary
        began = await self.storage.message_time(summary.covers_from_id)
        return summary if began is not None and began >= history_from else None

    @staticmethod
    async def _tell(hook: Callable[..., Awaitable[object]], failure: Exception | None, channel_id: int) -> None:
        """Run a reply's ``on_answered`` / ``on_failed`` hook; its own failure is logged (its caller, which shows
        the reply, tries again and says what went wrong)."""
        try:
            await (hook() if failure is None else hook(failure))
        except Exception as exc:
            log.warning("showing the reply in channel %d failed: %s", channel_id, error_line(exc))

    async def _answer(self, stream: ReplyStream, began: float, user: User, channel: Channel,
                      user_msg: StoredMessage, waited: bool) -> AsyncIterator[str]:
        """The answer to the stored ``user_msg`` (``waited``: written after an answer before it; see ``_run``)."""
        message, persona = stream._message, stream._persona
        budgets = budgets_for(self.config, persona)
        # Whether the author is incognito is asked once, alongside the window (the tools and the tiers need it).
        sent = user_msg.created_at.timestamp()
        window, (incognito_since, in_ended) = await asyncio.gather(build_window(
            self.storage,
            self.estimator,
            channel.id,
            budget=budgets.history_tokens,
            min_exchanges=self.config.history.min_exchanges,
            before_id=user_msg.id,
            size_hint=self._window_sizes.get(channel.id, 0),
            viewer=(user.id, persona.name),
            since=message.history_from,
            labelled=not message.is_dm,  # (as history_turns labels them below)
        ), self.storage.incognito.at(user.id, user.key, persona.name, sent))
        if waited:  # the answers written meanwhile were stored after this message: they belong in its prompt
            late = await with_late_answers(self.storage, self.estimator, window, channel.id, user_msg.id,
                                           (user.id, persona.name), self.config.history.min_exchanges)
            if late is None or self.was_withdrawn(message):  # deleted (or its author forgotten) while it waited
                # (a stretch's message deleted by its end: its author is there to be told)
                raise StretchEnded() if in_ended and not self.was_withdrawn(message) else MessageWithdrawn()
            window = late
        # In the stretch by the message's own time (one sent before the pause, handled after it, is not; one sent
        # in a stretch that ended before it was stored is answered as in it, and goes), or only for what its
        # history held (the stretch's words: the reply is the stretch's, the message stays outside it).
        own_stretch = in_ended or (incognito_since is not None and sent >= incognito_since)
        reads = not own_stretch and incognito_since is not None and _reads_stretch(
            window, user.id, persona.name, incognito_since)
        if len(self._window_sizes) > 10_000:
            self._window_sizes.clear()
        self._window_sizes[channel.id] = len(window.messages)
        summary = self._within(await self._summary_for(channel.id, message.history_from), budgets.summary_tokens)
        # In the bot's zone: the date the prompt tells, and the dates of what its sections show, are its.
        now = (believable(message.sent_at) or datetime.now(UTC)).astimezone(self.config.skills.zone)
        context = PromptContext(
            persona=persona.name,
            language=persona.language,
            user_db_id=user.id,
            user_key=user.key,
            user_name=user.display_name,
            channel_key=channel.key,
            is_dm=message.is_dm,
            server_key=message.server_key,
            message=user_msg.text,
            now=now,
            in_prompt=frozenset(m.id for m in (*window.messages, user_msg)),
            previous=window.messages[-1].text if window.messages else "",
            is_admin=stream._is_admin,
            is_bot_admin=stream._is_bot_admin,
            message_key=message.message_key,
            parent_channel_key=message.parent_channel_key,
            incognito=own_stretch or reads,
        )
        stretch_read = incognito_since if reads else None
        stream.incognito = context.incognito  # before the first piece of text
        sections: dict[str, list[PromptSection]] = {slot: [] for slot in get_args(SectionSlot)}
        # Concurrently: while one waits (the memory search for its query's embedding), the others work.
        built = await asyncio.gather(*(p.sections(context, SECTION_BUDGET) for p in self.section_providers))
        for provider, provided in zip(self.section_providers, built, strict=True):
            sections[provider.slot].extend(provided)
        if not any(p.slot == "rules" for p in self.section_providers) and self.config.bot.global_rules.strip():
            sections["rules"].append(PromptSection("Rules", self.config.bot.global_rules))
        toolbox = await self.tools.toolbox(context) if self.tools is not None else None
        system = render_system(
            PromptParts(
                rules=sections["rules"],
                guidelines=sections["guidelines"],
                persona=fit_soul(persona, self.estimator, SOUL_BUDGET),
                cortex=sections["cortex"],
                knowledge=sections["knowledge"],
                summary=summary,
                tools=toolbox is not None,
            ),
            {
                "char_name": persona.name,
                "user_name": user.display_name,
                "language": persona.language,
                "date": now.strftime("%A, %d %B %Y"),
            },
        )
        turns = history_turns(window.messages, label_speakers=not message.is_dm, persona=persona.name)
        turns += history_turns([user_msg], label_speakers=not message.is_dm)
        # Stored messages carry their token counts: only the system prompt is tokenised here.
        raw_prompt = self.estimator.raw_count(system) + sum(
            m.token_count + PER_MESSAGE_OVERHEAD for m in (*window.messages, user_msg)
        )
        model = self.config.model_for(persona)
        request = LLMRequest(
            system=system,
            messages=tuple(turns),
            model=model,
            max_tokens=self.config.llm.max_tokens,
            temperature=self.config.temperature_for(persona),
        )
        if toolbox is not None:  # the tool definitions are part of the prompt the model is billed for
            raw_prompt += self.estimator.raw_count(" ".join(
                f"{s.name} {s.description} {json.dumps(s.input_schema)}" for s in toolbox.specs))
        done: list[Completion] = []
        started = time.monotonic()
        try:
            async for text in self._generate(request, toolbox, stream, done):
                yield text
            completion = done[0]
            # A reply the provider's filter stopped, after some text or before any, is neither kept nor sent back
            # to the model: kept, it would get later requests refused too (the person sees why, under the text).
            if completion.stop_reason == "refused":  # (not "could not read": it read, and was stopped)
                raise LLMRefused("the provider's content filter stopped the reply")
            if not visible(completion.text):  # (zero-width spaces, a BOM, a soft hyphen: a blank message)
                raise LLMBadResponse("the model returned an empty reply")
        except LLMError as exc:  # the rounds that finished (an empty answer, tools before an outage) were billed,
            # and so was the input of one whose stream broke off
            billed_in, billed_out = exc.billed
            await self.storage.record_llm_call(
                LLMCallRecord(
                    "reply", model, stream.usage.input_tokens + billed_in, stream.usage.output_tokens + billed_out,
                    int((time.monotonic() - started) * 1000), type(exc).__name__, estimated_input_tokens=raw_prompt,
                )
            )
            # (the person sees the failure in its place: USER_TOLD lets a terminal chat leave this line out)
            log.warning("reply in channel %d failed: %s", channel.id, type(exc).__name__, extra={USER_TOLD: True})
            if in_ended:  # a message of an ended stretch, stored after its end: it goes now, answered or not
                await self._drop_from_ended_stretch(user_msg, message.channel_key)
            raise
        except BaseException:  # (the reply cancelled or abandoned, a bug): such a message goes all the same
            if in_ended:
                await asyncio.shield(self._drop_from_ended_stretch(user_msg, message.channel_key))
            raise
        duration_ms = int((time.monotonic() - started) * 1000)
        finished = await self._finish(
            persona, user, channel, user_msg, window, summary, raw_prompt, completion, duration_ms, message,
            stream.rounds, began, incognito=context.incognito,
            # (a message sent before a stretch began: its reply belongs before it too, not in it)
            before_stretch=incognito_since is not None and not context.incognito, stretch_read=stretch_read,
        )
        if finished is None:
            return
        stream.result, exchange = finished
        used = [s for slot in sections.values() for section in slot for s in section.sources]
        if summary is not None:
            used.append(ReplySource("summary", summary.version))
        # Independent of each other: their queries go to the database together instead of one after another
        # (all three end before a failure to record the sources is raised).
        outcomes = await asyncio.gather(self.storage.sources.record(exchange.reply.id, used),
                                        self._check_summary(exchange, window, summary), self._observe(exchange),
                                        return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _generate(
        self, request: LLMRequest, toolbox: Toolbox | None, stream: ReplyStream, done: list[Completion]
    ) -> AsyncIterator[str]:
        """The model's text as it streams, over as many rounds as tool calls need (at most the toolbox's
        ``max_rounds``; the last round, or the first over the token cap, must answer in text). Each
        round's text streams at once; rounds are joined by a blank line. Appends the whole completion:
        its text is what was shown (cut at :data:`MAX_REPLY_CHARS`, and then no further round runs)."""
        messages, usage = list(request.messages), Usage()
        texts: list[str] = []
        rounds = toolbox.max_rounds if toolbox is not None else 1
        ended: list[Completion] = []
        shown = _Shown()
        for number in range(rounds):
            last = toolbox is None or number == rounds - 1 or (
                usage.input_tokens + usage.output_tokens >= toolbox.token_cap)
            offered = replace(request, messages=tuple(messages), tools=toolbox.specs if toolbox else (),
                              tool_choice="none" if last else "auto")
            async for piece in self._round(offered, shown, any(t.strip() for t in texts), ended):
                yield piece
            completion = ended[-1]
            texts.append(completion.text)
            usage = Usage(usage.input_tokens + completion.usage.input_tokens,
                          usage.output_tokens + completion.usage.output_tokens)
            stream.usage = usage  # what the rounds so far cost, counted also when a later one fails
            if last or toolbox is None or not completion.tool_calls or shown.cut:
                break
            planned = turn_calls(completion, MAX_CALLS_PER_ROUND)
            messages.append(ChatMessage("assistant", completion.text, tuple(p.echoed for p in planned)))
            for each in planned:
                outcome = await self._tool(toolbox, each.call, stream, refused=each.refusal)
                messages.append(ChatMessage("tool", outcome.content, tool_call_id=each.echoed.id,
                                            is_error=outcome.is_error))
        stream.rounds = len(texts)
        if ended[-1].stop_reason == "max_tokens" and not shown.cut and any(t.strip() for t in texts):
            yield shown.take(LENGTH_NOTE)
            texts.append(LENGTH_NOTE)
        text = shown.text.strip() if shown.cut else "\n\n".join(t.strip() for t in texts if t.strip())
        if not text and ended[-1].tool_calls:
            raise LLMNoAnswer(f"the model still called tools in round {stream.rounds} of {rounds}, where it was "
                              "asked to answer in text")
        done.append(replace(ended[-1], text=text, usage=usage, tool_calls=()))

    async def _round(self, offered: LLMRequest, shown: _Shown, separate: bool, ended: list[Completion]
                     ) -> AsyncIterator[str]:
        """One model call's text as it streams (after a blank line when an earlier round said something);
        its completion is appended to ``ended``."""
        completion: Completion | None = None
        before = len(shown.text)
        events = self.llm.stream(offered)
        try:
            async for event in events:
                if isinstance(event, TextDelta) and event.text:
                    if separate and (gap := shown.take("\n\n")):
                        yield gap
                    separate = False
                    if piece := shown.take(event.text):
                        yield piece
                    if shown.cut:  # the rest is neither shown nor kept: not read either (a broken server's MBs)
                        completion = self._cut_short(offered, shown.text[before:])
                        break
                elif isinstance(event, StreamEnd):
                    completion = event.completion
        finally:
            if isinstance(events, AsyncGenerator):  # (closed now, with its connection: not when collected)
                await events.aclose()
        if completion is None:
            raise LLMBadResponse("the model's stream ended without a result")
        ended.append(completion)

    def _cut_short(self, offered: LLMRequest, text: str) -> Completion:
        """The round of a reply cut at :data:`MAX_REPLY_CHARS` (``text``: what it showed), whose stream was closed
        before its end and its usage: what it wrote counts as its output, at least, and its input as estimated
        (a budget counts it: a daily budget must not let cut replies through uncounted)."""
        sent = self.estimator.count(offered.system) + sum(self.estimator.count(m.content) for m in offered.messages)
        return Completion(text, usage=Usage(sent, self.estimator.count(text)), stop_reason="other",
                          model=offered.model)

    @staticmethod
    async def _tool(toolbox: Toolbox, call: ToolCall, stream: ReplyStream, *, refused: str = "") -> ToolOutcome:
        """The call run (its status shown first), or ``refused`` with that reason."""
        if refused:
            return ToolOutcome(refused, True)
        if stream.on_status is not None:
            await stream.on_status(toolbox.status(call))
        return await toolbox.execute(call)

    def _prepare(self, message: IncomingMessage, persona: Persona, text: str) -> None:
        """Let the preparers start what the reply will need (the query embedding) before anything waits."""
        previous = self._last_text.get(message.channel_key, "")
        for preparer in self.preparers:
            try:
                preparer.prepare(message, persona.name, text, previous)
            except Exception:
                log.exception("a reply preparer failed; the reply goes on without it")

    def _remember_last(self, channel_key: str, text: str) -> None:
        if len(self._last_text) > 10_000:
            self._last_text.clear()
        self._last_text[channel_key] = text[:PREVIOUS_CHARS]

    async def withdraw(self, message_key: str, author_key: str | None = None) -> bool:
        """A platform message its author (or a moderator) took back (a Matrix redaction): the stored copy
        goes with what points at it, and memory items remembered from it (a 🧠 reaction) are archived
        (the user can restore them). ``author_key``: whose message the platform says it was (only theirs
        goes). Whether the bot held anything of it. What a summary or a cortex file already took from it
        stays (``!memory`` shows and corrects those)."""
        self._note_withdrawn(message_key)
        deleted, archived = await self.storage.withdraw_message(message_key, time.time(), author_key)
        if deleted or archived:
            self._last_text.clear()  # the follow-up context may quote it
            log.info("a withdrawn message: %s stored message and %d memory item(s) removed",
                     "its" if deleted else "no", archived)
        return deleted or bool(archived)

    async def unshown(self, result: ReplyResult) -> None:
        """A reply the platform refused to show (no right to send in the channel, a form it refused): it goes
        from the store, as if never written; the message it answers stays."""
        await self.storage.delete_message(result.reply.id)

    async def withdraw_channel(self, channel_key: str) -> None:
        """A channel (a thread, a forum post) deleted on its platform, with every message in it: what the bot
        stored of it goes as a deleted message's does, its summaries too (``Storage.withdraw_channel``)."""
        deleted, archived = await self.storage.withdraw_channel(channel_key, time.time())
        if deleted or archived:
            self._last_text.pop(channel_key, None)
            log.info("a deleted channel: %d stored message(s) and %d memory item(s) removed", deleted, archived)

    def _note_withdrawn(self, message_key: str) -> None:
        now = time.monotonic()
        self._withdrawn.pop(message_key, None)
        self._withdrawn[message_key] = now
        while self._withdrawn:
            oldest, at = next(iter(self._withdrawn.items()))
            if now - at < WITHDRAWN_KEPT_SECONDS and len(self._withdrawn) <= WITHDRAWN_KEPT:
                break
            del self._withdrawn[oldest]

    def was_withdrawn(self, message: IncomingMessage) -> bool:
        """Whether the platform message was taken back lately (its author's or a moderator's deletion came
        before, or while, it was handled)."""
        return message.message_key is not None and self.key_withdrawn(message.message_key)

    def key_withdrawn(self, message_key: str) -> bool:
        """Whether the platform message ``message_key`` (a user's or a reply's) was taken back lately."""
        at = self._withdrawn.get(message_key)
        return at is not None and time.monotonic() - at < WITHDRAWN_KEPT_SECONDS

    def forget_recent_texts(self) -> None:
        """Drop the last texts kept per channel (forget-me: they may be the forgotten user's words)."""
        self._last_text.clear()

    async def _store_incoming(
        self, message: IncomingMessage, persona: Persona, text: str
    ) -> tuple[User, Channel, StoredMessage]:
        if self.was_withdrawn(message):  # deleted on the platform before the bot got to it
            raise MessageWithdrawn()
        for attempt in range(2):
            user = await self.storage.upsert_user(message.author_key, message.display_name)
            channel = await self.storage.upsert_channel(
                message.channel_key, message.channel_name or message.channel_id, message.is_dm
            )
            try:
                stored = await self.storage.add_message(
                    channel.id, user.id, persona.name, "user", message.author_name, text,  # (the turns' label)
                    self.estimator.raw_count(text), believable(message.sent_at),
                )
            except StaleReference:
                if attempt:
                    raise
                # Another process deleted this user (forget-me) while this one had them cached: start afresh.
                self.storage.forget_cached(user_key=message.author_key)
                continue
            if message.message_key:  # so that taking the message back on the platform deletes it here too
                try:
                    await self.storage.sources.link([message.message_key], stored.id)
                except Exception:  # (a forget-me meanwhile): the reply goes on, the message is not linked
                    log.warning("could not link message %d to its platform key", stored.id, exc_info=True)
                if self.was_withdrawn(message):  # its deletion came while it was stored, before the link
                    await self.storage.delete_message(stored.id)
                    raise MessageWithdrawn()
            return user, channel, stored
        raise AssertionError("unreachable")

    async def _finish(
        self,
        persona: Persona,
        user: User,
        channel: Channel,
        user_msg: StoredMessage,
        window: HistoryWindow,
        summary: Summary | None,
        raw_prompt: int,
        completion: Completion,
        duration_ms: int,
        message: IncomingMessage,
        rounds: int = 1,
        message_started: float = 0.0,
        *,
        incognito: bool | None = None,
        before_stretch: bool = False,
        stretch_read: float | None = None,
    ) -> tuple[ReplyResult, Exchange] | None:
        """Store the reply and its audit; None when its user asked to be forgotten (or their channel went)
        while it was written: the reply was shown, nothing of it is kept but the model call's cost."""
        text = completion.text.strip()
        call = LLMCallRecord("reply", completion.model or self.config.model_for(persona), completion.usage.input_tokens,
                             completion.usage.output_tokens, duration_ms, estimated_input_tokens=raw_prompt)
        if (why := await self._not_to_keep(message, user, persona, user_msg, incognito, stretch_read)) is not None:
            await self.storage.record_llm_call(call)
            log.info("the reply in channel %d is not stored: %s", channel.id, why)
            return None
        # A reply is never stored as older than its message (stamped by the platform's clock): inside an incognito
        # stretch by its message's time, it is inside by its own too; and one to a message sent before a stretch
        # began goes with its message, outside it (else resume deleted the reply and kept the message).
        now = datetime.now(UTC)
        at = user_msg.created_at if before_stretch or user_msg.created_at > now else None
        if stretch_read is not None and now.timestamp() < stretch_read:  # (inside it, by the platform's clock too)
            at = datetime.fromtimestamp(stretch_read, UTC)
        try:
            reply = await self.storage.add_message(
                channel.id, user.id, persona.name, "assistant", persona.name, text, self.estimator.raw_count(text), at,
                reply_to=user_msg.id,
                # (a pause that began while it was written: it goes with its message, outside the stretch)
                outside_stretch_from=None if incognito else user_msg.created_at,
            )
        except StaleReference:
            self.storage.forget_cached(user_key=user.key)
            await self.storage.record_llm_call(call)
            log.info("the reply in channel %d is not stored: its user was forgotten while it was written", channel.id)
            return None
        if (why := await self._not_to_keep(message, user, persona, user_msg, incognito, stretch_read)) is not None:
            await self.storage.delete_message(reply.id)  # (it happened between the check and the store)
            await self.storage.record_llm_call(call)
            log.info("the reply in channel %d is not kept: %s", channel.id, why)
            return None
        self._remember_last(message.channel_key, reply.text)
        prompt_tokens = self.estimator.scale(raw_prompt)
        summary_used = summary is not None
        await self.storage.record_llm_call(call)
        stats = ReplyStats(
            channel_id=channel.id,
            message_id=reply.id,
            history_tokens=window.tokens,
            history_budget=window.budget,
            window_messages=len(window.messages),
            trimmed_messages=window.trimmed,
            summary_used=summary_used,
            prompt_tokens=prompt_tokens,
        )
        await self.storage.record_reply_stats(stats)
        metrics.observe_reply(stats, time.monotonic() - message_started - duration_ms / 1000)
        if rounds == 1:  # several rounds bill the prompt several times: no measure of one prompt
            self.estimator.calibrate(raw_prompt, completion.usage.input_tokens)
        log.info(
            "reply in channel %d: history %d/%d tokens, %d messages, %d trimmed, summary %s",
            channel.id, window.tokens, window.budget, len(window.messages), window.trimmed,
            "yes" if summary_used else "no",
        )
        exchange = Exchange(
            channel_db_id=channel.id,
            user_db_id=user.id,
            user_key=user.key,
            persona=persona.name,
            is_dm=message.is_dm,
            server_key=message.server_key,
            user_message=user_msg,
            reply=reply,
            incognito=incognito,
        )
        return ReplyResult(text, user_msg, reply, window, summary_used, prompt_tokens, completion), exchange

    async def _not_to_keep(self, message: IncomingMessage, user: User, persona: Persona, user_msg: StoredMessage,
                           incognito: bool | None, stretch_read: float | None = None) -> str | None:
        """Why the reply to ``user_msg`` must not be kept, or None: its message was deleted on the platform (it
        went, with the reply to it stored so far), or the incognito stretch it was sent in ended (the message
        goes now if it was stored after that end)."""
        if self.was_withdrawn(message):
            return "its message was deleted on the platform"
        if stretch_read is not None:  # a message from before the stretch, whose history held the stretch's words
            since = await self.storage.incognito.since(user.id, persona.name)
            return None if since == stretch_read else "the incognito stretch its history held ended meanwhile"
        if incognito and await self._stretch_ended(user, persona, user_msg):
            await self._drop_from_ended_stretch(user_msg, message.channel_key)
            return "its incognito stretch ended while it was written"
        return None

    async def _stretch_ended(self, user: User, persona: Persona, user_msg: StoredMessage) -> bool:
        """Whether the incognito stretch ``user_msg`` was sent in has ended since (``!memory resume``, or its
        hours ran out): the message went with it, and a reply stored now would outlive it, outside any stretch."""
        sent = user_msg.created_at.timestamp()
        since, in_ended = await self.storage.incognito.at(user.id, user.key, persona.name, sent)
        return in_ended or since is None or since > sent

    async def _drop_from_ended_stretch(self, user_msg: StoredMessage, channel_key: str) -> None:
        """The message of a stretch that has ended goes: the end deleted it, unless it was stored after that
        (it was on its way as ``!memory resume`` was handled), and then it goes now, with its words in this
        process (``on_stretch_dropped``)."""
        await self.storage.delete_message(user_msg.id)
        if self._last_text.get(channel_key) == user_msg.text:
            del self._last_text[channel_key]
        if self.on_stretch_dropped is not None:
            self.on_stretch_dropped()
        await self.storage.scrub_soon()

    async def _check_summary(self, exchange: Exchange, window: HistoryWindow, summary: Summary | None) -> None:
        try:
            await self.summaries.on_reply(exchange.channel_db_id, exchange.reply.seq, window, exchange.persona, summary)
        except Exception:
            log.exception("could not check whether channel %d needs a summary", exchange.channel_db_id)

    async def _observe(self, exchange: Exchange) -> None:
        for observer in self.observers:
            try:
                await observer.on_exchange(exchange)
            except Exception:
                log.exception("exchange observer %s failed", type(observer).__name__)
