"""The SQLite engine (aiosqlite): the embedded default, zero setup, one machine.

One connection per handle in autocommit mode (WAL, foreign keys, busy timeout). Single statements
are atomic on their own; anything that must be read-then-written atomically runs inside
``BEGIN IMMEDIATE`` under an asyncio lock, so in-process tasks never interleave in one transaction
and other processes wait on SQLite's write lock (bounded by ``busy_timeout``). WAL checkpoints
(which fsync) run every ``CHECKPOINT_SECONDS`` on a connection of their own instead of inside
whichever reply's write happens to cross SQLite's page threshold.

Every call is a round trip to aiosqlite's thread: the helpers below are one each
(``execute_fetchall``), where a cursor opened, fetched and closed would be three.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import aiosqlite

from bot.privatefs import private_dir, private_file
from bot.storage.engine import Migration, Row, StorageCaches, StorageError, Tx, apply_migrations, refuse_foreign

log = logging.getLogger(__name__)

SCRUB_ATTEMPTS = 20
BUSY_TIMEOUT_MS = 10_000
OPEN_PATIENCE_SECONDS = 30.0  # how long opening keeps trying while another process holds the file
OPEN_RETRY_SECONDS = 0.1
CHECKPOINT_SECONDS = 5.0  # WAL checkpoints run this often on a connection of their own ...
WAL_AUTOCHECKPOINT_PAGES = 20_000  # ... so SQLite's own (inline, fsyncing) one is only a backstop


def _can_open(path: Path) -> None:
    """Open and close ``path`` with plain :mod:`sqlite3` (creating it if missing); raises its error."""
    sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000).close()


class _SQLiteTx:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def fetch_all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(await self._db.execute_fetchall(sql, params))

    async def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        return next(iter(await self._db.execute_fetchall(sql, params)), None)

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        await self._db.execute(sql, params)

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        await self._db.executemany(sql, rows)


class SQLiteDatabase:
    dialect: Literal["sqlite"] = "sqlite"
    shared_across_hosts = False
    url_settings: frozenset[str] = frozenset()

    def __init__(self, path: str | Path, *, caches: StorageCaches | None = None, checkpoints: bool = True,
                 urgent: bool = True) -> None:
        given = Path(path)
        # Every message names the file itself: sqlite:///bot.db is relative to the folder the bot started in.
        self.path = given if str(given) == ":memory:" else given.absolute()
        self._relative = not given.is_absolute() and str(given) != ":memory:"
        self.url = f"sqlite:///{self.path}"
        self.caches = caches or StorageCaches()
        # A sibling (background jobs) is not urgent: the reply path's writes go before its own.
        self._tx_lock = self.caches.write_lock.line(urgent)
        self._checkpoints = checkpoints
        self._db: aiosqlite.Connection | None = None
        self._checkpointer: asyncio.Task[None] | None = None
        self._checkpoint_db: aiosqlite.Connection | None = None

    async def open(self) -> SQLiteDatabase:
        if self.path != Path(":memory:"):
            if self.path.is_dir():
                raise StorageError(f"the database path {self.path} is a folder: name a file, e.g. {self.path}/bot.db")
            try:
                private_dir(self.path.parent)  # a new folder and file are the owner's alone: people's words
            except OSError as exc:
                raise StorageError(f"cannot create the database folder {self.path.parent}: {exc}") from None
            if self._relative and not self.path.exists():
                log.warning("the database path in the URL is relative: a new database is created at %s (under "
                            "the folder the bot was started in); an absolute path takes four slashes: sqlite:////%s",
                            self.path, str(self.path).lstrip("/"))
            try:
                private_file(self.path)
            except OSError as exc:
                raise StorageError(f"cannot create the database {self.path}: {exc.strerror or exc}") from None
        self._db = await self._connect_patiently()
        if self._checkpoints and self.path != Path(":memory:"):
            # Connected here, not inside the task: a task cancelled while aiosqlite was still connecting
            # would leave a connection (and its thread) that nobody closes.
            self._checkpoint_db = await aiosqlite.connect(self.path, isolation_level=None)
            self._checkpointer = asyncio.create_task(self._checkpoint_loop(self._checkpoint_db),
                                                     name="storage-wal-checkpoint")
        return self

    async def _connect_patiently(self) -> aiosqlite.Connection:
        """Connect, trying again for ``OPEN_PATIENCE_SECONDS`` while another process holds the file (opening or
        migrating it at this moment: SQLite can answer "locked" at once, without waiting on the busy timeout),
        saying so once: a start that waits in silence looks hung."""
        patience, said = time.monotonic() + OPEN_PATIENCE_SECONDS, False
        holder = ("another process holds it: a bot process starting or migrating, or a program such as the sqlite3 "
                  "shell with a transaction open")
        while True:
            try:
                return await self._connect()
            except sqlite3.OperationalError as exc:
                if not _busy(exc):
                    raise StorageError(f"cannot open the database {self.path}: {exc}") from None
                if time.monotonic() >= patience:
                    raise StorageError(f"cannot open the database {self.path}: {exc} ({holder}; waited "
                                       f"{OPEN_PATIENCE_SECONDS:g} s)") from None
                if not said:
                    log.warning("the database %s is busy (%s); trying again for up to %g s", self.path, holder,
                                OPEN_PATIENCE_SECONDS)
                    said = True
                await asyncio.sleep(OPEN_RETRY_SECONDS)
            except sqlite3.Error as exc:
                raise StorageError(f"cannot open the database {self.path}: {exc}") from None

    async def _connect(self) -> aiosqlite.Connection:
        # A file SQLite cannot open fails here (opening takes well under a millisecond, and happens at start
        # only): aiosqlite's own worker thread, failing, would still be answering into the event loop after a
        # CLI command's loop closed (a traceback), and a worker thread here would outlive the open.
        _can_open(self.path)
        db = await aiosqlite.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            db.row_factory = sqlite3.Row
            # SQL's lower() folds ASCII letters only: a search for "Äpfel" needs Unicode's case folding.
            await db.create_function("cortex_fold", 1, _fold, deterministic=True)
            await _refuse_foreign(db, self.path)
            # secure_delete: freed pages are zeroed, so deleted words (forget-me) do not linger in the file.
            for pragma in ("journal_mode=WAL", "foreign_keys=ON", "secure_delete=ON",
                           f"busy_timeout={BUSY_TIMEOUT_MS}", "synchronous=NORMAL", "cache_size=-16000",
                           f"wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}"):
                await db.execute(f"PRAGMA {pragma}")
            await db.execute(
                "CREATE TABLE IF NOT EXISTS schema_version ("
                " version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
        except BaseException:
            await db.close()
            raise
        return db

    async def sibling(self) -> SQLiteDatabase:
        """A second connection to the same database sharing this one's caches: background jobs use it,
        so their queries never wait in line with the reply path's on aiosqlite's thread, and its writes
        let the reply path's go first."""
        return await SQLiteDatabase(self.path, caches=self.caches, checkpoints=False, urgent=False).open()

    @staticmethod
    async def _checkpoint_loop(db: aiosqlite.Connection) -> None:
        """Checkpoint the WAL from a connection (and thread) of its own; PASSIVE never blocks writers."""
        await db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        while True:
            await asyncio.sleep(CHECKPOINT_SECONDS)
            try:
                await db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error as exc:
                log.warning("WAL checkpoint failed (%s); SQLite's own checkpoint is the backstop", exc)

    async def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.cancel()
            await asyncio.gather(self._checkpointer, return_exceptions=True)
            self._checkpointer = None
        if self._checkpoint_db is not None:
            checkpoint_db, self._checkpoint_db = self._checkpoint_db, None
            await checkpoint_db.close()  # waits for a statement still running on its thread
        if self._db is not None:
            db, self._db = self._db, None
            await db.close()

    @property
    def connection(self) -> aiosqlite.Connection:
        if self._db is None:
            raise StorageError("storage is not open")
        return self._db

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[_SQLiteTx]:
        db = self.connection
        async with self._tx_lock:
            begin = asyncio.ensure_future(db.execute("BEGIN IMMEDIATE"))
            try:
                await asyncio.shield(begin)
            except asyncio.CancelledError:
                # The BEGIN still runs on aiosqlite's thread: wait for it and undo it, or the connection
                # would stay inside a transaction nobody ends.
                with contextlib.suppress(Exception):
                    await begin
                    await db.execute("ROLLBACK")
                raise
            try:
                yield _SQLiteTx(db)
            except BaseException:
                await db.execute("ROLLBACK")
                raise
            else:
                await db.execute("COMMIT")

    async def now(self) -> float:
        return time.time()

    async def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        return next(iter(await self.connection.execute_fetchall(sql, params)), None)

    async def scrub(self, text_indexes: Sequence[str]) -> bool:
        """Merge each FTS5 index (deleted rows leave their words in old segments until a merge), then
        checkpoint the WAL into the file and truncate it (older page images of deleted rows live there)."""
        async with self._tx_lock:
            for table in text_indexes:
                await self.connection.execute(f"INSERT INTO {table} ({table}) VALUES ('optimize')")
            for _ in range(SCRUB_ATTEMPTS):
                busy, _, _ = next(iter(await self.connection.execute_fetchall("PRAGMA wal_checkpoint(TRUNCATE)")))
                if not busy:
                    return True
                await asyncio.sleep(0.05)
        log.warning("the WAL could not be truncated after deleting data (readers kept it busy); the next "
                    "checkpoint will")
        return False

    async def fetch_all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(await self.connection.execute_fetchall(sql, params))

    async def fetch_all_set(self, sql: str, params: Sequence[Any], settings: Mapping[str, str]) -> list[Row]:
        return await self.fetch_all(sql, params)

    async def write_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        return next(iter(await self.write(sql, params)), None)

    async def maintain(self, sql: str, *, lock: str, when: str, params: Sequence[Any] = ()) -> bool:
        row = await self.fetch_one(when, params)  # one process writes this file: no lock is needed
        if row is None or not row[0]:
            return False
        await self.write(sql)
        return True

    async def write(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """One writing statement (use RETURNING to learn what it did), never inside another task's
        open transaction."""
        async with self._tx_lock:
            return list(await self.connection.execute_fetchall(sql, params))

    # -- migrations ------------------------------------------------------------------------------

    async def applied_migrations(self) -> list[int]:
        return [int(r["version"]) for r in await self.fetch_all("SELECT version FROM schema_version ORDER BY 1")]

    async def migrate(self, migrations: Sequence[Migration]) -> list[int]:
        # BEGIN IMMEDIATE takes SQLite's write lock: another process migrating at once waits, then skips.
        # Rebuilding a table needs foreign keys off (they are switched per connection, outside a
        # transaction); every migration then checks them itself before it commits.
        db = self.connection
        await db.execute("PRAGMA foreign_keys=OFF")
        try:
            return await apply_migrations(self, migrations, after=_rebuild_and_check)
        finally:
            await db.execute("PRAGMA foreign_keys=ON")

    @property
    def in_transaction(self) -> bool:
        return bool(self.connection.in_transaction)


def _fold(value: object) -> object:
    return value.casefold() if isinstance(value, str) else value


def _busy(exc: sqlite3.OperationalError) -> bool:
    return getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or any(
        word in str(exc) for word in ("locked", "busy"))


async def _refuse_foreign(db: aiosqlite.Connection, path: Path) -> None:
    rows = await db.execute_fetchall("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
    refuse_foreign(str(path), [str(r[0]) for r in rows], "name a new file ([storage] url, or copy-data's --to)")


async def _rebuild_and_check(tx: Tx, migration: Migration) -> None:
    for table in migration.sqlite_autoincrement:
        await rebuild_with_autoincrement(tx, table)
    broken = await tx.fetch_all("PRAGMA foreign_key_check")
    if broken:
        raise StorageError(f"migration {migration.version} would leave {len(broken)} broken reference(s), "
                           f"first in table {broken[0][0]}; nothing was changed")


_ID_COLUMN = re.compile(r"\bid INTEGER PRIMARY KEY\b(?! AUTOINCREMENT)")


async def rebuild_with_autoincrement(tx: Tx, table: str) -> None:
    """Make ``table``'s ids never come back: without AUTOINCREMENT, SQLite gives a new row the largest
    id + 1, so deleting the newest user (forget-me) would hand their id to the next new user while
    another process still has it cached. The table is copied into one declared with AUTOINCREMENT
    (SQLite's documented rebuild: same rows and ids, its indexes and triggers made again, the id
    counter started at the largest id); foreign keys must be off, and are checked by the caller."""
    row = await tx.fetch_one("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
    if row is None:
        raise StorageError(f"cannot rebuild table {table}: it does not exist")
    create, count = _ID_COLUMN.subn("id INTEGER PRIMARY KEY AUTOINCREMENT", str(row[0]), count=1)
    if not count:
        return  # already rebuilt
    create = re.sub(rf'^CREATE TABLE "?{table}"?', f'CREATE TABLE "{table}__rebuild"', create, count=1)
    others = await tx.fetch_all(
        "SELECT sql FROM sqlite_master WHERE tbl_name = ? AND type IN ('index', 'trigger') AND sql IS NOT NULL"
        " ORDER BY type, name", (table,))
    columns = ", ".join(f'"{r[1]}"' for r in await tx.fetch_all(f'PRAGMA table_info("{table}")'))
    await tx.execute("PRAGMA legacy_alter_table = ON")  # the rename must not rewrite other tables' triggers
    try:
        await tx.execute(create)
        await tx.execute(f'INSERT INTO "{table}__rebuild" ({columns}) SELECT {columns} FROM "{table}"')
        await tx.execute(f'DROP TABLE "{table}"')
        await tx.execute(f'ALTER TABLE "{table}__rebuild" RENAME TO "{table}"')
    finally:
        await tx.execute("PRAGMA legacy_alter_table = OFF")
    for other in others:
        await tx.execute(str(other[0]))
    # The copy above already made the counter's row (under the new name, renamed with the table) unless
    # the table was empty: one row per table, or SQLite reads the first and leaves the other stale.
    await tx.execute("DELETE FROM sqlite_sequence WHERE name = ?", (table,))
    await tx.execute(
        f"INSERT INTO sqlite_sequence (name, seq) SELECT ?, coalesce(max(id), 0) FROM \"{table}\"", (table,))


def sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///")).expanduser()
