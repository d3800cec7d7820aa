"""``copy_data`` and ``cortexbot copy-data`` on real engines: SQLite files and a real PostgreSQL with pgvector."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import bot.storage.copy as copy_module
from bot.storage import Storage, StorageError, open_storage
from bot.storage.base import LLMCallRecord, ReplyStats
from bot.storage.copy import INSTANCE_KEY, TABLES, CopyReport, TableCount, copy_data
from bot.storage.memory import ItemScope
from bot.storage.personas import NewLore
from bot.storage.skills import SkillExecution
from bot.storage.sources import ReplySource
from cortex.memory.store import MemoryStore

BIN = Path(sys.executable).parent
DIMS = 8
SKIPPED_COLUMNS = {"ts"}  # PostgreSQL's tsvector columns (made by its triggers)


def vec(seed: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    values = np.random.default_rng(seed).standard_normal(DIMS).astype(np.float32)
    return values / np.linalg.norm(values)


async def fill(storage: Storage) -> None:
    """A small bot's life through the app's own storage API: every copied table gets rows."""
    await storage.upsert_persona("Cora", "en")
    await storage.upsert_persona("Lena", "de")
    await storage.personas.put("soul", "1", "identity", "You are Cora.", author="config")
    await storage.personas.put("guidelines", "discord:guild1", "", "Be kind here.", author="discord:7")
    cora = await storage.personas.get_persona("Cora")
    assert cora is not None
    await storage.lore.add(cora.id, [NewLore("The mill is old.", ("mill",), always_on=True)], source="chat",
                           author="discord:7")
    ann = await storage.upsert_user("discord:1", "Ann")
    bob = await storage.upsert_user("matrix:@bob:example.org", "Bob")
    general = await storage.upsert_channel("discord:g", "general", is_dm=False)
    dm = await storage.upsert_channel("matrix:!dm", "bob dm", is_dm=True)
    said = []
    for n in range(5):
        said.append(await storage.add_message(general.id, ann.id, "Cora", "user", "Ann", f"I went sailing, day {n}", 7))
        said.append(await storage.add_message(general.id, None, "Cora", "assistant", "Cora", f"Lovely, day {n}!", 4))
    said.append(await storage.add_message(dm.id, bob.id, "Lena", "user", "Bob", "Ich mag Fahrräder", 5))
    await storage.add_summary(general.id, "Ann sails a lot.", said[0].id, said[3].id, 6, "model-x")
    await storage.add_summary(general.id, "bad", said[0].id, said[5].id, 1, "model-x", "rejected", "too short")
    await storage.enqueue_job("cortex_update", "pair:ann:Cora", {"user": ann.id, "tier": 50}, 3)
    await storage.record_llm_call(LLMCallRecord("reply", "model-x", 120, 30, 250, estimated_input_tokens=118))
    await storage.record_reply_stats(ReplyStats(general.id, said[1].id, 100, 4000, 2, 0, True, 300))
    await storage.flush_audit()
    await storage.set_setting("memory.weights", '{"vector": 0.5}')
    pair = await storage.cortex.count_messages(ann.id, "Cora", 5)
    run = await storage.cortex.start_run(pair.id, None, "50%")
    await storage.cortex.add_version(pair.id, "memory.md", "# Ann\nSails on weekends.", "model", "tier", "50%", run)
    await storage.cortex.add_version(pair.id, "memory.md", "# Ann\nSails a red kayak.", "user", "edit")
    await storage.cortex.finish_run(run, "success", rounds=2, files_read=["memory.md"], files_written=["memory.md"],
                                    input_tokens=900, output_tokens=80, duration_ms=1234)
    await storage.cortex.set_setting("global", "budget", {"tokens": 5000}, "admin")
    await storage.cortex.count_messages(bob.id, "Lena", 1)
    store = MemoryStore(storage)
    kayak = await store.remember(pair.id, "Ann owns a red kayak called Otter", tags=["boats"], importance=8)
    kiel = await store.remember(pair.id, "Ann lives in Kiel", category="user_info", metadata={"from": "chat"})
    await store.remember(pair.id, "Ann moved to Lübeck", category="correction", supersedes=kiel.id, pinned=True)
    await storage.memory.store_item_vectors("e5-test", [(kayak.id, vec(1)), (kiel.id, vec(2))])
    await storage.memory.store_message_vectors(
        "e5-test", [(m.id, m.user_id, m.persona, vec(10 + m.id)) for m in said if m.user_id is not None])
    replies = [m for m in said if m.role == "assistant"]
    await storage.sources.record(replies[0].id, [ReplySource("item", 1), ReplySource("file", 2, "memory.md")])
    await storage.sources.link(["discord-message:99"], replies[0].id)
    await storage.incognito.start(bob.id, "Lena")
    await storage.incognito.start(ann.id, "Cora")
    await storage.end_incognito(ann.id, "Cora")  # (remembered a while as ended)
    await storage.undo_offers.offer("matrix-message:$confirmation", bob.key, "matrix-message:$remembered")
    await storage.db.write("INSERT INTO forgotten_spending (started_at, tokens) VALUES (?, ?)", (1_700_000_000.5, 900))
    await storage.db.write("INSERT INTO forgotten_usage (subject, counted_at, amount) VALUES (?, ?, ?)",
                           ("skill:0123abcd:current_time", 1_700_000_000.5, 1))
    await storage.skills.record(SkillExecution("current_time", "Lena", bob.key, "matrix:!dm", "", "{}", True,
                                               "", 3, "model", 1_700_000_000.5))  # audited only for a user there
    token = await storage.web.create_link("console:bob", "Bob", 600)
    await storage.web.consume_link(token, 3600)  # a web session copied keeps its owner logged in
    await storage.fleet.claim_period("memory-prune", 86_400, "host-a:1")
    await storage.fleet.acquire_lock("matrix:@cora:example.org", "host-a:1", 60)
    await storage.fleet.heartbeat("host-a:1", "host-a", 1, {}, 1.0)  # processes: not copied
    gone = await storage.add_message(dm.id, bob.id, "Lena", "user", "Bob", "Vergiss das", 3)
    await storage.delete_message(gone.id)  # deleted on the platform: who wrote in the channel is kept


async def dump(storage: Storage, table: str) -> list[dict[str, Any]]:
    """A table's rows in key order, engine differences taken out (vectors as float32 tuples, no tsvectors)."""
    order = {"settings": "key", "cortex_settings": "scope, key", "periodic_runs": "name", "instance_locks": "name",
             "message_vectors": "message_id", "reply_sources": "message_id, kind, ref",
             "platform_messages": "key", "incognito": "user_id, persona",
             "incognito_ended": "user_key, persona, started_at", "undo_offers": "key", "web_links": "token_hash",
             "web_sessions": "id_hash"}.get(table, "id")
    left_out = f" WHERE {copy_module.NOT_COPIED[table]}" if table in copy_module.NOT_COPIED else ""  # (each one's)
    rows = await storage.db.fetch_all(f"SELECT * FROM {table}{left_out} ORDER BY {order}")
    out = []
    for row in rows:
        record = {k: v for k, v in dict(row).items() if k not in SKIPPED_COLUMNS}
        for name in ("embedding", "vector"):
            value = record.get(name)
            if isinstance(value, bytes | memoryview):
                record[name] = tuple(np.frombuffer(bytes(value), dtype=np.float32).tolist())
            elif value is not None and name in record:
                record[name] = tuple(value.to_numpy().astype(np.float32).tolist())
        out.append(record)
    return out


