"""The provider port: one small interface every LLM backend implements.

The core speaks in these neutral types only. A provider converts them to its SDK's wire format
(Anthropic Messages, OpenAI chat completions) and converts answers and errors back.

A conversation is a list of :class:`ChatMessage`. Tool use is neutral too: an assistant message may
carry ``tool_calls``; the results go back as messages with ``role="tool"`` and ``tool_call_id``.
Providers merge consecutive messages of the same role where their API requires strict alternation.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

from bot.llm.errors import LLMBadResponse
from bot.text import nested_within, storable, storable_json, without_hidden

Role = Literal["user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool the model may call: ``input_schema`` is a JSON Schema object."""

    name: str
    description: str
    input_schema: dict[str, Any]


# The answer to a tool call the output limit (max_tokens) cut off: its arguments are incomplete, so it is
# not run ("not a JSON object" would not tell the model why).
CUT_OFF_CALL = "refused: your answer reached the output limit while writing this call, so it was cut off and not run."


MAX_CALL_ARGUMENT_CHARS = 65_536  # a tool call's arguments longer than this are neither run nor sent back
MAX_TOOL_NAME_CHARS = 64  # a tool's name or call id as both APIs allow it; a longer one is cut when sent back
MAX_CALLS_SENT_BACK = 32  # a turn's calls repeated to the model at all: the rest are dropped with their results
# Of one streamed answer (its text, thinking and tool arguments), at most this many characters are read: past
# it the stream fails. A broken or hostile server's endless stream would otherwise be kept in memory (200 MB
# took 700 MB) and read until the time-out. (A reply shows far less; 32 calls' arguments of 64 KiB fit.)
MAX_STREAMED_CHARS = 8_000_000


# Of one non-streamed answer, at most this many bytes are read (the same answer as a stream's, with its JSON
# around it: up to 4 bytes a character): past it the answer fails, and the rest is not read.
MAX_ANSWER_BYTES = 4 * MAX_STREAMED_CHARS


def past_answer_cap(provider: str) -> LLMBadResponse:
    """The error of a non-streamed answer of more than :data:`MAX_ANSWER_BYTES`."""
    return LLMBadResponse(f"{provider}: the server's answer ran past {MAX_ANSWER_BYTES:,} bytes; the rest was not "
                          "read")


def past_stream_cap(provider: str) -> LLMBadResponse:
    """The error of a stream that sent more than :data:`MAX_STREAMED_CHARS`."""
    return LLMBadResponse(f"{provider}: the streamed answer ran past {MAX_STREAMED_CHARS:,} characters; the rest "
                          "was not read")


def sent_back(call: ToolCall, *, ran: bool = True, argument_chars: int = MAX_CALL_ARGUMENT_CHARS) -> ToolCall:
    """The call as the next request repeats it to the model. Arguments over :data:`MAX_CALL_ARGUMENT_CHARS`
    characters, and those of a call that did not run, are left out; a name or id over
    :data:`MAX_TOOL_NAME_CHARS` is cut. (A misbehaving server's megabytes, in one call or spread over many,
    would otherwise be sent with every later round, each time costing their tokens or failing the request.)"""
    name, call_id = call.name[:MAX_TOOL_NAME_CHARS], call.id
    if len(call_id) > MAX_TOOL_NAME_CHARS:  # (cut ids could collide: a digest keeps them apart)
        call_id = "call_" + hashlib.sha256(call_id.encode("utf-8", "replace")).hexdigest()[:32]
    if ran and len(call.raw_arguments) <= argument_chars:
        return call if (name, call_id) == (call.name, call.id) else replace(call, id=call_id, name=name)
    return replace(call, id=call_id, name=name, arguments=None,
                   raw_arguments=f"(arguments of {len(call.raw_arguments):,} characters, left out)")


@dataclass(frozen=True, slots=True)
class TurnCall:
    """One tool call of a model's turn: as sent (what runs), as the next request repeats it, and why it
    does not run (``""``: it runs)."""

    call: ToolCall
    echoed: ToolCall
    refusal: str


def turn_calls(completion: Completion, runs_at_most: int, cut_off: str = CUT_OFF_CALL, *,
               argument_chars: int = MAX_CALL_ARGUMENT_CHARS) -> list[TurnCall]:
    """The turn's calls as a tool loop handles them: the first ``runs_at_most`` run unless cut off by the
    output limit (refused with ``cut_off``) or their arguments are over ``argument_chars``; the rest are
    refused; past :data:`MAX_CALLS_SENT_BACK` they are dropped."""
    cut, planned = cut_off_call(completion), []
    for number, call in enumerate(completion.tool_calls[:MAX_CALLS_SENT_BACK]):
        refusal = ""
        if number == cut:
            refusal = cut_off
        elif number >= runs_at_most:
            refusal = (f"refused: at most {runs_at_most} tool calls run per turn; nothing was done. Call it again "
                       "in your next turn if you still need it.")
        elif len(call.raw_arguments) > argument_chars:
            refusal = (f"refused: its arguments were {len(call.raw_arguments):,} characters long; at most "
                       f"{argument_chars:,}")
        planned.append(TurnCall(call, sent_back(call, ran=not refusal, argument_chars=argument_chars), refusal))
    return planned


