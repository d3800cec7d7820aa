"""What every database engine offers the repositories: queries, single writes, transactions, migrations.

Repositories (``bot.storage.core``, ``cortex``, ``memory``, ``fleet``) are written once against this
small interface in a portable SQL subset with ``?`` placeholders (the PostgreSQL engine numbers them);
where the engines differ (full text, vectors, the message counter, upserts of a scalar maximum) a
repository forks on :attr:`Database.dialect`. Rows support both ``row["column"]`` and ``row[0]``
(``sqlite3.Row`` and ``asyncpg.Record`` both do).

Times are UNIX seconds (floating point) in both engines; the repositories speak UTC ``datetime``. Times
that processes compare with each other's (job leases, periodic runs, locks, live processes, web sessions)
are read from :meth:`Database.now`: a shared database's clock, not each machine's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)

Row = Any  # sqlite3.Row or asyncpg.Record: both index by position and by column name
Dialect = Literal["sqlite", "postgres"]


class StorageError(Exception):
    """The database cannot be opened or used; the message says which one, why, and what to do."""


class ConnectionsBusy(StorageError):
    """Every connection of the pool was busy for as long as a statement waits for one (slow statements)."""


def refuse_foreign(where: str, tables: Sequence[str], fix: str) -> None:
    """Before anything is changed (the migrations table, an extension, WAL mode): a database that holds tables
    (``tables``, sorted) but no ``schema_version`` is another program's, and is left as it is."""
    if tables and "schema_version" not in tables:
        shown = ", ".join(tables[:5]) + (", …" if len(tables) > 5 else "")
        raise StorageError(f"{where} is not a cortex-bot database: it holds another program's tables ({shown}). "
                           f"It was left untouched; {fix}")


class StaleReference(StorageError):
    """A write referred to a row that no longer exists (e.g. a user another process just forgot while
    this one still had it cached); the caller drops its cached copy and tries again."""


def is_missing_reference(exc: BaseException) -> bool:
    """Whether a write failed on a foreign key (either engine's driver, or a repository that said so)."""
    name = type(exc).__name__
    return isinstance(exc, StaleReference) or name == "ForeignKeyViolationError" or (
        name == "IntegrityError" and "FOREIGN KEY" in str(exc).upper())


@contextmanager
def stale_if_missing(what: str) -> Iterator[None]:
    """A write inside whose foreign key points at a row gone meanwhile raises :class:`StaleReference` (``what``
    says which row), whichever engine's driver noticed."""
    try:
        yield
    except StaleReference:
        raise
    except Exception as exc:
        if is_missing_reference(exc):
            raise StaleReference(what) from None
        raise


class Tx(Protocol):
    """A transaction in progress: every statement runs inside it."""

    async def fetch_all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    async def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None: ...

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...


class WriteLock:
    """An asyncio lock with two lines: a waiter from the urgent line (the reply path's handle) is let
    in before every waiter from the other (background jobs' handle), each line first come first served.

    With a plain FIFO lock a reply's write queued behind every background write already waiting: 50
    cortex updates whose model calls return together put about as many writes ahead of it. Now it
    waits at most for the write in progress (and, rarely, one background write: after ``URGENT_RUN``
    urgent writes in a row while background ones wait, one of those goes, so a busy reply path can
    never hold back a job's lease renewal until the lease runs out)."""

    URGENT_RUN = 8

    def __init__(self) -> None:
        self._held = False
        self._lines: tuple[deque[asyncio.Future[None]], deque[asyncio.Future[None]]] = (deque(), deque())
        self._urgent_run = 0  # urgent hand-overs in a row while background waiters waited

    def line(self, urgent: bool) -> _LockLine:
        """An ``async with`` handle that queues in one of the two lines."""
        return _LockLine(self, urgent)

    async def acquire(self, urgent: bool) -> None:
        if not self._held and not any(self._lines):
            self._held = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lines[0 if urgent else 1].append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed the lock just as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        """Hand the lock to the next waiter (urgent line first, bounded; cancelled waiters are skipped)."""
        if not self._held:
            raise RuntimeError("WriteLock released while not held")
        urgent, background = self._lines
        for line in (background, urgent) if self._urgent_run >= self.URGENT_RUN else (urgent, background):
            while line:
                turn = line.popleft()
                if not turn.done():
                    waiting = any(not t.done() for t in background)
                    self._urgent_run = self._urgent_run + 1 if line is urgent and waiting else 0
                    turn.set_result(None)
                    return
        self._held = False
        self._urgent_run = 0


