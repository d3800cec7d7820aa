"""SQLite engine of :class:`bot.storage.base.Storage`, on aiosqlite.

One connection per process in autocommit mode (WAL, foreign keys, busy timeout). Single statements
are atomic on their own; anything that must be read-then-written atomically runs inside
``BEGIN IMMEDIATE`` under an asyncio lock, so in-process tasks never interleave in one transaction
and other processes wait on SQLite's write lock (bounded by ``busy_timeout``).

Every call is a round trip to aiosqlite's thread, which is most of what a reply costs the core, so
the reply path keeps them few: identical user/channel upserts are answered from memory, the newest
summary of a channel is cached (invalidated by this process's writes, re-read after
``SUMMARY_CACHE_SECONDS`` for other processes' writes), and audit rows (LLM calls, reply stats) are
buffered and written in batches (at most ``AUDIT_FLUSH_SECONDS`` late; flushed before they are read
and on close). A crash can lose that last second of audit rows, never a message. WAL checkpoints
(which fsync) run every ``CHECKPOINT_SECONDS`` on a second connection instead of inside whichever
reply's write happens to cross SQLite's page threshold.

Times are stored as UNIX seconds (REAL); the interface speaks UTC ``datetime``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiosqlite

from bot.storage.base import (
    Channel,
    Job,
    JobStatus,
    LLMCallRecord,
    MessageRole,
    ReplyMetrics,
    ReplyStats,
    StoredMessage,
    Summary,
    SummaryStatus,
    User,
)
from bot.storage.migrations import SQLITE_MIGRATIONS, Migration

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 10_000
AUDIT_FLUSH_ROWS = 64  # buffered audit rows written in one go ...
AUDIT_FLUSH_SECONDS = 1.0  # ... or after this long
SUMMARY_CACHE_SECONDS = 5.0  # how stale another process's new summary may look here
CHECKPOINT_SECONDS = 5.0  # WAL checkpoints run this often on a connection of their own ...
WAL_AUTOCHECKPOINT_PAGES = 20_000  # ... so SQLite's own (inline, fsyncing) one is only a backstop

MESSAGE_COLUMNS = "id, channel_id, user_id, persona, role, author_name, text, token_count, seq, created_at"
LLM_CALL_SQL = (
    "INSERT INTO llm_calls (purpose, model, input_tokens, output_tokens, estimated_input_tokens,"
    " duration_ms, error, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
REPLY_STATS_SQL = (
    "INSERT INTO reply_stats (channel_id, message_id, history_tokens, history_budget, window_messages,"
    " trimmed_messages, summary_used, prompt_tokens, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


class StorageError(Exception):
    """The database cannot be opened or used; the message says which file and why."""


def _ts(value: datetime | None) -> float:
    return time.time() if value is None else value.timestamp()


def _dt(value: float) -> datetime:
    return datetime.fromtimestamp(value, tz=UTC)


@dataclass
class StorageCaches:
    """What one process remembers between calls; shared by the connections it opens on one file.

    ``write_lock`` serialises writes of those connections in the process itself: two of them meeting
    SQLite's write lock would make one sleep in SQLite's busy handler (a millisecond or more)."""

    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: dict[str, User] = field(default_factory=dict)
    channels: dict[str, Channel] = field(default_factory=dict)
    summaries: dict[int, tuple[float, Summary | None]] = field(default_factory=dict)
    extra: dict[str, dict[Any, Any]] = field(default_factory=dict)  # caches of components on this storage

    def named(self, name: str) -> dict[Any, Any]:
        return self.extra.setdefault(name, {})


class SQLiteStorage:
    def __init__(
        self,
        path: str | Path,
        *,
        migrations: Sequence[Migration] = SQLITE_MIGRATIONS,
        caches: StorageCaches | None = None,
        checkpoints: bool = True,
    ) -> None:
        self.path = Path(path)
        self._migrations = tuple(sorted(migrations, key=lambda m: m.version))
        self._db: aiosqlite.Connection | None = None
        # Users and channels are upserted on every message; identical repeats are answered from here.
        self.caches = caches or StorageCaches()
        self._tx_lock = self.caches.write_lock
        self._users = self.caches.users
        self._channels = self.caches.channels
        self._summaries = self.caches.summaries
        self._checkpoints = checkpoints
        self._audit: list[tuple[str, tuple[Any, ...]]] = []
        self._audit_timer: asyncio.Task[None] | None = None
        self._checkpointer: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def open(self) -> SQLiteStorage:
        if self.path != Path(":memory:"):
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create the database folder {self.path.parent}: {exc}") from None
        try:
            db = await aiosqlite.connect(self.path, isolation_level=None)
            db.row_factory = sqlite3.Row
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA foreign_keys=ON")
            await db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            await db.execute("PRAGMA synchronous=NORMAL")
            await db.execute("PRAGMA cache_size=-16000")  # 16 MB of page cache
            await db.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
            await db.execute(
                "CREATE TABLE IF NOT EXISTS schema_version ("
                " version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
        except sqlite3.Error as exc:
            raise StorageError(f"cannot open the database {self.path}: {exc}") from None
        self._db = db
        if self._checkpoints and self.path != Path(":memory:"):
            self._checkpointer = asyncio.create_task(self._checkpoint_loop(), name="storage-wal-checkpoint")
        return self

    async def sibling(self) -> SQLiteStorage:
        """A second connection to the same database sharing this one's caches: background jobs use it,
        so their queries never wait in line with the reply path's on aiosqlite's thread."""
        return await SQLiteStorage(
            self.path, migrations=self._migrations, caches=self.caches, checkpoints=False
        ).open()

    async def _checkpoint_loop(self) -> None:
        """Checkpoint the WAL from a connection (and thread) of its own; PASSIVE never blocks writers."""
        db = await aiosqlite.connect(self.path, isolation_level=None)
        try:
            await db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            while True:
                await asyncio.sleep(CHECKPOINT_SECONDS)
                try:
                    await db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error as exc:
                    log.warning("WAL checkpoint failed (%s); SQLite's own checkpoint is the backstop", exc)
        finally:
            await db.close()

    async def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.cancel()
            await asyncio.gather(self._checkpointer, return_exceptions=True)
            self._checkpointer = None
        if self._db is not None:
            if self._audit_timer is not None:
                self._audit_timer.cancel()
            try:
                await self.flush_audit()
            except sqlite3.Error:
                log.exception("could not write %d buffered audit rows at close", len(self._audit))
            finally:
                await self._db.close()
                self._db = None

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise StorageError("storage is not open")
        return self._db

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        async with self._tx_lock:
            begin = asyncio.ensure_future(self.db.execute("BEGIN IMMEDIATE"))
            try:
                await asyncio.shield(begin)
            except asyncio.CancelledError:
                # The BEGIN still runs on aiosqlite's thread: wait for it and undo it, or the connection
                # would stay inside a transaction nobody ends.
                with contextlib.suppress(Exception):
                    await begin
                    await self.db.execute("ROLLBACK")
                raise
            try:
                yield self.db
            except BaseException:
                await self.db.execute("ROLLBACK")
                raise
            else:
                await self.db.execute("COMMIT")

    # Each helper is one round trip to aiosqlite's thread (execute_fetchall), which is what a reply
    # mostly pays for: a cursor opened, fetched and closed would be three.

    async def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        rows = await self.db.execute_fetchall(sql, params)
        return next(iter(rows), None)

    async def fetch_all(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        return list(await self.db.execute_fetchall(sql, params))

    async def write_one(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        return next(iter(await self.write(sql, params)), None)

    async def write(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """One writing statement (use RETURNING to learn what it did), never inside another task's
        open transaction."""
        async with self._tx_lock:
            return list(await self.db.execute_fetchall(sql, params))

    # -- migrations ------------------------------------------------------------------------------

    async def applied_migrations(self) -> list[int]:
        return [int(r["version"]) for r in await self.fetch_all("SELECT version FROM schema_version ORDER BY 1")]

    async def pending_migrations(self) -> list[int]:
        done = set(await self.applied_migrations())
        return [m.version for m in self._migrations if m.version not in done]

    async def migrate(self) -> list[int]:
        applied: list[int] = []
        for migration in self._migrations:
            async with self.transaction() as db:
                # Re-check inside the write lock: another process may have just applied it.
                if await db.execute_fetchall(
                    "SELECT 1 FROM schema_version WHERE version = ?", (migration.version,)
                ):
                    continue
                for statement in migration.statements:
                    await db.execute(statement)
                await db.execute(
                    "INSERT INTO schema_version (version, description, applied_at) VALUES (?, ?, ?)",
                    (migration.version, migration.description, time.time()),
                )
            log.info("applied migration %d: %s", migration.version, migration.description)
            applied.append(migration.version)
        return applied

    # -- users, personas, channels ---------------------------------------------------------------

    async def upsert_user(self, key: str, display_name: str) -> User:
        cached = self._users.get(key)
        if cached is not None and cached.display_name == display_name:
            return cached
        now = time.time()
        row = await self.write_one(
            "INSERT INTO users (key, display_name, created_at, updated_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET display_name = excluded.display_name, updated_at = excluded.updated_at"
            " RETURNING id, key, display_name",
            (key, display_name, now, now),
        )
        assert row is not None
        user = User(int(row["id"]), str(row["key"]), str(row["display_name"]))
        self._users[key] = user
        return user

    async def get_user(self, key: str) -> User | None:
        row = await self.fetch_one("SELECT id, key, display_name FROM users WHERE key = ?", (key,))
        return None if row is None else User(int(row["id"]), str(row["key"]), str(row["display_name"]))

    async def upsert_persona(self, name: str) -> None:
        await self.write(
            "INSERT INTO personas (name, created_at) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
            (name, time.time()),
        )

    async def upsert_channel(self, key: str, name: str, is_dm: bool) -> Channel:
        cached = self._channels.get(key)
        if cached is not None and (cached.name, cached.is_dm) == (name, is_dm):
            return cached
        now = time.time()
        row = await self.write_one(
            "INSERT INTO channels (key, name, is_dm, created_at, updated_at) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET name = excluded.name, is_dm = excluded.is_dm,"
            " updated_at = excluded.updated_at RETURNING *",
            (key, name, int(is_dm), now, now),
        )
        assert row is not None
        channel = self._channel(row)
        self._channels[key] = channel
        return channel

    async def get_channel(self, key: str) -> Channel | None:
        row = await self.fetch_one("SELECT * FROM channels WHERE key = ?", (key,))
        return None if row is None else self._channel(row)

    async def count_messages(self, channel_id: int) -> int:
        row = await self.fetch_one("SELECT message_count FROM channels WHERE id = ?", (channel_id,))
        return int(row[0]) if row else 0

    @staticmethod
    def _channel(row: sqlite3.Row) -> Channel:
        return Channel(int(row["id"]), str(row["key"]), str(row["name"]), bool(row["is_dm"]))

    # -- messages --------------------------------------------------------------------------------

    async def add_message(
        self,
        channel_id: int,
        user_id: int | None,
        persona: str,
        role: MessageRole,
        author_name: str,
        text: str,
        token_count: int,
        created_at: datetime | None = None,
    ) -> StoredMessage:
        ts = _ts(created_at)
        # One statement: its seq is the channel's count so far + 1, and the trigger bumps the count.
        row = await self.write_one(
            "INSERT INTO messages (channel_id, user_id, persona, role, author_name, text, token_count, seq,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?, ?,"
            " (SELECT message_count + 1 FROM channels WHERE id = ?), ?) RETURNING id, seq",
            (channel_id, user_id, persona, role, author_name, text, token_count, channel_id, ts),
        )
        assert row is not None
        return StoredMessage(
            int(row[0]), channel_id, user_id, persona, role, author_name, text, token_count, int(row[1]), _dt(ts)
        )

    @staticmethod
    def _message(row: sqlite3.Row) -> StoredMessage:
        # Positional: rows come from MESSAGE_COLUMNS, in that order.
        return StoredMessage(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8], _dt(row[9]))

    async def recent_messages(
        self, channel_id: int, limit: int, before_id: int | None = None
    ) -> list[StoredMessage]:
        rows = await self.fetch_all(
            f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE channel_id = ? AND id < ? ORDER BY id DESC LIMIT ?",
            (channel_id, before_id if before_id is not None else 2**62, limit),
        )
        return [self._message(r) for r in rows]

    async def messages_between(
        self, channel_id: int, after_id: int, before_id: int, limit: int
    ) -> list[StoredMessage]:
        rows = await self.fetch_all(
            f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE channel_id = ? AND id > ? AND id < ? ORDER BY id LIMIT ?",
            (channel_id, after_id, before_id, limit),
        )
        return [self._message(r) for r in rows]

    async def count_messages_between(self, channel_id: int, after_id: int, before_id: int) -> int:
        row = await self.fetch_one(
            "SELECT count(*) FROM messages WHERE channel_id = ? AND id > ? AND id < ?",
            (channel_id, after_id, before_id),
        )
        return int(row[0]) if row else 0

    # -- summaries -------------------------------------------------------------------------------

    @staticmethod
    def _summary(row: sqlite3.Row) -> Summary:
        return Summary(
            id=int(row["id"]),
            channel_id=int(row["channel_id"]),
            version=int(row["version"]),
            text=str(row["text"]),
            covers_from_id=int(row["covers_from_id"]),
            covers_to_id=int(row["covers_to_id"]),
            covers_to_seq=int(row["covers_to_seq"]),
            token_count=int(row["token_count"]),
            model=str(row["model"]),
            status=row["status"],
            reason=str(row["reason"]),
            created_at=_dt(float(row["created_at"])),
        )

    async def latest_summary(self, channel_id: int) -> Summary | None:
        cached = self._summaries.get(channel_id)
        if cached is not None and time.monotonic() - cached[0] < SUMMARY_CACHE_SECONDS:
            return cached[1]
        row = await self.fetch_one(
            "SELECT * FROM summaries WHERE channel_id = ? AND status = 'ok' ORDER BY version DESC LIMIT 1",
            (channel_id,),
        )
        summary = None if row is None else self._summary(row)
        self._summaries[channel_id] = (time.monotonic(), summary)
        return summary

    async def add_summary(
        self,
        channel_id: int,
        text: str,
        covers_from_id: int,
        covers_to_id: int,
        token_count: int,
        model: str,
        status: SummaryStatus = "ok",
        reason: str = "",
    ) -> Summary:
        # One statement: the next version number and the insert are atomic together.
        row = await self.write_one(
            "INSERT INTO summaries (channel_id, version, text, covers_from_id, covers_to_id, covers_to_seq,"
            " token_count, model, status, reason, created_at)"
            " SELECT ?, coalesce(max(version), 0) + 1, ?, ?, ?,"
            " coalesce((SELECT seq FROM messages WHERE id = ?), 0), ?, ?, ?, ?, ? FROM summaries"
            " WHERE channel_id = ? RETURNING *",
            (channel_id, text, covers_from_id, covers_to_id, covers_to_id, token_count, model, status, reason,
             time.time(), channel_id),
        )
        assert row is not None
        summary = self._summary(row)
        if summary.status == "ok":
            self._summaries[channel_id] = (time.monotonic(), summary)
        return summary

    async def list_summaries(self, channel_id: int) -> list[Summary]:
        rows = await self.fetch_all("SELECT * FROM summaries WHERE channel_id = ? ORDER BY version", (channel_id,))
        return [self._summary(r) for r in rows]

    # -- jobs ------------------------------------------------------------------------------------

    @staticmethod
    def _job(row: sqlite3.Row) -> Job:
        return Job(
            id=int(row["id"]),
            kind=str(row["kind"]),
            key=str(row["key"]),
            payload=json.loads(row["payload"]),
            status=row["status"],
            attempts=int(row["attempts"]),
            max_attempts=int(row["max_attempts"]),
            run_after=_dt(float(row["run_after"])),
            last_error=str(row["last_error"]),
            locked_by=str(row["locked_by"]),
            created_at=_dt(float(row["created_at"])),
            updated_at=_dt(float(row["updated_at"])),
        )

    async def enqueue_job(
        self,
        kind: str,
        key: str,
        payload: dict[str, Any],
        max_attempts: int,
        *,
        dedupe: bool = True,
        run_after: datetime | None = None,
    ) -> Job | None:
        now = time.time()
        # One statement, so the duplicate check and the insert are atomic without a transaction.
        duplicate = (
            "NOT EXISTS (SELECT 1 FROM jobs WHERE kind = ? AND key = ? AND status = 'queued')" if dedupe else "1"
        )
        row = await self.write_one(
            "INSERT INTO jobs (kind, key, payload, status, max_attempts, run_after, created_at, updated_at)"
            f" SELECT ?, ?, ?, 'queued', ?, ?, ?, ? WHERE {duplicate} RETURNING *",
            (
                kind, key, json.dumps(payload), max_attempts, _ts(run_after) if run_after else now, now, now,
                *((kind, key) if dedupe else ()),
            ),
        )
        return None if row is None else self._job(row)

    async def claim_job(self, worker: str, kinds: Sequence[str], lease_seconds: float) -> Job | None:
        if not kinds:
            return None
        now = time.time()
        marks = ",".join("?" for _ in kinds)
        runnable = (
            f"SELECT id FROM jobs AS j WHERE status = 'queued' AND run_after <= ? AND kind IN ({marks})"
            " AND NOT EXISTS (SELECT 1 FROM jobs AS r WHERE r.key = j.key AND r.status = 'running')"
            " ORDER BY run_after, id LIMIT 1"
        )
        # Idle workers poll: look first without taking SQLite's write lock.
        if await self.fetch_one(runnable, (now, *kinds)) is None:
            return None
        # One statement, so choosing and taking the job is atomic across tasks and processes.
        row = await self.write_one(
            "UPDATE jobs SET status = 'running', attempts = attempts + 1, locked_by = ?, lease_until = ?,"
            f" updated_at = ? WHERE id = ({runnable}) RETURNING *",
            (worker, now + lease_seconds, now, now, *kinds),
        )
        return None if row is None else self._job(row)

    async def renew_lease(self, job_id: int, worker: str, lease_seconds: float) -> bool:
        renewed = await self.write(
            "UPDATE jobs SET lease_until = ? WHERE id = ? AND status = 'running' AND locked_by = ? RETURNING id",
            (time.time() + lease_seconds, job_id, worker),
        )
        return bool(renewed)

    async def _set_job(self, job_id: int, sql_set: str, params: Sequence[Any]) -> None:
        await self.write(
            f"UPDATE jobs SET {sql_set}, updated_at = ? WHERE id = ?", (*params, time.time(), job_id)
        )

    async def finish_job(self, job_id: int) -> None:
        await self._set_job(job_id, "status = 'done', locked_by = '', lease_until = 0", ())

    async def retry_job(self, job_id: int, error: str, run_after: datetime) -> None:
        await self._set_job(
            job_id,
            "status = 'queued', last_error = ?, run_after = ?, locked_by = '', lease_until = 0",
            (error, run_after.timestamp()),
        )

    async def fail_job(self, job_id: int, error: str) -> None:
        await self._set_job(job_id, "status = 'failed', last_error = ?, locked_by = '', lease_until = 0", (error,))

    async def release_job(self, job_id: int) -> None:
        await self._set_job(
            job_id, "status = 'queued', attempts = max(attempts - 1, 0), locked_by = '', lease_until = 0", ()
        )

    async def recover_jobs(self, is_worker_dead: Callable[[str], bool]) -> list[Job]:
        now = time.time()
        recovered: list[Job] = []
        async with self.transaction() as db:
            rows = await db.execute_fetchall("SELECT * FROM jobs WHERE status = 'running'")
            for row in rows:
                if float(row["lease_until"]) < now or is_worker_dead(str(row["locked_by"])):
                    await db.execute(
                        "UPDATE jobs SET status = 'queued', locked_by = '', lease_until = 0, updated_at = ?,"
                        " last_error = ? WHERE id = ?",
                        (now, "interrupted: the worker running it stopped", row["id"]),
                    )
                    recovered.append(self._job(row))
        return recovered

    async def get_job(self, job_id: int) -> Job | None:
        row = await self.fetch_one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else self._job(row)

    async def active_job(self, key: str) -> Job | None:
        row = await self.fetch_one(
            "SELECT * FROM jobs WHERE key = ? AND status IN ('queued', 'running') ORDER BY id LIMIT 1", (key,)
        )
        return None if row is None else self._job(row)

    async def list_jobs(self, status: JobStatus | None = None, limit: int = 100) -> list[Job]:
        if status is None:
            rows = await self.fetch_all("SELECT * FROM jobs ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = await self.fetch_all("SELECT * FROM jobs WHERE status = ? ORDER BY id DESC LIMIT ?", (status, limit))
        return [self._job(r) for r in rows]

    async def count_jobs(self, statuses: Sequence[JobStatus]) -> int:
        marks = ",".join("?" for _ in statuses)
        row = await self.fetch_one(f"SELECT count(*) FROM jobs WHERE status IN ({marks})", tuple(statuses))
        return int(row[0]) if row else 0

    # -- audit and metrics -----------------------------------------------------------------------

    def _buffer_audit(self, sql: str, params: tuple[Any, ...]) -> None:
        self._audit.append((sql, params))
        if len(self._audit) >= AUDIT_FLUSH_ROWS:
            self._schedule_flush(0.0)
        else:
            self._schedule_flush(AUDIT_FLUSH_SECONDS)

    def _schedule_flush(self, delay: float) -> None:
        if self._audit_timer is not None and not self._audit_timer.done():
            if delay > 0:
                return
            self._audit_timer.cancel()
        self._audit_timer = asyncio.create_task(self._flush_after(delay), name="storage-audit-flush")

    async def _flush_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self.flush_audit()
        except Exception:
            log.exception("could not write %d buffered audit rows; will retry", len(self._audit))

    async def flush_audit(self) -> None:
        """Write buffered audit rows (LLM calls, reply stats) now."""
        if not self._audit or self._db is None:
            return
        pending, self._audit = self._audit, []
        try:
            async with self.transaction() as db:
                for sql in dict.fromkeys(sql for sql, _ in pending):
                    await db.executemany(sql, [params for s, params in pending if s == sql])
        except sqlite3.IntegrityError:
            # Rows that can never be written (their message was deleted meanwhile): retrying won't help.
            log.error("dropped %d audit rows that no longer fit the database", len(pending))
        except BaseException:
            self._audit[:0] = pending
            raise

    async def record_llm_call(self, record: LLMCallRecord) -> None:
        self._buffer_audit(
            LLM_CALL_SQL,
            (
                record.purpose,
                record.model,
                record.input_tokens,
                record.output_tokens,
                record.estimated_input_tokens,
                record.duration_ms,
                record.error,
                time.time(),
            ),
        )

    async def list_llm_calls(self, limit: int = 100) -> list[dict[str, Any]]:
        await self.flush_audit()
        rows = await self.fetch_all("SELECT * FROM llm_calls ORDER BY id DESC LIMIT ?", (limit,))
        return [dict(r) for r in rows]

    async def record_reply_stats(self, stats: ReplyStats) -> None:
        self._buffer_audit(
            REPLY_STATS_SQL,
            (
                stats.channel_id,
                stats.message_id,
                stats.history_tokens,
                stats.history_budget,
                stats.window_messages,
                stats.trimmed_messages,
                int(stats.summary_used),
                stats.prompt_tokens,
                time.time(),
            ),
        )

    async def reply_metrics(self, channel_id: int | None = None) -> ReplyMetrics:
        await self.flush_audit()
        where, params = ("WHERE channel_id = ?", (channel_id,)) if channel_id is not None else ("", ())
        row = await self.fetch_one(
            "SELECT count(*) AS n,"
            " avg(CAST(history_tokens AS REAL) / max(history_budget, 1)) AS util,"
            " avg(trimmed_messages > 0) AS trim, avg(summary_used) AS hit"
            f" FROM reply_stats {where}",
            params,
        )
        srow = await self.fetch_one(
            "SELECT sum(status = 'ok') AS ok, sum(status = 'rejected') AS bad" f" FROM summaries {where}", params
        )
        replies = int(row["n"]) if row else 0
        written = int(srow["ok"] or 0) if srow else 0
        rejected = int(srow["bad"] or 0) if srow else 0
        return ReplyMetrics(
            replies=replies,
            token_utilisation=float(row["util"] or 0.0) if row else 0.0,
            trim_rate=float(row["trim"] or 0.0) if row else 0.0,
            summary_hit_rate=float(row["hit"] or 0.0) if row else 0.0,
            summary_generation_rate=(written / replies) if replies else 0.0,
            summaries_written=written,
            summaries_rejected=rejected,
        )

    def forget_cached(self, *, user_key: str, channel_ids: Sequence[int] = ()) -> None:
        """Drop cached rows of a deleted user and of channels whose summaries were deleted."""
        self._users.pop(user_key, None)
        for channel_id in channel_ids:
            self._summaries.pop(channel_id, None)

    async def get_setting(self, key: str) -> str | None:
        row = await self.fetch_one("SELECT value FROM settings WHERE key = ?", (key,))
        return None if row is None else str(row["value"])

    async def set_setting(self, key: str, value: str) -> None:
        await self.write(
            "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
            (key, value, time.time()),
        )


async def open_storage(url: str) -> SQLiteStorage:
    """Open the engine the URL names (``sqlite:///path``), without migrating."""
    if not url.startswith("sqlite:///"):
        raise StorageError(f"unsupported storage URL {url!r}: use sqlite:///path/to/bot.db")
    return await SQLiteStorage(sqlite_path(url)).open()


def sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///")).expanduser()
