"""The PostgreSQL engine (asyncpg + pgvector): for bots that outgrow one machine or one process.

Why asyncpg: it is the fastest asyncio driver (binary protocol, prepared statements cached per
connection, no libpq), has a built-in pool, and pgvector ships an adapter for it; mautrix-python's
database layer, the model for this one, runs on it too. Statements are written with ``?`` like the
SQLite ones and numbered here (``$1``, ``$2``, …) once per distinct statement.

Every handle is a pool: statements outside a transaction take any free connection, a transaction
holds one. Migrations take a transaction-level advisory lock, so processes starting together apply
each migration exactly once. The password never sits in the config file: it comes from
``[storage] password_env`` or the standard ``PGPASSWORD`` (or a URL held by ``[storage] url_env``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from bot.config import hide_secrets_of, hide_url_password
from bot.storage.engine import (
    ConnectionsBusy,
    Migration,
    Row,
    StorageCaches,
    StorageError,
    apply_migrations,
    refuse_foreign,
)
from bot.storage.memory import EF_SEARCH

if TYPE_CHECKING:
    import asyncpg

log = logging.getLogger(__name__)

MIGRATION_LOCK = 0x636F7274  # "cort": the advisory lock every process takes to migrate
POOL_MIN = 1
POOL_MAX = 10
CONNECT_TIMEOUT = 10.0
# Seconds a statement waits for one of the pool's connections: every one held by slow statements (an index built,
# a query of minutes), every database call of the process waited for them silently, replies and the heartbeats
# and lock renewals that keep the process in the fleet too.
ACQUIRE_TIMEOUT = 15.0
COMMAND_TIMEOUT = 300.0  # seconds a statement may take (asyncpg cancels it then)
MAINTENANCE_TIMEOUT = 24 * 3600.0  # an index build over millions of rows: hours at worst, never for ever
VECTOR_SETTINGS = {"hnsw.iterative_scan": "relaxed_order", "hnsw.ef_search": str(EF_SEARCH)}
_PLACEHOLDER = re.compile(r"'(?:[^']|'')*'|\?")


@lru_cache(maxsize=4096)
def numbered(sql: str) -> str:
    """``?`` placeholders as ``$1``, ``$2``, … (question marks inside string literals stay)."""
    counter = 0

    def number(match: re.Match[str]) -> str:
        nonlocal counter
        if match.group(0) != "?":
            return match.group(0)
        counter += 1
        return f"${counter}"

    return _PLACEHOLDER.sub(number, sql)


def redacted(url: str) -> str:
    """The URL without its password, for messages and logs (everything up to the URL's last "@" hidden: a
    password written with an unencoded "/" or "@" would otherwise show in part as the host and path)."""
    return hide_url_password(url)


def _query_names(url: str) -> frozenset[str]:
    """The names of the URL's query parameters (asyncpg sends those it does not know as settings)."""
    try:
        return frozenset(key for key, _ in parse_qsl(urlsplit(url).query))
    except ValueError:
        return frozenset()


def _args(params: Sequence[Any]) -> Sequence[Any]:
    """``params`` as PostgreSQL takes them: its text has no NUL character, which SQLite stores and a
    platform or an older row may carry ("hi\\x00there" would fail the whole statement), so NULs go."""
    if not any(isinstance(p, str) and "\x00" in p for p in params):
        return params
    return [p.replace("\x00", "") if isinstance(p, str) else p for p in params]


class _PgTx:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def fetch_all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(await self._conn.fetch(numbered(sql), *_args(params)))

    async def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        return await self._conn.fetchrow(numbered(sql), *_args(params))

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        if params:
            await self._conn.execute(numbered(sql), *_args(params))
        else:
            await self._conn.execute(sql)

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        await self._conn.executemany(numbered(sql), [_args(row) for row in rows])


def _import_asyncpg() -> Any:
    """The driver, with pgvector's adapter for it (both come with the ``postgres`` extra: either missing is one
    line saying how to install them)."""
    try:
        import asyncpg
        import pgvector.asyncpg  # noqa: F401  (registered on each connection)
    except ImportError as exc:
        what = "pgvector's adapter for the PostgreSQL driver" if "pgvector" in str(exc) else "the PostgreSQL driver"
        raise StorageError(
            f"{what} is not installed: pip install 'cortex-bot[postgres]' (or scripts/install.sh postgres)"
        ) from None
    return asyncpg


