"""Quirks of OpenAI-compatible servers other than OpenAI (Ollama, vLLM, llama.cpp, LM Studio, gateways),
through the real `openai` SDK against the fake server on loopback: raw SSE bodies the fake sends as written."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bot.app import App
from bot.config import parse_config
from bot.llm import ChatMessage, LLMRequest, StreamEnd, TextDelta, ToolSpec, create_provider
from bot.llm.base import LLMProvider
from bot.llm.reasoning import ThinkingFilter, without_thinking
from bot.ports import IncomingMessage
from tests.engines import db_url_for
from tests.fakes.llm_server import FakeLLMServer, FakeResponse

KEY_ENV = "CB_COMPAT_TEST_KEY"
WEATHER = ToolSpec("weather", "the weather", {"type": "object", "properties": {"city": {"type": "string"}}})


def _provider(server: FakeLLMServer) -> LLMProvider:
    return create_provider("openai", api_key="k", base_url=server.openai_url, timeout_seconds=5,
                           connect_timeout_seconds=2, max_retries=0)


def _request(**fields: Any) -> LLMRequest:
    return LLMRequest(system="s", messages=(ChatMessage("user", "Hi"),), model="m", max_tokens=64, **fields)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"


def _sse(*chunks: str) -> FakeResponse:
    return FakeResponse.malformed(("".join(chunks) + "data: [DONE]\n\n").encode(), content_type="text/event-stream")


def _config(tmp_path: Any, server: FakeLLMServer, model: str, provider: str = "openai") -> Any:
    """A bot asking ``model`` on the fake server through the real SDK of ``provider``."""
    url = server.anthropic_url if provider == "anthropic" else server.openai_url
    return parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                         "llm": {"provider": provider, "base_url": url, "api_key_env": KEY_ENV, "max_retries": 0,
                                 "model": model}})


def _refusing_tools(request: Any) -> FakeResponse:
    """Ollama's answer for a model without tool support; a text answer without them."""
    if "tools" in request.body:
        return FakeResponse.error(400, "registry.ollama.ai/library/gemma2:9b does not support tools")
    return FakeResponse.text("Hello Ann.")


async def _streamed(server: FakeLLMServer, request: LLMRequest | None = None) -> tuple[list[str], Any]:
    provider = _provider(server)
    shown, end = [], None
    try:
        async for event in provider.stream(request or _request()):
            if isinstance(event, TextDelta):
                shown.append(event.text)
            elif isinstance(event, StreamEnd):
                end = event.completion
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    return shown, end


@pytest.mark.parametrize("pieces", [
    ["<think>\nAnn seems grumpy; her password is hunter2.\n</think>\n\nHello Ann."],
    ["<th", "ink>notes", " about hunter2</thi", "nk>", "\n\n", "Hello", " Ann."],
    ["  \n<think></think>Hello Ann."],
])
async def test_a_reasoning_models_thinking_is_neither_shown_nor_kept(fake_llm: FakeLLMServer,
                                                                    pieces: list[str]) -> None:
    """Qwen3 or DeepSeek-R1 on a server without a reasoning parser: the <think> block came as the answer's text,
    into the chat, the stored reply, every later request and the summaries."""
    fake_llm.enqueue(_sse(_chunk({"role": "assistant", "content": ""}), *(_chunk({"content": p}) for p in pieces),
                          _chunk({}, "stop")))
    shown, end = await _streamed(fake_llm)
    assert "".join(shown) == "Hello Ann." and end.text == "Hello Ann."


def test_thinking_is_only_a_block_at_the_start() -> None:
    keep = ThinkingFilter()
    said = "".join(keep.feed(p) for p in ["Use ", "<think>", " tags like this.</think>"]) + keep.end()
    assert said == "Use <think> tags like this.</think>"  # (later in an answer: text the model meant)
    short = ThinkingFilter()
    assert short.feed("<th") == "" and short.end() == "<th"  # (an answer that is just "<th")
    code = 'To drop it: `answer = raw.split("</think>")[-1]` and show `answer`.'
    assert without_thinking(code) == code  # (an answer may write the tag: only a block at the start goes)
    assert without_thinking("<think>notes</think> Hello.") == "Hello." and without_thinking("Hello.") == "Hello."