@dataclass(frozen=True, slots=True)
class _LockLine:
    lock: WriteLock
    urgent: bool

    async def __aenter__(self) -> None:
        await self.lock.acquire(self.urgent)

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()


CLOCK_REFRESH_SECONDS = 60.0


class ServerClock:
    """A database server's clock as this process sees it: this machine's clock plus an offset measured at
    most once a minute with one round trip (whose middle is taken as the moment the server read its clock,
    so the error is at most half the round trip). Processes on machines whose clocks disagree by minutes
    still agree on a lease's end: each reads the same server's time."""

    def __init__(self) -> None:
        self.offset = 0.0
        self._measured_at = -float("inf")  # time.monotonic() of the last measurement
        self._measuring = asyncio.Lock()

    async def now(self, read_server: Callable[[], Awaitable[float]]) -> float:
        if time.monotonic() - self._measured_at >= CLOCK_REFRESH_SECONDS:
            async with self._measuring:
                if time.monotonic() - self._measured_at >= CLOCK_REFRESH_SECONDS:
                    before = time.time()
                    server = await read_server()
                    after = time.time()
                    self.offset, self._measured_at = server - (before + after) / 2, time.monotonic()
                    if abs(self.offset) > 5.0:
                        log.warning("this machine's clock is %.1f s %s the database server's: the bot goes by the "
                                    "server's for leases and locks (keep the clocks in sync: NTP)",
                                    abs(self.offset), "behind" if self.offset > 0 else "ahead of")
        return time.time() + self.offset


@dataclass
class StorageCaches:
    """What one process remembers between calls; shared by the handles it opens on one database.

    ``write_lock`` serialises writes of those handles in the process itself (SQLite: two connections
    meeting its write lock would make one sleep in SQLite's busy handler); the first handle's writes
    (the reply path's) go before those of its siblings (background jobs)."""

    write_lock: WriteLock = field(default_factory=WriteLock)
    clock: ServerClock = field(default_factory=ServerClock)
    extra: dict[str, dict[Any, Any]] = field(default_factory=dict)  # caches of components on this storage

    def named(self, name: str) -> dict[Any, Any]:
        return self.extra.setdefault(name, {})


