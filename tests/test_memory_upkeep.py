"""Forgetting and the memory admin commands on real SQLite: pruning rules at their boundaries (injected
clock), expiry, restore, the report, weights, budgets, embedder status, jobs in stats, permissions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bot.app import App
from bot.config import parse_config
from bot.ports import IncomingMessage
from cortex.memory.embedders import HashEmbedder
from cortex.memory.store import MemoryStore, Weights
from cortex.memory.upkeep import Pruner
from tests.fakes.llm_server import FakeLLMServer
from tests.fakes.provider import ScriptedProvider
from tests.test_cortex_commands import ctx, run
from tests.test_memory_store import Clock

DAY = 86_400.0
SECOND = 1.0


def _config(tmp_path: Path, **memory: object):
    return parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "cortex": {"context_limit": 1000},
                         "memory": memory})


async def _pair(app: App, user: str = "ann") -> int:
    account = await app.storage.upsert_user(f"console:{user}", user.title())
    return (await app.cortex.store.count_messages(account.id, "Cora", 0)).id


async def test_pruning_rules_at_their_boundaries(tmp_path: Path) -> None:
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        pair = await _pair(app)
        clock = Clock()
        store = MemoryStore(app.storage, clock=clock)
        start = clock.now

        async def item(text: str, age_days: float, *, accesses: int = 0, **kw: object) -> int:
            clock.now = start - age_days * DAY
            made = await store.remember(pair, text, **kw)  # type: ignore[arg-type]
            for _ in range(accesses):
                await store.get(pair, made.id)
            return made.id

        young_unused = await item("89 days old, never used", 90 - 1 / 24)
        old_unused = await item("just over 90 days old, never used", 90 + 1 / 24)
        old_used_once = await item("100 days old, used once", 100, accesses=1)
        pinned_old = await item("a pinned memory from long ago", 400, pinned=True)
        year_rare = await item("just over a year old, used twice", 365 + 1 / 24, accesses=2, category="event")
        year_enough = await item("just over a year old, used three times", 365 + 1 / 24, accesses=3)
        year_young = await item("almost a year old, used twice", 365 - 1 / 24, accesses=2)
        expired = await item("exam on Friday", 2, category="temporal", expires_at=start - SECOND)
        not_yet = await item("exam next week", 2, category="temporal", expires_at=start + DAY)
        clock.now = start
        pruner = Pruner(app.storage, app.config.memory, clock=clock)
        report = await pruner.prune()
        archived = {i.id: i for i in (await store.list_items(pair, archived=True, limit=50))[0]}
        assert set(archived) == {old_unused, year_rare, expired}
        for kept in (young_unused, old_used_once, pinned_old, year_enough, year_young, not_yet):
            assert (await store.get(pair, kept, count_access=False)).archived_at is None
        assert archived[old_unused].archive_reason == "pruned: never used in 90 days"
        assert archived[year_rare].archive_reason == "pruned: used fewer than 3 times in 365 days"
        assert report.archived == {
            "fact": {"never used in 90 days": 1},
            "event": {"used fewer than 3 times in 365 days": 1},
            "temporal": {"expired": 1},
        }
        text = "\n".join(report.lines())
        assert "archived 3 item(s)" in text and "event: 1 used fewer than 3 times in 365 days" in text
        assert (await pruner.last_report()) == report
        assert (await pruner.prune()).total == 0  # nothing left to do, nothing done twice
        # restoring brings an item back; an expired one stops expiring
        await store.restore(pair, expired)
        back = await store.get(pair, expired, count_access=False)
        assert back.archived_at is None and back.expires_at is None and back.visible
        # a restored item starts afresh: the next pruning leaves it alone
        await store.restore(pair, old_unused)
        assert (await pruner.prune()).total == 0
        assert (await store.get(pair, old_unused, count_access=False)).archived_at is None


async def test_thresholds_are_configurable(tmp_path: Path) -> None:
    async with App(_config(tmp_path, prune_unused_days=10, prune_rarely_used_days=20, prune_min_access=5),
                   llm=ScriptedProvider()) as app:
        pair = await _pair(app)
        clock = Clock()
        store = MemoryStore(app.storage, clock=clock)
        clock.now -= 11 * DAY
        unused = await store.remember(pair, "eleven days, never used")
        clock.now -= 10 * DAY
        rare = await store.remember(pair, "twenty-one days, used four times")
        for _ in range(4):
            await store.get(pair, rare.id)
        clock.now += 21 * DAY
        report = await Pruner(app.storage, app.config.memory, clock=clock).prune()
        assert report.archived == {"fact": {"never used in 10 days": 1, "used fewer than 5 times in 20 days": 1}}
        assert {i.id for i in (await store.list_items(pair, archived=True))[0]} == {unused.id, rare.id}


async def test_a_corrected_item_is_neither_pruned_nor_listed_as_archived(tmp_path: Path) -> None:
    """Pruning archived the hidden old wording beside its correction: the report counted two items where the user
    had one, and !memory archived listed the old one, whose restore is refused."""
    from bot.llm.base import ToolCall
    from cortex.memory.tools import MemoryTools

    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        await run(app, "!memory remember Ann drinks tea")
        pair = await _pair(app)
        tools = MemoryTools(app.cortex.memory, pair, run_id=1)
        assert not (await tools.execute(ToolCall("a", "update_memory", {"id": 1, "content": "Ann drinks green tea"}))
                    ).is_error
        later = Clock()
        later.now += 100 * DAY
        report = await Pruner(app.storage, app.config.memory, clock=later).prune()
        assert "archived 1 item(s)" in report.lines()[0], report.lines()
        archived = (await run(app, "!memory archived")).text
        assert "#2" in archived and "#1 " not in archived, archived


async def test_the_wordings_a_correction_replaced_go_with_it_and_free_their_places(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruning (or forgetting) a correction left the wording it replaced hidden but not archived: counted against
    the pair's item limit for ever, since nothing else archives it, so a memory could be full of nothing in use."""
    import cortex.memory.store as store_module
    from bot.llm.base import ToolCall
    from cortex.memory.tools import MemoryTools

    monkeypatch.setattr(store_module, "PAIR_ITEMS", 6)
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        pair = await _pair(app)
        tools = MemoryTools(app.cortex.memory, pair, run_id=1)
        for n, fact in enumerate(("Ann drinks tea", "Ann has a cat", "Ann rows")):
            await run(app, f"!memory remember {fact}")
            assert not (await tools.execute(ToolCall(f"u{n}", "update_memory", {"id": 2 * n + 1,
                                                                                "content": f"{fact} daily"}))).is_error
        await run(app, "!memory forget 6")  # a correction forgotten by the person: its old wording goes too
        later = Clock()
        later.now += 100 * DAY
        report = await Pruner(app.storage, app.config.memory, clock=later).prune()
        assert "archived 2 item(s)" in report.lines()[0], report.lines()  # the two corrections, counted once each
        for n in range(6):
            assert "Remembered" in (await run(app, f"!memory remember new fact {n}")).text
        archived = (await run(app, "!memory archived")).text
        assert "#1 " not in archived and "#3 " not in archived and "#5 " not in archived, archived


