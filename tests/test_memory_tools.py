"""The update loop's memory tools through the real anthropic SDK against the fake server, on real SQLite;
and facts coming back in later replies."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import pytest_asyncio

from bot.app import App
from bot.config import parse_config
from bot.ports import IncomingMessage
from cortex.memory.embedders import HashEmbedder
from cortex.memory.tools import MEMORY_TOOL_NAMES
from tests.engines import db_url_for
from tests.fakes.llm_server import FakeLLMServer, FakeResponse
from tests.fakes.provider import ScriptedProvider
from tests.test_cortex_update import KEY_ENV, _config, _pair, _talk, cortex_requests, result_text, tool_results

pytestmark = pytest.mark.both_engines

CONVERSATION = ["My sister Mia moved to Lyon", "I am a nurse on night shifts", "Exam on Friday, wish me luck"]


@pytest_asyncio.fixture
async def app(tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[App]:
    monkeypatch.setenv(KEY_ENV, "test-key")
    async with App(_config(tmp_path, fake_llm), embedder=HashEmbedder()) as application:
        yield application


async def _run(app: App):
    pair = await _pair(app)
    return pair, await app.cortex.updater.run(pair, "50", (await app.cortex.resolver.effective("Cora")).settings)


async def test_remember_search_update_forget_through_the_loop(app: App, fake_llm: FakeLLMServer) -> None:
    await _talk(app, CONVERSATION)
    pair = await _pair(app)
    old = await app.cortex.memory.remember(pair.id, "Ann's sister Mia lives in Paris", category="user_info")
    stale = await app.cortex.memory.remember(pair.id, "Ann works in a bakery", category="user_info")
    fake_llm.enqueue(
        FakeResponse.tool_calls([("1", "search_memory", {"query": "sister Mia"})]),
        FakeResponse.tool_calls([
            ("2", "update_memory", {"id": old.id, "content": "Ann's sister Mia lives in Lyon"}),
            ("3", "remember", {"content": "Ann is a nurse on night shifts", "category": "user_info",
                               "importance": 8, "key": "job"}),
            ("4", "remember", {"content": "Ann has an exam on Friday", "category": "temporal",
                               "expires_in_days": 4}),
            ("5", "forget", {"id": stale.id, "reason": "she is a nurse now"}),
        ]),
        FakeResponse.text(""),
    )
    _, outcome = await _run(app)
    assert outcome.status == "success" and outcome.reason == ""
    requests = cortex_requests(fake_llm)
    assert MEMORY_TOOL_NAMES <= {t["name"] for t in requests[0].body["tools"]}
    assert "long-term memory" in requests[0].body["system"]
    found = result_text(tool_results(requests[1])[0])
    assert f"#{old.id} [user_info" in found and "Paris" in found
    texts = [result_text(r) for r in tool_results(requests[2])]
    assert not any(r.get("is_error") for r in tool_results(requests[2]))
    assert texts[0].startswith("saved #") and f"replacing #{old.id}" in texts[0]
    memory = app.cortex.memory
    items, _ = await memory.list_items(pair.id)
    by_text = {i.content: i for i in items}
    lyon = by_text["Ann's sister Mia lives in Lyon"]
    assert lyon.supersedes == old.id and lyon.source == "model" and lyon.category == "user_info"
    assert lyon.source_ref == f"cortex update run {outcome.run_id}"
    assert (await memory.get(pair.id, old.id, count_access=False)).superseded_by == lyon.id  # chain kept
    nurse = by_text["Ann is a nurse on night shifts"]
    assert (nurse.importance, nurse.key) == (8, "job")
    exam = by_text["Ann has an exam on Friday"]
    assert exam.expires_at is not None and exam.category == "temporal"
    forgotten = await memory.get(pair.id, stale.id, count_access=False)
    assert forgotten.archived_at is not None and "she is a nurse now" in forgotten.archive_reason
    assert "Paris" not in {i.content for i in items} and stale.id not in by_text.values()


async def test_a_correction_by_the_update_is_private(app: App, fake_llm: FakeLLMServer) -> None:
    """A shared item corrected by the persona stayed shared: the update reads the pair's DMs, and "Bob was fired
    and sees a therapist", said in a DM, correcting the shared "Bob works at Acme", entered his group channels'
    prompts. Every item the update writes is private (the README: items the persona writes itself are private);
    the user shares one again with !memory scope."""
    await _talk(app, CONVERSATION)
    pair = await _pair(app)
    memory = app.cortex.memory
    shared = await memory.remember(pair.id, "Ann's team plays on Tuesdays", category="fact", scope="shared")
    private = await memory.remember(pair.id, "Ann's sister Mia lives in Paris", category="user_info")
    fake_llm.enqueue(
        FakeResponse.tool_calls([
            ("1", "update_memory", {"id": shared.id, "content": "Ann's team plays on Fridays"}),
            ("2", "update_memory", {"id": private.id, "content": "Ann's sister Mia lives in Lyon"}),
        ]),
        FakeResponse.text(""),
    )
    _, outcome = await _run(app)
    assert outcome.status == "success"
    items, _ = await memory.list_items(pair.id)
    scopes = {i.content: i.scope for i in items}
    assert scopes == {"Ann's team plays on Fridays": "private", "Ann's sister Mia lives in Lyon": "private"}


async def test_a_correction_of_a_fact_that_expires_still_expires(app: App, fake_llm: FakeLLMServer) -> None:
    """update_memory dropped the expiry: "the exam moved to Saturday" stayed in every prompt for good. It keeps
    the old item's time, or takes its own."""
    await _talk(app, CONVERSATION)
    pair = await _pair(app)
    memory = app.cortex.memory
    exam = await memory.remember(pair.id, "Ann has an exam on Friday", category="temporal",
                                 expires_at=memory.clock() + 4 * 86400)
    trip = await memory.remember(pair.id, "Ann flies to Rome on Monday", category="temporal",
                                 expires_at=memory.clock() + 6 * 86400)
    fake_llm.enqueue(
        FakeResponse.tool_calls([
            ("1", "update_memory", {"id": exam.id, "content": "Ann's exam moved to Saturday"}),
            ("2", "update_memory", {"id": trip.id, "content": "Ann flies to Rome next month", "expires_in_days": 40}),
            ("3", "update_memory", {"id": 99, "content": "x", "expires_in_days": -1}),
        ]),
        FakeResponse.text(""),
    )
    _, outcome = await _run(app)
    assert outcome.status == "success"
    items, _ = await memory.list_items(pair.id)
    expiry = {i.content: i.expires_at for i in items}
    assert expiry["Ann's exam moved to Saturday"] == exam.expires_at
    moved = expiry["Ann flies to Rome next month"]
    assert moved is not None and 39 * 86400 < moved.timestamp() - memory.clock() <= 40 * 86400
    refused = result_text(tool_results(cortex_requests(fake_llm)[1])[2])
    assert refused.startswith("update_memory: 'expires_in_days' must be a number of days above 0"), refused