async def test_a_non_streamed_answer_loses_its_thinking_too(fake_llm: FakeLLMServer) -> None:
    """Summaries and the cortex update read whole answers."""
    fake_llm.enqueue(FakeResponse.text("<think>private notes</think>\n\nAnn likes tea."))
    provider = _provider(fake_llm)
    try:
        completion = await provider.complete(_request())
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    assert completion.text == "Ann likes tea."


async def test_a_finish_reason_sent_empty_ends_the_stream(fake_llm: FakeLLMServer) -> None:
    """Ollama and sglang send "" as the finish reason: every streamed reply failed as damaged."""
    fake_llm.enqueue(_sse(_chunk({"role": "assistant", "content": "Hello"}), _chunk({}, "")))
    shown, end = await _streamed(fake_llm)
    assert shown == ["Hello"] and end.text == "Hello" and end.stop_reason == "other"


async def test_tool_arguments_sent_as_an_object_are_read(fake_llm: FakeLLMServer) -> None:
    """Some gateways send a call's arguments as the object itself: every reply with a tool call failed as
    unreadable, streamed or not."""
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    fake_llm.enqueue(_sse(_chunk({"role": "assistant", "content": None}), _chunk({"tool_calls": [call]}),
                          _chunk({}, "tool_calls")))
    _, end = await _streamed(fake_llm, _request(tools=(WEATHER,)))
    assert [(c.name, c.arguments) for c in end.tool_calls] == [("weather", {"city": "Oslo"})]
    whole = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
                                                               "tool_calls": [{k: v for k, v in call.items()
                                                                               if k != "index"}]}}]}
    fake_llm.enqueue(FakeResponse.malformed(json.dumps(whole).encode(), content_type="application/json"))
    provider = _provider(fake_llm)
    try:
        completion = await provider.complete(_request(tools=(WEATHER,)))
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    assert [(c.name, c.arguments) for c in completion.tool_calls] == [("weather", {"city": "Oslo"})]


async def test_a_reply_shows_and_keeps_no_thinking(tmp_path: Any, fake_llm: FakeLLMServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "k")
    async with App(_config(tmp_path, fake_llm, "qwen3:8b")) as app:
        fake_llm.enqueue(FakeResponse.text("<think>\nher password is hunter2, don't say it.\n</think>\n\nHello Ann."),
                         FakeResponse.text("Fine, thanks."))
        message = IncomingMessage("discord", "dm-ann", "ann", "Ann", "hi", is_dm=True)
        assert await app.core.reply(message).text() == "Hello Ann."
        await app.core.reply(IncomingMessage("discord", "dm-ann", "ann", "Ann", "how are you?", is_dm=True)).text()
        assert "hunter2" not in json.dumps(fake_llm.completion_requests[-1].body)
        assert not await app.storage.db.fetch_all("SELECT id FROM messages WHERE text LIKE '%hunter2%'")


