"""Which database engine the current test runs on (see the ``engine`` fixture in conftest.py).

Test modules marked ``pytestmark = pytest.mark.both_engines`` run every test once on SQLite and once
on the session's real PostgreSQL; their helpers build configs with :func:`db_url_for`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bot.storage import Storage

ENGINES = ("sqlite", "postgres")
_current: dict[str, str] = {}


def use(url: str | None) -> None:
    """Set (or with None, clear) the database URL of the running test."""
    if url is None:
        _current.pop("url", None)
    else:
        _current["url"] = url


def db_url_for(tmp_path: Path, name: str = "bot.db") -> str:
    """The running test's database: its PostgreSQL database, or a SQLite file in ``tmp_path``."""
    return _current.get("url") or f"sqlite:///{tmp_path / name}"


async def settled_index_scans(storage: Storage, name: str | tuple[str, ...]) -> int:
    """:func:`index_scans` once the other backends (the migration's, a pooled connection's) have reported theirs:
    read until two reads a report's interval apart agree (an exact count taken before one of them had reported
    counted its scan among the test's own)."""
    count = await index_scans(storage, name)
    for _ in range(10):
        await asyncio.sleep(1.1)
        again = await index_scans(storage, name)
        if again == count:
            return count
        count = again
    return count


async def index_scans(storage: Storage, name: str | tuple[str, ...], above: int = -1) -> int:
    """PostgreSQL's count of scans of index ``name`` (of all of them, given several), waiting (up to 10 s) for
    more than ``above``: each backend reports its counts on its own, within a second or so."""
    count, names = 0, [name] if isinstance(name, str) else list(name)
    for _ in range(100):
        row = await storage.db.fetch_one(
            "SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes WHERE indexrelname = ANY(?)", (names,))
        count = int(row[0]) if row else 0
        if count > above:
            return count
        await asyncio.sleep(0.1)
    return count