class Database(Protocol):
    """One engine's connection (SQLite) or pool (PostgreSQL)."""

    @property
    def dialect(self) -> Dialect: ...

    @property
    def url(self) -> str:
        """For messages: never holds a password."""

    @property
    def caches(self) -> StorageCaches: ...

    @property
    def shared_across_hosts(self) -> bool:
        """Whether processes of other machines may use it (then no pid checks)."""

    @property
    def url_settings(self) -> frozenset[str]:
        """The server settings the URL gives every connection (PostgreSQL: ``?hnsw.ef_search=200``): the
        operator's, which the bot's own choices leave alone."""

    async def now(self) -> float:
        """The time (UNIX seconds) every process on this database goes by: PostgreSQL's server clock (see
        :class:`ServerClock`), SQLite's machine clock (its file is on one machine)."""

    async def fetch_all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    async def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    async def fetch_all_set(self, sql: str, params: Sequence[Any], settings: Mapping[str, str]) -> list[Row]:
        """:meth:`fetch_all` with session ``settings`` in force (PostgreSQL; SQLite has none: ignored)."""

    async def write(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """One writing statement (RETURNING tells what it did), atomic on its own."""

    async def write_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    async def maintain(self, sql: str, *, lock: str, when: str, params: Sequence[Any] = ()) -> bool:
        """A maintenance statement that may run for minutes (an index built over a big table): on its own,
        outside any transaction, without the engine's statement timeout; only while this process holds the
        lock named ``lock`` across the fleet (PostgreSQL: an advisory lock, not waited for), and only if the
        query ``when`` (with ``params``) then answers true. Whether it ran."""

    def transaction(self) -> AbstractAsyncContextManager[Tx]:
        """Statements that must see and change the data atomically; rolled back on any error."""

    async def applied_migrations(self) -> list[int]: ...

    async def migrate(self, migrations: Sequence[Migration]) -> list[int]:
        """Apply the pending ``migrations`` (each in a transaction, each once even when several
        processes start together); return the versions applied."""

    async def sibling(self) -> Database:
        """A second handle on the same database sharing this one's caches (background jobs use it)."""

    async def scrub(self, text_indexes: Sequence[str]) -> bool:
        """Make data deleted a moment ago unreadable in the database's files where the engine can (SQLite:
        full-text indexes merged, the WAL checkpointed and truncated; deleted pages are zeroed as they
        are freed). PostgreSQL keeps dead rows until VACUUM reuses their space: nothing to do here.
        Whether it is done (False: readers kept the WAL busy, and the next scrub tries again)."""

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Migration:
    """A numbered schema change; ``sqlite`` and ``postgres`` hold each engine's statements (the same
    list serves both where the SQL is portable)."""

    version: int
    description: str
    sqlite: tuple[str, ...]
    postgres: tuple[str, ...] | None = None
    # SQLite only: tables rebuilt with AUTOINCREMENT after the statements (see ``bot.storage.sqlite``).
    sqlite_autoincrement: tuple[str, ...] = ()

    def statements(self, dialect: Dialect) -> tuple[str, ...]:
        if dialect == "postgres":
            return self.sqlite if self.postgres is None else self.postgres
        return self.sqlite


async def serialise(db: Database, tx: Tx, key: str) -> None:
    """Make transactions that call this with the same ``key`` run one after the other, so that a count
    checked in one still holds when it writes (a cap, a daily limit). SQLite's transactions already do
    (``BEGIN IMMEDIATE``); on PostgreSQL it takes an advisory lock held until the transaction ends."""
    if db.dialect == "postgres":
        await tx.execute("SELECT pg_advisory_xact_lock(hashtextextended(CAST(? AS TEXT), 0))", (key,))


def multi_row(sql: str, rows: Sequence[Sequence[Any]]) -> tuple[str, list[Any]]:
    """``INSERT … VALUES (?, …) [ON CONFLICT …]`` for one row as one statement inserting ``rows``, with their
    values."""
    head, rest = sql.split(" VALUES ", 1)
    one, tail = rest[:rest.index(")") + 1], rest[rest.index(")") + 1:]
    return f"{head} VALUES {', '.join(one for _ in rows)}{tail}", [value for row in rows for value in row]


def power_chunks(rows: Sequence[Any], largest: int) -> list[Sequence[Any]]:
    """``rows`` in chunks whose sizes are powers of two, at most ``largest`` (a power of two): multi-row
    statements of a few sizes only, so the engines' statement caches (asyncpg keeps 100 per connection,
    Python's sqlite3 128) hold them without pushing out the reply path's own."""
    chunks, start = [], 0
    while start < len(rows):
        size = min(largest, 1 << ((len(rows) - start).bit_length() - 1))
        chunks.append(rows[start:start + size])
        start += size
    return chunks


def is_conflict(exc: BaseException) -> bool:
    """Whether a write failed on a unique constraint (either engine's driver)."""
    return type(exc).__name__ in ("IntegrityError", "UniqueViolationError") and (
        "UNIQUE" in str(exc).upper() or type(exc).__name__ == "UniqueViolationError")


MigrationStep = Callable[[Tx, Migration], Awaitable[None]]


async def apply_migrations(
    db: Database, migrations: Sequence[Migration], *, lock: str = "", after: MigrationStep | None = None
) -> list[int]:
    """Apply each pending migration in a transaction of its own (after ``lock``, a statement that makes
    other processes wait: they then find the version applied and skip it); return the versions applied.
    ``after`` runs in the same transaction once the statements have (an engine's own steps and checks)."""
    applied: list[int] = []
    for migration in migrations:
        async with db.transaction() as tx:
            if lock:
                await tx.execute(lock)
            if await tx.fetch_one("SELECT 1 FROM schema_version WHERE version = ?", (migration.version,)):
                continue
            for statement in migration.statements(db.dialect):
                await tx.execute(statement)
            if after is not None:
                await after(tx, migration)
            await tx.execute(
                "INSERT INTO schema_version (version, description, applied_at) VALUES (?, ?, ?)",
                (migration.version, migration.description, time.time()),
            )
        log.info("applied migration %d: %s", migration.version, migration.description)
        applied.append(migration.version)
    return applied