async def test_bad_memory_tool_calls_get_clear_errors_and_write_nothing(app: App, fake_llm: FakeLLMServer) -> None:
    await _talk(app, CONVERSATION)
    await _talk(app, ["hello there", "how are you", "fine"], user="bob")
    bob = await _pair(app, "bob")
    bobs = await app.cortex.memory.remember(bob.id, "Bob's secret")
    pair = await _pair(app)
    pinned = await app.cortex.memory.remember(pair.id, "Ann is vegetarian", pinned=True)
    archived = await app.cortex.memory.remember(pair.id, "Ann had a cold")
    await app.cortex.memory.archive(pair.id, archived.id, "over")
    bad_calls = [
        ("1", "remember", {"category": "fact"}),
        ("2", "remember", {"content": "x", "category": "gossip"}),
        ("3", "remember", {"content": "x", "category": "fact", "importance": 11}),
        ("4", "remember", {"content": "x", "category": "fact", "importance": "very"}),
        ("5", "remember", {"content": "   ", "category": "fact"}),
        ("6", "remember", {"content": "x", "category": "fact", "tags": "a,b"}),
        ("7", "remember", {"content": "x", "category": "fact", "expires_in_days": -2}),
        ("8", "update_memory", {"id": bobs.id, "content": "Bob's secret is mine now"}),
        ("9", "update_memory", {"id": "twelve", "content": "x"}),
        ("10", "update_memory", {"id": archived.id, "content": "x"}),
        ("11", "forget", {"id": pinned.id, "reason": "no"}),
        ("12", "forget", {"id": bobs.id, "reason": "no"}),
        ("13", "forget", {"id": pinned.id}),
        ("14", "search_memory", {}),
        ("15", "remember", '{"content": "unterminated'),
        ("16", "update_memory", {"id": 10**30, "content": "x"}),
        ("17", "update_memory", {"id": pinned.id, "content": "Ann eats meat now"}),  # not a way round forget
        ("18", "remember", {"content": "Ann likes tea", "category": "fact", "key": "k" * 20_000}),
    ]
    fake_llm.enqueue(FakeResponse.tool_calls(bad_calls), FakeResponse.text("ok"))
    before = await app.storage.db.fetch_all("SELECT * FROM memory_items ORDER BY id")
    _, outcome = await _run(app)
    assert outcome.status == "success"
    results = tool_results(cortex_requests(fake_llm)[1])
    assert len(results) == len(bad_calls) and all(r.get("is_error") for r in results)
    texts = [result_text(r) for r in results]
    assert "'content' must be a non-empty string" in texts[0] and "'content'" in texts[4]
    assert "'category' must be one of fact" in texts[1]
    assert "from 1 to 10, got 11" in texts[2] and "whole number" in texts[3]
    assert "'tags' must be a list" in texts[5] and "'expires_in_days' must be a number of days above 0" in texts[6]
    assert f"no memory item #{bobs.id}" in texts[7] and f"no memory item #{bobs.id}" in texts[11]
    assert "whole number" in texts[8] and "archived" in texts[9]
    assert "pinned by the user" in texts[10] and "'reason' must be" in texts[12]
    assert "'query' must be" in texts[13] and "needs a JSON object" in texts[14]
    assert "'id' must be from 1" in texts[15]
    assert f"item #{pinned.id} is pinned by the user; only they can change" in texts[16]
    assert "a key is a short label of at most 200 characters, not 20,000" in texts[17]
    after = await app.storage.db.fetch_all("SELECT * FROM memory_items ORDER BY id")
    assert [tuple(r) for r in after] == [tuple(r) for r in before]


