"""The storage contract, written against the interface so every engine can run it."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bot.storage import Storage, StorageError, open_sqlite, open_storage
from bot.storage.base import LLMCallRecord, ReplyStats
from bot.storage.engine import Migration, WriteLock
from bot.storage.migrations import MIGRATIONS


async def test_migrations_apply_once_and_are_recorded(tmp_path: Path) -> None:
    store = await open_sqlite(tmp_path / "a.db")
    assert await store.pending_migrations() == [m.version for m in MIGRATIONS]
    assert await store.migrate() == [m.version for m in MIGRATIONS]
    assert await store.migrate() == []
    assert await store.pending_migrations() == []
    await store.close()
    again = await open_sqlite(tmp_path / "a.db")
    assert await again.migrate() == []
    await again.close()


async def test_a_failing_migration_is_rolled_back_whole(tmp_path: Path) -> None:
    broken = Migration(99, "broken", ("CREATE TABLE extra (x)", "CREATE TABLE nonsense ("))

    store = await open_sqlite(tmp_path / "b.db", migrations=(*MIGRATIONS, broken))
    with pytest.raises(sqlite3.Error):
        await store.migrate()
    assert await store.applied_migrations() == [m.version for m in MIGRATIONS]
    tables = {r[0] for r in await store.db.fetch_all("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "extra" not in tables  # the first statement of the failed migration did not stick
    await store.close()


async def test_pragmas(sqlite_storage: Storage) -> None:
    assert (await sqlite_storage.db.fetch_one("PRAGMA journal_mode"))[0] == "wal"
    assert (await sqlite_storage.db.fetch_one("PRAGMA foreign_keys"))[0] == 1
    assert (await sqlite_storage.db.fetch_one("PRAGMA busy_timeout"))[0] >= 5000


async def test_unopenable_database_gives_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="cannot create the database folder"):
        await open_sqlite(blocker / "sub" / "bot.db")


async def test_another_programs_database_is_refused_and_left_untouched(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "theirs.db"
    with sqlite3.connect(path) as theirs:
        theirs.execute("CREATE TABLE users (x)")
    before = path.read_bytes()
    with pytest.raises(StorageError, match=r"not a cortex-bot database: it holds another program's tables \(users\)"
                                           r"\. It was left untouched; name a new file \(\[storage\] url, or "
                                           r"copy-data's --to\)"):
        await open_sqlite(path)
    assert path.read_bytes() == before and not (tmp_path / "theirs.db-wal").exists()
    store = await open_sqlite(tmp_path / "empty.db")  # an empty file, or none, becomes the bot's
    await store.close()


async def test_users_channels_and_messages(storage: Storage) -> None:
    ann = await storage.upsert_user("console:ann", "Ann")
    ann2 = await storage.upsert_user("console:ann", "Annie")
    assert ann.id == ann2.id and ann2.display_name == "Annie"
    channel = await storage.upsert_channel("console:room", "room", is_dm=False)
    ids = []
    for i in range(5):
        m = await storage.add_message(channel.id, ann.id, "Cora", "user", "Annie", f"m{i}", 2)
        ids.append(m.id)
    assert await storage.count_messages(channel.id) == 5
    assert [m.seq for m in await storage.recent_messages(channel.id, 10)] == [5, 4, 3, 2, 1]
    # repeated identical upserts are answered from the cache; a rename still reaches the database
    assert await storage.upsert_channel("console:room", "room", is_dm=False) == channel
    renamed = await storage.upsert_channel("console:room", "lounge", is_dm=False)
    assert renamed.id == channel.id and (await storage.get_channel("console:room")).name == "lounge"
    assert (await storage.get_user("console:ann")).display_name == "Annie"
    newest = await storage.recent_messages(channel.id, 3)
    assert [m.text for m in newest] == ["m4", "m3", "m2"]
    older = await storage.recent_messages(channel.id, 3, before_id=newest[-1].id)
    assert [m.text for m in older] == ["m1", "m0"]
    between = await storage.messages_between(channel.id, ids[0], ids[4], limit=10)
    assert [m.text for m in between] == ["m1", "m2", "m3"]
    assert await storage.count_messages_between(channel.id, ids[0], ids[4]) == 3


async def test_a_replys_sources_are_kept_once_each_however_many(storage: Storage) -> None:
    """What shaped a reply is recorded whole: duplicates once, a usual few in one statement, a great many
    (a huge lore book) in one transaction."""
    from bot.storage.sources import ROWS_PER_STATEMENT, ReplySource

    ann = await storage.upsert_user("console:ann", "Ann")
    channel = await storage.upsert_channel("console:room", "room", is_dm=False)
    few = await storage.add_message(channel.id, ann.id, "Cora", "assistant", "Cora", "a reply", 2)
    many = await storage.add_message(channel.id, ann.id, "Cora", "assistant", "Cora", "another", 2)
    used = [ReplySource("item", 7), ReplySource("file", 3, "memory.md"), ReplySource("item", 7), ReplySource("lore", 2)]
    await storage.sources.record(few.id, used)  # three: one statement of four rows, the last one twice
    assert await storage.sources.of(few.id) == [
        ReplySource("file", 3, "memory.md"), ReplySource("item", 7), ReplySource("lore", 2)]
    lore = [ReplySource("lore", n) for n in range(ROWS_PER_STATEMENT * 2 + 5)]
    await storage.sources.record(many.id, lore + lore[:10])
    assert await storage.sources.of(many.id) == sorted(lore, key=lambda s: s.ref)
    await storage.sources.record(many.id, [])  # nothing used: nothing written, nothing fails


async def test_message_role_is_checked(storage: Storage) -> None:
    channel = await storage.upsert_channel("console:x", "x", is_dm=True)
    with pytest.raises(Exception, match="(?i)check constraint") as caught:
        await storage.add_message(channel.id, None, "Cora", "system", "x", "t", 1)  # type: ignore[arg-type]
    assert type(caught.value).__name__ in ("IntegrityError", "CheckViolationError")


async def test_summaries_are_versioned_and_latest_is_the_newest_good(storage: Storage) -> None:
    channel = await storage.upsert_channel("console:s", "s", is_dm=True)
    assert await storage.latest_summary(channel.id) is None
    first = await storage.add_summary(channel.id, "one", 1, 10, 5, "m")
    await storage.add_summary(channel.id, "", 1, 20, 0, "m", status="rejected", reason="empty summary")
    assert first.version == 1
    latest = await storage.latest_summary(channel.id)
    assert latest is not None and latest.text == "one"
    second = await storage.add_summary(channel.id, "two", 1, 20, 5, "m")
    assert second.version == 3
    assert (await storage.latest_summary(channel.id)).text == "two"  # type: ignore[union-attr]
    assert [(s.version, s.status) for s in await storage.list_summaries(channel.id)] == [
        (1, "ok"), (2, "rejected"), (3, "ok"),
    ]


async def test_jobs_claim_dedupe_and_one_per_key(storage: Storage) -> None:
    a1 = await storage.enqueue_job("summary", "channel:1", {"n": 1}, 3)
    assert a1 is not None
    assert await storage.enqueue_job("summary", "channel:1", {"n": 2}, 3) is None  # deduped while queued
    b = await storage.enqueue_job("summary", "channel:2", {"n": 3}, 3)
    claimed = await storage.claim_job("w1", ["summary"], 60)
    assert claimed is not None and claimed.id == a1.id and claimed.status == "running" and claimed.attempts == 1
    a2 = await storage.enqueue_job("summary", "channel:1", {"n": 4}, 3)  # allowed: the first one is running
    assert a2 is not None
    nxt = await storage.claim_job("w2", ["summary"], 60)
    assert nxt is not None and nxt.id == b.id  # channel:1 is busy, so its second job waits
    assert await storage.claim_job("w2", ["summary"], 60) is None
    await storage.finish_job(a1.id)
    third = await storage.claim_job("w2", ["summary"], 60)
    assert third is not None and third.id == a2.id
    assert await storage.claim_job("w3", ["other-kind"], 60) is None


async def test_retry_fail_release_and_recover(storage: Storage) -> None:
    job = await storage.enqueue_job("k", "key", {}, 3)
    assert job is not None
    await storage.claim_job("host:1:a", ["k"], 60)
    later = datetime.now(UTC) + timedelta(hours=1)
    await storage.retry_job(job.id, "boom", later)
    assert await storage.claim_job("host:1:a", ["k"], 60) is None  # not before run_after
    got = await storage.get_job(job.id)
    assert got is not None and got.status == "queued" and got.last_error == "boom"
    await storage.retry_job(job.id, "boom", datetime.now(UTC) - timedelta(seconds=1))
    running = await storage.claim_job("host:99999:dead", ["k"], 60)
    assert running is not None and running.attempts == 2
    recovered = await storage.recover_jobs(lambda worker: worker == "host:99999:dead")
    assert [j.id for j in recovered] == [job.id]
    again = await storage.get_job(job.id)
    assert again is not None and again.status == "queued" and "interrupted" in again.last_error
    claimed = await storage.claim_job("w", ["k"], 60)
    assert claimed is not None
    await storage.release_job(job.id)
    released = await storage.get_job(job.id)
    assert released is not None and released.status == "queued" and released.attempts == 2
    await storage.claim_job("w", ["k"], 0)  # lease already expired
    assert [j.id for j in await storage.recover_jobs(lambda worker: False)] == [job.id]
    await storage.claim_job("w", ["k"], 60)
    await storage.fail_job(job.id, "gave up")
    failed = await storage.get_job(job.id)
    assert failed is not None and failed.status == "failed" and failed.last_error == "gave up"
    assert await storage.count_jobs(("failed",)) == 1


async def test_old_finished_and_failed_jobs_are_deleted_the_rest_kept(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's finding: job rows piled up forever (every summary and cortex update leaves one); they go
    in batches (the first prune of a long-running bot would have held the write lock for all of them)."""
    import bot.storage.core as core

    monkeypatch.setattr(core, "PRUNE_BATCH", 1)
    now = time.time()
    kept, gone = {}, []
    for n, (status, days) in enumerate((("done", 20), ("done", 30), ("done", 2), ("failed", 100), ("failed", 20),
                                        ("queued", 200), ("running", 200))):
        job = await storage.enqueue_job("k", f"key{n}", {}, 3)
        assert job is not None
        await storage.db.write("UPDATE jobs SET status = ?, updated_at = ? WHERE id = ?",
                               (status, now - days * 86_400, job.id))
        (gone.append(job.id) if (status, days) in (("done", 20), ("done", 30), ("failed", 100))
         else kept.update({job.id: status}))
    assert await storage.delete_old_jobs(done_before=now - 14 * 86_400, failed_before=now - 90 * 86_400) == 3
    for job_id in gone:
        assert await storage.get_job(job_id) is None
    for job_id, status in kept.items():
        found = await storage.get_job(job_id)
        assert found is not None and found.status == status
    assert await storage.delete_old_jobs(done_before=None, failed_before=None) == 0  # (0 days: kept forever)
    assert await storage.delete_old_jobs(done_before=now, failed_before=None) == 1  # the recent done one


