"""The Anthropic Messages API behind the neutral :class:`bot.llm.base.LLMProvider` port.

Conversion rules (neutral → Anthropic):

* ``role="tool"`` messages become ``tool_result`` blocks in a user turn (``is_error`` kept);
  consecutive tool results end up in one user turn;
* an assistant message's ``tool_calls`` become ``tool_use`` blocks after its text;
* consecutive turns of the same role are merged (texts joined with a blank line, ``tool_result``
  blocks first as the API requires), empty text blocks are dropped;
* a conversation that starts with the assistant gets a ``(conversation continues)`` user turn first.

Streaming reads the raw server-sent events (``messages.create(stream=True)``) and accumulates the
message itself rather than through ``messages.stream()``: the SDK helper raises ``ValueError`` on a
tool input that is not valid JSON, while this provider must hand such input to the tool loop as
``ToolCall(arguments=None, raw_arguments=...)``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import anthropic
import httpx2

from bot.llm._capped import capped_http_client
from bot.llm._mapping import Deadline, SdkErrors, limit_retry_waits, never_retry_ours, not_json, to_llm_error
from bot.llm.base import (
    MAX_STREAMED_CHARS,
    ChatMessage,
    Completion,
    LLMRequest,
    StopReason,
    StreamEnd,
    StreamEvent,
    TextDelta,
    ToolCall,
    ToolSpec,
    Usage,
    past_stream_cap,
)
from bot.llm.errors import LLMAuthError, LLMBadResponse, LLMDamagedResponse, LLMError
from bot.text import nested_within

if TYPE_CHECKING:
    from anthropic.types import Message, MessageParam, RawMessageStreamEvent, ToolParam

CONTINUATION_PROMPT = "(conversation continues)"
_STOP_REASONS: dict[str, StopReason] = {
    "end_turn": "end_turn",
    "max_tokens": "max_tokens",
    "tool_use": "tool_use",
    "stop_sequence": "stop_sequence",
    "refusal": "refused",
}
_SDK_ERRORS = SdkErrors(
    status=anthropic.APIStatusError,
    timeout=(anthropic.APITimeoutError, httpx2.TimeoutException),
    connection=(anthropic.APIConnectionError, httpx2.TransportError, httpx2.StreamError),
    validation=anthropic.APIResponseValidationError,
    api=anthropic.APIError,
    base=anthropic.AnthropicError,
)

Block = dict[str, Any]


# --------------------------------------------------------------------------- request conversion


def _message_blocks(message: ChatMessage) -> tuple[str, list[Block]]:
    """One neutral message as ``(anthropic role, content blocks)``."""
    if message.role == "tool":
        result: Block = {"type": "tool_result", "tool_use_id": message.tool_call_id or ""}
        if message.content:
            result["content"] = message.content
        if message.is_error:
            result["is_error"] = True
        return "user", [result]
    blocks: list[Block] = []
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    if message.role == "assistant":
        for call in message.tool_calls:
            tool_input = call.arguments if call.arguments is not None else {}
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input})
    return message.role, blocks


def _normalise_blocks(blocks: list[Block]) -> list[Block]:
    """Tool results first, adjacent text blocks joined with a blank line, no empty or blank text."""
    ordered = [b for b in blocks if b["type"] == "tool_result"] + [b for b in blocks if b["type"] != "tool_result"]
    merged: list[Block] = []
    for block in ordered:
        if block["type"] == "text":
            if not block["text"].strip():  # the API refuses a text block of whitespace only
                continue
            if merged and merged[-1]["type"] == "text":
                merged[-1] = {"type": "text", "text": merged[-1]["text"] + "\n\n" + block["text"]}
                continue
        merged.append(block)
    return merged


def convert_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Neutral messages → the Anthropic ``messages`` list (strictly alternating roles)."""
    turns: list[tuple[str, list[Block]]] = []
    for message in messages:
        role, blocks = _message_blocks(message)
        if not blocks:
            continue
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    result = [{"role": role, "content": _normalise_blocks(blocks)} for role, blocks in turns]
    _strip_trailing_assistant_whitespace(result)
    result = [turn for turn in result if turn["content"]]
    if result and result[0]["role"] == "assistant":
        result.insert(0, {"role": "user", "content": [{"type": "text", "text": CONTINUATION_PROMPT}]})
    return result


def _strip_trailing_assistant_whitespace(turns: list[dict[str, Any]]) -> None:
    """The API rejects a final assistant turn (a prefill) whose text ends in whitespace."""
    if not turns or turns[-1]["role"] != "assistant":
        return
    content: list[Block] = turns[-1]["content"]
    if content and content[-1]["type"] == "text":
        text = content[-1]["text"].rstrip()
        if text:
            content[-1] = {"type": "text", "text": text}
        else:
            content.pop()