async def test_a_run_writes_at_most_its_limit_of_items(app: App, fake_llm: FakeLLMServer) -> None:
    await _talk(app, CONVERSATION)
    calls = [(str(i), "remember", {"content": f"fact number {i}", "category": "fact"}) for i in range(25)]
    fake_llm.enqueue(FakeResponse.tool_calls(calls), FakeResponse.text(""))
    pair, _ = await _run(app)
    results = tool_results(cortex_requests(fake_llm)[1])
    assert sum(1 for r in results if not r.get("is_error")) == 20
    assert "limit per update" in result_text(results[-1])
    assert (await app.cortex.memory.list_items(pair.id))[1] == 20


async def test_a_run_forgets_at_most_its_limit_of_items(app: App, fake_llm: FakeLLMServer) -> None:
    """A misled model (the update reads what anyone wrote) cannot empty a user's memory in one update."""
    await _talk(app, CONVERSATION)
    pair = await _pair(app)
    ids = [(await app.cortex.memory.remember(pair.id, f"Ann fact {i}", category="fact")).id for i in range(8)]
    calls = [(str(i), "forget", {"id": item, "reason": "told to"}) for i, item in enumerate(ids)]
    fake_llm.enqueue(FakeResponse.tool_calls(calls), FakeResponse.text(""))
    await _run(app)
    results = tool_results(cortex_requests(fake_llm)[1])
    assert sum(1 for r in results if not r.get("is_error")) == 5
    assert "limit per update" in result_text(results[-1])
    assert (await app.cortex.memory.list_items(pair.id))[1] == 3