async def assert_same(a: Storage, b: Storage) -> None:
    for table in TABLES:
        assert await dump(a, table) == await dump(b, table), table


@pytest_asyncio.fixture
async def source(tmp_path: Path) -> AsyncIterator[Storage]:
    store = await open_storage(f"sqlite:///{tmp_path / 'source.db'}")
    await store.migrate()
    await fill(store)
    yield store
    await store.close()


@pytest_asyncio.fixture
async def pg(pg_url: str) -> AsyncIterator[Storage]:
    store = await open_storage(pg_url)
    yield store
    await store.close()


async def test_sqlite_to_postgres_and_back_keeps_every_row(source: Storage, pg: Storage, tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    report = await copy_data(source, pg, progress=lambda t, done, total: seen.append((t, done, total)), batch=3)
    assert report.ok, report.mismatches
    assert [t.table for t in report.tables] == list(TABLES)
    assert all(t.source_rows > 0 for t in report.tables), report.tables
    # Every row copied once; the instance id went in first, to mark the target as this bot's.
    assert {t.table: t.source_rows - t.copied for t in report.tables if t.copied != t.source_rows} == {"settings": 1}
    assert ("messages", 11, 11) in seen and ("messages", 3, 11) in seen
    assert await pg.db.fetch_one("SELECT 1 FROM processes") is None
    await assert_same(source, pg)

    back = await open_storage(f"sqlite:///{tmp_path / 'back.db'}")
    try:
        assert (await copy_data(pg, back)).ok
        await assert_same(source, back)  # SQLite's message trigger did not leave its counts behind
        assert await back.get_setting(INSTANCE_KEY) == await source.get_setting(INSTANCE_KEY)
    finally:
        await back.close()


async def test_the_copy_works_as_a_bot_database(source: Storage, pg: Storage) -> None:
    await copy_data(source, pg)
    ann = await pg.get_user("discord:1")
    assert ann is not None
    pair = await pg.cortex.get_pair(ann.id, "Cora")
    assert pair is not None
    hits = await MemoryStore(pg).search(pair.id, "kayak", user_id=ann.id, persona="Cora")
    assert any(h.kind == "item" and "Otter" in h.text for h in hits)
    assert any(h.kind == "message" and "sailing" in h.text for h in await MemoryStore(pg).search(
        pair.id, "sailing", user_id=ann.id, persona="Cora"))
    visible, _ = await MemoryStore(pg).list_items(pair.id)
    assert {i.content for i in visible} == {"Ann owns a red kayak called Otter", "Ann moved to Lübeck"}
    near = await pg.memory.vector_top(ItemScope(pair.id), "e5-test", vec(1), 1)
    assert list(near) == [int((await dump(source, "memory_items"))[0]["id"])]
    # New rows get fresh ids (the identity sequences moved past the copied ones).
    general = await pg.get_channel("discord:g")
    assert general is not None
    before = await pg.count_messages(general.id)
    message = await pg.add_message(general.id, ann.id, "Cora", "user", "Ann", "new on PostgreSQL", 4)
    assert message.id == 13 and message.seq == before + 1  # (12 was the message deleted on the platform)
    assert (await pg.upsert_user("discord:3", "Cy")).id == 3
    assert (await MemoryStore(pg).remember(pair.id, "Ann also has a canoe")).id == 4
    assert (await pg.enqueue_job("x", "y", {}, 1)) is not None


async def test_a_nul_stored_by_sqlite_does_not_block_the_copy(source: Storage, pg: Storage) -> None:
    """SQLite stores NUL characters (older rows, imports); PostgreSQL's text has none. The copy failed on
    such a row, and again on every run, so the move could never finish; the NUL now goes."""
    general = await source.get_channel("discord:g")
    ann = await source.get_user("discord:1")
    assert general is not None and ann is not None
    await source.add_message(general.id, ann.id, "Cora", "user", "An\x00n", "a\x00b", 2)
    report = await copy_data(source, pg)
    assert report.ok, report.mismatches
    row = await pg.db.fetch_one("SELECT text, author_name FROM messages ORDER BY id DESC LIMIT 1")
    assert row is not None and (row["text"], row["author_name"]) == ("ab", "Ann")


async def test_a_second_run_copies_nothing(source: Storage, pg: Storage) -> None:
    first = await copy_data(source, pg)
    second = await copy_data(source, pg)
    assert second.ok and second.copied == 0
    assert [t.target_rows for t in second.tables] == [t.target_rows for t in first.tables]


async def test_an_interrupted_copy_resumes(source: Storage, pg: Storage, pg_url: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from bot.app import App
    from bot.config import parse_config
    from tests.fakes.provider import ScriptedProvider

    real_insert = copy_module._insert
    pages: list[str] = []

    async def failing_insert(target: Any, plan: Any, rows: Any) -> int:
        if plan.table == "messages" and pages.count("messages") == 1:
            raise StorageError("connection lost")
        pages.append(plan.table)
        return await real_insert(target, plan, rows)

    monkeypatch.setattr(copy_module, "_insert", failing_insert)
    with pytest.raises(StorageError, match="connection lost"):
        await copy_data(source, pg, batch=2)
    assert len(await dump(pg, "messages")) == 2
    # a bot started on it, or doctor, says it is unfinished (it looked whole: the bot ran on part of the data,
    # and no copy could finish it then); nor is it copied from
    unfinished = await copy_module.unfinished_copy(pg)
    assert unfinished is not None and f"is an unfinished copy of {source.db.url}" in unfinished, unfinished
    assert f"run cortexbot copy-data --to {pg.db.url} again" in unfinished
    config = parse_config({"storage": {"url": pg_url}, "personas": [{"name": "Cora"}]})
    with pytest.raises(StorageError, match="is an unfinished copy of"):
        await App(config, llm=ScriptedProvider()).start(workers=False)
    with pytest.raises(StorageError, match="the source database is not whole"):
        await copy_data(pg, source)
    monkeypatch.setattr(copy_module, "_insert", real_insert)
    report = await copy_data(source, pg, batch=2)
    assert report.ok and await copy_module.unfinished_copy(pg) is None
    counts = {t.table: t for t in report.tables}
    assert counts["messages"].copied == 9 and counts["users"].copied == 0
    await assert_same(source, pg)


async def test_a_user_forgotten_and_back_is_copied_as_the_new_row(source: Storage, pg: Storage) -> None:
    """Bob forgotten and back (a new id, the same key) after a first copy: the second run failed for good on
    a foreign key, and kept Bob's old words in the target; then it refused the target as gone apart. The old
    Bob goes from the target first, the new one goes in."""
    assert (await copy_data(source, pg)).ok
    bob_key = "matrix:@bob:example.org"
    await source.forget_user(bob_key)
    back = await source.upsert_user(bob_key, "Bob")
    channel = await source.upsert_channel("matrix:!dm", "bob dm", is_dm=True)
    await source.add_message(channel.id, back.id, "Lena", "user", "Bob", "Hallo again", 3)
    report = await copy_data(source, pg)
    assert report.ok and report.removed > 0
    await assert_same(source, pg)
    words = [str(r[0]) for r in await pg.db.fetch_all("SELECT text FROM messages")]
    assert "Hallo again" in words and "Ich mag Fahrräder" not in words


async def test_a_target_that_went_apart_is_refused_with_a_clear_line(source: Storage, pg: Storage) -> None:
    """A user row of the target under the source's id but with another key (a hand-edited target, say):
    filling it would point the source's rows at another person."""
    assert (await copy_data(source, pg)).ok
    await pg.db.write("UPDATE users SET key = 'matrix:@eve:example.org' WHERE key = 'matrix:@bob:example.org'")
    with pytest.raises(StorageError, match=r"has gone apart from this database: users \d+ is another row there"
                                           r".*Copy into an empty database"):
        await copy_data(source, pg)


async def test_a_target_a_bot_used_after_the_copy_is_refused_before_rows_mix(source: Storage, pg: Storage,
                                                                            tmp_path: Path) -> None:
    """A copy, then the bot ran on the target (a message there), and this database went on too (a message here
    under the same next id): the second copy left this one's message out as "there already" and pinned rows
    pointing at it onto the target's. A target grown past what the last copy left is refused."""
    assert (await copy_data(source, pg)).ok
    channel = await source.upsert_channel("discord:g", "general", is_dm=False)
    ann = await source.upsert_user("discord:1", "Ann")
    there_channel = await pg.upsert_channel("discord:g", "general", is_dm=False)
    await pg.add_message(there_channel.id, ann.id, "Cora", "user", "Ann", "said on the target", 3)
    await source.add_message(channel.id, ann.id, "Cora", "user", "Ann", "said here meanwhile", 3)
    with pytest.raises(StorageError, match=r"was used after the earlier copy \(messages up to #\d+ \(the copy left "
                                           r"#\d+\)\): a bot ran on it.*Copy into an empty database"):
        await copy_data(source, pg)
    assert "said here meanwhile" not in {m["text"] for m in await dump(pg, "messages")}
    # The target, copied on in turn, does not hand its mark on: a copy of it into a third database goes, again.
    third = await open_storage(f"sqlite:///{tmp_path / 'third.db'}")
    try:
        await third.migrate()
        assert (await copy_data(pg, third)).ok and (await copy_data(pg, third)).copied == 0
    finally:
        await third.close()


async def test_a_second_copy_interrupted_goes_on_and_copies_back_and_forth_pass(source: Storage,
                                                                                pg: Storage) -> None:
    """The mark must refuse only a target used since: a second copy (after new rows here) stopped half-way was
    refused ever after, and so was going back and forth (here, there, back, and there again) with the bot run
    in between on each in turn; a copy back after both went on at once is refused."""
    assert (await copy_data(source, pg)).ok
    general = await source.upsert_channel("discord:g", "general", is_dm=False)
    ann = await source.upsert_user("discord:1", "Ann")
    for n in range(3):
        await source.add_message(general.id, ann.id, "Cora", "user", "Ann", f"later {n}", 3)

    def stop_at_summaries(table: str, done: int, total: int) -> None:
        if table == "summaries":
            raise StorageError("connection lost")

    with pytest.raises(StorageError, match="connection lost"):
        await copy_data(source, pg, progress=stop_at_summaries)
    assert (await copy_data(source, pg)).ok  # resumed
    there = await pg.upsert_channel("discord:g", "general", is_dm=False)
    await pg.add_message(there.id, ann.id, "Cora", "user", "Ann", "the bot ran there", 3)
    assert (await copy_data(pg, source)).ok  # back here: nothing of this one was added since
    await source.add_message(general.id, ann.id, "Cora", "user", "Ann", "and here again", 3)
    assert (await copy_data(source, pg)).ok  # and there again
    assert "and here again" in {m["text"] for m in await dump(pg, "messages")}
    await pg.add_message(there.id, ann.id, "Cora", "user", "Ann", "there, at the same time", 3)
    await source.add_message(general.id, ann.id, "Cora", "user", "Ann", "here, at the same time", 3)
    with pytest.raises(StorageError, match="was used after the earlier copy"):
        await copy_data(pg, source)  # (either way)
    with pytest.raises(StorageError, match="was used after the earlier copy"):
        await copy_data(source, pg)


async def test_a_copy_back_brings_what_changed_in_rows_copied_before(source: Storage, pg: Storage) -> None:
    """Copied there, the bot ran there (an item forgotten, one pinned and made shared, a job done, a setting
    changed, an item corrected), then copied back: every change to a row that was there already was dropped
    (ON CONFLICT DO NOTHING), and the report said every table matched."""
    assert (await copy_data(source, pg)).ok
    store = MemoryStore(pg)
    kayak = next(i for i in await dump(pg, "memory_items") if "kayak" in i["content"])
    kiel = next(i for i in await dump(pg, "memory_items") if i["content"] == "Ann lives in Kiel")
    await store.archive(kayak["pair_id"], kayak["id"], "forgotten by the user")
    await pg.memory.set_scope(kiel["pair_id"], kiel["id"], "shared", 1_700_000_100.0)
    job = await pg.enqueue_job("summary", "channel:9", {}, 3)
    assert job is not None and (await copy_data(pg, source)).ok  # (the queued job goes over as it is)
    claimed = await pg.claim_job("w", ["summary"], 60)
    assert claimed is not None and await pg.finish_job(claimed.id, "w")
    await pg.set_setting("memory.weights", '{"vector": 0.7}')
    report = await copy_data(pg, source)
    assert report.ok and report.copied == 2  # (the job, the setting: the items went over with the first copy back)
    for table in ("memory_items", "jobs", "settings"):
        assert await dump(source, table) == await dump(pg, table), table
    assert (await copy_data(pg, source)).copied == 0  # (nothing differs now)
    await MemoryStore(source).restore(kayak["pair_id"], kayak["id"])  # and into PostgreSQL again
    await source.set_setting("memory.weights", '{"vector": 0.9}')
    assert (await copy_data(source, pg)).copied == 2
    for table in ("memory_items", "settings"):
        assert await dump(source, table) == await dump(pg, table), table


async def test_rows_a_running_bot_adds_during_the_copy_wait_for_the_next_one(source: Storage, pg: Storage) -> None:
    """--while-running: a message (and its reply's sources) written after the messages were copied made the
    sources' page fail on its foreign key, and the target, holding rows past the mark, was refused ever after."""
    general = await source.upsert_channel("discord:g", "general", is_dm=False)
    ann = await source.upsert_user("discord:1", "Ann")

    async def meanwhile() -> None:  # (the bot answers while the copy is past the messages)
        late = await source.add_message(general.id, ann.id, "Cora", "assistant", "Cora", "written meanwhile", 3)
        await source.sources.record(late.id, [ReplySource("item", 1)])
        await source.sources.link(["discord-message:late"], late.id)

    written: list[asyncio.Task[None]] = []

    def progress(table: str, done: int, total: int) -> None:
        if table == "summaries" and not written:
            written.append(asyncio.create_task(meanwhile()))

    report = await copy_data(source, pg, progress=progress)
    await asyncio.gather(*written)
    assert written and not report.ok  # (the counts differ: the new rows wait)
    assert {t.table for t in report.mismatches} == {"messages", "reply_sources", "platform_messages"}
    assert "written meanwhile" not in {m["text"] for m in await dump(pg, "messages")}
    again = await copy_data(source, pg)  # (the bot stopped): the rest goes over, the target is not "used"
    assert again.ok and "written meanwhile" in {m["text"] for m in await dump(pg, "messages")}


async def test_a_correction_the_running_bot_makes_during_the_copy_waits_for_the_next_one(
        source: Storage, pg: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """--while-running: an item corrected after the items' pages went over pointed (superseded_by) at an item
    the copy left for the next one, and linking the items failed on the foreign key with a driver's traceback."""
    store = MemoryStore(source)
    kayak = next(i for i in await dump(source, "memory_items") if "kayak" in i["content"])
    deferred = copy_module._copy_deferred

    async def correction_first(*args: Any) -> None:
        await store.remember(kayak["pair_id"], "Ann owns a blue kayak now", supersedes=kayak["id"])
        await deferred(*args)

    monkeypatch.setattr(copy_module, "_copy_deferred", correction_first)
    report = await copy_data(source, pg)
    assert not report.ok and {t.table for t in report.mismatches} == {"memory_items"}
    copied = {i["id"]: i for i in await dump(pg, "memory_items")}
    assert copied[kayak["id"]]["superseded_by"] is None  # (its successor is not there yet)
    monkeypatch.setattr(copy_module, "_copy_deferred", deferred)
    again = await copy_data(source, pg)  # (the bot stopped): the correction and its link go over
    assert again.ok
    assert (await dump(pg, "memory_items")) == (await dump(source, "memory_items"))


async def test_a_rerun_after_a_forget_me_deletes_what_was_forgotten_from_the_target(source: Storage,
                                                                                   pg: Storage) -> None:
    """Ann forgotten here after a first copy, her channel's summary written anew (version 1 again, a new id):
    the copy kept all of Ann's words, memory, vectors and files in the target (it only added rows), and the new
    summary could not go in beside the old one. Now the target is this database again, both ways."""
    assert (await copy_data(source, pg)).ok
    general = await source.upsert_channel("discord:g", "general", is_dm=False)
    await source.forget_user("discord:1")
    said = await source.recent_messages(general.id, 10)
    await source.add_summary(general.id, "Cora answered.", said[-1].id, said[0].id, 3, "model-x")
    report = await copy_data(source, pg)
    assert report.ok, report.mismatches
    removed = {t.table: t.removed for t in report.tables if t.removed}
    assert {"users", "messages", "memory_items", "message_vectors", "cortex_versions", "cortex_pairs",
            "summaries"} <= set(removed), removed
    await assert_same(source, pg)
    for table, column in (("messages", "text"), ("memory_items", "content"), ("cortex_versions", "content")):
        texts = " ".join(str(r[0]) for r in await pg.db.fetch_all(f"SELECT {column} FROM {table}"))
        assert "sailing" not in texts and "kayak" not in texts and "Kiel" not in texts, table
    again = await copy_data(source, pg)
    assert again.ok and again.copied == 0 and again.removed == 0


ANN, BOB = "discord:1", "matrix:@bob:example.org"
KEYED = ("SELECT 'web_links' FROM web_links WHERE user_key = ? UNION ALL SELECT 'web_sessions' FROM web_sessions"
         " WHERE user_key = ? UNION ALL SELECT 'skill_executions' FROM skill_executions WHERE user_key = ?"
         " UNION ALL SELECT key FROM settings WHERE key IN (?, ?) UNION ALL SELECT 'users' FROM users WHERE key = ?")


async def keyed_by(storage: Storage, user_key: str) -> list[str]:
    """Where ``storage`` holds rows a forget-me deletes by ``user_key`` (and their user row): the tables (and the
    settings' keys)."""
    from bot.storage.core import user_persona_key
    from bot.storage.export import import_claim_key

    params = (user_key, user_key, user_key, user_persona_key(user_key), import_claim_key(user_key), user_key)
    return sorted(str(r[0]) for r in await storage.db.fetch_all(KEYED, params))


async def give_keyed_rows(storage: Storage, user_key: str) -> None:
    """A login link used (a session) and one not yet, a persona picked, an import running, a skill run."""
    from bot.storage.core import user_persona_key

    await storage.web.consume_link(await storage.web.create_link(user_key, "Someone", 600), 3600)
    await storage.web.create_link(user_key, "Someone", 600)
    await storage.set_setting(user_persona_key(user_key), "Lena")
    assert await storage.export.claim_import(user_key, "token", 1.0, 0.0)
    await storage.skills.record(SkillExecution("current_time", "Cora", user_key, "discord:g", "", "{}", True, "", 3,
                                               "model", 1_700_000_000.5))


async def test_a_forget_me_between_two_copies_takes_what_is_keyed_by_the_user_from_the_target(
        source: Storage, pg: Storage, tmp_path: Path) -> None:
    """Ann forgotten on SQLite between two copies: her web sessions and login links, her persona pick and import
    claim stayed in the PostgreSQL copy (keyed by her platform key, not an id), so a forget-me before the last copy
    was partly undone there. Now they go, Bob's and the rows written on the target itself stay. The other way, Bob
    forgotten on PostgreSQL while paused (a bare row of his key under a new id) loses them from a SQLite copy too,
    and what he has there since goes over."""
    from bot.storage.core import user_persona_key

    await give_keyed_rows(source, ANN)
    await give_keyed_rows(source, BOB)
    assert (await copy_data(source, pg)).ok
    assert len(await keyed_by(pg, ANN)) == 7
    await pg.set_setting(f"persona.user.{ANN}", "Lena")  # (written on the target itself: not a forget-me's)
    await pg.web.create_link("console:carol", "Carol", 600)
    await source.forget_user(ANN)
    report = await copy_data(source, pg)
    removed = {t.table: t.removed for t in report.tables if t.removed}
    assert {"web_links": 2, "web_sessions": 1, "skill_executions": 1}.items() <= removed.items(), removed
    assert [t.table for t in report.mismatches] == ["settings", "web_links"], report.mismatches
    assert await keyed_by(pg, ANN) == []
    assert await keyed_by(pg, BOB) == await keyed_by(source, BOB) and "web_sessions" in await keyed_by(pg, BOB)
    assert await pg.get_setting(f"persona.user.{ANN}") == "Lena"
    assert [r[0] for r in await pg.db.fetch_all("SELECT user_key FROM web_links WHERE user_key = 'console:carol'")]
    again = await copy_data(source, pg)
    assert again.copied == 0 and again.removed == 0
    back = await open_storage(f"sqlite:///{tmp_path / 'back.db'}")
    try:
        assert (await copy_data(pg, back)).ok
        await pg.forget_user(BOB)
        bare = await pg.get_user(BOB)
        assert bare is not None and await pg.incognito.active(bare.id, "Lena")  # (a bare row: his pause goes on)
        assert await keyed_by(pg, BOB) == ["users"]
        await pg.set_setting(user_persona_key(BOB), "Cora")  # (picked again since)
        report = await copy_data(pg, back, batch=2)
        assert report.ok, report.mismatches
        assert await keyed_by(back, BOB) == sorted([user_persona_key(BOB), "users"])
        assert await back.get_setting(user_persona_key(BOB)) == "Cora"
        await assert_same(pg, back)
    finally:
        await back.close()


WORD = "qxzvkjwplm"


def file_holds(path: Path, word: str) -> bool:
    wal = path.with_name(path.name + "-wal")
    return word.encode() in path.read_bytes() or (wal.exists() and word.encode() in wal.read_bytes())


async def test_a_forget_me_on_postgresql_goes_from_a_sqlite_copy_and_from_its_files(source: Storage, pg: Storage,
                                                                                   tmp_path: Path) -> None:
    """The other way (PostgreSQL → SQLite), in pages of 2: Bob forgotten there goes from the copy, what pointed at
    his rows too (a reply's sources, keyed otherwise), and his words from the SQLite file (a forget-me scrubs;
    the copy's deletions did not). Rows keyed otherwise than by an id are not deleted: their origin is not
    certain (a setting gone at the source stays, and the counts name it)."""
    general = await source.upsert_channel("discord:g", "general", is_dm=False)
    bob = await source.get_user("matrix:@bob:example.org")
    assert bob is not None
    said = await source.add_message(general.id, bob.id, "Cora", "user", "Bob", f"my secret is {WORD}", 4)
    await source.sources.record(said.id, [ReplySource("item", 1)])
    await source.set_setting("s.kept", "1")
    await source.scrub()
    assert (await copy_data(source, pg)).ok
    path = tmp_path / "back.db"
    back = await open_storage(f"sqlite:///{path}")
    try:
        assert (await copy_data(pg, back)).ok
        await pg.forget_user("matrix:@bob:example.org")
        await pg.db.write("DELETE FROM settings WHERE key = 's.kept'")
        report = await copy_data(pg, back, batch=2)
        removed = {t.table: t.removed for t in report.tables if t.removed}
        assert {"users", "messages", "reply_sources", "message_vectors"} <= set(removed), removed
        assert "settings" not in removed and [t.table for t in report.mismatches] == ["settings"]
        assert await back.get_setting("s.kept") == "1"
        for table in TABLES:
            if table != "settings":
                assert await dump(pg, table) == await dump(back, table), table
        assert await back.get_setting("storage.scrub-pending") is None
    finally:
        await back.close()
    assert not file_holds(path, WORD)


async def test_rows_a_bot_added_on_the_target_beside_the_ids_are_never_deleted(source: Storage, pg: Storage,
                                                                              tmp_path: Path) -> None:
    """A bot on the target that wrote only rows keyed otherwise than by an id (a user's pause, a setting, a web
    session) is not caught by the check of the ids: the copy deleted those rows as "deleted at the source", and
    lifted a user's incognito pause. They stay now."""
    assert (await copy_data(source, pg)).ok
    ann = await pg.get_user("discord:1")
    assert ann is not None
    await pg.incognito.start(ann.id, "Cora")
    await pg.set_setting("persona.user.discord:1", "Lena")
    await pg.cortex.set_setting("global", "daily_tokens", {"tokens": 1}, "admin")
    token = await pg.web.create_link("console:bob", "Bob", 600)
    await pg.web.consume_link(token, 3600)
    report = await copy_data(source, pg)
    assert report.removed == 0, {t.table: t.removed for t in report.tables if t.removed}
    assert await pg.incognito.active(ann.id, "Cora")
    assert await pg.get_setting("persona.user.discord:1") == "Lena"


async def test_a_target_an_older_copy_data_made_is_not_deleted_from(source: Storage, pg: Storage) -> None:
    """A target copied by a cortex-bot before the mark of the copies' ids existed has no mark: its bot's rows
    were not refused, and the new first pass deleted all of them."""
    assert (await copy_data(source, pg)).ok
    await pg.db.write("DELETE FROM settings WHERE key = ?", (copy_module.LAST_COPY_KEY,))
    ann = await pg.get_user("discord:1")
    general = await pg.upsert_channel("discord:g", "general", is_dm=False)
    assert ann is not None
    for n in range(3):
        await pg.add_message(general.id, ann.id, "Cora", "user", "Ann", f"said on PostgreSQL {n}", 4)
    report = await copy_data(source, pg)
    assert report.removed == 0
    texts = [str(r[0]) for r in await pg.db.fetch_all("SELECT text FROM messages")]
    assert "said on PostgreSQL 2" in texts


async def test_a_copy_from_an_older_state_of_the_source_is_refused_before_anything_goes(source: Storage, pg: Storage,
                                                                                        tmp_path: Path) -> None:
    """The source restored from a file backup older than the last copy: the target's newer rows passed every check,
    and the first pass deleted them all as "deleted at the source" (the report said ok)."""
    import shutil

    assert (await copy_data(source, pg)).ok
    path = Path(source.db.url.removeprefix("sqlite:///"))
    backup = tmp_path / "backup.db"
    await source.db.write("PRAGMA wal_checkpoint(TRUNCATE)")
    shutil.copy(path, backup)
    ann = await source.get_user("discord:1")
    general = await source.upsert_channel("discord:g", "general", is_dm=False)
    assert ann is not None
    for n in range(3):
        await source.add_message(general.id, ann.id, "Cora", "user", "Ann", f"later words {n}", 2)
    assert (await copy_data(source, pg)).ok
    restored = await open_storage(f"sqlite:///{backup}")
    try:
        with pytest.raises(StorageError, match=r"holds rows this database never had \(messages up to #\d+ .*restored "
                                               r"from a backup\?\)"):
            await copy_data(restored, pg)
    finally:
        await restored.close()
    texts = [str(r[0]) for r in await pg.db.fetch_all("SELECT text FROM messages")]
    assert "later words 2" in texts


async def test_a_forget_me_during_the_first_pass_leaves_a_target_the_next_run_completes(
        source: Storage, pg: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """--while-running and a forget-me during the deleting pass: the user's row was to go while messages the
    pass had looked at before pointed at it, and the copy ended in the driver's foreign key traceback. Parents
    are looked at first now: a child gone meanwhile goes, its parent waits for the next run."""
    assert (await copy_data(source, pg)).ok
    real = copy_module._gone_ids

    async def forget_meanwhile(src: Any, dst: Any, table: str, key: str, batch: int, upto: int) -> list[int]:
        found = await real(src, dst, table, key, batch, upto)
        if table == "users":
            await source.forget_user("discord:1")
        return found

    monkeypatch.setattr(copy_module, "_gone_ids", forget_meanwhile)
    first = await copy_data(source, pg)
    assert "messages" in {t.table for t in first.tables if t.removed}
    assert "users" in [t.table for t in first.mismatches]  # (Ann's row waits; what the forget-me added too)
    monkeypatch.undo()
    again = await copy_data(source, pg)
    assert again.ok and {t.table: t.removed for t in again.tables if t.removed} == {"users": 1}


async def test_a_copy_back_leaves_a_message_and_its_words_in_the_text_index_as_they_were(source: Storage,
                                                                                         pg: Storage) -> None:
    """A message with a NUL (PostgreSQL drops it) was rewritten in place by the copy back: SQLite's text index
    kept its old words, a search for its new text found nothing, and after its deletion its words stayed."""
    general = await source.upsert_channel("discord:g", "general", is_dm=False)
    ann = await source.get_user("discord:1")
    assert ann is not None
    said = await source.add_message(general.id, ann.id, "Cora", "user", "Ann", "walrus\x00penguin", 2)
    assert (await copy_data(source, pg)).ok
    await copy_data(pg, source)
    assert (await source.db.fetch_one("SELECT text FROM messages WHERE id = ?", (said.id,)))[0] == "walrus\x00penguin"
    await source.delete_message(said.id)
    assert await source.db.fetch_all("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'walrus'") == []


async def test_a_page_bigger_than_a_statement_may_hold_is_checked_in_parts(source: Storage, pg: Storage) -> None:
    """33,000 rows already there (a resumed copy) checked with one parameter each: over PostgreSQL's limit
    of 32,767 the check failed with the driver's error."""
    now = 1_700_000_000.0
    async with source.db.transaction() as tx:
        await tx.executemany("INSERT INTO users (key, display_name, created_at, updated_at) VALUES (?, ?, ?, ?)",
                             [(f"discord:{n}", f"User {n}", now, now) for n in range(1000, 34_000)])
    assert (await copy_data(source, pg, batch=50_000)).ok
    again = await copy_data(source, pg, batch=50_000)
    assert again.ok and again.copied == 0


async def test_ids_of_deleted_rows_are_not_handed_out_again_after_a_copy(source: Storage, pg: Storage,
                                                                      tmp_path: Path) -> None:
    gone = await source.upsert_user("discord:gone", "Gone")
    await source.forget_user("discord:gone")
    assert (await copy_data(source, pg)).ok
    assert (await pg.upsert_user("discord:new", "New")).id > gone.id
    back = await open_storage(f"sqlite:///{tmp_path / 'back.db'}")
    try:
        assert (await copy_data(pg, back)).ok
        assert (await back.upsert_user("discord:newer", "Newer")).id > gone.id + 1
    finally:
        await back.close()


async def test_another_bots_database_is_refused(source: Storage, pg: Storage, tmp_path: Path) -> None:
    await pg.migrate()
    await pg.set_setting(INSTANCE_KEY, "someone-else")
    with pytest.raises(StorageError, match="another bot's data"):
        await copy_data(source, pg)
    assert await pg.get_user("discord:1") is None

    unnamed = await open_storage(f"sqlite:///{tmp_path / 'unnamed.db'}")
    try:
        await unnamed.migrate()
        await unnamed.upsert_user("discord:9", "Zed")
        with pytest.raises(StorageError, match="already holds data"):
            await copy_data(source, unnamed)
    finally:
        await unnamed.close()


async def test_copying_a_database_onto_itself_is_refused(source: Storage, pg: Storage, pg_url: str,
                                                        tmp_path: Path) -> None:
    same = await open_storage(f"sqlite:///{tmp_path}/./source.db")
    try:
        with pytest.raises(StorageError, match="itself"):
            await copy_data(source, same)
    finally:
        await same.close()
    await pg.migrate()
    again = await open_storage(pg_url.replace("127.0.0.1", "localhost"))
    try:
        with pytest.raises(StorageError, match="itself"):
            await copy_data(pg, again)
    finally:
        await again.close()


def counts(stdout: str) -> dict[str, list[str]]:
    """The printed table: source rows, target rows, copied now per table."""
    rows = [line.split("│") for line in stdout.splitlines() if line.count("│") >= 5]
    return {cells[1].strip(): [c.strip() for c in cells[2:5]] for cells in rows}


def _copy_command(tmp_path: Path, to_url: str, *, batch: int) -> tuple[list[str], dict[str, str]]:
    """``cortexbot copy-data`` from the test's SQLite database (``bot.db`` in ``tmp_path``, named by a config file
    there) to ``to_url``, in pages of ``batch`` rows, and the environment to run it in."""
    config = tmp_path / "config.toml"
    config.write_text(f'[storage]\nurl = "sqlite:///{tmp_path / "bot.db"}"\n')
    args = [str(BIN / "cortexbot"), "--config", str(config), "copy-data", "--to", to_url, "--batch", str(batch)]
    return args, {**os.environ, "OPENBLAS_NUM_THREADS": "1"}


def test_the_command_copies_and_prints_the_counts(tmp_path: Path, pg_url: str) -> None:
    async def prepare() -> None:
        store = await open_storage(f"sqlite:///{tmp_path / 'bot.db'}")
        await store.migrate()
        await fill(store)
        await store.fleet.leave("host-a:1")  # the bot stopped (a running one is refused: see below)
        await store.close()

    asyncio.run(prepare())
    args, env = _copy_command(tmp_path, pg_url, batch=4)
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert set(TABLES) <= set(counts(result.stdout)), result.stdout
    assert counts(result.stdout)["messages"] == ["11", "11", "11"]
    assert "every table's row count matches" in result.stdout

    async def forget_here() -> None:  # someone forgotten here since the copy
        store = await open_storage(f"sqlite:///{tmp_path / 'bot.db'}")
        await store.forget_user("discord:1")
        await store.close()

    asyncio.run(forget_here())
    again = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "row(s) the source no longer has (deleted there since the earlier copy)" in " ".join(again.stdout.split())
    assert counts(again.stdout)["users"] == ["1", "1", "0"]
    assert again.stdout.splitlines()[[n for n, line in enumerate(again.stdout.splitlines())
                                      if "│ users" in line][0]].split("│")[5].strip() == "1"  # deleted

    async def add_user_on_target() -> None:  # as if the bot had run on the target meanwhile
        store = await open_storage(pg_url)
        await store.upsert_user("discord:3", "Cy")
        await store.close()

    asyncio.run(add_user_on_target())
    used = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert used.returncode == 1 and "was used after the earlier copy (users up to #" in used.stderr, used.stderr
    bad = subprocess.run([*args[:-4], "--to", "mysql://x"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and "--to:" in bad.stderr and "Traceback" not in bad.stderr
    shown = subprocess.run([*args[:-4], "--to", "postgresql://cortex:sekret@127.0.0.1:5/x"], capture_output=True,
                           text=True, env=env, timeout=60)  # (a password on the command line: ps shows it)
    assert shown.returncode == 1 and "--to: the URL holds a password" in shown.stderr
    assert "--to-password-env" in shown.stderr and "sekret" not in shown.stderr
    itself = subprocess.run([*args[:-4], "--to", f"sqlite:///{tmp_path / 'bot.db'}"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert itself.returncode == 1 and itself.stderr.startswith("Error: "), itself.stderr  # (no empty line first)


def test_a_copy_stopped_with_ctrl_c_says_how_to_go_on(tmp_path: Path, pg_url: str) -> None:
    """Ctrl-C printed only "stopped.": the operator could not tell that running it again goes on."""
    import signal
    import time

    async def prepare() -> None:
        store = await open_storage(f"sqlite:///{tmp_path / 'bot.db'}")
        await store.migrate()
        ann = await store.upsert_user("discord:1", "Ann")
        room = await store.upsert_channel("discord:g", "general", is_dm=False)
        for n in range(3000):
            await store.add_message(room.id, ann.id, "Cora", "user", "Ann", f"message {n}", 3)
        await store.fleet.leave("host-a:1")
        await store.close()

    async def copied() -> int:
        store = await open_storage(pg_url)
        try:
            row = await store.db.fetch_one("SELECT count(*) FROM messages")
            return int(row[0]) if row else 0
        except Exception:  # not migrated yet
            return 0
        finally:
            await store.close()

    asyncio.run(prepare())
    args, env = _copy_command(tmp_path, pg_url, batch=1)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while asyncio.run(copied()) == 0:  # (the target's tables exist once the copy has started)
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "run copy-data again to go on where it stopped" in stderr and "Traceback" not in stderr, stderr
    target = tmp_path / "target.toml"  # (the operator points the bot at the target: doctor says it is not whole)
    target.write_text(f'[storage]\nurl = "{pg_url}"\n')
    doctor = subprocess.run([str(BIN / "cortexbot"), "--config", str(target), "doctor"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert f"✗ database: {pg_url} is an unfinished copy of sqlite:///" in doctor.stdout, doctor.stdout
    again = subprocess.run(args[:-2], capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0 and counts(again.stdout)["messages"][:2] == ["3000", "3000"], again.stdout


def test_report_names_mismatches() -> None:
    report = CopyReport("a", "b", "id", (TableCount("users", 2, 2, 0), TableCount("messages", 5, 4, 1)))
    assert not report.ok and [t.table for t in report.mismatches] == ["messages"] and report.copied == 1


async def test_the_command_refuses_a_missing_source_and_a_running_bot(tmp_path: Path, pg_url: str) -> None:
    """A typo in [storage] url made an empty source (and the advice to migrate it); and the copy ran while a bot
    wrote to the source, whose later changes to rows already copied stay old in the target."""
    import time

    from bot.cli import _copy_data
    from bot.config import ConfigError, parse_config

    missing = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'typo.db'}"}})
    with pytest.raises(ConfigError, match="does not exist"):
        await _copy_data(missing, pg_url, None, 100, False)
    assert not (tmp_path / "typo.db").exists()
    (tmp_path / "empty.db").touch()  # a file the bot never ran on: the migrations it lacks are named
    with pytest.raises(StorageError, match="lacks migration"):
        await _copy_data(parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'empty.db'}"}}), pg_url, None, 100,
                         False)
    store = await open_storage(f"sqlite:///{tmp_path / 'bot.db'}")
    await store.migrate()
    await fill(store)
    await store.fleet.heartbeat("p1", "host-a", 4242, {}, time.time())
    await store.close()
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    with pytest.raises(ConfigError, match="a bot is running on the source database .*pid 4242 on host-a"):
        await _copy_data(config, pg_url, None, 100, False)
    assert (await _copy_data(config, pg_url, None, 100, True)).ok


async def test_a_bot_of_this_machine_that_died_does_not_hold_up_the_copy(source: Storage, tmp_path: Path,
                                                                        pg_url: str) -> None:
    """A chat killed with kill -9 left its heartbeat: for 45 s copy-data said a bot was running (pid 405 on this
    very machine, long gone) and advised --while-running. A process of this machine that is gone is not one."""
    import socket
    import sys
    import time

    from bot.cli import _copy_data
    from bot.config import ConfigError, parse_config

    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()
    await source.fleet.leave("host-a:1")
    await source.fleet.heartbeat("dead", socket.gethostname(), gone.pid, {}, time.time())
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'source.db'}"}})
    assert (await _copy_data(config, pg_url, None, 100, False)).ok
    await source.fleet.heartbeat("alive", socket.gethostname(), os.getpid(), {}, time.time())  # (this test's own)
    with pytest.raises(ConfigError, match=rf"pid {os.getpid()} on .*, seen \d+ s ago\): stop it first"):
        await _copy_data(config, pg_url, None, 100, False)


async def test_a_sqlite_target_in_a_missing_folder_is_refused_naming_it(source: Storage, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in --to (or three slashes meant as four) made the whole missing folder tree without a word, and
    the copy went there."""
    from bot.cli import _copy_data
    from bot.config import ConfigError, parse_config

    await source.fleet.leave("host-a:1")
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'source.db'}"}})
    with pytest.raises(ConfigError, match=f"the folder {tmp_path / 'new' / 'dir'} does not exist: create it first"):
        await _copy_data(config, f"sqlite:///{tmp_path / 'new' / 'dir' / 'copy.db'}", None, 100, False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"sqlite:///var/lib/cortex/copy.db is relative to this folder.*: sqlite:////var/lib/cortex/copy.db"):
        await _copy_data(config, "sqlite:///var/lib/cortex/copy.db", None, 100, False)
    assert sorted(os.listdir(tmp_path)) == ["source.db", "source.db-shm", "source.db-wal"]
    assert (await _copy_data(config, "sqlite:///copy.db", None, 100, False)).ok  # an existing folder is fine


async def test_a_target_a_bot_was_started_on_before_the_copy_is_refused(source: Storage, pg: Storage) -> None:
    """The bot started once on the new database (no users, no messages yet, but its personas, souls and settings
    from the config): the copy went in, kept the target's soul in place of this one's under the same ids and
    left this one's guidelines out."""
    await pg.migrate()
    await pg.upsert_persona("Cora", "en")
    await pg.personas.put("soul", "1", "identity", "You are someone else.", author="config")
    with pytest.raises(StorageError, match=r"already holds data \(1 personas, 1 versioned_texts\) of a bot with no "
                                           r"bot.instance_id"):
        await copy_data(source, pg)
    assert await pg.get_setting(INSTANCE_KEY) is None and await pg.get_user("discord:1") is None


async def test_a_target_a_newer_cortex_bot_upgraded_names_the_target_option(source: Storage, pg: Storage) -> None:
    """The refusal told the operator to point [storage] elsewhere, when it was --to that named the target."""
    await copy_data(source, pg)
    await pg.db.write("INSERT INTO schema_version (version, description, applied_at) VALUES (999, 'x', 0)")
    with pytest.raises(StorageError, match="upgraded by a newer cortex-bot") as refused:
        await copy_data(source, pg)
    assert "name another database with --to" in str(refused.value) and "[storage]" not in str(refused.value)


async def test_a_row_deleted_on_a_copied_postgresql_keeps_its_id_in_the_next_copy(source: Storage, pg: Storage,
                                                                                 tmp_path: Path) -> None:
    """An attacker's finding: a copy leaves PostgreSQL's sequences set without a "last value" (setval(…, false)),
    so a copy from there before any insert read none, and a user forgotten there had their id handed out again."""
    assert (await copy_data(source, pg)).ok
    last = await pg.upsert_user("discord:last", "Last")  # (this insert gives the sequence a last value again …)
    await pg.forget_user("discord:last")
    assert (await copy_data(source, pg)).ok  # (… and a second copy sets it back without one)
    back = await open_storage(f"sqlite:///{tmp_path / 'back.db'}")
    try:
        assert (await copy_data(pg, back)).ok
        assert (await back.upsert_user("discord:next", "Next")).id > last.id
    finally:
        await back.close()


async def test_a_broken_row_in_the_source_stops_the_copy_with_one_line_naming_it(source: Storage, pg: Storage) -> None:
    """An attacker's finding: a vector of 7 bytes (a hand-edited or damaged source) ended the copy in a traceback,
    with no word of which row; the copy says which rows, and what to do."""
    said = (await source.db.fetch_one("SELECT min(message_id) FROM message_vectors"))
    assert said is not None
    await source.db.write("UPDATE message_vectors SET vector = ? WHERE message_id = ?", (b"\x00" * 7, int(said[0])))
    with pytest.raises(StorageError, match=r"copying message_vectors \(message_id \d+ to \d+\) into .* failed: "
                                           r"ValueError: .*correct or delete that row in the source"):
        await copy_data(source, pg, batch=1000)
    with pytest.raises(StorageError, match=rf"copying message_vectors \(message_id {int(said[0])} to "
                                           rf"{int(said[0])}\)"):
        await copy_data(source, pg, batch=1)  # (one row a page: that row)


def _bot_config(url: str) -> Any:
    from bot.config import parse_config

    return parse_config({"storage": {"url": url}, "memory": {"embedder": "none"}})


async def _forget_me(app: Any, user_key: str) -> str:
    from bot.commands import CommandContext

    ctx = CommandContext("discord", user_key, "Ann", "discord:dm-ann", "Cora", is_dm=True)
    return (await app.commands.dispatch("!memory forget-me confirm", ctx)).text


async def test_a_forget_me_a_bot_did_on_the_target_is_not_undone_by_the_next_copy(tmp_path: Path,
                                                                                  pg_url: str) -> None:
    """The bot moved to PostgreSQL, Ann asked to be forgotten there, and the operator ran copy-data from the old
    SQLite file again: the target counted as used only when an id had grown past the mark, which a forget-me (or
    items archived or pinned, a setting changed) never does, so the copy put all of Ann's words and memory back
    ("ok"). A bot started on a database marks it used: a copy into it is refused until a copy from it."""
    from bot.app import App
    from tests.fakes.provider import ScriptedProvider

    src_url = f"sqlite:///{tmp_path / 'bot.db'}"
    async with App(_bot_config(src_url), llm=ScriptedProvider()) as app:
        ann = await app.storage.upsert_user("discord:1", "Ann")
        dm = await app.storage.upsert_channel("discord:dm-ann", "DM with Ann", is_dm=True)
        for n in range(3):
            await app.storage.add_message(dm.id, ann.id, "Cora", "user", "Ann", f"my secret number {n}", 4)
        pair = await app.storage.cortex.count_messages(ann.id, "Cora", 3)
        await MemoryStore(app.storage).remember(pair.id, "Ann is moving to Oslo")
    src, pg = await open_storage(src_url), await open_storage(pg_url)
    try:
        assert (await copy_data(src, pg)).ok  # (the source a bot ran on: copied from, its mark goes)
        await pg.close()
        async with App(_bot_config(pg_url), llm=ScriptedProvider()) as fleet:
            assert "Done." in await _forget_me(fleet, "discord:1")
        pg = await open_storage(pg_url)
        with pytest.raises(StorageError, match=rf"{re.escape(pg_url)} was used by a bot after the last copy from or "
                                               r"into it \(a bot process \(pid \d+ on .*\) at .* UTC\).*forget-me.*"
                                               r"Copy into a fresh database"):
            await copy_data(src, pg)
        assert await pg.get_user("discord:1") is None
        assert not await pg.db.fetch_all("SELECT 1 FROM messages UNION ALL SELECT 1 FROM memory_items")
        back = await copy_data(pg, src)  # the other way: the forget-me reaches the old file
        assert back.ok and await src.get_user("discord:1") is None and back.removed > 0
        again = await copy_data(src, pg)  # and from it again, nothing copied twice (no bot ran on either since)
        assert again.ok and again.copied == 0 and again.removed == 0
    finally:
        await pg.close()
        await src.close()


async def test_a_bot_running_on_the_source_through_the_copy_leaves_it_used(source: Storage, pg: Storage,
                                                                           tmp_path: Path) -> None:
    """--while-running: the bot went on writing into the source after the copy's mark; a copy back into it would
    undo what it did there since (its forget-mes), so it is refused, until a copy from it with no bot running."""
    from bot.app import App
    from bot.cli import _copy_data
    from tests.fakes.provider import ScriptedProvider

    await source.fleet.leave("host-a:1")
    config = _bot_config(source.db.url)
    async with App(config, llm=ScriptedProvider()):
        assert (await _copy_data(config, pg.db.url, None, 100, True)).ok
    with pytest.raises(StorageError, match="was used by a bot after the last copy from or into it"):
        await copy_data(pg, source)
    assert (await copy_data(source, pg)).ok  # (the bot stopped: this copy accounts for all it did)
    assert (await copy_data(pg, source)).ok


async def test_the_command_refuses_a_target_a_bot_is_running_on(source: Storage, pg: Storage,
                                                                tmp_path: Path) -> None:
    """Only the source's processes were looked at: a bot running on the target stored its rows under ids the copy
    then kept or collided with, and the report said ok while the source's message was lost. A target with a live
    bot is refused, --while-running or not (that option is about the source)."""
    from bot.app import App
    from bot.cli import _copy_data
    from bot.config import ConfigError
    from tests.fakes.provider import ScriptedProvider

    await source.fleet.leave("host-a:1")
    config = _bot_config(source.db.url)
    assert (await _copy_data(config, pg.db.url, None, 100, False)).ok
    async with App(_bot_config(pg.db.url), llm=ScriptedProvider()):
        for running in (False, True):
            with pytest.raises(ConfigError, match=rf"a bot is running on the target database "
                                                  rf"{re.escape(pg.db.url)} \(pid {os.getpid()} on .*\): stop it "
                                                  r"first.*copy into a fresh"):
                await _copy_data(config, pg.db.url, None, 100, running)
    assert await copy_module.unfinished_copy(pg) is None


async def test_a_read_only_source_is_copied_into_a_fresh_database(source: Storage, pg: Storage, pg_url: str,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A hot standby (here a session made read-only by its URL): the copy from it ended in asyncpg's
    ReadOnlySQLTransactionError (it wrote its marks into the source). It copies into a fresh database now, and
    finishes a copy it began; into a copy an earlier run finished it is refused in one line (unmarked, it cannot
    tell what its primary deleted since: a forget-me)."""
    assert (await copy_data(source, pg)).ok  # (the bot on PostgreSQL: its primary)
    marked = await pg.get_setting(copy_module.LAST_COPY_KEY)
    standby = await open_storage(f"{pg_url}?default_transaction_read_only=on")
    back = await open_storage(f"sqlite:///{tmp_path / 'back.db'}")
    try:
        real_insert = copy_module._insert

        async def failing_insert(target: Any, plan: Any, rows: Any) -> int:
            if plan.table == "messages":
                raise StorageError("connection lost")
            return await real_insert(target, plan, rows)

        monkeypatch.setattr(copy_module, "_insert", failing_insert)
        with pytest.raises(StorageError, match="connection lost"):
            await copy_data(standby, back)
        monkeypatch.undo()
        assert (await copy_data(standby, back)).ok  # (finished)
        await assert_same(pg, back)
        with pytest.raises(StorageError, match=r"is read-only \(a hot standby\?\): a copy from it cannot be marked "
                                               r"there, so it cannot tell what was deleted since the earlier copy"):
            await copy_data(standby, back)
        assert await pg.get_setting(copy_module.LAST_COPY_KEY) == marked
    finally:
        await back.close()
        await standby.close()
