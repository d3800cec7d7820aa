"""The Anthropic and OpenAI-compatible providers, with the real SDKs talking HTTP to the fake server."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bot.llm import (
    ChatMessage,
    Completion,
    LLMAuthError,
    LLMBadRequest,
    LLMBadResponse,
    LLMBrokenOff,
    LLMConnectionError,
    LLMError,
    LLMOutOfCredit,
    LLMOverloaded,
    LLMProvider,
    LLMRateLimited,
    LLMRequest,
    LLMServerError,
    LLMTimeout,
    StreamEnd,
    TextDelta,
    ToolCall,
    ToolSpec,
    Usage,
    create_provider,
)
from tests.fakes.llm_server import FakeLLMServer, FakeResponse, RecordedRequest, StreamFailure

API_KEY = "sk-test-VERY-SECRET-0123456789abcdef"
PROVIDERS = ["anthropic", "openai"]
WEATHER = ToolSpec(
    name="weather",
    description="Current weather for a city.",
    input_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def make_provider(
    kind: str,
    srv: FakeLLMServer,
    *,
    max_retries: int = 0,
    timeout: float = 5.0,
    api_key: str | None = API_KEY,
) -> LLMProvider:
    return create_provider(
        kind,
        api_key=api_key,
        base_url=srv.anthropic_url if kind == "anthropic" else srv.openai_url,
        timeout_seconds=timeout,
        connect_timeout_seconds=2.0,
        max_retries=max_retries,
    )


def request(*messages: ChatMessage, **kwargs: Any) -> LLMRequest:
    options: dict[str, Any] = {"system": "You are terse.", "model": "test-model", "max_tokens": 256}
    options.update(kwargs)
    return LLMRequest(messages=messages or (ChatMessage("user", "Hi"),), **options)


async def collect(provider: LLMProvider, req: LLMRequest) -> tuple[list[str], Completion]:
    deltas: list[str] = []
    ends: list[Completion] = []
    async for event in provider.stream(req):
        assert not ends, "StreamEnd must be the last event"
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        else:
            assert isinstance(event, StreamEnd)
            ends.append(event.completion)
    assert len(ends) == 1
    return deltas, ends[0]


async def run(provider: LLMProvider, req: LLMRequest, streaming: bool) -> Completion:
    if streaming:
        return (await collect(provider, req))[1]
    return await provider.complete(req)


def last_completion_body(srv: FakeLLMServer) -> dict[str, Any]:
    return srv.completion_requests[-1].body


@pytest_asyncio.fixture(params=PROVIDERS)
async def provider(request: pytest.FixtureRequest, fake_llm: FakeLLMServer) -> AsyncIterator[LLMProvider]:
    prov = make_provider(request.param, fake_llm)
    yield prov
    await prov.aclose()


@pytest_asyncio.fixture
async def anthropic_provider(fake_llm: FakeLLMServer) -> AsyncIterator[LLMProvider]:
    prov = make_provider("anthropic", fake_llm)
    yield prov
    await prov.aclose()


@pytest_asyncio.fixture
async def openai_provider(fake_llm: FakeLLMServer) -> AsyncIterator[LLMProvider]:
    prov = make_provider("openai", fake_llm)
    yield prov
    await prov.aclose()


# --------------------------------------------------------------------------- text


@pytest.mark.asyncio
async def test_complete_returns_text_usage_and_stop_reason(provider: LLMProvider, fake_llm: FakeLLMServer) -> None:
    fake_llm.enqueue(FakeResponse.text("Hello there.", input_tokens=12, output_tokens=7))
    completion = await provider.complete(request())
    assert completion == Completion(text="Hello there.", usage=Usage(12, 7), stop_reason="end_turn", model="test-model")


@pytest.mark.asyncio
async def test_default_responder_echoes_the_last_user_message(provider: LLMProvider) -> None:
    completion = await provider.complete(request(ChatMessage("user", "ping")))
    assert completion.text == "echo: ping"


@pytest.mark.asyncio
async def test_stream_yields_deltas_in_order_then_one_final_completion(
    provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    fake_llm.enqueue(FakeResponse.text("Hello world!", chunks=["Hel", "lo ", "world", "!"], output_tokens=4))
    deltas, completion = await collect(provider, request())
    assert deltas == ["Hel", "lo ", "world", "!"]
    assert completion.text == "Hello world!"
    assert completion.usage == Usage(10, 4)
    assert completion.stop_reason == "end_turn"


@pytest.mark.asyncio
async def test_max_tokens_stop_reason(provider: LLMProvider, fake_llm: FakeLLMServer) -> None:
    fake_llm.enqueue(FakeResponse.text("cut", stop_reason="max_tokens"))
    fake_llm.enqueue(FakeResponse.text("cut", stop_reason="max_tokens"))
    assert (await provider.complete(request())).stop_reason == "max_tokens"
    assert (await collect(provider, request()))[1].stop_reason == "max_tokens"


@pytest.mark.asyncio
async def test_openai_stream_without_usage_gives_zero_usage(
    openai_provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    fake_llm.enqueue(FakeResponse.text("no usage here", send_usage=False))
    _, completion = await collect(openai_provider, request())
    assert completion.text == "no usage here"
    assert completion.usage == Usage(0, 0)
    assert last_completion_body(fake_llm)["stream_options"] == {"include_usage": True}


@pytest.mark.asyncio
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_lone_surrogates_and_nul_never_leave_the_provider(
    provider: LLMProvider, fake_llm: FakeLLMServer, streaming: bool
) -> None:
    """JSON may escape a lone surrogate or a NUL; no store takes either (a reply that could not be stored
    was lost, its user shown a half-finished answer): they become U+FFFD and nothing."""
    fake_llm.enqueue(FakeResponse.text("hello \ud800 there\x00!", chunks=["hello \ud800", " there\x00!"]))
    completion = await run(provider, request(), streaming)
    assert completion.text == "hello \ufffd there!"
    fake_llm.enqueue(FakeResponse.tool_calls([("call_1", "weather", {"city": "Par\udc00is\x00"})]))
    [call] = (await run(provider, request(tools=(WEATHER,)), streaming)).tool_calls
    assert call.arguments == {"city": "Par\ufffdis"} and "\x00" not in call.raw_arguments
    call.raw_arguments.encode()  # storable


def _stream_naming(provider: str, model: object) -> bytes:
    """A whole streamed answer ("Hello Ann.") whose every event names the model as ``model``."""
    if provider == "anthropic":
        events = [
            {"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "model": model,
                                                  "content": [], "stop_reason": None, "stop_sequence": None,
                                                  "usage": {"input_tokens": 5, "output_tokens": 1}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello Ann."}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": {"output_tokens": 3}},
            {"type": "message_stop"},
        ]
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()
    chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [
                  {"index": 0, "delta": {"role": "assistant", "content": "Hello Ann."}, "finish_reason": None}]},
              {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": model,
               "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    return ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


@pytest.mark.asyncio
@pytest.mark.parametrize("model", ["m\ud800x\x00", {"a": 1}, "x" * 5000], ids=["surrogate", "object", "long"])
async def test_the_servers_model_name_is_a_storable_string(provider: LLMProvider, fake_llm: FakeLLMServer,
                                                           model: object) -> None:
    """The name goes into the audit rows: an object or a lone surrogate there failed every later flush of the
    audit buffer, and with it forget-me, which flushes first."""
    fake_llm.enqueue(FakeResponse.malformed(_stream_naming(provider.name, model), 200, "text/event-stream"))
    _, completion = await collect(provider, request())
    assert completion.text == "Hello Ann." and isinstance(completion.model, str) and len(completion.model) <= 200
    completion.model.encode()
    assert "\x00" not in completion.model


# --------------------------------------------------------------------------- tool calls


@pytest.mark.asyncio
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize("shape", ["broken", "valid"])
async def test_tool_arguments_nested_thousands_deep_are_no_arguments_not_a_failed_reply(
    provider: LLMProvider, fake_llm: FakeLLMServer, streaming: bool, shape: str
) -> None:
    """A degenerate model looping on "[" (or a valid object 700 deep) raised RecursionError in parsing
    or cleaning, and the whole reply failed; now the call simply has no arguments (the tool loop then
    tells the model what came)."""
    sent = "[" * 3000 if shape == "broken" else '{"a":' * 700 + "1" + "}" * 700
    fake_llm.enqueue(FakeResponse.tool_calls([("call_1", "weather", sent)]))
    [call] = (await run(provider, request(tools=(WEATHER,)), streaming)).tool_calls
    assert call.name == "weather" and call.arguments is None and call.raw_arguments
    fake_llm.enqueue(FakeResponse.tool_calls([("call_2", "weather", {"city": {"a": [[["x"]]]}})]))
    [fine] = (await run(provider, request(tools=(WEATHER,)), streaming)).tool_calls
    assert fine.arguments == {"city": {"a": [[["x"]]]}}  # ordinary nesting is kept


@pytest.mark.asyncio
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_single_tool_call(provider: LLMProvider, fake_llm: FakeLLMServer, streaming: bool) -> None:
    fake_llm.enqueue(FakeResponse.tool_calls([("call_1", "weather", {"city": "Paris"})], text="Let me check."))
    completion = await run(provider, request(tools=(WEATHER,)), streaming)
    assert completion.text == "Let me check."
    assert completion.stop_reason == "tool_use"
    [call] = completion.tool_calls
    assert (call.id, call.name, call.arguments) == ("call_1", "weather", {"city": "Paris"})
    assert json.loads(call.raw_arguments) == {"city": "Paris"}


@pytest.mark.asyncio
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_two_parallel_tool_calls(provider: LLMProvider, fake_llm: FakeLLMServer, streaming: bool) -> None:
    fake_llm.enqueue(
        FakeResponse.tool_calls([("call_a", "weather", {"city": "Oslo"}), ("call_b", "weather", {"city": "Rome"})])
    )
    completion = await run(provider, request(tools=(WEATHER,)), streaming)
    assert completion.text == ""
    assert [(c.id, c.arguments) for c in completion.tool_calls] == [
        ("call_a", {"city": "Oslo"}),
        ("call_b", {"city": "Rome"}),
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_malformed_tool_arguments_are_kept_raw(
    provider: LLMProvider, fake_llm: FakeLLMServer, streaming: bool
) -> None:
    raw = '{"city": "Par'
    fake_llm.enqueue(FakeResponse.tool_calls([("call_1", "weather", raw), ("call_2", "weather", {"city": "Oslo"})]))
    completion = await run(provider, request(tools=(WEATHER,)), streaming)
    bad, good = completion.tool_calls
    assert bad.arguments is None
    assert raw in bad.raw_arguments or json.dumps(raw) == bad.raw_arguments
    assert good.arguments == {"city": "Oslo"}


@pytest.mark.asyncio
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_non_object_tool_arguments_become_none(
    provider: LLMProvider, fake_llm: FakeLLMServer, streaming: bool
) -> None:
    fake_llm.enqueue(FakeResponse.tool_calls([("call_1", "weather", ["Paris", 1])]))
    completion = await run(provider, request(tools=(WEATHER,)), streaming)
    [call] = completion.tool_calls
    assert call.arguments is None
    assert json.loads(call.raw_arguments) == ["Paris", 1]


# --------------------------------------------------------------------------- request serialisation


TOOL_EXCHANGE = (
    ChatMessage("user", "Weather in Paris and Oslo?"),
    ChatMessage(
        "assistant",
        "Checking.",
        tool_calls=(
            ToolCall("call_1", "weather", {"city": "Paris"}, '{"city": "Paris"}'),
            ToolCall("call_2", "weather", None, '{"city": '),
        ),
    ),
    ChatMessage("tool", "sunny, 21 C", tool_call_id="call_1"),
    ChatMessage("tool", "arguments were not valid JSON", tool_call_id="call_2", is_error=True),
    ChatMessage("user", "Thanks!"),
)


@pytest.mark.asyncio
async def test_anthropic_serialises_a_tool_exchange(anthropic_provider: LLMProvider, fake_llm: FakeLLMServer) -> None:
    await anthropic_provider.complete(request(*TOOL_EXCHANGE, tools=(WEATHER,)))
    body = last_completion_body(fake_llm)
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Oslo?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_2", "name": "weather", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 21 C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "call_2",
                    "content": "arguments were not valid JSON",
                    "is_error": True,
                },
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    assert body["tools"] == [
        {
            "name": "weather",
            "description": "Current weather for a city.",
            "input_schema": WEATHER.input_schema,
        }
    ]


@pytest.mark.asyncio
async def test_openai_serialises_a_tool_exchange(openai_provider: LLMProvider, fake_llm: FakeLLMServer) -> None:
    await openai_provider.complete(request(*TOOL_EXCHANGE, tools=(WEATHER,)))
    body = last_completion_body(fake_llm)
    assert body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Error: arguments were not valid JSON"},
        {"role": "user", "content": "Thanks!"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Current weather for a city.",
                "parameters": WEATHER.input_schema,
            },
        }
    ]
    assert body["max_tokens"] == 256
    assert body["model"] == "test-model"
    assert "temperature" not in body


@pytest.mark.asyncio
async def test_anthropic_merges_same_role_turns_and_drops_empty_text(
    anthropic_provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    await anthropic_provider.complete(
        request(
            ChatMessage("assistant", "Welcome back."),
            ChatMessage("user", "first"),
            ChatMessage("user", ""),
            ChatMessage("user", "second"),
            ChatMessage("assistant", "one"),
            ChatMessage("assistant", "two"),
            ChatMessage("user", "third"),
        )
    )
    assert last_completion_body(fake_llm)["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "(conversation continues)"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Welcome back."}]},
        {"role": "user", "content": [{"type": "text", "text": "first\n\nsecond"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "one\n\ntwo"}]},
        {"role": "user", "content": [{"type": "text", "text": "third"}]},
    ]


@pytest.mark.asyncio
async def test_anthropic_request_carries_model_limits_and_system(
    anthropic_provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    await anthropic_provider.complete(request(model="claude-test-1", max_tokens=321, temperature=0.3))
    recorded = fake_llm.completion_requests[-1]
    assert recorded.api == "anthropic"
    assert recorded.body["model"] == "claude-test-1"
    assert recorded.body["max_tokens"] == 321
    assert recorded.body["temperature"] == 0.3
    assert recorded.body["system"] == "You are terse."
    assert "tools" not in recorded.body
    assert "anthropic-version" in recorded.headers
    assert recorded.headers.get("Authorization") == recorded.headers["authorization"] == f"Bearer {API_KEY}"
    await anthropic_provider.complete(request(system=""))
    body = last_completion_body(fake_llm)
    assert "temperature" not in body and "system" not in body


# --------------------------------------------------------------------------- errors

ERROR_CASES = [
    pytest.param(429, None, "slow down", LLMRateLimited, id="429"),
    pytest.param(529, None, "Overloaded", LLMOverloaded, id="529"),
    pytest.param(503, None, "unavailable", LLMOverloaded, id="503"),
    pytest.param(500, None, "internal", LLMServerError, id="500"),
    pytest.param(401, None, "invalid x-api-key", LLMAuthError, id="401"),
    pytest.param(403, None, "forbidden", LLMAuthError, id="403"),
    pytest.param(402, None, "payment required", LLMOutOfCredit, id="402"),
    pytest.param(429, "insufficient_quota", "You exceeded your current quota", LLMOutOfCredit, id="429-quota"),
    pytest.param(400, None, "Your credit balance is too low to access the API.", LLMOutOfCredit, id="400-credit"),
    pytest.param(400, None, "messages: field required", LLMBadRequest, id="400"),
    pytest.param(404, "not_found_error", "model: nope", LLMBadRequest, id="404"),
    pytest.param(413, None, "too large", LLMBadRequest, id="413"),
    pytest.param(422, None, "unprocessable", LLMBadRequest, id="422"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("status", "error_type", "message", "expected"), ERROR_CASES)
async def test_http_errors_map_to_the_error_tree(
    provider: LLMProvider,
    fake_llm: FakeLLMServer,
    status: int,
    error_type: str | None,
    message: str,
    expected: type[LLMError],
) -> None:
    fake_llm.enqueue(FakeResponse.error(status, message, error_type=error_type))
    with pytest.raises(expected) as info:
        await provider.complete(request())
    assert type(info.value) is expected
    assert info.value.status_code == status
    assert str(status) in str(info.value) and message in str(info.value)
    assert len(fake_llm.completion_requests) == 1  # max_retries=0
    if expected is LLMBadRequest:  # what to fix reaches the user, not just "rejected"
        assert f"HTTP {status}" in info.value.user_message and message in info.value.user_message


@pytest.mark.asyncio
async def test_a_servers_rejection_reaches_chat_as_one_line(provider: LLMProvider, fake_llm: FakeLLMServer) -> None:
    """A proxy's 400 may carry its whole traceback: it went to the channel with every line."""
    fake_llm.enqueue(FakeResponse.error(400, "litellm.BadRequestError: model not found\n\nTraceback (most recent "
                                             "call last):\n  File \"/app/litellm/main.py\", line 1234, in completion"))
    with pytest.raises(LLMBadRequest) as info:
        await provider.complete(request())
    said = info.value.user_message
    assert "\n" not in said and "model not found" in said and "Traceback" not in said and "/app/" not in said
    fake_llm.enqueue(FakeResponse.error(400, "x" * 2000))
    with pytest.raises(LLMBadRequest) as info:
        await provider.complete(request())
    assert len(info.value.user_message) < 400
    # A proxy's error page (nginx's) went to the channel as HTML; markup in a plain text went too.
    page = b"<html><head><title>400 Error</title></head><body><center><h1>400 Error</h1></center><hr>" \
           b"<center>nginx/1.18.0</center></body></html>"
    fake_llm.enqueue(FakeResponse.malformed(page, status=400, content_type="text/html"))
    with pytest.raises(LLMBadRequest) as info:
        await provider.complete(request())
    assert info.value.user_message == "The language model rejected the request (HTTP 400).", info.value.user_message
    fake_llm.enqueue(FakeResponse.malformed(b"bad <script>alert(1)</script> model name", status=400,
                                            content_type="text/plain"))
    with pytest.raises(LLMBadRequest) as info:
        await provider.complete(request())
    assert "<" not in info.value.user_message and "bad alert(1) model name" in info.value.user_message
    fake_llm.enqueue(FakeResponse.error(400, "must satisfy 1 <= max_tokens <= 4096, got <class 'int'> 5000"))
    with pytest.raises(LLMBadRequest) as info:
        await provider.complete(request())
    assert "1 <= max_tokens <= 4096, got <class 'int'> 5000" in info.value.user_message  # (no tag: kept)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("status", "expected"),
    [(429, LLMRateLimited), (529, LLMOverloaded), (401, LLMAuthError)],
    ids=["429", "529", "401"],
)
async def test_http_errors_on_stream_requests(
    provider: LLMProvider, fake_llm: FakeLLMServer, status: int, expected: type[LLMError]
) -> None:
    fake_llm.enqueue(FakeResponse.error(status, "nope"))
    with pytest.raises(expected):
        await collect(provider, request())


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", PROVIDERS)
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_rate_limit_then_success_is_retried(fake_llm: FakeLLMServer, kind: str, streaming: bool) -> None:
    fake_llm.enqueue(FakeResponse.error(429, "slow down"), FakeResponse.error(529, "busy"), FakeResponse.text("ok"))
    prov = make_provider(kind, fake_llm, max_retries=2)
    try:
        completion = await run(prov, request(), streaming)
    finally:
        await prov.aclose()
    assert completion.text == "ok"
    assert len(fake_llm.completion_requests) == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", PROVIDERS)
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_hung_request_times_out(fake_llm: FakeLLMServer, kind: str, streaming: bool) -> None:
    fake_llm.enqueue(FakeResponse.text("too late", delay=5))
    prov = make_provider(kind, fake_llm, timeout=0.3)
    try:
        with pytest.raises(LLMTimeout):
            await run(prov, request(), streaming)
    finally:
        await prov.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", PROVIDERS)
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_the_timeout_bounds_the_whole_answer_retries_included(
    fake_llm: FakeLLMServer, kind: str, streaming: bool
) -> None:
    for _ in range(4):
        fake_llm.enqueue(FakeResponse.text("too late", delay=5))
    prov = make_provider(kind, fake_llm, timeout=0.8, max_retries=3)  # per attempt 0.8 s, four attempts
    started = time.monotonic()
    try:
        with pytest.raises(LLMTimeout, match="no complete answer within 0.8 s"):
            await run(prov, request(), streaming)
    finally:
        await prov.aclose()
    assert time.monotonic() - started < 1.6  # not 4 × 0.8 s plus back-off