async def test_old_llm_call_rows_are_deleted_the_recent_kept(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row per model call (every reply, summary and cortex round) was kept for good: the table grew by each
    call of the bot's whole life. The old ones go, in batches, buffered ones too."""
    import bot.storage.core as core

    monkeypatch.setattr(core, "PRUNE_BATCH", 2)
    now = time.time()
    for n in range(5):
        await storage.record_llm_call(LLMCallRecord("reply", f"old-{n}", n, 1, n))
    await storage.flush_audit()
    await storage.db.write("UPDATE llm_calls SET created_at = ?", (now - 100 * 86_400,))
    await storage.record_llm_call(LLMCallRecord("reply", "recent", 1, 1, 1))  # (still buffered)
    assert await storage.delete_old_llm_calls(now - 90 * 86_400) == 5
    assert [call["model"] for call in await storage.list_llm_calls()] == ["recent"]
    assert await storage.delete_old_llm_calls(now - 90 * 86_400) == 0


async def test_old_llm_calls_are_found_by_their_time_not_by_reading_every_row(tmp_path: Path) -> None:
    """The daily deletion of old model calls (and the page's last 14 days) read the whole table, a row per call of
    the bot's life: they go by an index of the calls' times."""
    store = await open_sqlite(tmp_path / "plan.db")
    try:
        await store.migrate()
        plan = await store.db.fetch_all(
            "EXPLAIN QUERY PLAN SELECT id FROM llm_calls WHERE created_at < ? LIMIT 10", (time.time(),))
        assert any("llm_calls_by_time" in str(row[-1]) for row in plan), [tuple(r) for r in plan]
    finally:
        await store.close()


async def test_concurrent_claims_never_hand_out_a_job_twice(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    stores = [await open_sqlite(path) for _ in range(3)]
    await stores[0].migrate()
    for i in range(30):
        await stores[0].enqueue_job("k", f"key{i}", {}, 3)

    async def drain(store: Storage, name: str) -> list[int]:
        got = []
        while (job := await store.claim_job(name, ["k"], 60)) is not None:
            got.append(job.id)
            await asyncio.sleep(0)
        return got

    results = await asyncio.gather(*(drain(s, f"w{i}") for i, s in enumerate(stores)))
    all_ids = [i for r in results for i in r]
    assert len(all_ids) == 30 and len(set(all_ids)) == 30
    for s in stores:
        await s.close()


async def test_metrics_and_llm_calls_and_settings(storage: Storage) -> None:
    channel = await storage.upsert_channel("console:m", "m", is_dm=True)
    empty = await storage.reply_metrics()
    assert empty.replies == 0 and empty.trim_rate == 0.0
    msg = await storage.add_message(channel.id, None, "Cora", "assistant", "Cora", "hi", 1)
    await storage.record_reply_stats(ReplyStats(channel.id, msg.id, 1000, 2000, 10, 0, False, 1500))
    await storage.record_reply_stats(ReplyStats(channel.id, msg.id, 2000, 2000, 12, 4, True, 2600))
    await storage.add_summary(channel.id, "s", 1, 2, 1, "m")
    metrics = await storage.reply_metrics(channel.id)
    assert metrics.replies == 2
    assert metrics.token_utilisation == pytest.approx(0.75)
    assert metrics.trim_rate == pytest.approx(0.5)
    assert metrics.summary_hit_rate == pytest.approx(0.5)
    assert metrics.summary_generation_rate == pytest.approx(0.5)
    await storage.record_llm_call(LLMCallRecord("reply", "m", 10, 5, 12))
    calls = await storage.list_llm_calls()
    assert calls[0]["purpose"] == "reply" and calls[0]["input_tokens"] == 10
    assert await storage.get_setting("x") is None
    await storage.set_setting("x", "1")
    await storage.set_setting("x", "2")
    assert await storage.get_setting("x") == "2"


async def test_audit_rows_are_buffered_but_never_lost_on_close(tmp_path: Path) -> None:
    store = await open_sqlite(tmp_path / "audit.db")
    await store.migrate()
    for i in range(3):
        await store.record_llm_call(LLMCallRecord("summary", "m", i, 1, 5))
    await store.close()  # flushes
    again = await open_sqlite(tmp_path / "audit.db")
    assert [c["input_tokens"] for c in await again.list_llm_calls()] == [2, 1, 0]
    # a full buffer is written without waiting for the timer
    for i in range(70):
        await again.record_llm_call(LLMCallRecord("reply", "m", i, 1, 5))
    await asyncio.sleep(0.1)
    assert (await again.db.fetch_one("SELECT count(*) FROM llm_calls"))[0] >= 64
    await again.close()


async def test_many_buffered_audit_rows_of_both_tables_are_all_written_in_order(storage: Storage) -> None:
    from bot.storage.core import AUDIT_ROWS_PER_STATEMENT

    channel = await storage.upsert_channel("console:m", "m", is_dm=True)
    msg = await storage.add_message(channel.id, None, "Cora", "assistant", "Cora", "hi", 1)
    calls = AUDIT_ROWS_PER_STATEMENT * 2 + 7
    for n in range(calls):
        await storage.record_llm_call(LLMCallRecord("reply", f"model-{n}", n, 1, n))
        if n % 100 == 0:
            await storage.record_reply_stats(ReplyStats(channel.id, msg.id, n, 2000, 10, 0, False, 1500))
    await storage.flush_audit()
    written = await storage.list_llm_calls(limit=calls + 10)
    assert [c["model"] for c in written] == [f"model-{n}" for n in reversed(range(calls))]
    assert (await storage.reply_metrics(channel.id)).replies == len(range(0, calls, 100))


async def test_a_forget_me_during_a_flush_waits_for_it_and_keeps_other_users_audit_rows(storage: Storage) -> None:
    """The timer's flush was under way (its rows no longer buffered) when a forget-me flushed and deleted: the
    stats rows after the deletion met their deleted message, and the whole batch went, other users' too."""
    channel = await storage.upsert_channel("console:room", "room", is_dm=False)
    ann = await storage.upsert_user("console:ann", "Ann")
    bob = await storage.upsert_user("console:bob", "Bob")
    said = {}
    for who in (ann, bob):
        await storage.add_message(channel.id, who.id, "Cora", "user", who.display_name, "hi", 1)
        said[who.id] = await storage.add_message(channel.id, who.id, "Cora", "assistant", "Cora", "hello", 1)
    await storage.record_llm_call(LLMCallRecord("reply", "m", 1, 1, 1))
    for who in (bob, ann):
        await storage.record_reply_stats(ReplyStats(channel.id, said[who.id].id, 10, 100, 2, 0, False, 20))
    flushing = asyncio.create_task(storage.flush_audit())
    await asyncio.sleep(0)  # the flush has taken the rows and started writing
    assert await storage.forget_user("console:ann") is not None
    await flushing
    assert (await storage.reply_metrics(channel.id)).replies == 1  # Bob's row; Ann's went with her


@pytest.mark.parametrize("model", ["m\ud800x", {"an": "object"}], ids=["lone-surrogate", "object"])
async def test_an_audit_row_no_column_takes_is_dropped_alone(storage: Storage, model: Any) -> None:
    """A row whose value no column takes was put back in the buffer: every later flush failed on it, and with
    them forget-me, the prune and the stats, which flush first."""
    await storage.record_llm_call(LLMCallRecord("reply", "before", 1, 1, 1))
    await storage.record_llm_call(LLMCallRecord("reply", model, 1, 1, 1))
    await storage.record_llm_call(LLMCallRecord("reply", "after", 1, 1, 1))
    await storage.flush_audit()
    assert sorted(c["model"] for c in await storage.list_llm_calls()) == ["after", "before"]
    await storage.upsert_user("console:ann", "Ann")
    assert await storage.forget_user("console:ann") is not None


async def test_a_flush_cut_short_neither_loses_nor_doubles_rows(storage: Storage) -> None:
    """A cancelled flush's statement still runs on the database thread: its rows must not be queued again."""
    for n in range(3):
        await storage.record_llm_call(LLMCallRecord("reply", f"m{n}", n, 1, 1))
    for turns in range(6):  # cut short at every point of its way
        flushing = asyncio.create_task(storage.flush_audit())
        for _ in range(turns):
            await asyncio.sleep(0)
        flushing.cancel()
        await asyncio.gather(flushing, return_exceptions=True)
        await storage.flush_audit()
        assert sorted(c["model"] for c in await storage.list_llm_calls()) == ["m0", "m1", "m2"]
        await storage.db.write("DELETE FROM llm_calls")
        for n in range(3):
            await storage.record_llm_call(LLMCallRecord("reply", f"m{n}", n, 1, 1))
    await storage.flush_audit()


async def test_another_process_summary_is_seen_after_the_cache_expires(tmp_path: Path, monkeypatch) -> None:
    import bot.storage.core as engine

    first = await open_sqlite(tmp_path / "shared.db")
    await first.migrate()
    second = await open_sqlite(tmp_path / "shared.db")
    channel = await first.upsert_channel("console:c", "c", is_dm=True)
    assert await first.latest_summary(channel.id) is None
    await second.add_summary(channel.id, "from the other process", 1, 5, 4, "m")
    monkeypatch.setattr(engine, "SUMMARY_CACHE_SECONDS", 0.0)
    latest = await first.latest_summary(channel.id)
    assert latest is not None and latest.text == "from the other process"
    await first.close()
    await second.close()


@pytest.mark.parametrize("cancel_after", [0, 1, 3])
async def test_a_cancelled_transaction_leaves_the_connection_usable(storage: Storage, cancel_after: int) -> None:
    """Cancelled at any point (while BEGIN is still on aiosqlite's thread, or inside the body), the
    connection ends up outside any transaction and nothing half-done is committed."""

    async def writer() -> None:
        async with storage.db.transaction() as db:
            await db.execute("INSERT INTO settings (key, value, updated_at) VALUES ('half', 'done', 0)")
            await asyncio.sleep(10)

    task = asyncio.ensure_future(writer())
    for _ in range(cancel_after):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not storage.db.in_transaction
    assert await storage.get_setting("half") is None
    async with storage.db.transaction() as db:  # and the next one works
        await db.execute("INSERT INTO settings (key, value, updated_at) VALUES ('next', 'ok', 0)")
    assert await storage.get_setting("next") == "ok"


async def test_an_upgrade_keeps_every_row(db_url: str) -> None:
    """A database made by the previous release (migrations 1-4) with data in it: the upgrade adds what is
    new and loses nothing."""
    from bot.storage import open_storage

    old = await open_storage(db_url, migrations=MIGRATIONS[:4])
    assert await old.migrate() == [1, 2, 3, 4]
    ann = await old.upsert_user("console:ann", "Ann")
    channel = await old.upsert_channel("console:c", "c", is_dm=True)
    said = [await old.add_message(channel.id, ann.id, "Cora", "user", "Ann", f"message {i}", 3) for i in range(3)]
    await old.add_summary(channel.id, "Ann said three things", said[0].id, said[2].id, 5, "m")
    job = await old.enqueue_job("summary", "channel:1", {"channel_id": 1}, 3)
    await old.set_setting("memory.weights", '{"vector": 0.9}')
    await old.close()
    new = await open_storage(db_url)
    try:
        newer = [m.version for m in MIGRATIONS if m.version > 4]
        assert await new.pending_migrations() == newer
        assert await new.migrate() == newer
        assert [m.text for m in reversed(await new.recent_messages(channel.id, 10))] == [m.text for m in said]
        assert (await new.latest_summary(channel.id)).text == "Ann said three things"
        assert (await new.get_job(job.id)).status == "queued"
        assert await new.get_setting("memory.weights") == '{"vector": 0.9}'
        assert (await new.get_user("console:ann")).id == ann.id
        # the rebuilt tables keep their triggers, full text and references
        later = await new.add_message(channel.id, ann.id, "Cora", "user", "Ann", "figs are ripe", 3)
        assert later.id > said[-1].id and await new.count_messages(channel.id) == 4
        found = await new.memory.message_text_candidates(ann.id, "Cora", {"figs": 1.0}, newest=False, limit=5)
        assert [int(r["id"]) for r in found] == [later.id]
        assert [int(r["id"]) for r in await new.memory.message_text_candidates(
            ann.id, "Cora", {"message": 1.0}, newest=True, limit=5)] == [m.id for m in reversed(said)]
    finally:
        await new.close()


async def test_sqlite_keeps_one_id_counter_per_table(tmp_path: Path) -> None:
    """Migration 6's rebuild left two ``sqlite_sequence`` rows per non-empty table (the copy's, renamed with
    the table, and one inserted after it): SQLite advanced the first, the second stayed stale. A rebuild now
    leaves one, and migration 15 merges the pairs an older release left, keeping the larger counter."""
    from bot.storage import open_storage

    url = f"sqlite:///{tmp_path / 'bot.db'}"
    old = await open_storage(url, migrations=MIGRATIONS[:5])
    await old.migrate()
    ann = await old.upsert_user("console:ann", "Ann")
    await old.upsert_user("console:bob", "Bob")
    await old.close()
    upgraded = await open_storage(url, migrations=MIGRATIONS[:14])
    try:
        await upgraded.migrate()
        db = upgraded.db
        assert await db.fetch_all("SELECT name FROM sqlite_sequence GROUP BY name HAVING count(*) > 1") == []
        assert [tuple(r) for r in await db.fetch_all("SELECT name, seq FROM sqlite_sequence WHERE name = 'users'")
                ] == [("users", ann.id + 1)]
        # what the older rebuild left: a stale second row (and one counter ahead of its table)
        await db.write("INSERT INTO sqlite_sequence (name, seq) VALUES ('users', 1)")
        await db.write("UPDATE sqlite_sequence SET seq = 40 WHERE name = 'users' AND seq = 1")
        await db.write("INSERT INTO sqlite_sequence (name, seq) VALUES ('messages', 7)")
    finally:
        await upgraded.close()
    new = await open_storage(url, migrations=MIGRATIONS[:15])
    try:
        assert await new.migrate() == [15]
        rows = {r[0]: r[1] for r in await new.db.fetch_all("SELECT name, seq FROM sqlite_sequence")}
        assert len(rows) == len(await new.db.fetch_all("SELECT name FROM sqlite_sequence"))
        assert rows["users"] == 40 and rows["messages"] == 7
        assert (await new.upsert_user("console:cid", "Cid")).id == 41
    finally:
        await new.close()


async def test_ids_are_never_reused_after_the_newest_rows_are_deleted(storage: Storage) -> None:
    """Another process may still hold a forgotten user's id (or a message's, an item's) in a cache: a new
    row must never get it, or a message would land under someone else."""
    ann = await storage.upsert_user("console:ann", "Ann")
    bob = await storage.upsert_user("console:bob", "Bob")
    channel = await storage.upsert_channel("console:bob-dm", "dm", is_dm=True)
    said = await storage.add_message(channel.id, bob.id, "Cora", "user", "Bob", "I am Bob", 3)
    pair = await storage.cortex.ensure_pair(bob.id, "Cora")
    assert await storage.forget_user("console:bob") is not None
    cid = await storage.upsert_user("console:cid", "Cid")
    assert cid.id > bob.id > ann.id
    again = await storage.add_message(channel.id, cid.id, "Cora", "user", "Cid", "I am Cid", 3)
    assert again.id > said.id
    assert (await storage.cortex.ensure_pair(cid.id, "Cora")).id > pair.id


async def test_closing_right_after_opening_leaves_no_connection_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cause of a flaky test: the WAL checkpointer connected inside its task, so closing the storage
    while that connect was under way (slow under load) left a connection thread running past the close,
    which then woke an event loop already closed ("Event loop is closed")."""
    import threading
    import time

    import aiosqlite.core

    from bot.storage.sqlite import SQLiteDatabase

    real_connect = sqlite3.connect

    def slow_connect(*args: object, **kwargs: object) -> sqlite3.Connection:
        time.sleep(0.2)  # a loaded machine
        return real_connect(*args, **kwargs)  # type: ignore[arg-type]

    before = set(threading.enumerate())
    monkeypatch.setattr(aiosqlite.core.sqlite3, "connect", slow_connect)
    for _ in range(2):
        db = await SQLiteDatabase(tmp_path / "bot.db").open()
        await asyncio.sleep(0)  # the checkpointer task starts
        await db.close()
        await asyncio.sleep(0.05)  # a closed connection's thread ends at once; a connect still running does not
        assert not set(threading.enumerate()) - before


def _writer(lock: WriteLock, order: list[str]) -> Callable[[str, bool], Awaitable[None]]:
    """A write through ``lock``'s urgent or background line that records its turn in ``order``."""

    async def write(name: str, urgent: bool) -> None:
        async with lock.line(urgent):
            order.append(name)
            await asyncio.sleep(0)

    return write


async def test_the_reply_paths_writes_go_before_background_writes_waiting() -> None:
    lock = WriteLock()
    order: list[str] = []
    write = _writer(lock, order)

    async with lock.line(urgent=False):  # a background write in progress
        waiting = [asyncio.ensure_future(write(f"job{i}", False)) for i in range(3)]
        await asyncio.sleep(0)
        replies = [asyncio.ensure_future(write(f"reply{i}", True)) for i in range(2)]
        await asyncio.sleep(0)
    await asyncio.gather(*waiting, *replies)
    assert order == ["reply0", "reply1", "job0", "job1", "job2"]  # each line first come, first served


async def test_a_write_cancelled_while_waiting_or_just_let_in_never_keeps_the_lock() -> None:
    lock = WriteLock()
    await lock.acquire(urgent=False)
    gone = asyncio.ensure_future(lock.acquire(urgent=True))
    let_in = asyncio.ensure_future(lock.acquire(urgent=True))
    after = asyncio.ensure_future(lock.acquire(urgent=False))
    await asyncio.sleep(0)
    gone.cancel()  # cancelled while waiting: skipped
    await asyncio.sleep(0)
    lock.release()  # hands the lock to let_in ...
    let_in.cancel()  # ... which is cancelled before it runs: it passes the lock on
    for task in (gone, let_in):
        with pytest.raises(asyncio.CancelledError):
            await task
    await asyncio.wait_for(after, 1)
    lock.release()
    await asyncio.wait_for(lock.acquire(urgent=True), 1)  # free again


async def test_a_busy_reply_path_lets_a_background_write_in_after_a_few_of_its_own() -> None:
    lock = WriteLock()
    order: list[str] = []
    write = _writer(lock, order)

    async with lock.line(urgent=True):
        job = asyncio.ensure_future(write("job", False))
        await asyncio.sleep(0)
        replies = [asyncio.ensure_future(write(f"reply{i}", True)) for i in range(12)]
        await asyncio.sleep(0)
    await asyncio.gather(job, *replies)
    assert order.index("job") == WriteLock.URGENT_RUN  # not last: a lease renewal cannot wait for ever
    assert [n for n in order if n != "job"] == [f"reply{i}" for i in range(12)]
    with pytest.raises(RuntimeError):
        lock.release()  # not held at all: a stray release is an error, not a free pass


async def test_a_withdrawn_platform_message_goes_with_what_points_at_it(storage: Storage) -> None:
    ann = await storage.upsert_user("matrix:@ann:x", "Ann")
    channel = await storage.upsert_channel("matrix:!dm:x", "dm", is_dm=True)
    said = await storage.add_message(channel.id, ann.id, "Cora", "user", "Ann", "my password is hunter2", 5)
    kept = await storage.add_message(channel.id, ann.id, "Cora", "user", "Ann", "hello", 1)
    await storage.sources.link(["matrix-message:$a"], said.id)
    await storage.sources.link(["matrix-message:$b"], kept.id)
    pair = await storage.cortex.ensure_pair(ann.id, "Cora")
    item = await storage.memory.add_item(pair.id, {"category": "fact", "content": "password hunter2",
                                                   "source_ref": "matrix-message:$a"}, None, 1.0)
    bob = await storage.upsert_user("matrix:@bob:x", "Bob")
    bobs = await storage.cortex.ensure_pair(bob.id, "Cora")
    await storage.memory.add_item(bobs.id, {"category": "fact", "content": "Bob's note",
                                            "source_ref": "matrix-message:$a"}, None, 1.0)
    # A redaction naming Ann's message while saying it was Bob's (any homeserver can send one): nothing of hers
    assert await storage.withdraw_message("matrix-message:$a", 2.0, "matrix:@bob:x") == (False, 1)  # his item only
    assert await storage.withdraw_message("matrix-message:$a", 2.0, "matrix:@nobody:x") == (False, 0)
    assert len(await storage.recent_messages(channel.id, 10)) == 2
    assert await storage.withdraw_message("matrix-message:$a", 2.0, "matrix:@ann:x") == (True, 1)
    assert [m.text for m in await storage.recent_messages(channel.id, 10)] == ["hello"]
    assert (await storage.memory.item(pair.id, int(item["id"])))["archived_at"] == 2.0
    assert await storage.withdraw_message("matrix-message:$a", 3.0) == (False, 0)  # once is enough
    assert await storage.withdraw_message("matrix-message:$unknown", 3.0) == (False, 0)
    assert await storage.count_messages(channel.id) == 1


async def test_a_withdrawn_channel_goes_with_its_summaries_and_the_items_from_its_messages(storage: Storage) -> None:
    ann = await storage.upsert_user("discord:1", "Ann")
    gone = await storage.upsert_channel("discord:10", "plans", is_dm=False)
    kept = await storage.upsert_channel("discord:11", "general", is_dm=False)
    said = await storage.add_message(gone.id, ann.id, "Cora", "user", "Ann", "my secret plan", 5)
    await storage.add_message(gone.id, ann.id, "Cora", "assistant", "Cora", "a fine plan", 5, reply_to=said.id)
    other = await storage.add_message(kept.id, ann.id, "Cora", "user", "Ann", "hello", 1)
    await storage.sources.link(["discord-message:100"], said.id)
    await storage.sources.link(["discord-message:101"], other.id)
    await storage.add_summary(gone.id, "Ann has a secret plan.", said.id, said.id, 5, "m")
    await storage.add_summary(kept.id, "Ann said hello.", other.id, other.id, 5, "m")
    pair = await storage.cortex.ensure_pair(ann.id, "Cora")
    for ref in ("discord-message:100", "discord:10", "discord-message:101", "discord:11"):
        await storage.memory.add_item(pair.id, {"category": "fact", "content": f"from {ref}", "source_ref": ref},
                                      None, 1.0)
    assert await storage.withdraw_channel("discord:10", 2.0) == (2, 2)
    assert await storage.count_messages(gone.id) == 0 and await storage.latest_summary(gone.id) is None
    assert [m.text for m in await storage.recent_messages(kept.id, 10)] == ["hello"]
    assert (await storage.latest_summary(kept.id)) is not None
    rows = await storage.db.fetch_all("SELECT content, archive_reason FROM memory_items ORDER BY id")
    assert [(str(r[0]), str(r[1])) for r in rows] == [
        ("from discord-message:100", "its channel was deleted"), ("from discord:10", "its channel was deleted"),
        ("from discord-message:101", ""), ("from discord:11", "")]
    assert await storage.withdraw_channel("discord:10", 3.0) == (0, 0)  # once is enough
    assert await storage.withdraw_channel("discord:99", 3.0) == (0, 0)  # a channel the bot never stored


async def test_a_withdrawn_message_takes_the_reply_to_it_along_and_a_withdrawn_reply_goes_alone(
        storage: Storage) -> None:
    """An attacker's finding: deleting a message on the platform left the bot's stored reply to it, which often
    repeats it (in the next prompts), and a moderator deleting one of the bot's replies left it in the history.
    Replies in one channel may be stored out of order (a slow one after a quick one): each goes by what it answers."""
    ann = await storage.upsert_user("discord:ann", "Ann")
    bob = await storage.upsert_user("discord:bob", "Bob")
    channel = await storage.upsert_channel("discord:room", "room", is_dm=False)

    async def add(user: int, role: str, text: str, reply_to: int | None = None) -> int:
        return (await storage.add_message(channel.id, user, "Cora", role, "x", text, 1,  # type: ignore[arg-type]
                                          reply_to=reply_to)).id

    question = await add(ann.id, "user", "what is 2+2")
    secret = await add(ann.id, "user", "my card is 4111 1111")
    await add(bob.id, "user", "Bob meanwhile")
    await add(ann.id, "assistant", "4", reply_to=question)  # (the quick answer first …)
    await add(bob.id, "assistant", "hi Bob")
    await add(ann.id, "assistant", "your card 4111 1111 is noted", reply_to=secret)  # (… the slow one after)
    thanks = await add(ann.id, "user", "thanks")
    welcome = await add(ann.id, "assistant", "you are welcome", reply_to=thanks)
    for key, message_id in (("discord-message:1", question), ("discord-message:2", secret),
                            ("discord-message:3", thanks), ("discord-message:9", welcome)):
        await storage.sources.link([key], message_id)
    assert await storage.withdraw_message("discord-message:2", 2.0) == (True, 0)
    left = [m.text for m in reversed(await storage.recent_messages(channel.id, 20))]
    assert left == ["what is 2+2", "Bob meanwhile", "4", "hi Bob", "thanks", "you are welcome"]
    # The bot's reply by its platform key: as the platform vouches (no author), not as someone's own message
    assert await storage.withdraw_message("discord-message:9", 3.0, "discord:ann") == (False, 0)
    assert await storage.withdraw_message("discord-message:9", 3.0) == (True, 0)
    left = [m.text for m in reversed(await storage.recent_messages(channel.id, 20))]
    assert left[-2:] == ["hi Bob", "thanks"]


@pytest.mark.both_engines
async def test_an_upgrade_embeds_again_the_messages_of_channels_that_lost_some(tmp_path: Path) -> None:
    """Each message was embedded with the one before it, and deleting a message left the next one's vector as
    it was (a forgotten user's words in someone else's vector). The upgrade drops the vectors of every channel
    whose messages were ever deleted (its positions have a gap), for the backfill to embed them again."""
    from bot.storage import open_storage
    from tests.engines import db_url_for

    url = db_url_for(tmp_path)
    old = await open_storage(url, migrations=MIGRATIONS[:18])
    try:
        await old.migrate()
        ann = await old.upsert_user("console:ann", "Ann")
        kept = await old.upsert_channel("console:kept", "kept", is_dm=False)
        lost = await old.upsert_channel("console:lost", "lost", is_dm=False)
        ids = {c.key: [(await old.add_message(c.id, ann.id, "Cora", "user", "Ann", f"{c.name} {n}", 2)).id
                       for n in range(3)] for c in (kept, lost)}
        import numpy as np

        await old.memory.store_message_vectors("m", [(message_id, ann.id, "Cora", np.full(4, 0.5, dtype=np.float32))
                                                     for message_id in [*ids["console:kept"], *ids["console:lost"]]])
        await old.db.write("DELETE FROM message_vectors WHERE message_id = ?", (ids["console:lost"][1],))
        await old.db.write("DELETE FROM messages WHERE id = ?", (ids["console:lost"][1],))  # as releases before did
        await old.db.write("UPDATE channels SET message_count = 2 WHERE id = ?", (lost.id,))
    finally:
        await old.close()
    new = await open_storage(url, migrations=MIGRATIONS[:19])
    try:
        assert await new.migrate() == [19]
        left = sorted(int(r[0]) for r in await new.db.fetch_all("SELECT message_id FROM message_vectors"))
        assert left == sorted(ids["console:kept"])
    finally:
        await new.close()


async def test_a_files_read_that_a_write_overtook_is_not_kept_for_the_next_prompts(
        storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply read the cortex files while an update's write landed (another connection, another task): the
    read's older content went into the prompt cache after the write had cleared it, and the next replies
    for five seconds were built without the update."""
    ann = await storage.upsert_user("discord:1", "Ann")
    pair = await storage.cortex.ensure_pair(ann.id, "Cora")
    first = await storage.cortex.add_first_version(pair.id, "memory.md", "old", "model")
    assert first is not None
    assert await storage.cortex.files_for_prompt(ann.id, "Cora") == {"memory.md": "old"}
    storage.cortex._prompt_files.clear()  # the cache entry expired: the next prompt reads again
    real = storage.cortex.db.fetch_all

    async def read_then_overtaken(sql: str, params: Any = ()) -> Any:
        rows = await real(sql, params)
        if "cortex_versions AS v" in sql:  # the update's write lands before this read is handed back
            monkeypatch.setattr(storage.cortex.db, "fetch_all", real)
            await storage.cortex.add_version_based_on(first.version, pair.id, "memory.md", "new", "model")
        return rows

    monkeypatch.setattr(storage.cortex.db, "fetch_all", read_then_overtaken)
    assert await storage.cortex.files_for_prompt(ann.id, "Cora") == {"memory.md": "old"}  # begun before it
    assert await storage.cortex.files_for_prompt(ann.id, "Cora") == {"memory.md": "new"}


async def test_each_file_keeps_its_newest_versions_only(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save is a whole new version: without a bound, saving at the rate limit grew the database by
    gigabytes a day. The oldest go beyond the bound, per file, whichever way the version was saved."""
    monkeypatch.setattr(type(storage.cortex), "KEEP_VERSIONS", 3)
    ann = await storage.upsert_user("discord:1", "Ann")
    pair = await storage.cortex.ensure_pair(ann.id, "Cora")
    await storage.cortex.add_version(pair.id, "soul.md", "the soul", "model")
    for n in range(1, 6):
        await storage.cortex.add_version(pair.id, "memory.md", f"text {n}", "model")
    saved = await storage.cortex.add_version_based_on(5, pair.id, "memory.md", "text 6", "user")
    assert saved is not None and saved.version == 6
    assert [v.version for v in await storage.cortex.versions(pair.id, "memory.md")] == [4, 5, 6]
    assert await storage.cortex.version_range(pair.id, "memory.md") == (4, 6)
    assert (await storage.cortex.current(pair.id, "memory.md")).content == "text 6"  # type: ignore[union-attr]
    assert [v.version for v in await storage.cortex.versions(pair.id, "soul.md")] == [1]  # another file: untouched
    assert await storage.cortex.version_range(pair.id, "relationship.md") is None
    refused = await storage.cortex.add_version_based_on(5, pair.id, "memory.md", "stale", "user")
    assert refused is None and await storage.cortex.version_range(pair.id, "memory.md") == (4, 6)  # nothing trimmed


async def test_what_forget_mes_kept_of_the_daily_limits_goes_after_two_days(storage: Storage) -> None:
    """It was deleted only by the next forget-me: without one, it stayed for good."""
    now = time.time()
    for age_days, tokens in ((3, 10), (1, 20)):
        await storage.db.write("INSERT INTO forgotten_spending (started_at, tokens) VALUES (?, ?)",
                               (now - age_days * 86_400, tokens))
        await storage.db.write("INSERT INTO forgotten_usage (subject, counted_at, amount) VALUES (?, ?, ?)",
                               ("skill:abc:lookup", now - age_days * 86_400, tokens))
    assert await storage.prune_forgotten() == 2
    assert [r[0] for r in await storage.db.fetch_all("SELECT tokens FROM forgotten_spending")] == [20]
    assert [r[0] for r in await storage.db.fetch_all("SELECT amount FROM forgotten_usage")] == [20]
    assert await storage.prune_forgotten() == 0


async def test_undo_offers_outlive_the_process_and_go_with_forget_me_and_age(storage: Storage) -> None:
    """Which confirmation undoes what was kept in the memory of the process that sent it (a restart dropped it);
    kept in the database, it goes with the user's forget-me and after ``KEPT_DAYS``."""
    from bot.storage.undo import KEPT_DAYS

    offers = storage.undo_offers
    await storage.upsert_user("matrix:@ann:hs", "Ann")
    await storage.upsert_user("matrix:@bob:hs", "Bob")
    assert await offers.offer("matrix-message:$c1", "matrix:@ann:hs", "matrix-message:$m1")
    assert await offers.offer("matrix-message:$c2", "matrix:@bob:hs", "matrix-message:$m2")
    assert not await offers.offer("matrix-message:$c3", "matrix:@nobody:hs", "matrix-message:$m3")
    assert await offers.find("matrix-message:$c1") == ("matrix:@ann:hs", "matrix-message:$m1")
    assert await offers.find("matrix-message:$m1") is None  # (the remembered message offers nothing)
    assert await storage.forget_user("matrix:@ann:hs") is not None
    assert await offers.find("matrix-message:$c1") is None
    assert await offers.prune() == 0
    await storage.db.write("UPDATE undo_offers SET created_at = ?", (time.time() - (KEPT_DAYS + 1) * 86_400,))
    assert await offers.prune() == 1
    assert await offers.find("matrix-message:$c2") is None


async def test_a_summary_made_from_one_no_longer_the_newest_is_dropped(storage: Storage) -> None:
    """A run whose worker stalled while another wrote a newer summary put an older range on top (the latest
    summary went back in time, and the messages folded in since dropped out of the prompt)."""
    from bot.storage.base import SummarySources

    channel = await storage.upsert_channel("discord:c", "c", is_dm=False)
    said = [await storage.add_message(channel.id, None, "Cora", "user", "Ann", f"m{i}", 1) for i in range(6)]
    first = await storage.add_summary(channel.id, "one", said[0].id, said[1].id, 1, "m",
                                      made_from=SummarySources(None, (said[0].id, said[1].id)))
    assert first is not None
    late_first = await storage.add_summary(channel.id, "one again", said[0].id, said[1].id, 1, "m",
                                           made_from=SummarySources(None, (said[0].id, said[1].id)))
    assert late_first is None
    second = await storage.add_summary(channel.id, "two", said[0].id, said[3].id, 1, "m",
                                       made_from=SummarySources(first.id, (said[2].id, said[3].id)))
    assert second is not None and second.version == 2
    late = await storage.add_summary(channel.id, "two, late", said[0].id, said[2].id, 1, "m",
                                     made_from=SummarySources(first.id, (said[2].id,)))
    assert late is None
    latest = await storage.latest_summary(channel.id)
    assert latest is not None and latest.text == "two"


async def test_forget_me_finds_the_summaries_of_channels_whose_messages_of_theirs_are_gone(storage: Storage) -> None:
    """Retention (or deletions on the platform) took Ann's messages and left the summaries written from them and
    her DM's name: forget-me kept both (the summary came back into the next prompt), and her export lacked it."""
    dm = await storage.upsert_channel("discord:dm-ann", "DM with Annzz", is_dm=True)
    room = await storage.upsert_channel("discord:room", "room", is_dm=False)
    ann, bob = await storage.upsert_user("discord:ann", "Annzz"), await storage.upsert_user("discord:bob", "Bob")
    said = await storage.add_message(dm.id, ann.id, "Cora", "user", "Annzz", "my diagnosis is zebra", 5)
    await storage.add_summary(dm.id, "Annzz told Cora her diagnosis is zebra.", said.id, said.id, 5, "m")
    in_room = await storage.add_message(room.id, ann.id, "Cora", "user", "Annzz", "zebra again", 3)
    bobs = await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "hi", 1)
    await storage.add_summary(room.id, "Annzz and Bob spoke of zebras.", in_room.id, bobs.id, 5, "m")
    assert await storage.delete_messages_before(time.time() + 1) == 3  # all of them age out; the summaries stay

    assert [s["text"] for s in await storage.export.dm_summaries(ann.id)] == ["Annzz told Cora her diagnosis is zebra."]
    report = await storage.forget_user("discord:ann")
    assert report is not None and report.summaries == 2
    assert await storage.list_summaries(dm.id) == [] and await storage.list_summaries(room.id) == []
    assert (channel := await storage.get_channel("discord:dm-ann")) is not None and channel.name != "DM with Annzz"
    assert await storage.db.fetch_all("SELECT * FROM channel_speakers WHERE user_id = ?", (ann.id,)) == []
    # Bob's link stays (a later forget-me of his finds the room), and he can be forgotten too
    assert await storage.forget_user("discord:bob") is not None
    assert await storage.db.fetch_all("SELECT * FROM channel_speakers") == []


async def test_an_upgrade_makes_the_words_inside_addresses_of_stored_rows_searchable(pg_url: str) -> None:
    """Migration 28 (PostgreSQL): items and messages stored before it hold "example.com" as one token; the upgrade
    makes their tsvectors again, so their words are found as those of new rows are."""
    from cortex.memory.store import MemoryStore

    old = await open_storage(pg_url, migrations=MIGRATIONS[:27])
    try:
        await old.migrate()
        ann = await old.upsert_user("console:ann", "Ann")
        pair = await old.cortex.count_messages(ann.id, "Cora", 0)
        await MemoryStore(old).remember(pair.id, "Ann's website is example.com")
        dm = await old.upsert_channel("console:dm-ann", "dm", is_dm=True)
        await old.add_message(dm.id, ann.id, "Cora", "user", "Ann", "mail me at ann@figs.example", 5)
        assert await MemoryStore(old).search(pair.id, "example.com", patient=True) == []
    finally:
        await old.close()
    new = await open_storage(pg_url, migrations=MIGRATIONS[:29])
    try:
        assert await new.migrate() == [28, 29]
        hits = await MemoryStore(new).search(pair.id, "example.com figs", user_id=ann.id, persona="Cora", patient=True)
        assert {h.kind for h in hits} == {"item", "message"}, [h.text for h in hits]
    finally:
        await new.close()


async def test_a_correction_archived_with_its_channel_or_before_the_upgrade_frees_its_old_wordings_place(
        db_url: str) -> None:
    """A correction remembered from a message of a channel deleted on its platform was archived alone: the wording
    it replaced, hidden, went on counting against the pair's item limit. Migration 30 archives those an older
    version left behind."""
    old = await open_storage(db_url, migrations=MIGRATIONS[:29])
    try:
        await old.migrate()
        ann = await old.upsert_user("discord:1", "Ann")
        chan = await old.upsert_channel("discord:10", "plans", is_dm=False)
        said = await old.add_message(chan.id, ann.id, "Cora", "user", "Ann", "actually I moved to Oslo", 5)
        await old.sources.link(["discord-message:100"], said.id)
        pair = await old.cortex.ensure_pair(ann.id, "Cora")

        async def corrected(before: str, after: str, source: str) -> tuple[int, int]:
            first = await old.memory.add_item(pair.id, {"category": "fact", "content": before, "source_ref": "web"},
                                              None, 1.0)
            second = await old.memory.add_item(pair.id, {"category": "fact", "content": after, "source_ref": source},
                                               int(first["id"]), 1.5)
            return int(first["id"]), int(second["id"])

        left_behind = await corrected("Ann lives in Bergen", "Ann lives in Oslo", "web")
        await old.db.write("UPDATE memory_items SET archived_at = 2.0 WHERE id = ?", (left_behind[1],))  # as before
    finally:
        await old.close()
    new = await open_storage(db_url, migrations=MIGRATIONS[:30])
    try:
        assert await new.migrate() == [30]
        old = new
        await corrected("Ann has a dog", "Ann has two dogs", "discord-message:100")
        assert await new.withdraw_channel("discord:10", 3.0) == (1, 1)
        assert not await new.memory.has_at_least(pair.id, 1)  # every wording archived: nothing counts
        reasons = [r[0] for r in await new.db.fetch_all("SELECT archive_reason FROM memory_items ORDER BY id")]
        assert reasons == ["its correction was archived", "", "its correction was archived",
                           "its channel was deleted"]
    finally:
        await new.close()
