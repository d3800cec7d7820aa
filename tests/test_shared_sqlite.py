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
