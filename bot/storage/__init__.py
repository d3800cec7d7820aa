"""Storage: one port (``Storage`` and its repositories), two engines (SQLite, PostgreSQL).

``open_storage(url)`` picks the engine by the URL's scheme: ``sqlite:///path/to/bot.db`` (the
embedded default) or ``postgresql://user@host:port/dbname`` (needs the ``postgres`` extra). Callers
outside this package write no SQL and import neither driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bot.storage.core import Storage
from bot.storage.engine import Migration, StorageCaches, StorageError
from bot.storage.migrations import MIGRATIONS

__all__ = ["MIGRATIONS", "Storage", "StorageError", "open_sqlite", "open_storage"]

SCHEMES = ("sqlite:///", "postgresql://", "postgres://")


async def open_storage(url: str, *, password: str | None = None, pool_size: int = 10,
                       migrations: Sequence[Migration] = MIGRATIONS) -> Storage:
    """Open the engine the URL names, without migrating; a clear :class:`StorageError` when it can't."""
    if "\x00" in url:
        raise StorageError("the storage URL contains a NUL character")
    if url.startswith("sqlite:///"):
        from bot.storage.sqlite import SQLiteDatabase, sqlite_path

        return Storage(await SQLiteDatabase(sqlite_path(url)).open(), migrations=migrations)
    if url.startswith(("postgresql://", "postgres://")):
        from bot.storage.postgres import PostgresDatabase

        return Storage(await PostgresDatabase(url, password=password, max_size=pool_size).open(), migrations=migrations)
    raise StorageError(
        f"unsupported storage URL {url.split('://')[0]}://…: use sqlite:////abs/path/bot.db (four slashes: "
        "absolute) or postgresql://user@host:5432/dbname"
    )


async def open_sqlite(path: str | Path, *, migrations: Sequence[Migration] = MIGRATIONS,
                      caches: StorageCaches | None = None) -> Storage:
    """A SQLite storage on ``path`` (tests and benchmarks)."""
    from bot.storage.sqlite import SQLiteDatabase

    return Storage(await SQLiteDatabase(path, caches=caches).open(), migrations=migrations)