@pytest.mark.asyncio
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize(
    "body",
    [b'{"id": "x", "content": [', b'{"unexpected": true}', b"<html>502 Bad Gateway</html>"],
    ids=["truncated-json", "wrong-shape", "html"],
)
async def test_malformed_body_is_a_bad_response(
    provider: LLMProvider, fake_llm: FakeLLMServer, streaming: bool, body: bytes
) -> None:
    fake_llm.enqueue(FakeResponse.malformed(body))
    with pytest.raises(LLMBadResponse) as info:
        await run(provider, request(), streaming)
    # Cut short or a proxy's page: the next try may well work (jobs retry it); a whole answer of the wrong
    # shape will not.
    assert info.value.transient == (body != b'{"unexpected": true}' or streaming), (body, streaming)


@pytest.mark.asyncio
async def test_openai_response_without_choices_is_a_bad_response(
    openai_provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": []}
    fake_llm.enqueue(FakeResponse.malformed(json.dumps(body).encode()))
    with pytest.raises(LLMBadResponse, match="no choices"):
        await openai_provider.complete(request())


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("failure", "expected"),
    [("disconnect", LLMConnectionError), ("eof", LLMBadResponse), ("error_event", LLMError)],
)
async def test_stream_failing_midway_raises_an_llm_error(
    provider: LLMProvider, fake_llm: FakeLLMServer, failure: StreamFailure, expected: type[LLMError]
) -> None:
    fake_llm.enqueue(FakeResponse.stream_error_after(4, "abcdefghi", chunks=["abc", "def", "ghi"], failure=failure))
    deltas: list[str] = []
    with pytest.raises(expected) as info:
        async for event in provider.stream(request()):
            assert isinstance(event, TextDelta), "no StreamEnd after a failure"
            deltas.append(event.text)
    assert deltas and "".join(deltas) in "abcdefghi"
    assert info.value.transient or failure == "error_event"  # a stream cut short is worth another try
    if failure == "disconnect":  # (it answered, then broke off: not "cannot be reached")
        assert type(info.value) is LLMBrokenOff and "broke off" in info.value.user_message


