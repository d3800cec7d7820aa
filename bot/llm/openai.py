"""OpenAI-compatible chat completions behind the neutral :class:`bot.llm.base.LLMProvider` port.

Works with OpenAI itself and with compatible servers (DeepSeek, Ollama, vLLM, llama.cpp, ...) through
``base_url``. Only widely supported features are used: ``max_tokens`` (not ``max_completion_tokens``),
function tools, and ``stream_options.include_usage`` (servers that ignore it simply report no usage,
which becomes ``Usage(0, 0)``). A server that refuses the tools or stream_options with a 400 is asked again
without them, and from then on (said once in the log). A reasoning model's leading ``<think>`` block is left
out of the answer (``bot.llm.reasoning``).

Conversion rules (neutral → OpenAI): the system prompt is the first ``system`` message; tool results
are ``role="tool"`` messages (a failed tool's content is prefixed with ``Error:`` since the API has no
error flag); consecutive user messages, or assistant messages without tool calls, are merged because
several local servers' chat templates insist on alternating roles. Tool-call arguments the model sent
as something other than a JSON object are sent back as ``{}``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import httpx2
import openai

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
from bot.llm.errors import LLMBadRequest, LLMBadResponse, LLMDamagedResponse, LLMError, LLMOnlyThought
from bot.llm.reasoning import ThinkingFilter, without_thinking

if TYPE_CHECKING:
    from openai.types.chat import (
        ChatCompletion,
        ChatCompletionChunk,
        ChatCompletionMessageParam,
        ChatCompletionToolParam,
    )

# Sent when no key is configured: local servers (Ollama, llama.cpp) accept any key, and the SDK
# refuses to start without one.
NO_API_KEY = "no-key-configured"
log = logging.getLogger(__name__)
# A server's 400 that says the model or the server takes no tools (Ollama: "… does not support tools"; vLLM
# without --enable-auto-tool-choice; llama.cpp without --jinja), or no stream_options (older Azure, strict proxies).
REFUSES_TOOLS = re.compile(r"support\w*\W+(?:\w+\W+){0,4}tool|tools?\W+(?:\w+\W+){0,3}(?:not|un)\s*supported"
                           r"|enable-auto-tool-choice|--jinja", re.IGNORECASE)
REFUSES_STREAM_OPTIONS = re.compile(r"stream_options", re.IGNORECASE)
REASONING_FIELDS = ("reasoning_content", "reasoning")  # a stream delta's thinking, beside its content
_FINISH_REASONS: dict[str, StopReason] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refused",
}
_SDK_ERRORS = SdkErrors(
    status=openai.APIStatusError,
    timeout=(openai.APITimeoutError, httpx2.TimeoutException),
    connection=(openai.APIConnectionError, httpx2.TransportError, httpx2.StreamError),
    validation=openai.APIResponseValidationError,
    api=openai.APIError,
    base=openai.OpenAIError,
)

Message = dict[str, Any]


# --------------------------------------------------------------------------- request conversion


def _tool_call_param(call: ToolCall) -> dict[str, Any]:
    arguments = json.dumps(call.arguments if call.arguments is not None else {}, ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _convert_one(message: ChatMessage) -> Message | None:
    if message.role == "tool":
        content = message.content
        if message.is_error and not content.lower().startswith("error"):
            content = f"Error: {content}"
        return {"role": "tool", "tool_call_id": message.tool_call_id or "", "content": content}
    if message.role == "assistant":
        if not message.content and not message.tool_calls:
            return None
        result: Message = {"role": "assistant", "content": message.content or None}
        if message.tool_calls:
            result["tool_calls"] = [_tool_call_param(call) for call in message.tool_calls]
        return result
    if not message.content:
        return None
    return {"role": "user", "content": message.content}


def _mergeable(previous: Message, current: Message) -> bool:
    return (
        previous["role"] == current["role"]
        and previous["role"] in ("user", "assistant")
        and "tool_calls" not in previous
    )


def convert_messages(system: str, messages: Sequence[ChatMessage]) -> list[Message]:
    """Neutral messages → the chat-completions ``messages`` list."""
    result: list[Message] = [{"role": "system", "content": system}] if system else []
    for message in messages:
        converted = _convert_one(message)
        if converted is None:
            continue
        if result and _mergeable(result[-1], converted):
            previous = result[-1]
            texts = [t for t in (previous["content"], converted["content"]) if t]
            merged: Message = {**converted, "content": "\n\n".join(texts) or None}
            result[-1] = merged
        else:
            result.append(converted)
    return result


def convert_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
        }
        for t in tools
    ]


# --------------------------------------------------------------------------- response conversion


def map_finish_reason(reason: object) -> StopReason:
    return _FINISH_REASONS.get(reason, "other") if isinstance(reason, str) else "other"


def parse_tool_call(call_id: str | None, name: str, raw: object) -> ToolCall:
    """Arguments arrive as a JSON string (some gateways send the object itself): parsed when it is an object,
    else only kept raw."""
    raw = (raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)) if raw is not None else ""
    try:
        parsed = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):  # (RecursionError: nested thousands deep)
        parsed = None
    arguments = cast(dict[str, Any], parsed) if isinstance(parsed, dict) else None
    return ToolCall(id=call_id or _new_call_id(), name=name, arguments=arguments, raw_arguments=raw)


def _new_call_id() -> str:
    """Some compatible servers send tool calls without an id; the tool result needs one."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _usage(usage: object) -> Usage:
    if usage is None:
        return Usage()
    return Usage(
        input_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
        output_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
    )