def _connect_error(exc: BaseException, url: str) -> StorageError:
    asyncpg = _import_asyncpg()
    where = redacted(url)
    if isinstance(exc, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError):
        return StorageError(
            f"PostgreSQL refused the login for {where}: check the user and the password (the bot's database: in "
            "the variable named by [storage] password_env, or PGPASSWORD; copy-data's target: in the variable "
            "named by --to-password-env, or PGPASSWORD)")
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        name = unquote(urlsplit(url).path.strip("/")) or "NAME"
        return StorageError(f"the database of {where} does not exist: create it (createdb {shlex.quote(name)}) or "
                            "fix the URL")
    said = hide_secrets_of(url, str(exc))  # (a parser's error may quote a piece of the password)
    if isinstance(exc, OSError | asyncio.TimeoutError):
        return StorageError(
            f"cannot reach PostgreSQL at {where} ({type(exc).__name__}: {said}): is the server running and "
            "listening there?")
    if isinstance(exc, ValueError):
        return StorageError(f"cannot read the PostgreSQL URL {where} ({type(exc).__name__}: {said}): a password "
                            "holding / @ : ? # or spaces must be percent-encoded (%2F %40 %3A %3F %23 %20)")
    return StorageError(f"cannot open the PostgreSQL database {where}: {type(exc).__name__}: {said}")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset of a connection given back. asyncpg's own (``RESET ALL``, ``CLOSE ALL``,
    ``UNLISTEN *``, advisory locks released) is a round trip on every release, so about one per statement:
    a reply's dozen cost more than a millisecond, most of what set PostgreSQL apart from SQLite on the
    reply path. The bot leaves nothing in a session to reset: the one setting it changes for a session
    (:meth:`PostgresDatabase.fetch_all_set`, the k-NN's ``hnsw.ef_search``) is tracked per connection and
    set again by whatever needs another value; it listens to nothing, and takes advisory locks for a
    transaction, but for :meth:`PostgresDatabase.maintain`, which releases its own. An open transaction is
    still rolled back (asyncpg does that before calling this)."""


class PostgresDatabase:
    dialect: Literal["postgres"] = "postgres"
    shared_across_hosts = True

    def __init__(self, url: str, *, password: str | None = None, caches: StorageCaches | None = None,
                 min_size: int = POOL_MIN, max_size: int = POOL_MAX) -> None:
        self._dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
        self.url = redacted(url)
        self._password = password
        self.caches = caches or StorageCaches()
        self._min_size = min_size
        self._max_size = max_size
        self._pool: asyncpg.Pool | None = None
        self._owner = True
        # Each connection's own settings from its start: filtered k-NN over an HNSW index goes on scanning
        # until enough rows pass the filter, and looks at enough neighbours for the candidates a search asks
        # for. A setting the URL gives (``?hnsw.ef_search=400``) is the operator's: asyncpg would let these
        # override it.
        self.url_settings = _query_names(self._dsn)
        self._startup = {k: v for k, v in VECTOR_SETTINGS.items() if k not in self.url_settings}
        self._session: dict[int, dict[str, str]] = {}  # backend pid -> what fetch_all_set set there (siblings share)

    async def open(self) -> PostgresDatabase:
        asyncpg = _import_asyncpg()
        try:
            await self._ensure_vector(asyncpg)
            self._pool = await asyncpg.create_pool(
                self._dsn, password=self._password, min_size=min(self._min_size, self._max_size),
                max_size=self._max_size, timeout=CONNECT_TIMEOUT, init=self._new_connection,
                command_timeout=COMMAND_TIMEOUT, reset=_keep_session,
                server_settings=self._startup,
            )
        except StorageError:
            raise
        except Exception as exc:
            raise _connect_error(exc, self._dsn) from None
        return self

    async def _ensure_vector(self, asyncpg: Any) -> None:
        """pgvector must exist before the pool's connections register its type (in a database that is not
        another program's: that one is refused first, and left as it is)."""
        conn = await asyncpg.connect(self._dsn, password=self._password, timeout=CONNECT_TIMEOUT)
        try:
            await self._refuse_foreign(conn)
            if await conn.fetchval("SELECT 1 FROM pg_extension WHERE extname = 'vector'"):
                return
            if not await conn.fetchval("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'"):
                raise StorageError(
                    f"the PostgreSQL server of {self.url} has no pgvector extension: install pgvector on the server "
                    "(e.g. the postgresql-NN-pgvector package, or the pgvector/pgvector Docker image)")
            try:
                await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            except asyncpg.InsufficientPrivilegeError:
                raise StorageError(
                    f"the extension 'vector' is not enabled in {self.url} and this user may not enable it: "
                    "run CREATE EXTENSION vector; as a superuser in that database, then run it again") from None
            except asyncpg.UniqueViolationError:
                pass  # another process created it at the same moment
        finally:
            await conn.close()

    async def _refuse_foreign(self, conn: asyncpg.Connection) -> None:
        rows = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY tablename")
        refuse_foreign(self.url, [str(r[0]) for r in rows], "name a new, empty database")

    async def _new_connection(self, conn: asyncpg.Connection) -> None:
        from pgvector.asyncpg import register_vector

        self._session.pop(conn.get_server_pid(), None)  # a new session (its backend may reuse an old one's pid)
        await register_vector(conn)

    async def fetch_all_set(self, sql: str, params: Sequence[Any], settings: Mapping[str, str]) -> list[Row]:
        """:meth:`fetch_all` with ``settings`` in force on its connection: each one the connection does not have
        yet is set for its session first (a pooled connection keeps it: once per connection and value, not a
        transaction per statement). Missing values are the pool's startup ones."""
        async with self.connection() as conn:
            has = self._session.setdefault(conn.get_server_pid(), {})
            for name, value in settings.items():
                if has.get(name, self._startup.get(name)) != value:
                    await conn.execute("SELECT set_config($1, $2, false)", name, value)
                    has[name] = value
            return list(await conn.fetch(numbered(sql), *_args(params)))

    async def scrub(self, text_indexes: Sequence[str]) -> bool:
        return True  # rows are gone; VACUUM (autovacuum) reuses their space later (see the README)

    async def sibling(self) -> PostgresDatabase:
        """The same pool (a pool already gives background work connections of its own)."""
        twin = PostgresDatabase.__new__(PostgresDatabase)
        twin.__dict__.update(self.__dict__)
        twin._owner = False
        return twin

    async def close(self) -> None:
        if self._pool is not None and self._owner:
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), timeout=10)
            except TimeoutError:
                pool.terminate()
        self._pool = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise StorageError("storage is not open")
        return self._pool

    @property
    def in_transaction(self) -> bool:
        """Whether a connection is checked out of the pool (inside a transaction or a statement)."""
        return bool(self.pool.get_idle_size() < self.pool.get_size())

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """One of the pool's connections, waited for at most ``ACQUIRE_TIMEOUT``: then :class:`ConnectionsBusy`
        (the reply path says the database cannot be used right now; background work retries)."""
        pool = self.pool
        try:
            conn = await pool.acquire(timeout=ACQUIRE_TIMEOUT)
        except TimeoutError:
            if pool.get_size() < self._max_size or pool.get_idle_size():  # (a new connection's connect timed out:
                raise  # the server cannot be reached, which bot.storage.unavailable says as such)
            raise ConnectionsBusy(f"every connection to {self.url} was busy for {ACQUIRE_TIMEOUT:g} s "
                                  f"(slow statements hold the pool of {self._max_size})") from None
        try:
            yield conn
        finally:
            await pool.release(conn)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[_PgTx]:
        async with self.connection() as conn, conn.transaction():
            yield _PgTx(conn)

    async def now(self) -> float:
        return await self.caches.clock.now(self._server_time)

    async def _server_time(self) -> float:
        async with self.connection() as conn:
            return float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8"))

    async def fetch_all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        async with self.connection() as conn:
            return list(await conn.fetch(numbered(sql), *_args(params)))

    async def fetch_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        async with self.connection() as conn:
            return await conn.fetchrow(numbered(sql), *_args(params))

    async def write(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return await self.fetch_all(sql, params)

    async def write_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        return await self.fetch_one(sql, params)

    async def maintain(self, sql: str, *, lock: str, when: str, params: Sequence[Any] = ()) -> bool:
        key = f"cortex-bot maintenance: {lock}"
        async with self.connection() as conn:  # a session lock: the pool's reset on release leaves it held
            try:
                locked = await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", key)
            except BaseException:  # cancelled: the server may have granted it all the same, and a pooled
                conn.terminate()  # session keeping it would stop every process's builds; a new one replaces it
                raise
            if not locked:
                return False
            try:
                if not await conn.fetchval(numbered(when), *_args(params)):
                    return False
                await conn.execute(sql, timeout=MAINTENANCE_TIMEOUT)
                return True
            finally:
                try:
                    await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", key)
                except BaseException:  # cancelled, or the connection broke: a new one replaces it, lockless
                    conn.terminate()
                    raise

    # -- migrations ------------------------------------------------------------------------------

    async def applied_migrations(self) -> list[int]:
        # Only read when the table is there: a read-only database (a standby, a role that may only read) answers
        # `status` and `doctor`; only a new one gets the table made.
        found = await self.fetch_one("SELECT to_regclass('schema_version') IS NOT NULL")
        if found is None or not found[0]:
            await self._schema_table()
        return [int(r[0]) for r in await self.fetch_all("SELECT version FROM schema_version ORDER BY 1")]

    async def _schema_table(self) -> None:
        async with self.transaction() as tx:
            await tx.execute(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
            await tx.execute(
                "CREATE TABLE IF NOT EXISTS schema_version ("
                " version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
            )

    async def migrate(self, migrations: Sequence[Migration]) -> list[int]:
        await self._schema_table()
        # Every process waits at the lock for the one migrating; then it finds the version applied.
        return await apply_migrations(self, migrations, lock=f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