@pytest.mark.asyncio
async def test_anthropic_in_stream_overloaded_event(anthropic_provider: LLMProvider, fake_llm: FakeLLMServer) -> None:
    fake_llm.enqueue(FakeResponse.stream_error_after(3, failure="error_event", error_type="overloaded_error"))
    with pytest.raises(LLMOverloaded, match="overloaded_error"):
        await collect(anthropic_provider, request())


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", PROVIDERS)
async def test_unreachable_server_is_a_connection_error(fake_llm: FakeLLMServer, kind: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}" + ("/v1" if kind == "openai" else "")
    prov = create_provider(
        kind, api_key=API_KEY, base_url=url, timeout_seconds=2, connect_timeout_seconds=1, max_retries=0
    )
    try:
        with pytest.raises(LLMConnectionError) as info:
            await prov.complete(request())
    finally:
        await prov.aclose()
    assert API_KEY not in str(info.value) and API_KEY not in repr(info.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("status", [401, 400, 500])
async def test_api_key_never_appears_in_errors(provider: LLMProvider, fake_llm: FakeLLMServer, status: int) -> None:
    fake_llm.enqueue(FakeResponse.error(status, f"Incorrect API key provided: {API_KEY}"))
    with pytest.raises(LLMError) as info:
        await provider.complete(request())
    err = info.value
    assert API_KEY not in str(err) and API_KEY not in repr(err) and API_KEY not in err.detail
    assert str(status) in str(err) and "Incorrect API key provided" in str(err)
    assert err.user_message and API_KEY not in err.user_message


@pytest.mark.asyncio
async def test_anthropic_without_any_key_is_an_auth_error(
    fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_PROFILE", "ANTHROPIC_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    prov = make_provider("anthropic", fake_llm, api_key=None)
    try:
        with pytest.raises(LLMAuthError):
            await prov.complete(request())
    finally:
        await prov.aclose()
    assert fake_llm.requests == []


def test_anthropic_with_a_broken_credentials_config_is_an_auth_error(
    fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ANTHROPIC_CONFIG_DIR", str(tmp_path))  # no configs/default.json there
    with pytest.raises(LLMAuthError):
        make_provider("anthropic", fake_llm, api_key=None)


@pytest.mark.asyncio
async def test_openai_compatible_server_without_a_key(fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    prov = make_provider("openai", fake_llm, api_key=None)
    try:
        assert (await prov.complete(request(ChatMessage("user", "local")))).text == "echo: local"
    finally:
        await prov.aclose()


# --------------------------------------------------------------------------- models and factory


@pytest.mark.asyncio
async def test_list_models(provider: LLMProvider, fake_llm: FakeLLMServer) -> None:
    fake_llm.models = ["model-a", "model-b", "model-c"]
    assert await provider.list_models() == ["model-a", "model-b", "model-c"]
    recorded = fake_llm.requests[-1]
    assert recorded.path == "/v1/models"
    assert recorded.api == provider.name


@pytest.mark.asyncio
async def test_list_models_error_is_mapped(provider: LLMProvider, fake_llm: FakeLLMServer) -> None:
    fake_llm.stop()
    with pytest.raises(LLMConnectionError):
        await provider.list_models()


@pytest.mark.asyncio
async def test_create_provider_names_and_unknown_provider(fake_llm: FakeLLMServer) -> None:
    for kind in PROVIDERS:
        prov = make_provider(kind, fake_llm)
        assert prov.name == kind
        assert isinstance(prov, LLMProvider)
        await prov.aclose()
    with pytest.raises(ValueError, match="unknown LLM provider"):
        create_provider(
            "gemini", api_key=None, base_url=None, timeout_seconds=1, connect_timeout_seconds=1, max_retries=0
        )


# --------------------------------------------------------------------------- the fake server itself


def test_fake_server_serves_plain_http_and_records_requests(fake_llm: FakeLLMServer) -> None:
    data = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
    req = urllib.request.Request(
        fake_llm.openai_url + "/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        answer = json.loads(resp.read())
    assert answer["choices"][0]["message"]["content"] == "echo: hello"
    recorded = fake_llm.wait_for(lambda r: r.api == "openai", timeout=1)
    assert isinstance(recorded, RecordedRequest) and recorded.last_user_text() == "hello"
    with pytest.raises(TimeoutError):
        fake_llm.wait_for(lambda r: r.api == "anthropic", timeout=0.05)
    fake_llm.responder = lambda r: FakeResponse.text("scripted")
    fake_llm.enqueue(FakeResponse.text("queued"))
    texts = []
    for _ in range(2):
        with urllib.request.urlopen(req, timeout=5) as resp:
            texts.append(json.loads(resp.read())["choices"][0]["message"]["content"])
    assert texts == ["queued", "scripted"]
    fake_llm.reset()
    assert fake_llm.requests == [] and fake_llm.pending == 0


@pytest.mark.asyncio
async def test_a_key_in_a_long_error_message_is_redacted_before_the_message_is_cut(
    provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    fake_llm.enqueue(FakeResponse.error(400, "x" * 480 + f" bad key {API_KEY}"))
    with pytest.raises(LLMError) as info:
        await provider.complete(request())
    assert API_KEY[:8] not in info.value.detail and "[redacted]" in info.value.detail


@pytest.mark.asyncio
async def test_openai_stream_of_whole_calls_without_an_index(openai_provider: LLMProvider,
                                                             fake_llm: FakeLLMServer) -> None:
    """Some compatible servers stream each tool call whole and leave out ``index``: each new id is a call
    of its own (they were glued into one call whose arguments were no JSON)."""
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    def call(call_id: str, city: str) -> dict[str, Any]:
        return {"tool_calls": [{"id": call_id, "type": "function",
                                "function": {"name": "weather", "arguments": json.dumps({"city": city})}}]}

    body = (chunk({"role": "assistant", "content": ""}) + chunk(call("a", "Oslo")) + chunk(call("b", "Rome"))
            + chunk({}, "tool_calls") + "data: [DONE]\n\n")
    fake_llm.enqueue(FakeResponse.malformed(body.encode(), content_type="text/event-stream"))
    completion = (await collect(openai_provider, request(tools=(WEATHER,))))[1]
    assert [(c.id, c.arguments) for c in completion.tool_calls] == [("a", {"city": "Oslo"}), ("b", {"city": "Rome"})]


@pytest.mark.asyncio
async def test_openai_stream_of_calls_that_all_say_index_0(openai_provider: LLMProvider,
                                                           fake_llm: FakeLLMServer) -> None:
    """Ollama numbers every streamed call 0: a new id at a used index is a call of its own (two calls were
    merged into one named "weatherweather" with arguments that were no JSON); pieces after it continue it."""
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    def piece(call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
        function = {"arguments": arguments} | ({"name": name} if name else {})
        return {"tool_calls": [{"index": 0, "type": "function", "function": function}
                               | ({"id": call_id} if call_id else {})]}

    body = (chunk({"role": "assistant", "content": ""}) + chunk(piece("call_a", "weather", '{"city": ')) +
            chunk(piece(None, None, '"Oslo"}')) + chunk(piece("call_b", "weather", '{"city": "Rome"}')) +
            chunk({}, "tool_calls") + "data: [DONE]\n\n")
    fake_llm.enqueue(FakeResponse.malformed(body.encode(), content_type="text/event-stream"))
    completion = (await collect(openai_provider, request(tools=(WEATHER,))))[1]
    assert [(c.id, c.name, c.arguments) for c in completion.tool_calls] == [
        ("call_a", "weather", {"city": "Oslo"}), ("call_b", "weather", {"city": "Rome"})]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", PROVIDERS)
@pytest.mark.parametrize("header", [{"retry-after-ms": "30000"}, {"retry-after-ms": "100000000"}])
async def test_a_retry_after_longer_than_a_retry_may_wait_is_reported_at_once(
    fake_llm: FakeLLMServer, kind: str, header: dict[str, str]
) -> None:
    """The SDKs obey any retry-after: a reply sat out its whole deadline, then said "too slow"."""
    import time

    prov = make_provider(kind, fake_llm, max_retries=2, timeout=6.0)
    fake_llm.enqueue(*[FakeResponse.error(429, "slow down", headers=header) for _ in range(3)])
    started = time.monotonic()
    try:
        with pytest.raises(LLMRateLimited):
            await prov.complete(request())
    finally:
        await prov.aclose()
    assert time.monotonic() - started < 2.0 and len(fake_llm.completion_requests) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", PROVIDERS)
async def test_the_wait_a_server_asks_for_comes_with_its_error(fake_llm: FakeLLMServer, kind: str) -> None:
    """A background job backs off at least as long as the rate-limited (or overloaded) server asked: the wait
    was read, then dropped, and a server asking for an hour got five attempts in 35 s."""
    from bot.llm._mapping import retry_after

    prov = make_provider(kind, fake_llm, max_retries=0, timeout=6.0)
    fake_llm.enqueue(FakeResponse.error(429, "slow down", headers={"retry-after-ms": "3600000"}),
                     FakeResponse.error(529, "overloaded", headers={"retry-after-ms": "90000"}))
    try:
        with pytest.raises(LLMRateLimited) as limited:
            await prov.complete(request())
        with pytest.raises(LLMOverloaded) as overloaded:
            await prov.complete(request())
    finally:
        await prov.aclose()
    assert limited.value.retry_after == 3600 and overloaded.value.retry_after == 90
    assert retry_after({"retry-after": "3600"}) == 3600
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0  # a date in the past
    assert retry_after({"retry-after": "soon"}) is None and retry_after({}) is None
    assert retry_after({"retry-after-ms": "nan"}) is None and retry_after({"retry-after": "inf"}) is None
    assert retry_after({"retry-after-ms": "soon", "retry-after": "7"}) == 7  # (an unreadable one: the other)


@pytest.mark.asyncio
async def test_openai_chunk_of_two_calls_without_ids_or_indexes(openai_provider: LLMProvider,
                                                                fake_llm: FakeLLMServer) -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    calls = {"tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
                            {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]}
    body = chunk({"role": "assistant", "content": ""}) + chunk(calls) + chunk({}, "tool_calls") + "data: [DONE]\n\n"
    fake_llm.enqueue(FakeResponse.malformed(body.encode(), content_type="text/event-stream"))
    completion = (await collect(openai_provider, request(tools=(WEATHER,))))[1]
    assert [c.arguments for c in completion.tool_calls] == [{"city": "Oslo"}, {"city": "Rome"}]


def test_a_long_error_detail_keeps_its_start_and_its_request_id() -> None:
    from bot.llm._mapping import _shortened

    detail = "anthropic API error HTTP 400 invalid_request_error: " + "x" * 2000 + " (request id req_0123)"
    short = _shortened(detail)
    assert short.startswith("anthropic API error HTTP 400") and short.endswith("(request id req_0123)")
    assert len(short) <= 703 and _shortened("short") == "short"


def test_a_blank_text_before_a_tool_call_is_not_sent_back_to_anthropic() -> None:
    """The API refuses a text block of whitespace only ("text content blocks must contain non-whitespace
    text"): a model that wrote "\\n\\n" before its tool call made the next round fail."""
    from bot.llm.anthropic import convert_messages
    from bot.llm.base import ChatMessage, ToolCall

    call = ToolCall("call_1", "current_time", {})
    converted = convert_messages([
        ChatMessage(role="user", content="what time is it?"),
        ChatMessage(role="assistant", content="\n\n", tool_calls=(call,)),
        ChatMessage(role="tool", content="12:00", tool_call_id="call_1"),
    ])
    assistant = converted[1]
    assert assistant["role"] == "assistant" and [b["type"] for b in assistant["content"]] == ["tool_use"]
    assert all(b.get("text", "x").strip() for turn in converted for b in turn["content"])


@pytest.mark.asyncio
async def test_a_tool_round_after_a_blank_text_goes_through(anthropic_provider: LLMProvider,
                                                            fake_llm: FakeLLMServer) -> None:
    """The same through the SDK to the fake server, which refuses a blank text block as the API does."""
    from bot.llm.base import ToolCall

    fake_llm.enqueue(FakeResponse.text("It is noon."))
    exchange = (ChatMessage("user", "what time is it?"),
                ChatMessage("assistant", "\n\n", tool_calls=(ToolCall("call_1", "weather", {"city": "Oslo"}),)),
                ChatMessage("tool", "sunny", tool_call_id="call_1"))
    completion = await anthropic_provider.complete(request(*exchange, tools=(WEATHER,)))
    assert completion.text == "It is noon."


@pytest.mark.asyncio
async def test_an_answer_that_arrived_whole_but_odd_is_not_retried(openai_provider: LLMProvider,
                                                                   fake_llm: FakeLLMServer) -> None:
    """Only what arrives damaged is worth another try; a complete answer the bot cannot use (a tool call
    without its function) would fail the same way each time, and a job would pay for every attempt."""
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [{
        "index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": None}]}}]}
    fake_llm.enqueue(FakeResponse.malformed(json.dumps(body).encode()))
    with pytest.raises(LLMBadResponse) as info:
        await openai_provider.complete(request(tools=(WEATHER,)))
    assert not info.value.transient


@pytest.mark.asyncio
async def test_an_anthropic_stream_whose_message_delta_has_no_usage_still_answers(
    anthropic_provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    """A compatible server's message_delta without "usage" failed the reply after its text had been shown."""
    def event(name: str, data: dict[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    message = {"id": "m", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
               "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 1}}
    body = (event("message_start", {"message": message})
            + event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            + event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello Ann."}})
            + event("content_block_stop", {"index": 0})
            + event("message_delta", {"delta": {"stop_reason": "end_turn"}}) + event("message_stop", {}))
    fake_llm.enqueue(FakeResponse.malformed(body.encode(), content_type="text/event-stream"))
    deltas, completion = await collect(anthropic_provider, request())
    assert deltas == ["Hello Ann."] and completion.text == "Hello Ann." and completion.usage == Usage(5, 1)


@pytest.mark.asyncio
async def test_a_rate_limit_says_how_long_the_server_asked_to_wait(provider: LLMProvider, fake_llm: FakeLLMServer
                                                                   ) -> None:
    """A daily quota's Retry-After: 86400 reached people as "Please try again in a minute"."""
    waits = {"30": "in a minute", "1500": "in about 25 minutes", "7200": "in about 2 hours",
             "86400": "in about 24 hours"}
    said = []
    for wait in waits:
        fake_llm.enqueue(FakeResponse.error(429, "quota reached", headers={"retry-after": wait, "retry-after-ms": ""}))
        with pytest.raises(LLMRateLimited) as info:
            await provider.complete(request())
        said.append(info.value.user_message)
    assert said == [f"The language model is rate-limited right now. Please try again {when}."
                    for when in waits.values()]


@pytest.mark.asyncio
@pytest.mark.parametrize("content_type", ["text/html", "text/plain"])
async def test_a_200_answer_that_is_not_json_is_damaged_and_says_where_to_look(
    provider: LLMProvider, fake_llm: FakeLLMServer, content_type: str
) -> None:
    """The SDKs hand such a body over as a string: it failed as "unreadable" (an AttributeError), for good, and
    said nothing of a base_url that points at a web page."""
    fake_llm.enqueue(FakeResponse.malformed(b"<html><body>Sign in to the proxy</body></html>",
                                            content_type=content_type))
    with pytest.raises(LLMBadResponse) as info:
        await provider.complete(request())
    assert info.value.transient and "not JSON (check [llm] base_url)" in info.value.detail, info.value.detail


@pytest.mark.asyncio
async def test_a_stream_past_its_cap_fails_instead_of_filling_memory(
    provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    """A broken server's call arguments of any length were kept whole, as they came, until the stream ended."""
    from bot.llm.base import MAX_STREAMED_CHARS

    huge = '{"city": "' + "x" * MAX_STREAMED_CHARS + '"}'
    fake_llm.enqueue(FakeResponse.tool_calls([("c1", "weather", huge)]))
    with pytest.raises(LLMBadResponse, match="ran past 8,000,000 characters"):
        await collect(provider, request(tools=(WEATHER,)))


@pytest.mark.asyncio
async def test_a_compressed_answer_is_refused_unread_and_none_is_asked_for(
    provider: LLMProvider, fake_llm: FakeLLMServer
) -> None:
    """The cap counted an answer's bytes as they arrived, before the SDK unpacked them: 40 KB of gzip became 40 MB
    of answer past it. Answers are asked for uncompressed; one compressed all the same is refused unread."""
    import gzip

    from tests.fakes.llm_server import anthropic_message, openai_completion

    answer = FakeResponse.text("a" * 1000)
    document = anthropic_message(answer, "m") if provider.name == "anthropic" else openai_completion(answer, "m")
    fake_llm.enqueue(FakeResponse.malformed(gzip.compress(json.dumps(document).encode()),
                                            headers={"Content-Encoding": "gzip"}))
    with pytest.raises(LLMBadResponse) as info:
        await provider.complete(request())
    assert info.value.detail == (f"{provider.name}: the server compressed its answer (gzip) although none was asked"
                                 " for; unpacked, its size could pass any cap, so it was not read"), info.value.detail
    assert fake_llm.completion_requests[-1].headers["accept-encoding"] == "identity"
    fake_llm.enqueue(FakeResponse.text("plain"))
    assert (await provider.complete(request())).text == "plain"


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", PROVIDERS)
async def test_an_answer_past_its_cap_is_not_asked_for_again(fake_llm: FakeLLMServer, kind: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The Anthropic SDK took the cap's error, raised while it read the answer, for a lost connection and asked
    again: an oversized answer was downloaded, and paid for, once per retry."""
    import bot.llm._capped as capped

    monkeypatch.setattr(capped, "MAX_ANSWER_BYTES", 1 << 20)  # (to keep the test light: 8 MiB offered)
    for _ in range(3):
        fake_llm.enqueue(FakeResponse.huge(8))
    provider = make_provider(kind, fake_llm, max_retries=2)
    try:
        with pytest.raises(LLMBadResponse):
            await provider.complete(request())
        assert len(fake_llm.completion_requests) == 1
    finally:
        await provider.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("content_type", ["application/json", "text/event-stream"])
async def test_a_non_streamed_answer_past_its_cap_fails_and_is_not_read_further(
    provider: LLMProvider, fake_llm: FakeLLMServer, content_type: str
) -> None:
    """A non-streamed answer (a summary's, a cortex update's) was read whole into memory by the SDK, however large:
    a broken server's endless body grew the process without bound. Reading stops at the cap, with a clear error,
    also when the server calls it an event stream (those are capped where a stream asked for is read)."""
    from bot.llm.base import MAX_ANSWER_BYTES

    mebibytes = 4 * MAX_ANSWER_BYTES >> 20
    fake_llm.enqueue(FakeResponse.huge(mebibytes, content_type))
    with pytest.raises(LLMBadResponse) as info:
        await provider.complete(request())
    assert info.value.detail == (f"{provider.name}: the server's answer ran past {MAX_ANSWER_BYTES:,} bytes; the rest"
                                 " was not read"), info.value.detail
    assert fake_llm.huge_bytes_sent < MAX_ANSWER_BYTES + (16 << 20) < mebibytes << 20  # (the loopback's buffers)
