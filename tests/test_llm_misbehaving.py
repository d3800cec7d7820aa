"""A model server that misbehaves in ways the SDKs let through: absurd usage figures, tool-call ids no
store takes, a summary the model refused to write, failed replies that still cost tokens. The real
``anthropic`` and ``openai`` SDKs talk to the fake LLM server on loopback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.llm.errors import LLMError
from bot.ports import IncomingMessage
from tests.engines import db_url_for
from tests.fakes.llm_server import FakeLLMServer, FakeResponse

pytestmark = pytest.mark.both_engines

KEY_ENV = "CB_MISBEHAVING_TEST_KEY"
ANN = CommandContext("console", "console:ann", "Ann", "console:dm-ann", "Cora", is_dm=True)


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "test-key")


def _config(tmp_path: Path, server: FakeLLMServer, provider: str = "openai", **sections: Any) -> Any:
    url = server.anthropic_url if provider == "anthropic" else server.openai_url
    return parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "llm": {"provider": provider, "base_url": url, "api_key_env": KEY_ENV, "max_retries": 0, "model": "m"},
        "personas": [{"name": "Cora"}], **sections,
    })


def _msg(text: str) -> IncomingMessage:
    return IncomingMessage("console", "dm-ann", "ann", "Ann", text, is_dm=True)


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
@pytest.mark.parametrize("tokens", [2**64 - 1, 2**31, -7])
async def test_an_absurd_usage_figure_is_held_in_range_and_forget_me_still_works(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str, tokens: int) -> None:
    """One figure no column holds failed every later audit flush, and forget-me flushes first: nobody
    could be forgotten until a restart. A negative one failed the metrics after every reply."""
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.text("Hello Ann.", input_tokens=tokens, output_tokens=tokens))
        stream = app.core.reply(_msg("hi"))
        assert await stream.text() == "Hello Ann." and stream.result is not None  # stored, fully recorded
        calls = await app.storage.list_llm_calls()
        assert [(c["input_tokens"], c["output_tokens"]) for c in calls] == [
            (100_000_000, 100_000_000) if tokens > 0 else (0, 0)]
        assert "Done. Deleted 2 messages" in (await app.commands.dispatch("!memory forget-me confirm", ANN)).text
        assert await app.storage.get_user("console:ann") is None


async def test_an_audit_row_that_fits_no_column_is_dropped_not_kept_forever(tmp_path: Path, fake_llm: FakeLLMServer
                                                                            ) -> None:
    from bot.storage.base import LLMCallRecord

    async with App(_config(tmp_path, fake_llm)) as app:
        await app.storage.upsert_user("console:ann", "Ann")
        await app.storage.record_llm_call(LLMCallRecord("reply", "m", 2**64, 1, 1))  # past any column's type
        await app.storage.flush_audit()  # dropped with an error in the log, not raised again and again
        assert "Done." in (await app.commands.dispatch("!memory forget-me confirm", ANN)).text


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_tool_call_id_with_a_lone_surrogate_still_ends_in_a_reply(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    """The id goes back with the tool's result: a lone surrogate in it failed the next request as an
    "unreadable response", after the tool had run."""
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c\ud800x", "current_time", {})]), FakeResponse.text("It is noon."))
        assert await app.core.reply(_msg("what time is it?")).text() == "It is noon."
        assert len(fake_llm.completion_requests) == 2


@pytest.mark.parametrize(("provider", "refusal"), [("anthropic", "refusal"), ("openai", "content_filter")])
async def test_a_summary_the_providers_filter_stopped_never_replaces_the_good_one(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str, refusal: str) -> None:
    from bot.summary import SummaryRejected

    history = {"history_tokens": 60, "min_exchanges": 0, "summary_trigger": 2}
    app = await App(_config(tmp_path, fake_llm, provider, history=history)).start(workers=False)
    try:
        storage = app.storage
        ann = await storage.upsert_user("console:ann", "Ann")
        room = await storage.upsert_channel("console:dm-ann", "dm", True)

        job = await storage.enqueue_job("summary", f"channel:{room.id}", {"channel_id": room.id, "persona": "Cora"}, 5)
        assert job is not None

        async def summarise() -> None:  # the job run here, again, as workers would retry it
            for i in range(8):
                await storage.add_message(room.id, ann.id, "Cora", "user", "Ann", f"Pixel did trick {i} " * 3, 20)
            await app.summaries.run_job(job)

        fake_llm.enqueue(FakeResponse.text("Ann told Cora about her cat Pixel and its tricks."))
        await summarise()
        fake_llm.enqueue(FakeResponse.text("I'm sorry, but I", stop_reason=refusal))
        with pytest.raises(SummaryRejected):
            await summarise()
        latest = await storage.latest_summary(room.id)
        assert latest is not None and latest.text == "Ann told Cora about her cat Pixel and its tricks."
        rejected = [dict(r) for r in await storage.db.fetch_all("SELECT * FROM summaries WHERE status = 'rejected'")]
        assert [r["reason"] for r in rejected] == ["the provider's content filter stopped the summary"]
    finally:
        await app.stop()


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_failed_reply_still_counts_the_tokens_it_was_billed(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    """An empty answer that reported its usage, and a tool round before an outage, were recorded as 0."""
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.text("", input_tokens=1234, output_tokens=56))
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "current_time", {})], input_tokens=5000, output_tokens=40),
                         FakeResponse.error(500, "boom"))
        for text in ("hi", "what time is it?"):
            with pytest.raises(LLMError):
                await app.core.reply(_msg(text)).text()
        calls = await app.storage.list_llm_calls()
        assert sorted((c["input_tokens"], c["output_tokens"], c["error"]) for c in calls) == [
            (1234, 56, "LLMBadResponse"), (5000, 40, "LLMServerError")]


async def test_an_unknown_tools_name_is_not_sent_back_whole(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """The model's name for a tool went back uncut in the error (a 320 KB next request in one probe)."""
    async with App(_config(tmp_path, fake_llm)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "x" * 50_000, {})]), FakeResponse.text("Sorry."))
        assert await app.core.reply(_msg("hi")).text() == "Sorry."
        tool = [m for m in fake_llm.completion_requests[-1].body["messages"] if m["role"] == "tool"][0]
        assert "there is no tool 'xxxx" in tool["content"] and len(tool["content"]) < 500


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_two_tool_calls_with_one_id_each_get_their_own_result(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    """A broken server sent two calls under one id: both results went back under it, which the real APIs
    refuse (or pair with the wrong call). The repeat is renamed, in the call and in its result alike."""
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("dup", "current_time", {}), ("dup", "current_time", {}),
                                                  ("dup", "current_time", {})]),
                         FakeResponse.text("It is noon."))
        assert await app.core.reply(_msg("what time is it?")).text() == "It is noon."
        messages = fake_llm.completion_requests[-1].body["messages"]
        if provider == "anthropic":
            calls = [b["id"] for m in messages if m["role"] == "assistant" and isinstance(m["content"], list)
                     for b in m["content"] if b["type"] == "tool_use"]
            results = [b["tool_use_id"] for m in messages if m["role"] == "user" and isinstance(m["content"], list)
                       for b in m["content"] if b["type"] == "tool_result"]
        else:
            calls = [c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
            results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
        assert calls == ["dup", "dup-2", "dup-3"] and results == calls


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_tool_call_with_megabytes_of_arguments_is_neither_run_nor_sent_back(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    """A broken server sent a call with 2 MB of valid JSON arguments: it ran, and the next request (and every
    later round's) repeated the 2 MB to the model. Now it is refused and left out of what is sent back."""
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        huge = {"content": "x" * 2_000_000, "category": "fact"}
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "remember", huge), ("c2", "current_time", {})]),
                         FakeResponse.text("Noted."))
        assert await app.core.reply(_msg("remember this")).text() == "Noted."
        follow_up = fake_llm.completion_requests[-1]
        sent = str(follow_up.body)
        assert "x" * 1000 not in sent and len(sent) < 100_000, len(sent)
        results = _tool_results(follow_up.body["messages"], provider)
        assert results["c1"][1] and results["c1"][0].startswith("refused: its arguments were 2,000,0"), results
        assert not results["c2"][1] and "refused" not in results["c2"][0], results  # the other call still ran
        assert not await app.storage.db.fetch_all("SELECT id FROM memory_items")  # nothing remembered


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_many_calls_just_under_the_argument_cap_are_not_all_sent_back(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    """Each call's arguments were capped at 64 KB, but all 40 calls of 60 KB went back in the next request
    (2.4 MB: the server refused it, and the person got no answer). Calls that did not run go back without
    their arguments, and a turn's calls past 32 not at all."""
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        calls = [(f"c{i}", "current_time", {"pad": "x" * 60_000}) for i in range(40)]
        fake_llm.enqueue(FakeResponse.tool_calls(calls), FakeResponse.text("It is noon."))
        assert await app.core.reply(_msg("what time is it?")).text() == "It is noon."
        follow_up = fake_llm.completion_requests[-1]
        assert len(str(follow_up.body)) < 9 * 62_000, len(str(follow_up.body))  # the 8 calls that ran, at most
        results = _tool_results(follow_up.body["messages"], provider)
        assert sorted(results) == sorted(f"c{i}" for i in range(32))
        assert all(not results[f"c{i}"][1] for i in range(8))
        assert all(results[f"c{i}"][0].startswith("refused: at most 8 tool calls") for i in range(8, 32))


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_calls_huge_name_and_id_are_cut_in_what_goes_back(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    """A broken server's 50,000-character tool name and call id went back whole, in the call and its result."""
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        calls = [("i" * 50_000, "n" * 50_000, {}), ("j" * 50_000, "current_time", {})]
        fake_llm.enqueue(FakeResponse.tool_calls(calls), FakeResponse.text("Sorry."))
        assert await app.core.reply(_msg("hi")).text() == "Sorry."
        follow_up = fake_llm.completion_requests[-1]
        assert len(str(follow_up.body)) < 5_000, len(str(follow_up.body))
        results = _tool_results(follow_up.body["messages"], provider)
        assert len(results) == 2 and all(len(key) <= 64 for key in results), results  # two ids, kept apart
        assert sum("there is no tool 'nnn" in text for text, _ in results.values()) == 1, results
        assert sum("UTC" in text for text, _ in results.values()) == 1, results  # the other call ran


def _tool_results(messages: list[dict[str, Any]], provider: str) -> dict[str, tuple[str, bool]]:
    """Each tool result of a request: call id -> (text, whether it is an error)."""
    if provider == "openai":  # (the OpenAI format has no error flag: an error's text starts with "Error: ")
        return {m["tool_call_id"]: (str(m["content"]).removeprefix("Error: "), str(m["content"]).startswith("Error: "))
                for m in messages if m["role"] == "tool"}
    found = {}
    for message in messages:
        for block in message["content"] if isinstance(message["content"], list) else ():
            if block["type"] == "tool_result":
                content = block["content"]
                text = content if isinstance(content, str) else "".join(part["text"] for part in content)
                found[block["tool_use_id"]] = (text, bool(block.get("is_error")))
    return found


@pytest.mark.parametrize(("provider", "refusal"), [("anthropic", "refusal"), ("openai", "content_filter")])
async def test_a_reply_the_filter_stopped_after_some_text_is_neither_kept_nor_sent_back(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str, refusal: str) -> None:
    """Only an empty refused reply said so: one stopped after some words went out as a whole reply, was stored,
    and went back to the model in every later request (which tends to get those refused too)."""
    from bot.llm.errors import LLMRefused

    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.text("Sure, here is how you", stop_reason=refusal), FakeResponse.text("Hello."))
        stream = app.core.reply(_msg("question"))
        with pytest.raises(LLMRefused):
            async for _ in stream:
                pass
        assert await app.core.reply(_msg("next")).text() == "Hello."
        sent = str(fake_llm.completion_requests[-1].body["messages"])
        assert "question" in sent and "Sure, here is how you" not in sent
        channel = await app.storage.get_channel("console:dm-ann")
        assert channel is not None
        assert [m.text for m in reversed(await app.storage.recent_messages(channel.id, 10))] == [
            "question", "next", "Hello."]


@pytest.mark.parametrize(("provider", "limit"), [("anthropic", "max_tokens"), ("openai", "length")])
async def test_a_reply_cut_at_the_models_output_limit_says_so(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str, limit: str) -> None:
    """It ended mid-word without a sign, as if the bot had broken off."""
    from bot.conversation import LENGTH_NOTE

    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.text("Step 1: open the file. Step 2: chan", stop_reason=limit),
                         FakeResponse.text("Done."))
        shown = await app.core.reply(_msg("how?")).text()
        assert shown == "Step 1: open the file. Step 2: chan" + LENGTH_NOTE
        assert await app.core.reply(_msg("thanks")).text() == "Done."  # a reply that ended by itself has none
        channel = await app.storage.get_channel("console:dm-ann")
        assert channel is not None
        stored = [m.text for m in reversed(await app.storage.recent_messages(channel.id, 10))]
        assert stored[1] == shown and stored[-1] == "Done."