def completion_from_response(response: ChatCompletion, fallback_model: str) -> Completion:
    choices = response.choices
    if not choices:
        raise LLMBadResponse("openai: the response has no choices")
    message = choices[0].message
    if message is None:
        raise LLMBadResponse("openai: the first choice has no message")
    calls = tuple(
        parse_tool_call(call.id, call.function.name, call.function.arguments)
        for call in message.tool_calls or ()
        if call.type == "function"
    )
    return Completion(
        text=without_thinking(message.content or ""),
        tool_calls=calls,
        usage=_usage(response.usage),
        stop_reason=map_finish_reason(choices[0].finish_reason),
        model=response.model or fallback_model,
    )


@dataclass
class _PartialCall:
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class _StreamAccumulator:
    """Rebuilds the completion from stream chunks (tool calls accumulated by index)."""

    fallback_model: str
    model: str = ""
    chunks: int = 0
    texts: list[str] = field(default_factory=list)
    calls: dict[int, _PartialCall] = field(default_factory=dict)
    _slots: dict[int, int] = field(default_factory=dict)  # a stream's call index -> the call it continues now
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    thinking: ThinkingFilter = field(default_factory=ThinkingFilter)  # (a reasoning model's notes: not shown)
    reasoned: bool = False  # thinking came in a field of its own (reasoning_content: DeepSeek, vLLM; reasoning: Ollama)
    read: int = 0  # characters of content, reasoning and tool arguments so far (at most MAX_STREAMED_CHARS)

    def feed(self, chunk: ChatCompletionChunk) -> str | None:
        """Take one chunk; return the text it adds, if any."""
        self.chunks += 1
        self.model = chunk.model or self.model
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage)
        if not chunk.choices:
            return None
        choice = chunk.choices[0]
        if choice.finish_reason is not None:  # ("": sent, unnamed, as Ollama and sglang do: the end all the same)
            self.finish_reason = choice.finish_reason
        delta = choice.delta
        if delta is None:
            return None
        self._count(delta)
        for position, call in enumerate(delta.tool_calls or ()):
            self._feed_call(self._slot(call.index, call) if call.index is not None
                            else self._index_without(position, call), call)
        if delta.content and (shown := self.thinking.feed(delta.content)):
            self.texts.append(shown)
            return shown
        return None

    def _count(self, delta: Any) -> None:
        """Note the delta's reasoning and count what it brings (a stream past the cap fails)."""
        reasoning = [piece for name in REASONING_FIELDS if isinstance(piece := getattr(delta, name, None), str)]
        self.reasoned = self.reasoned or any(reasoning)
        pieces = [delta.content, *reasoning, *(call.function.arguments for call in delta.tool_calls or ()
                                               if call.function is not None)]
        self.read += sum(len(piece) for piece in pieces if isinstance(piece, str))
        if self.read > MAX_STREAMED_CHARS:
            raise past_stream_cap("openai")

    def _slot(self, index: int, call: Any) -> int:
        """Where a piece sent with ``index`` belongs: that index's call, unless it brings a new ``id`` there
        (Ollama numbers every call 0: two calls merged into one named "current_timeremember"); then it
        starts a call of its own, and later pieces of that index continue it."""
        slot = self._slots.get(index, index)
        known = self.calls.get(slot)
        if call.id and known is not None and known.call_id and known.call_id != call.id:
            slot = max(max(self.calls), max(self._slots.values(), default=0)) + 1
            self._slots[index] = slot
        return slot

    def _index_without(self, position: int, call: Any) -> int:
        """Where a call piece sent without an ``index`` belongs (some compatible servers stream each call
        whole, without one): a new ``id`` starts a new call, as does a second piece in one chunk; any other
        piece without an id continues the last call."""
        if call.id:
            known = [index for index, partial in self.calls.items() if partial.call_id == call.id]
            return known[0] if known else max(self.calls, default=-1) + 1
        if position > 0:  # a second piece in one chunk, without id or index: a call of its own
            return max(self.calls, default=-1) + 1
        return max(self.calls, default=0)

    def _feed_call(self, index: int, call: Any) -> None:
        partial = self.calls.setdefault(index, _PartialCall())
        if call.id:
            partial.call_id = call.id
        function = call.function
        if function is None:
            return
        if function.name and function.name != partial.name:
            partial.name += str(function.name)  # (a broken server's number: a name all the same)
        if function.arguments:  # (a string; some gateways send the object itself)
            arguments = function.arguments
            partial.arguments.append(arguments if isinstance(arguments, str)
                                     else json.dumps(arguments, ensure_ascii=False))

    def completion(self) -> Completion:
        if self.chunks == 0:
            raise LLMDamagedResponse("openai: the stream ended without any chunk")
        if self.finish_reason is None:
            raise LLMDamagedResponse("openai: the stream ended before a finish_reason")
        calls = tuple(parse_tool_call(p.call_id, p.name, "".join(p.arguments)) for _, p in sorted(self.calls.items()))
        if not self.texts and not calls and self.thinking.unfinished:
            raise LLMOnlyThought("openai: the answer was a thinking block that never closed")
        if not self.texts and not calls and (self.reasoned or self.thinking.thought) and self.finish_reason == "length":
            # (thinking and nothing else, ended by choice, is an empty round: after tool calls, the rounds before
            # may have said it all; only the output limit is a reason to raise max_tokens)
            raise LLMOnlyThought("openai: the model's thinking took its whole output (finish 'length')")
        return Completion(
            text="".join(self.texts) + self.thinking.end(),  # (what was shown: the filter took the block out)
            tool_calls=calls,
            usage=self.usage,
            stop_reason=map_finish_reason(self.finish_reason),
            model=self.model or self.fallback_model,
        )