def convert_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in tools]


# --------------------------------------------------------------------------- response conversion


def map_stop_reason(reason: object) -> StopReason:
    return _STOP_REASONS.get(reason, "other") if isinstance(reason, str) else "other"


def tool_call_from_input(call_id: str, name: str, tool_input: object) -> ToolCall:
    """A ``tool_use`` block's input: a dict becomes ``arguments``; anything else is kept only raw."""
    if not nested_within(tool_input):
        return ToolCall(id=call_id, name=name, arguments=None, raw_arguments="(an input nested too deep to read)")
    raw = json.dumps(tool_input, ensure_ascii=False)
    arguments = cast(dict[str, Any], tool_input) if isinstance(tool_input, dict) else None
    return ToolCall(id=call_id, name=name, arguments=arguments, raw_arguments=raw)


def tool_call_from_json(call_id: str, name: str, raw: str) -> ToolCall:
    """A streamed tool input (concatenated ``partial_json``): parsed if it is a JSON object."""
    try:
        parsed = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):  # (RecursionError: nested thousands deep)
        parsed = None
    arguments = cast(dict[str, Any], parsed) if isinstance(parsed, dict) else None
    return ToolCall(id=call_id, name=name, arguments=arguments, raw_arguments=raw or "{}")


def _usage(usage: object) -> Usage:
    if usage is None:
        return Usage()
    return Usage(
        input_tokens=int(getattr(usage, "input_tokens", 0) or 0),
        output_tokens=int(getattr(usage, "output_tokens", 0) or 0),
    )


def completion_from_message(message: Message, fallback_model: str) -> Completion:
    content = message.content
    if not isinstance(content, list):
        raise LLMBadResponse(f"anthropic: response has no content list (got {type(content).__name__})")
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block in content:
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            calls.append(tool_call_from_input(block.id, block.name, block.input))
    return Completion(
        text="".join(texts),
        tool_calls=tuple(calls),
        usage=_usage(message.usage),
        stop_reason=map_stop_reason(message.stop_reason),
        model=message.model or fallback_model,
    )


@dataclass
class _StreamBlock:
    kind: str
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    json_parts: list[str] = field(default_factory=list)
    initial_input: object = None


@dataclass
class _StreamAccumulator:
    """Rebuilds the final message from raw stream events."""

    fallback_model: str
    model: str = ""
    started: bool = False
    finished: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    stop_reason: object = None
    blocks: dict[int, _StreamBlock] = field(default_factory=dict)
    read: int = 0  # characters of text, thinking and tool input so far (at most MAX_STREAMED_CHARS)

    def feed(self, event: RawMessageStreamEvent) -> str | None:
        """Take one event; return the text it adds, if any."""
        if event.type == "message_start":
            self.started = True
            self.model = event.message.model or ""
            usage = _usage(event.message.usage)
            self.input_tokens, self.output_tokens = usage.input_tokens, usage.output_tokens
        elif event.type == "content_block_start":
            self._start_block(event.index, event.content_block)
        elif event.type == "content_block_delta":
            return self._delta(event.index, event.delta)
        elif event.type == "message_delta":
            self.stop_reason = event.delta.stop_reason
            said = getattr(event, "usage", None)  # (a compatible server may send none: the reply stands)
            if said is not None:
                self.output_tokens = getattr(said, "output_tokens", None) or self.output_tokens
                if (input_tokens := getattr(said, "input_tokens", None)) is not None:
                    self.input_tokens = input_tokens
        elif event.type == "message_stop":
            self.finished = True
        return None

    def _start_block(self, index: int, block: Any) -> None:
        entry = _StreamBlock(kind=str(block.type))
        if entry.kind == "text":
            entry.text.append(block.text or "")
        elif entry.kind == "tool_use":
            entry.call_id, entry.name, entry.initial_input = block.id, block.name, block.input
        self.blocks[index] = entry

    def _delta(self, index: int, delta: Any) -> str | None:
        entry = self.blocks.get(index)
        if entry is None:
            raise LLMBadResponse(f"anthropic: stream delta for unknown content block {index}")
        for name in ("text", "partial_json", "thinking"):
            if isinstance(piece := getattr(delta, name, None), str):
                self.read += len(piece)
        if self.read > MAX_STREAMED_CHARS:
            raise past_stream_cap("anthropic")
        if delta.type == "text_delta" and entry.kind == "text":
            entry.text.append(delta.text)
            return str(delta.text) or None
        if delta.type == "input_json_delta" and entry.kind == "tool_use":
            entry.json_parts.append(delta.partial_json)
        return None

    def completion(self) -> Completion:
        if not self.started:
            raise LLMDamagedResponse("anthropic: the stream ended without a message")
        if not self.finished:
            raise LLMDamagedResponse("anthropic: the stream ended before message_stop")
        texts: list[str] = []
        calls: list[ToolCall] = []
        for _, entry in sorted(self.blocks.items()):
            if entry.kind == "text":
                texts.append("".join(entry.text))
            elif entry.kind == "tool_use":
                calls.append(self._tool_call(entry))
        return Completion(
            text="".join(texts),
            tool_calls=tuple(calls),
            usage=Usage(self.input_tokens, self.output_tokens),
            stop_reason=map_stop_reason(self.stop_reason),
            model=self.model or self.fallback_model,
        )

    @staticmethod
    def _tool_call(entry: _StreamBlock) -> ToolCall:
        raw = "".join(entry.json_parts)
        if not raw.strip() and entry.initial_input not in (None, {}):
            return tool_call_from_input(entry.call_id, entry.name, entry.initial_input)
        return tool_call_from_json(entry.call_id, entry.name, raw)