async def test_a_server_that_takes_no_tools_still_answers(tmp_path: Any, fake_llm: FakeLLMServer,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Ollama answers a model without tool support with a 400 ("does not support tools"), as do vLLM without
    --enable-auto-tool-choice and llama.cpp without --jinja: with skills on by default, every reply failed."""
    monkeypatch.setenv(KEY_ENV, "k")
    fake_llm.responder = _refusing_tools
    async with App(_config(tmp_path, fake_llm, "gemma2:9b")) as app:
        message = IncomingMessage("discord", "dm-ann", "ann", "Ann", "hi", is_dm=True)
        assert await app.core.reply(message).text() == "Hello Ann."
        assert await app.core.reply(message).text() == "Hello Ann."  # (asked without them at once now)
    asked = [("tools" in r.body) for r in fake_llm.completion_requests]
    assert asked == [True, False, False], asked
    assert sum("takes no tools" in r.getMessage() for r in caplog.records) == 1


async def test_a_server_that_refuses_stream_options_still_streams(fake_llm: FakeLLMServer) -> None:
    """Older Azure API versions and strict proxies refuse stream_options with a 400: every streamed reply failed."""
    fake_llm.responder = lambda request: (
        FakeResponse.error(400, "Unrecognized request argument supplied: stream_options")
        if "stream_options" in request.body else FakeResponse.text("Hello"))
    provider = _provider(fake_llm)
    try:
        for _ in range(2):
            events = [event async for event in provider.stream(_request())]
            assert isinstance(events[-1], StreamEnd) and events[-1].completion.text == "Hello"
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    assert [("stream_options" in r.body) for r in fake_llm.completion_requests] == [True, False, False]


async def test_another_bad_request_is_not_asked_again(fake_llm: FakeLLMServer) -> None:
    from bot.llm.errors import LLMBadRequest

    fake_llm.enqueue(FakeResponse.error(400, "messages: the model m does not exist"))
    provider = _provider(fake_llm)
    try:
        with pytest.raises(LLMBadRequest):
            await provider.complete(_request(tools=(WEATHER,)))
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    assert len(fake_llm.completion_requests) == 1


@pytest.mark.parametrize(("code", "kind"), [(429, "LLMRateLimited"), (402, "LLMOutOfCredit")])
async def test_an_in_stream_error_with_a_numeric_code_is_what_the_code_says(fake_llm: FakeLLMServer, code: int,
                                                                           kind: str) -> None:
    """OpenRouter puts the HTTP status it means into an in-stream error's code: 429 and 402 were taken for a
    server's error, and credit used up was retried by background jobs, paying each time."""
    from bot.llm import errors

    error = "data: " + json.dumps({"error": {"message": "Insufficient credits" if code == 402 else "Slow down",
                                             "code": code}}) + "\n\n"
    fake_llm.enqueue(FakeResponse.malformed((_chunk({"role": "assistant", "content": ""}) + error).encode(),
                                            content_type="text/event-stream"))
    with pytest.raises(errors.LLMError) as raised:
        await _streamed(fake_llm)
    assert type(raised.value).__name__ == kind, raised.value


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_reply_the_providers_filter_stopped_says_so(tmp_path: Any, fake_llm: FakeLLMServer,
                                                           monkeypatch: pytest.MonkeyPatch, provider: str) -> None:
    """A refusal with no text (Anthropic's "refusal", OpenAI's "content_filter") told the person the bot "could not
    read" the answer."""
    from bot.llm.errors import LLMRefused

    monkeypatch.setenv(KEY_ENV, "k")
    async with App(_config(tmp_path, fake_llm, "m", provider)) as app:
        fake_llm.enqueue(FakeResponse.text("", stop_reason="refusal" if provider == "anthropic" else "content_filter"))
        with pytest.raises(LLMRefused) as refused:
            await app.core.reply(IncomingMessage("discord", "dm-ann", "ann", "Ann", "hi", is_dm=True)).text()
        assert refused.value.user_message == "The language model's provider declined to answer that (its content " \
                                             "filter)."


async def test_a_streamed_answer_is_kept_as_it_was_shown(fake_llm: FakeLLMServer) -> None:
    """The whole answer was taken through without_thinking again after the stream: an answer that wrote the tag
    in code was shown whole and stored cut."""
    answer = 'To drop it: `answer = raw.split("</think>")[-1]` and show `answer`.'
    fake_llm.enqueue(_sse(_chunk({"role": "assistant", "content": answer}), _chunk({}, "stop")))
    shown, end = await _streamed(fake_llm)
    assert "".join(shown) == answer and end.text == answer


async def test_arguments_sent_as_an_object_are_not_inflated_by_escapes(fake_llm: FakeLLMServer) -> None:
    """Read back as JSON with ASCII escapes, a Chinese argument grew six times (an emoji twelve), past the caps."""
    text = "猫" * 1000 + "😀"
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": text}}}
    fake_llm.enqueue(_sse(_chunk({"role": "assistant", "content": None}), _chunk({"tool_calls": [call]}),
                          _chunk({}, "tool_calls")))
    _, end = await _streamed(fake_llm, _request(tools=(WEATHER,)))
    [read] = end.tool_calls
    assert read.arguments == {"city": text} and len(read.raw_arguments) < len(text) + 20


async def test_requests_in_flight_when_the_tools_were_dropped_are_asked_again(fake_llm: FakeLLMServer) -> None:
    """Two requests met the 400 together: the first dropped the tools and asked again; the second saw them
    dropped already and failed."""
    import asyncio

    fake_llm.responder = lambda request: (
        FakeResponse.error(400, "model m does not support tools", delay=0.3)
        if "tools" in request.body else FakeResponse.text("Hello"))
    provider = _provider(fake_llm)
    try:
        answers = await asyncio.gather(*(provider.complete(_request(tools=(WEATHER,))) for _ in range(2)))
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    assert [a.text for a in answers] == ["Hello", "Hello"]


async def test_an_update_that_needs_its_tools_fails_on_a_server_without_them(
        tmp_path: Any, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked again without its tools, a cortex update got a text answer, passed for "nothing new to record" and
    was billed for the whole conversation, every time."""
    from bot.llm.errors import LLMBadRequest

    monkeypatch.setenv(KEY_ENV, "k")
    fake_llm.responder = _refusing_tools
    async with App(_config(tmp_path, fake_llm, "gemma2:9b")) as app:
        for text in ("I adopted a cat called Pixel", "I work nights", "Tea, never coffee"):
            await app.core.reply(IncomingMessage("discord", "dm-ann", "ann", "Ann", text, is_dm=True)).text()
        user = await app.storage.get_user("discord:ann")
        assert user is not None
        pair = await app.cortex.store.count_messages(user.id, app.personas.names()[0], 0)
        with pytest.raises(LLMBadRequest):
            await app.cortex.updater.run(pair, "50", (await app.cortex.resolver.effective(pair.persona)).settings)


async def test_an_answer_that_was_all_thinking_says_so(fake_llm: FakeLLMServer) -> None:
    """A reasoning model whose length ran out mid-thought left an empty reply: "could not read" told the person
    nothing an admin could act on."""
    from bot.llm.errors import LLMOnlyThought

    fake_llm.enqueue(_sse(_chunk({"role": "assistant", "content": "<think>Let me weigh this"}),
                          _chunk({"content": " at great length"}), _chunk({}, "length")))
    with pytest.raises(LLMOnlyThought) as raised:
        await _streamed(fake_llm)
    assert "raise [llm] max_tokens" in raised.value.user_message


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
@pytest.mark.parametrize("finish", ["length", "stop"])
async def test_an_answer_that_was_all_reasoning_says_so_and_counts_its_tokens(fake_llm: FakeLLMServer, field: str,
                                                                             finish: str) -> None:
    """DeepSeek and vLLM (reasoning_content) and Ollama (reasoning) send the thinking in a field of its own: an
    answer whose length ran out while it thought was an empty reply, "could not read", billed as 0 tokens."""
    from bot.llm.errors import LLMOnlyThought

    usage = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 700, "completion_tokens": 64, "total_tokens": 764}}
    fake_llm.enqueue(_sse(_chunk({"role": "assistant", field: "Let me weigh"}), _chunk({field: " what Ann wants"}),
                          _chunk({}, finish), "data: " + json.dumps(usage) + "\n\n"))
    if finish == "stop":  # (ended by choice: an empty round, which after tool calls may follow a whole answer)
        shown, end = await _streamed(fake_llm)
        assert shown == [] and end is not None and end.text == "" and end.stop_reason == "end_turn"
        return
    with pytest.raises(LLMOnlyThought) as raised:
        await _streamed(fake_llm)
    assert "raise [llm] max_tokens" in raised.value.user_message and raised.value.billed == (700, 64)


async def test_a_last_round_of_thinking_alone_after_a_tool_keeps_the_reply(tmp_path: Any, fake_llm: FakeLLMServer,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A reasoning model said its answer with a tool call, then ended a last round with thinking only (finish
    "stop"): the whole reply failed as "spent its whole answer thinking", after its text had been shown."""
    monkeypatch.setenv(KEY_ENV, "k")
    async with App(_config(tmp_path, fake_llm, "deepseek-r1")) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "current_time", {})], text="Let me look at the clock."),
                         _sse(_chunk({"role": "assistant", "reasoning_content": "It is noon; said already."}),
                              _chunk({"content": ""}), _chunk({}, "stop")))
        said = await app.core.reply(IncomingMessage("discord", "dm-ann", "ann", "Ann", "time?", is_dm=True)).text()
        assert said.endswith("Let me look at the clock."), said


async def test_an_answer_that_ran_out_after_its_thinking_says_so(fake_llm: FakeLLMServer) -> None:
    """A <think> block that closed just before the length ran out left an empty reply: "could not read"."""
    from bot.llm.errors import LLMOnlyThought

    fake_llm.enqueue(_sse(_chunk({"role": "assistant", "content": "<think>Let me weigh this</think>"}),
                          _chunk({"content": "\n\n"}), _chunk({}, "length")))
    with pytest.raises(LLMOnlyThought):
        await _streamed(fake_llm)
