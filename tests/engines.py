"""Which database engine the current test runs on (see the ``engine`` fixture in conftest.py).

Test modules marked ``pytestmark = pytest.mark.both_engines`` run every test once on SQLite and once
on the session's real PostgreSQL; their helpers build configs with :func:`db_url_for`.
"""

from __future__ import annotations

from pathlib import Path

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