# --------------------------------------------------------------------------- the provider



class OpenAICompatProvider:
    """:class:`bot.llm.base.LLMProvider` for OpenAI and OpenAI-compatible chat-completions servers."""

    name = "openai"

    def __init__(
        self,
        *,
        api_key: str | None,
        base_url: str | None = None,
        timeout_seconds: float = 120.0,
        connect_timeout_seconds: float = 10.0,
        max_retries: int = 2,
    ) -> None:
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY") or NO_API_KEY
        self._api_key = key
        self._deadline = timeout_seconds
        self._timeout = openai.Timeout(timeout_seconds, connect=connect_timeout_seconds)
        self._usage_in_streams = True  # (stream_options.include_usage: until a server refuses it)
        self._without_tools: set[str] = set()  # models whose server refused tools: asked without them
        try:
            self._client = openai.AsyncOpenAI(
                api_key=key,
                base_url=base_url,
                timeout=self._timeout,
                max_retries=max_retries,
                http_client=capped_http_client("openai", openai.DefaultAsyncHttpxClient),
            )
            limit_retry_waits(self._client, timeout_seconds)
            never_retry_ours(self._client)
        except openai.OpenAIError as exc:
            raise self._error(exc) from exc

    def _params(self, request: LLMRequest) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "messages": cast("list[ChatCompletionMessageParam]", convert_messages(request.system, request.messages)),
        }
        if request.temperature is not None:
            params["temperature"] = request.temperature
        if request.tools and (request.tools_required or request.model not in self._without_tools):
            params["tools"] = cast("list[ChatCompletionToolParam]", convert_tools(request.tools))
            if request.tool_choice == "none":
                params["tool_choice"] = "none"
        return params

    def _error(self, exc: BaseException) -> LLMError:
        return to_llm_error(exc, provider="openai", sdk=_SDK_ERRORS, secrets=(self._api_key,))

    async def _create(self, request: LLMRequest, deadline: Deadline, *, stream: bool) -> Any:
        """The SDK's request, asked again once without what the server refused with a 400: the tools (the model
        then answers without skills, as the log says once) or the usage in streams (reported as 0 then)."""
        for _ in range(3):
            params = self._params(request)
            if stream:
                params["stream"] = True
                if self._usage_in_streams:
                    params["stream_options"] = {"include_usage": True}
            try:
                return await deadline.run(self._client.chat.completions.create(**params))
            except Exception as exc:
                error = self._error(exc)
                # (by what this attempt sent: a request in flight when another one dropped it is asked again too)
                if not isinstance(error, LLMBadRequest) or not self._drops_refused(
                        request, str(error), tools="tools" in params, usage="stream_options" in params):
                    raise error from exc
        raise LLMBadRequest("openai: the server refused the request")  # (not reached: each kind is dropped once)

    def _drops_refused(self, request: LLMRequest, said: str, *, tools: bool, usage: bool) -> bool:
        """Whether the 400 ``said`` named something the request sent that this provider can leave out; then it is
        left out from now on."""
        if usage and REFUSES_STREAM_OPTIONS.search(said):
            if self._usage_in_streams:
                self._usage_in_streams = False
                log.warning("the model server refuses stream_options: replies are asked for without it (their "
                            "token usage is counted as 0)")
            return True
        if tools and not request.tools_required and REFUSES_TOOLS.search(said):
            if request.model not in self._without_tools:
                self._without_tools.add(request.model)
                log.warning("the model server says %s takes no tools: it answers without skills from now on "
                            "(use a model that supports tools, or set [skills] enabled = false)", request.model)
            return True
        return False

    async def complete(self, request: LLMRequest) -> Completion:
        try:
            deadline = Deadline(self._deadline, "openai")
            response = await self._create(request, deadline, stream=False)
            if isinstance(response, str):  # (a body that was not JSON, by its content type)
                raise not_json("openai", response)
            return completion_from_response(response, request.model)
        except LLMError:
            raise
        except Exception as exc:
            raise self._error(exc) from exc

    async def stream(self, request: LLMRequest) -> AsyncIterator[StreamEvent]:
        accumulator = _StreamAccumulator(fallback_model=request.model)
        try:
            deadline = Deadline(self._deadline, "openai")
            chunks = await self._create(request, deadline, stream=True)
            async with chunks:
                async for chunk in deadline.each(chunks):
                    text = accumulator.feed(chunk)
                    if text:
                        yield TextDelta(text)
            completion = accumulator.completion()
        except LLMError as exc:  # (what the stream said it was billed, with the chunk that carried usage)
            exc.billed = (accumulator.usage.input_tokens, accumulator.usage.output_tokens)
            raise
        except Exception as exc:
            error = self._error(exc)
            error.billed = (accumulator.usage.input_tokens, accumulator.usage.output_tokens)
            raise error from exc
        yield StreamEnd(completion)

    async def list_models(self) -> list[str]:
        try:
            return [model.id async for model in self._client.models.list()]
        except Exception as exc:
            raise self._error(exc) from exc

    async def aclose(self) -> None:
        await self._client.close()