@pytest.mark.parametrize("failure", ["disconnect", "error_event"])
async def test_a_stream_that_broke_off_counts_the_input_it_was_billed_for(
        tmp_path: Path, fake_llm: FakeLLMServer, failure: str) -> None:
    """Anthropic's stream says the input's tokens at its start: one that broke after it was recorded as 0/0."""
    from dataclasses import replace

    async with App(_config(tmp_path, fake_llm, "anthropic")) as app:
        fake_llm.enqueue(replace(FakeResponse.stream_error_after(4, "Hello there, a long answer", failure=failure),
                                 input_tokens=5000))
        with pytest.raises(LLMError):
            await app.core.reply(_msg("hi")).text()
        await app.storage.flush_audit()
        [call] = await app.storage.list_llm_calls()
        assert call["input_tokens"] == 5000 and call["error"]


def _anthropic_sse(*blocks: dict[str, Any], stop_reason: str = "tool_use") -> FakeResponse:
    """A streamed Anthropic message of these content blocks, as raw server-sent events (what the fake's own
    answers cannot say: a null where the API has a string)."""
    def event(name: str, data: dict[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    message = {"id": "m", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
               "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 1}}
    body = event("message_start", {"message": message})
    for index, block in enumerate(blocks):
        body += event("content_block_start", {"index": index, "content_block": block})
        body += event("content_block_stop", {"index": index})
    body += event("message_delta", {"delta": {"stop_reason": stop_reason}, "usage": {"output_tokens": 3}})
    return FakeResponse.malformed((body + event("message_stop", {})).encode(), content_type="text/event-stream")


async def test_a_streamed_tool_call_without_a_name_is_an_unknown_tool(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """A tool_use block with "name": null failed the reply with a TypeError, outside the model's errors: the
    person saw "TypeError". It is a call of no tool there is, and the model is told so."""
    async with App(_config(tmp_path, fake_llm, "anthropic")) as app:
        fake_llm.enqueue(_anthropic_sse({"type": "tool_use", "id": "t1", "name": None, "input": {}}),
                         FakeResponse.text("It is noon."))
        assert await app.core.reply(_msg("what time is it?")).text() == "It is noon."
        results = _tool_results(fake_llm.completion_requests[-1].body["messages"], "anthropic")
        assert results["t1"][1] and "there is no tool" in results["t1"][0], results


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
@pytest.mark.parametrize("content_type", ["text/html", "text/plain"])
async def test_a_summary_answered_with_a_web_page_is_retried(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str, content_type: str) -> None:
    """A 200 answer with an HTML page or plain text (a proxy, a wrong base_url) reached the bot as a string, failed
    as "unreadable" for good, and the summary job failed at its first attempt; it is retried as damaged."""
    history = {"history_tokens": 60, "min_exchanges": 0, "summary_trigger": 2}
    jobs = {"poll_seconds": 0.05, "retry_base_seconds": 0.05, "retry_max_seconds": 0.1}
    async with App(_config(tmp_path, fake_llm, provider, history=history, jobs=jobs)) as app:
        ann = await app.storage.upsert_user("console:ann", "Ann")
        room = await app.storage.upsert_channel("console:dm-ann", "dm", True)
        for i in range(8):
            await app.storage.add_message(room.id, ann.id, "Cora", "user", "Ann", f"Pixel did trick {i} " * 3, 20)
        fake_llm.enqueue(FakeResponse.malformed(b"<!doctype html><html><body>Please log in</body></html>",
                                                content_type=content_type),
                         FakeResponse.text("Ann told Cora about her cat Pixel and its tricks."))
        job = await app.storage.enqueue_job("summary", f"channel:{room.id}", {"channel_id": room.id, "persona": "Cora"},
                                            3)
        assert job is not None and await app.workers.drain(10)
        finished = await app.storage.get_job(job.id)
        assert finished is not None and (finished.status, finished.attempts) == ("done", 2), finished
        latest = await app.storage.latest_summary(room.id)
        assert latest is not None and latest.text == "Ann told Cora about her cat Pixel and its tricks."


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_reply_cut_at_its_length_cap_stops_reading_the_stream(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    """A server streaming without end was read to the end (or the time-out) after the reply was cut at 40,000
    characters, all of it kept in memory: 200 MB took the process to 700 MB. Its stream is closed at the cut."""
    from bot.conversation import CUT_NOTE, MAX_REPLY_CHARS

    pieces = 2_500  # of 8,000 characters: 20 MB, more than the loopback connection's buffers hold
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.flood("x" * 8_000, pieces))
        shown = await app.core.reply(_msg("hi")).text()
        assert shown.endswith(CUT_NOTE.strip()) and len(shown) <= MAX_REPLY_CHARS + len(CUT_NOTE)
        sent = await fake_llm.wait_for_stream_end_async(timeout=30)
        assert sent.ended == "client left" and sent.frames < pieces // 2, sent
        [call] = await app.storage.list_llm_calls()
        assert call["output_tokens"] > 0 and not call["error"]  # (the part it wrote counts, at least)
        assert call["input_tokens"] > 0  # (its prompt, as estimated: the stream's own count never came)