async def test_admin_commands_prune_weights_budgets_embedder_and_stats(tmp_path: Path) -> None:
    async with App(_config(tmp_path), llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        pair = await _pair(app)
        old = await app.cortex.memory.remember(pair, "Ann's secret diary entry")
        await app.storage.db.write("UPDATE memory_items SET created_at = created_at - ?, updated_at = updated_at - ?"
                                " WHERE id = ?", (100 * DAY, 100 * DAY, old.id))
        admin = ctx(admin=True)
        for line in ("!cortex prune", "!cortex weights", "!cortex weights vector=1", "!cortex budgets",
                     "!cortex embedder"):
            refused = await run(app, line, ctx("bob"))
            assert "admins only" in refused.text
        server_admin = ctx("bo", admin=True, server="console:guild1")
        for line in ("!cortex prune", "!cortex weights vector=1", "!cortex stats", "!cortex embedder"):
            assert "for the bot's admins" in (await run(app, line, server_admin)).text
        assert "Search weights:" in (await run(app, "!cortex weights", server_admin)).text
        their_budgets = (await run(app, "!cortex budgets", server_admin)).text
        assert "Daily cortex budgets" in their_budgets and "spent today" not in their_budgets  # bot-wide spending
        assert "only the bot's admins change daily_token_budget, max_rounds" in their_budgets
        assert "Change " not in their_budgets  # nothing here is theirs to change
        assert (await app.cortex.memory.get(pair, old.id, count_access=False)).archived_at is None
        report = (await run(app, "!cortex prune", admin)).text
        assert "archived 1 item(s)" in report and "fact: 1 never used in 90 days" in report
        assert "secret diary" not in report  # counts only, never content
        assert f"#{old.id} " in (await run(app, "!memory archived")).text
        # weights: shown, validated, applied to search at once, kept across a restart
        assert "vector 0.5, text 0.2, importance 0.15, recency 0.1, access 0.05" in (
            await run(app, "!cortex weights", admin)).text
        for bad in ("vector=lots", "speed=1", "vector=-1", "vector=0 text=0 importance=0 recency=0 access=0",
                    "vector=0 text=0 importance=0 recency=0 access=0 author=1"):
            assert (await run(app, f"!cortex weights {bad}", admin)).text.startswith(
                ("Write", "vector", "At least", "`speed` is no signal. Write signal=value"))
        assert "vector is given twice" in (await run(app, "!cortex weights vector=0.6 text=0.2 vector=0.1", admin)).text
        assert (await run(app, "!cortex weights foo=0.1", admin)).text.startswith("`foo` is no signal. Write")
        set_reply = (await run(app, "!cortex weights vector=0.7 text=0.3", admin)).text
        assert "vector 0.7, text 0.3, importance 0.15" in set_reply
        assert app.cortex.memory.weights.vector == 0.7 and app.cortex.updater.memory.weights.text == 0.3
        budgets = (await run(app, "!cortex budgets", admin)).text
        assert "knowledge 800" in budgets and "spent today" in budgets
        # every key it sends to the settings command is one that command takes
        pointed = budgets.split("Change ", 1)[1].split(" here with !cortex settings")[0].split(", ")
        assert pointed == ["daily_token_budget", "max_rounds"]
        for key in pointed:
            assert f"{key}: set to 7" in (await run(app, f"!cortex settings {key} 7", admin)).text
        assert "bot_daily_token_budget, prompt_tokens" in budgets.split("; ")[-1]
        status = (await run(app, "!cortex embedder", admin)).text
        assert "hash-trigram-64" in status and "0 of 0 memory items" in status
        await app.cortex.memory.remember(pair, "Ann collects stamps")
        status = (await run(app, "!cortex embedder", admin)).text
        assert "0 of 1 memory items" in status
        assert "Waiting to be embedded: 1; the background embedding runs every 60 s." in status
        await app.cortex.embeddings.backfill()
        status = (await run(app, "!cortex embedder", admin)).text
        assert "1 of 1 memory items" in status and "Last backfill" in status and "in progress" not in status
        # typed in a channel by a bot admin: privately (the embedding server's last error may quote a person's item,
        # its address and the whole bot's counts are the operator's); so is pruning's bot-wide report
        in_channel = ctx("root", admin=True, server="console:guild1", bot_admin=True)
        answer = await run(app, "!cortex embedder", in_channel)
        assert answer.private and "1 of 1 memory items" in answer.text
        assert not (await run(app, "!cortex embedder", admin)).private  # (a DM is private already)
        answer = await run(app, "!cortex stats", admin)
        assert answer.private  # (every pair's recent errors: to the admin who asked alone)
        stats = answer.text
        assert "Background jobs:" in stats and "prune-memory (every 24 h)" in stats
        assert "embed-backfill (every 60 s)" in stats and "requeue-abandoned-jobs" in stats
        assert "prune-old-jobs (every 24 h)" in stats
        assert "archived 1 item(s)" in stats
        pruned_here = await run(app, "!cortex prune", in_channel)
        assert pruned_here.private and "Pruning at" in pruned_here.text
    async with App(_config(tmp_path, weight_author=0.25), llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        assert app.cortex.memory.weights.vector == 0.7 and app.cortex.memory.weights.author == 0.4  # as saved
        # weights saved by a version without the author signal: it keeps the config file's weight
        await app.storage.set_setting("memory.weights", json.dumps(
            {"vector": 0.6, "text": 0.2, "importance": 0.1, "recency": 0.1, "access": 0.0}))
        await app.cortex.memory_admin.load()
        assert app.cortex.memory.weights == Weights(0.6, 0.2, 0.1, 0.1, 0.0, 0.25)
        assert "author 0.25" in (await run(app, "!cortex weights", ctx(admin=True))).text
        await run(app, "!cortex weights default", ctx(admin=True))
        assert app.cortex.memory.weights.vector == 0.5


@pytest.mark.parametrize("embedder", ["none"])
async def test_without_an_embedder_search_and_status_still_work(tmp_path: Path, embedder: str) -> None:
    async with App(_config(tmp_path, embedder=embedder), llm=ScriptedProvider()) as app:
        assert app.cortex.embeddings is None and "embed-backfill" not in app.scheduler.jobs
        pair = await _pair(app)
        item = await app.cortex.memory.remember(pair, "Ann collects stamps")
        assert [h.id for h in await app.cortex.memory.search(pair, "stamps")] == [item.id]
        assert "No embedder" in (await run(app, "!cortex embedder", ctx(admin=True))).text


async def test_an_embedder_failure_is_kept_for_the_status_and_retried(tmp_path: Path) -> None:
    class Broken(HashEmbedder):
        fail = True

        def embed(self, texts):  # type: ignore[no-untyped-def]
            if self.fail:
                from cortex.memory.embedders import EmbedderError
                raise EmbedderError("cannot reach http://127.0.0.1:9/v1 for embeddings")
            return super().embed(texts)

    broken = Broken()
    async with App(_config(tmp_path), llm=ScriptedProvider(), embedder=broken) as app:
        pair = await _pair(app)
        await app.cortex.memory.remember(pair, "Ann collects stamps")
        report = await app.cortex.embeddings.backfill()
        assert report.error and report.items == 0
        status = (await run(app, "!cortex embedder", ctx(admin=True))).text
        assert "Last error: cannot reach" in status
        # queries fall back to full text, with no error for the user
        await app.storage.db.write("UPDATE memory_items SET embedding = ?, embedding_model = ?",
                                (b"\0" * 256, broken.name))
        hits = await app.cortex.memory.search(pair, "stamps")
        assert hits and hits[0].signals["text"] == 1.0
        broken.fail = False
        assert (await app.cortex.embeddings.backfill()).error == ""
        assert "Last error" not in (await run(app, "!cortex embedder", ctx(admin=True))).text


async def test_changing_the_embedder_re_embeds_everything_with_progress(tmp_path: Path) -> None:
    config = _config(tmp_path, backfill_max_seconds=30)
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder(64)) as app:
        pair = await _pair(app)
        for n in range(5):
            await app.cortex.memory.remember(pair, f"Ann's fact number {n}")
        await app.core.reply(IncomingMessage("console", "dm-ann", "ann", "Ann", "I collect stamps", is_dm=True)).text()
        await app.cortex.embeddings.backfill()
        done = await app.cortex.embeddings.status()
        assert (done.items_embedded, done.messages_embedded, done.pending) == (5, 2, 0)
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder(32)) as app:
        status = (await run(app, "!cortex embedder", ctx(admin=True))).text
        assert "hash-trigram-32" in status and "0 of 5 memory items, 0 of 2 messages (0%)" in status
        assert "Waiting to be embedded: 7;" in status and "in progress" not in status  # (no run measured a speed)
        report = await app.cortex.embeddings.backfill()
        assert (report.items, report.messages) == (5, 2)
        status = (await run(app, "!cortex embedder", ctx(admin=True))).text
        assert "5 of 5 memory items, 2 of 2 messages (100%)" in status
        rows = await app.storage.db.fetch_all("SELECT DISTINCT embedding_model, length(embedding) FROM memory_items")
        assert [tuple(r) for r in rows] == [("hash-trigram-32", 32 * 4)]
        ann = await app.storage.get_user("console:ann")
        hits = await app.cortex.memory.search(pair, "stamps collection", user_id=ann.id, persona="Cora")
        assert hits and "vector" in hits[0].signals