def cut_off_call(completion: Completion) -> int:
    """The index of the tool call the output limit cut off (the last one, when it stopped at max_tokens), or -1."""
    return len(completion.tool_calls) - 1 if completion.stop_reason == "max_tokens" else -1


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call as the model sent it.

    ``arguments`` is the parsed JSON object, or ``None`` when the model sent something that is not a
    JSON object; ``raw_arguments`` always holds what was sent, so the tool loop can tell the model
    exactly what was wrong instead of crashing.
    """

    id: str
    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str = ""

    def __post_init__(self) -> None:  # what a model sends is made storable once, here (see bot.text.storable)
        # (a broken server's null or number as the id or name: a string, so the tool loop says it is unknown)
        object.__setattr__(self, "id", storable(_as_text(self.id)))
        object.__setattr__(self, "name", storable(_as_text(self.name)))
        object.__setattr__(self, "raw_arguments", storable(self.raw_arguments))
        if self.arguments is not None:  # (nested too deep: not arguments; the tool loop says what came)
            object.__setattr__(self, "arguments",
                               storable_json(self.arguments) if nested_within(self.arguments) else None)


def _as_text(value: object) -> str:
    """What a server sent where a string belongs, as one ("" for null)."""
    return "" if value is None else value if isinstance(value, str) else str(value)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a request. Its content is made :func:`~bot.text.storable`: a lone surrogate from a
    tool's result or an old row would fail the whole request as it is encoded."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # for role == "tool"
    is_error: bool = False  # for role == "tool": the tool failed

    def __post_init__(self) -> None:
        # (and what a reader does not see is not sent: a tool's result, a summary's or an update's text)
        object.__setattr__(self, "content", without_hidden(storable(self.content)))
        if self.tool_call_id is not None:
            object.__setattr__(self, "tool_call_id", storable(self.tool_call_id))


MODEL_NAME_CHARS = 200  # of the model name a server reports (names are far shorter)
MAX_REPORTED_TOKENS = 100_000_000  # per call: far past any model's context, and a sum of calls still fits a column


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a call used, as the server reported them: held within 0..``MAX_REPORTED_TOKENS`` (a broken
    server's negative or absurd figure would fail the metrics and the audit's database columns)."""

    input_tokens: int = 0
    output_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens"):
            object.__setattr__(self, name, min(max(int(getattr(self, name)), 0), MAX_REPORTED_TOKENS))


# "refused": the provider's safety layer stopped the answer (Anthropic's "refusal", OpenAI's "content_filter").
StopReason = Literal["end_turn", "max_tokens", "tool_use", "stop_sequence", "refused", "other"]


@dataclass(frozen=True, slots=True)
class Completion:
    """A model's answer. Its text never holds a lone surrogate or a NUL (a model can send both, as JSON
    escapes): no store takes them, and a reply that could not be stored would be lost."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage = field(default_factory=Usage)
    stop_reason: StopReason = "end_turn"
    model: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", storable(self.text))
        # The server's name for the model goes into the audit rows: only a storable string of sane length
        # (a broken or hostile server's object or lone surrogate would fail every later audit flush).
        model = self.model if isinstance(self.model, str) else ""
        object.__setattr__(self, "model", storable(model)[:MODEL_NAME_CHARS])
        object.__setattr__(self, "tool_calls", unique_call_ids(self.tool_calls))


def unique_call_ids(calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
    """Each tool result answers one call by its id, so a broken server's repeated (or empty) id would make
    the API refuse the next request, or pair a result with the wrong call: a repeat gets a suffix."""
    seen: set[str] = set()
    unique = []
    for call in calls:
        base = call.id or "call"
        new, n = base, 2
        while new in seen:
            new, n = f"{base}-{n}", n + 1
        seen.add(new)
        unique.append(call if new == call.id else replace(call, id=new))
    return tuple(unique)


@dataclass(frozen=True, slots=True)
class LLMRequest:
    system: str
    messages: tuple[ChatMessage, ...]
    model: str
    max_tokens: int
    temperature: float | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: Literal["auto", "none"] = "auto"  # "none": answer in text even though tools are defined
    # The work is done only through the tools (a cortex update): a server that takes no tools is an error then,
    # not a request asked again without them (its text answer would pass for "nothing new", billed each time).
    tools_required: bool = False

    def __post_init__(self) -> None:  # (every system prompt: the reply's, a summary's, a cortex update's)
        object.__setattr__(self, "system", without_hidden(self.system))


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", storable(self.text))


@dataclass(frozen=True, slots=True)
class StreamEnd:
    completion: Completion


StreamEvent = TextDelta | StreamEnd


@runtime_checkable
class LLMProvider(Protocol):
    """What the core needs from a language model.

    Both methods raise only :class:`bot.llm.errors.LLMError` subclasses.
    ``stream`` yields :class:`TextDelta` events as text arrives and exactly one final
    :class:`StreamEnd` carrying the whole :class:`Completion` (text, tool calls, usage, stop reason).
    """

    name: str

    async def complete(self, request: LLMRequest) -> Completion: ...

    def stream(self, request: LLMRequest) -> AsyncIterator[StreamEvent]: ...

    async def list_models(self) -> list[str]: ...

    async def aclose(self) -> None: ...
