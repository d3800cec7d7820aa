"""Two bot processes on one SQLite file (a `cortexbot chat` beside `cortexbot run`): each keeps its own
vector cache, so while another is alive each reads its cached vectors again every minute, and what the
other embedded is found by meaning here too."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bot.app import App
from bot.config import parse_config
from cortex.memory.embedders import HashEmbedder
from tests.fakes.provider import ScriptedProvider


def _config(tmp_path: Path):
    return parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})


async def test_a_second_process_on_the_file_refreshes_the_vector_cache(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as first:
        store = first.cortex.store
        _, pair = await store.pair_for("console:ann", "Ann", "Cora")
        await first.cortex.memory.remember(pair.id, "Ann keeps bees on the roof", category="fact")
        await first.cortex.embeddings.backfill()
        index = first.cortex.embeddings.index
        assert await index.has_vectors(("items", pair.id))
        await first._shared_sqlite()  # alone: the cache stays
        assert ("items", pair.id) in index._blocks
        async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as second:
            await second.cortex.memory.remember(pair.id, "Ann's hives gave 20 kg of honey", category="fact")
            await second.cortex.embeddings.backfill()
            with caplog.at_level(logging.WARNING, logger="bot.app"):
                await first._shared_sqlite()
            assert ("items", pair.id) not in index._blocks
            assert "another bot process" in caplog.text and "PostgreSQL" in caplog.text
            block = await index.items(pair.id)
            assert len(block.ids) == 2  # the other process's vector is here now


async def test_opening_waits_while_another_process_holds_the_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A process starting while another one migrates (or holds a write lock longer than the busy timeout)
    keeps trying instead of failing to start ("database is locked")."""
    import sqlite3
    import threading
    import time

    from bot.storage import open_storage, sqlite

    monkeypatch.setattr(sqlite, "BUSY_TIMEOUT_MS", 200)
    path = tmp_path / "bot.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(5.5, holder.rollback)  # longer than sqlite3's default wait of 5 s
    release.start()
    started = time.monotonic()
    try:
        storage = await open_storage(f"sqlite:///{path}")
        await storage.close()
    finally:
        release.cancel()
        holder.close()
    assert time.monotonic() - started >= 5.0  # it waited for the lock, then opened


async def test_a_file_held_too_long_is_named_with_who_may_hold_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The wait was silent for 30 s, then said only "database is locked"."""
    import logging
    import sqlite3

    from bot.storage import StorageError, open_storage, sqlite

    monkeypatch.setattr(sqlite, "BUSY_TIMEOUT_MS", 100)
    monkeypatch.setattr(sqlite, "OPEN_PATIENCE_SECONDS", 0.5)
    path = tmp_path / "bot.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with caplog.at_level(logging.WARNING, logger="bot.storage"), pytest.raises(StorageError) as refused:
            await open_storage(f"sqlite:///{path}")
    finally:
        holder.close()
    assert "another process holds it" in str(refused.value) and "waited 0.5 s" in str(refused.value)
    waiting = [r.getMessage() for r in caplog.records if "is busy" in r.getMessage()]
    assert len(waiting) == 1 and "trying again for up to 0.5 s" in waiting[0], waiting