async def test_an_openai_compatible_embedder_from_the_config(tmp_path: Path, fake_llm: FakeLLMServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The configured /v1/embeddings server (Ollama, vLLM, OpenAI) through the real SDK; its key from the
    environment; a server outage keeps the items, shows in the status and heals on the next run."""
    monkeypatch.setenv("CB_EMBED_KEY", "sk-embed-secret")
    config = _config(tmp_path, embedder="openai", embedder_model="nomic-embed-text",
                     embedder_base_url=fake_llm.openai_url, embedder_api_key_env="CB_EMBED_KEY")
    async with App(config, llm=ScriptedProvider()) as app:
        pair = await _pair(app)
        item = await app.cortex.memory.remember(pair, "Ann collects stamps")
        report = await app.cortex.embeddings.backfill()
        assert report.items == 1 and not report.error
        request = fake_llm.embedding_requests[-1]
        assert request.body["model"] == "nomic-embed-text" and request.body["input"] == ["Ann collects stamps"]
        assert request.headers.get("authorization") == "Bearer sk-embed-secret"
        status = (await run(app, "!cortex embedder", ctx(admin=True))).text
        assert "openai:nomic-embed-text" in status and "1 of 1 memory items" in status
        hits = await app.cortex.memory.search(pair, "stamp collecting")
        assert hits[0].id == item.id and "vector" in hits[0].signals
        fake_llm.stop()
        await app.cortex.memory.remember(pair, "Ann's stamps are from Peru")
        down = await app.cortex.embeddings.backfill()
        assert down.error and "sk-embed-secret" not in down.error
        assert [h.id for h in await app.cortex.memory.search(pair, "Peru")]  # text still finds it
        assert "Last error" in (await run(app, "!cortex embedder", ctx(admin=True))).text


async def test_the_backfill_embeds_on_a_low_priority_thread_of_its_own(tmp_path: Path) -> None:
    import os
    import threading

    seen: list[tuple[str, int]] = []

    class Watching(HashEmbedder):
        def embed(self, texts):  # type: ignore[no-untyped-def]
            niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            seen.append((threading.current_thread().name, niceness))
            return super().embed(texts)

    async with App(_config(tmp_path), llm=ScriptedProvider(), embedder=Watching()) as app:
        pair = await _pair(app)
        await app.cortex.memory.remember(pair, "Ann collects stamps")
        await app.cortex.embeddings.backfill()
    assert seen and seen[0][0].startswith("embed-backfill")
    assert seen[0][1] > os.getpriority(os.PRIO_PROCESS, 0)  # nicer than the event loop's thread


async def test_the_first_background_embedding_runs_soon_after_the_start(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The first backfill ran one interval (60 s) after the start: a short terminal chat ended before anything
    it said was searchable by meaning. It runs BACKFILL_FIRST_AFTER seconds after the start, then every interval."""
    import asyncio

    import bot.app

    monkeypatch.setattr(bot.app, "BACKFILL_FIRST_AFTER", 0.2)
    before = await App(_config(tmp_path), llm=ScriptedProvider(), embedder=HashEmbedder()).start(workers=False)
    try:  # stored before the bot below starts: its first backfill has it to embed, whenever that comes
        _, pair = await before.cortex.store.pair_for("console:ann", "Ann", "Cora")
        await before.cortex.memory.remember(pair.id, "Ann collects stamps")
    finally:
        await before.stop()
    async with App(_config(tmp_path), llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        assert app.cortex.embeddings is not None
        for _ in range(100):
            if app.scheduler.jobs["embed-backfill"].runs:
                break
            await asyncio.sleep(0.1)
        assert app.scheduler.jobs["embed-backfill"].runs == 1  # within seconds, where the interval is 60 s
        assert (await app.cortex.embeddings.status()).pending == 0


async def test_the_daily_upkeep_deletes_model_call_rows_past_their_days(tmp_path: Path) -> None:
    """The audit row of every model call was kept for good (no upkeep deleted any): now a daily job deletes
    those older than ``LLM_CALLS_KEPT_DAYS``, once across the fleet."""
    import time

    from bot.app import LLM_CALLS_KEPT_DAYS
    from bot.storage.base import LLMCallRecord

    async with App(_config(tmp_path, embedder="none"), llm=ScriptedProvider()) as app:
        assert "prune-old-llm-calls" in app.scheduler.jobs
        for model in ("old", "new"):
            await app.storage.record_llm_call(LLMCallRecord("reply", model, 1, 1, 1))
        await app.storage.flush_audit()
        await app.storage.db.write("UPDATE llm_calls SET created_at = ? WHERE model = 'old'",
                                   (time.time() - (LLM_CALLS_KEPT_DAYS + 1) * 86_400,))
        await app._prune_llm_calls()
        assert [call["model"] for call in await app.storage.list_llm_calls()] == ["new"]
