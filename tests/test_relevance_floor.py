"""The relevance floor with the default offline embedder: a search with nothing related says so
instead of returning the least bad ten, on both engines; related memory is still found by meaning
alone (no shared word), and the reply prompt uses the same floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.ports import IncomingMessage
from cortex.memory.embedders import create_embedder
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider

pytestmark = pytest.mark.both_engines
FACTS = [
    "Ann has a golden retriever named Rufus", "Ann works as a night nurse at the city hospital",
    "Ann's sister Mia lives in Oslo", "Ann is learning to play the cello", "Ann is allergic to peanuts",
    "Ann's favourite film is Spirited Away", "Ann grew up on a farm in Devon", "Ann runs every Sunday morning",
    "Ann drives an old red Volvo", "Ann's birthday is on the 3rd of March", "Ann collects vinyl records",
    "Ann wants to visit Japan next spring",
]
ANN = CommandContext("console", "console:ann", "Ann", "console:dm-ann", "Cora", is_dm=True)


@pytest.fixture(scope="module")
def e5():  # type: ignore[no-untyped-def]
    return create_embedder("default")


async def _app(tmp_path: Path, e5, llm: ScriptedProvider) -> App:  # type: ignore[no-untyped-def]
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    app = await App(config, llm=llm, embedder=e5).start(workers=False)
    _, pair = await app.cortex.store.pair_for("console:ann", "Ann", "Cora")
    for fact in FACTS:
        await app.cortex.memory.remember(pair.id, fact)
    assert app.cortex.embeddings is not None
    report = await app.cortex.embeddings.backfill(max_seconds=120)
    assert report.items == len(FACTS)
    return app


@pytest.mark.parametrize("nonsense", ["zzzqqq", "qwertzuiop", "🙂🙂🙂", "How do I configure a BGP router?"])
async def test_a_search_for_nothing_related_finds_nothing(tmp_path: Path, e5, nonsense: str) -> None:  # type: ignore[no-untyped-def]
    app = await _app(tmp_path, e5, ScriptedProvider())
    try:
        reply = (await app.commands.dispatch(f"!memory search {nonsense}", ANN)).text
        assert reply == f"Nothing found for {nonsense!r}."
        # found by meaning alone: no word of the question is in the fact
        hits = await app.cortex.memory.search(
            (await app.cortex.store.pair_for("console:ann", "Ann", "Cora"))[1].id, "tell me about my dog")
        assert hits and hits[0].text == "Ann has a golden retriever named Rufus"
    finally:
        await app.stop()


async def test_the_reply_prompt_uses_the_same_floor(tmp_path: Path, e5) -> None:  # type: ignore[no-untyped-def]
    llm = ScriptedProvider()
    app = await _app(tmp_path, e5, llm)
    try:
        await app.core.reply(IncomingMessage("console", "dm-ann", "ann", "Ann", "zzzqqq", is_dm=True)).text()
        assert not any(fact in llm.requests[-1].system for fact in FACTS)
        await app.core.reply(IncomingMessage("console", "dm-ann-2", "ann", "Ann", "what instrument do I play?",
                                             is_dm=True)).text()
        assert "learning to play the cello" in llm.requests[-1].system
    finally:
        await app.stop()