async def test_a_retried_job_keeps_one_limit_over_all_its_attempts(app: App, fake_llm: FakeLLMServer) -> None:
    """A 529 after the first attempt stored and forgot items: the retry gets what is left of the limits,
    not a fresh 20 and 5 (before, one job could store 20 items per attempt)."""
    await _talk(app, CONVERSATION)
    pair = await _pair(app)
    mine = [(await app.cortex.memory.remember(pair.id, f"Ann fact {i}", category="fact")).id for i in range(8)]
    first = [(f"a{i}", "remember", {"content": f"first try fact {i}", "category": "fact"}) for i in range(15)]
    first += [(f"f{i}", "forget", {"id": item, "reason": "told to"}) for i, item in enumerate(mine[:3])]
    second = [(f"b{i}", "remember", {"content": f"second try fact {i}", "category": "fact"}) for i in range(10)]
    second += [(f"g{i}", "forget", {"id": item, "reason": "told to"}) for i, item in enumerate(mine[3:])]
    fake_llm.enqueue(FakeResponse.tool_calls(first), FakeResponse.error(529, "Overloaded"),
                     FakeResponse.tool_calls(second), FakeResponse.text("done"))
    job = await app.cortex.tiers.request_update(pair, "75", None)
    assert await app.workers.drain(10)
    assert (await app.storage.get_job(job.id)).attempts == 2
    results = tool_results(cortex_requests(fake_llm)[-1])
    assert [r.get("is_error", False) for r in results] == [False] * 5 + [True] * 5 + [False] * 2 + [True] * 3
    assert "15 of them in its earlier attempts" in result_text(results[5])
    assert "3 of them in its earlier attempts" in result_text(results[-1])
    items, total = await app.cortex.memory.list_items(pair.id, limit=100)
    assert total == len(items) == 23 and sum(i.content.startswith(("first", "second")) for i in items) == 20
    assert sum(i.id in mine for i in items) == 3
    forgotten = await app.cortex.memory.get(pair.id, mine[0], count_access=False)
    assert forgotten.archive_reason.endswith(": told to") and "update run" in forgotten.archive_reason


@asynccontextmanager
async def _short_window(tmp_path: Path) -> AsyncIterator[tuple[App, ScriptedProvider, Callable[[str], Awaitable[str]]]]:
    """A bot whose history window holds about one exchange, with a hash embedder: the bot, its provider, and
    a way for Ann to say something to it in her DM (the reply's text)."""
    config = parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "history": {"history_tokens": 60, "min_exchanges": 1},
        "cortex": {"context_limit": 1000},
    })
    llm = ScriptedProvider()
    async with App(config, llm=llm, embedder=HashEmbedder()) as app:
        yield app, llm, lambda text: app.core.reply(
            IncomingMessage("console", "dm-ann", "ann", "Ann", text, is_dm=True)).text()


async def test_a_fact_comes_back_after_it_left_the_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Said once, long ago: neither in the history window nor in any file, it still reaches the reply
    prompt, by its words (full text) and, once embedded, by vector too."""
    # The embedding is the test's to run (below): the background's first run, 5 s after the start, came first on a
    # busy machine, and the hash embedder's vectors found the weather too.
    monkeypatch.setattr("bot.app.BACKFILL_FIRST_AFTER", 3600.0)
    async with _short_window(tmp_path) as (app, llm, say):
        await say("My grandmother's lasagne recipe uses nutmeg and three cheeses")
        for i in range(8):
            await say(f"small talk number {i} about the weather today")
        window = llm.requests[-1].messages
        assert not any("nutmeg" in str(m) for m in window)
        await say("what goes into the lasagne again?")
        system = llm.requests[-1].system
        assert "From earlier conversations" in system and "nutmeg" in system
        assert "weather" not in system.split("From earlier conversations")[1]  # only what is relevant
        report = await app.cortex.embeddings.backfill()
        assert report.messages >= 20 and not report.error
        await say("the lasagne?")
        assert "nutmeg" in llm.requests[-1].system


async def test_recalled_words_and_facts_reach_the_prompt_as_written_not_as_template_variables(tmp_path: Path) -> None:
    """What people said is kept as written: a "{user_name}" or "{{char}}" typed long ago is not filled with
    the present user's or persona's name when it is recalled (the header still names the user)."""
    async with _short_window(tmp_path) as (app, llm, say):
        await say("My lasagne recipe says {user_name} bakes it while {{char}} grates nutmeg")
        for i in range(8):
            await say(f"small talk number {i} about the weather today")
        await say("what goes into the lasagne recipe again?")
        recalled = llm.requests[-1].system.split("From earlier conversations")[1]
        assert "{user_name} bakes it while {{char}} grates nutmeg" in recalled
        account = await app.storage.get_user("console:ann")
        pair = await app.cortex.store.count_messages(account.id, "Cora", 0)
        await app.cortex.memory.remember(pair.id, "Ann's oven note reads {char} preheats, {{user}} waits",
                                         source="user")
        await say("what does the oven note say?")
        system = llm.requests[-1].system
        assert "Facts you remember about Ann:\n- Ann's oven note reads {char} preheats, {{user}} waits" in system
