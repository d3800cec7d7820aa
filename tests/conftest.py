from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from collections.abc import AsyncIterator, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402

from bot.storage.sqlite import SQLiteStorage  # noqa: E402
from bot.tokens import BPETokenEstimator  # noqa: E402
from tests.fakes.llm_server import FakeLLMServer  # noqa: E402
from tests.synapse import SynapseServer  # noqa: E402


@pytest.fixture
def fake_llm() -> Iterator[FakeLLMServer]:
    with FakeLLMServer() as server:
        yield server


@pytest_asyncio.fixture
async def storage(tmp_path: Path) -> AsyncIterator[SQLiteStorage]:
    store = await SQLiteStorage(tmp_path / "bot.db").open()
    await store.migrate()
    yield store
    await store.close()


@pytest.fixture
def estimator() -> BPETokenEstimator:
    return BPETokenEstimator(margin=0.0)


@pytest.fixture(scope="session")
def synapse() -> Iterator[SynapseServer]:
    """One real Synapse homeserver (127.0.0.1, server name "localhost") for the whole session.

    The first run installs Synapse into its own venv (see ``tests/synapse.py``); an install or start-up
    failure errors the tests that use this fixture rather than skipping them. Tests share the server,
    so they should register unique user names.
    """
    with SynapseServer() as server:
        yield server