# --------------------------------------------------------------------------- the provider



class AnthropicProvider:
    """:class:`bot.llm.base.LLMProvider` for the Anthropic Messages API."""

    name = "anthropic"

    def __init__(
        self,
        *,
        api_key: str | None,
        base_url: str | None = None,
        timeout_seconds: float = 120.0,
        connect_timeout_seconds: float = 10.0,
        max_retries: int = 2,
    ) -> None:
        """Raises :class:`LLMAuthError` when ``api_key`` is None and the SDK's credential lookup fails."""
        self._api_key = api_key
        self._deadline = timeout_seconds
        self._timeout = anthropic.Timeout(timeout_seconds, connect=connect_timeout_seconds)
        try:
            self._client = anthropic.AsyncAnthropic(
                api_key=api_key,
                base_url=base_url,
                timeout=self._timeout,
                max_retries=max_retries,
                http_client=capped_http_client("anthropic", anthropic.DefaultAsyncHttpxClient),
            )
            limit_retry_waits(self._client, timeout_seconds)
            never_retry_ours(self._client)
        except anthropic.AnthropicError as exc:
            # Without api_key the SDK looks for credentials in the environment and in config files.
            raise LLMAuthError(f"anthropic: no usable credentials ({self._error(exc).detail})") from exc

    def _params(self, request: LLMRequest) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "messages": cast("list[MessageParam]", convert_messages(request.messages)),
            "timeout": self._timeout,
        }
        if request.system:
            params["system"] = request.system
        if request.temperature is not None:
            # anthropic>=1.0 removed the sampling keywords from messages.create(); the API still takes
            # them (on models that support sampling), so they go through extra_body.
            params["extra_body"] = {"temperature": request.temperature}
        if request.tools:
            params["tools"] = cast("list[ToolParam]", convert_tools(request.tools))
            if request.tool_choice == "none":
                params["tool_choice"] = {"type": "none"}
        return params

    def _error(self, exc: BaseException) -> LLMError:
        if isinstance(exc, TypeError) and "authentication method" in str(exc):
            return LLMAuthError("anthropic: no API key configured")
        return to_llm_error(exc, provider="anthropic", sdk=_SDK_ERRORS, secrets=(self._api_key,))

    async def complete(self, request: LLMRequest) -> Completion:
        try:
            deadline = Deadline(self._deadline, "anthropic")
            message = await deadline.run(self._client.messages.create(**self._params(request)))
            if isinstance(message, str):  # (a body that was not JSON, by its content type)
                raise not_json("anthropic", message)
            return completion_from_message(message, request.model)
        except LLMError:
            raise
        except Exception as exc:
            raise self._error(exc) from exc

    async def stream(self, request: LLMRequest) -> AsyncIterator[StreamEvent]:
        accumulator = _StreamAccumulator(fallback_model=request.model)
        try:
            deadline = Deadline(self._deadline, "anthropic")
            events = await deadline.run(self._client.messages.create(**self._params(request), stream=True))
            async with events:
                async for event in deadline.each(events):
                    text = accumulator.feed(event)
                    if text:
                        yield TextDelta(text)
            completion = accumulator.completion()
        except LLMError as exc:
            exc.billed = (accumulator.input_tokens, accumulator.output_tokens)
            raise
        except Exception as exc:
            error = self._error(exc)
            error.billed = (accumulator.input_tokens, accumulator.output_tokens)
            raise error from exc
        yield StreamEnd(completion)

    async def list_models(self) -> list[str]:
        try:
            return [model.id async for model in self._client.models.list()]
        except Exception as exc:
            raise self._error(exc) from exc

    async def aclose(self) -> None:
        await self._client.close()
