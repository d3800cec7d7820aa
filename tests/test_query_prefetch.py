"""The reply path starts its memory search's query embedding when the message arrives and embeds it once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bot.app import App
from bot.config import parse_config
from bot.ports import IncomingMessage
from cortex.memory.embedders import EmbedderError, HashEmbedder, Vectors
from tests.fakes.provider import ScriptedProvider


class GatedEmbedder(HashEmbedder):
    """Records every query it embeds; a query waits for ``gate`` (open by default); ``failures`` first
    calls raise, as an unreachable embedding server would."""

    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.queries: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.failures = failures

    def embed_query(self, texts: Sequence[str]) -> Vectors:
        self.queries.extend(texts)
        if self.failures:
            self.failures -= 1
            raise EmbedderError("embedding server unreachable")
        if not self.gate.wait(10):
            raise EmbedderError("gate never opened")
        return self.embed(texts)


def _config(tmp_path: Path) -> object:
    return parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
                         "memory": {"query_timeout_seconds": 10}})


def _dm(text: str) -> IncomingMessage:
    return IncomingMessage("console", "dm-ann", "ann", "Ann", text, is_dm=True)


async def _app_with_a_fact(tmp_path: Path, embedder: GatedEmbedder, *, talked: bool = True) -> App:
    """Ann has one memory item, embedded; ``talked``: she had a reply here already (so the bot knows that
    her replies search by meaning), and the embedder's record starts empty."""
    app = await App(_config(tmp_path), llm=ScriptedProvider(), embedder=embedder).start(workers=False)  # type: ignore[arg-type]
    user = await app.storage.upsert_user("console:ann", "Ann")
    pair = (await app.cortex.store.count_messages(user.id, "Cora", 0)).id
    await app.cortex.memory.remember(pair, "Ann's cat Luna was adopted from the shelter in spring")
    assert app.cortex.embeddings is not None
    await app.cortex.embeddings.backfill()
    if talked:
        await app.core.reply(_dm("Good morning, I hope you slept well and are ready for a long chat.")).text()
        embedder.queries.clear()
    return app


def _knowledge(app: App) -> str:
    llm = app.llm
    assert isinstance(llm, ScriptedProvider)
    return llm.requests[-1].system


async def test_the_query_is_embedded_while_the_message_is_stored_and_only_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    embedder = GatedEmbedder()
    app = await _app_with_a_fact(tmp_path, embedder)
    stored, storing = asyncio.Event(), asyncio.Event()
    add_message = app.storage.add_message

    async def slow_add_message(*args: Any, **kwargs: Any) -> Any:
        storing.set()
        await stored.wait()  # the database is slow today
        return await add_message(*args, **kwargs)

    monkeypatch.setattr(app.storage, "add_message", slow_add_message)
    try:
        text = "Which shelter did my cat come from when I adopted her?"
        reply = asyncio.create_task(app.core.reply(_dm(text)).text())
        await asyncio.wait_for(storing.wait(), 5)
        for _ in range(500):  # the embedding runs while the message is still being stored
            if embedder.queries:
                break
            await asyncio.sleep(0.01)
        assert embedder.queries == [text] and not reply.done()
        stored.set()
        await reply
        assert embedder.queries == [text]  # the search took the embedding started on arrival
        assert "Luna was adopted from the shelter" in _knowledge(app)
    finally:
        stored.set()
        await app.stop()


async def test_a_short_follow_up_is_searched_with_the_message_before_it(tmp_path: Path) -> None:
    embedder = GatedEmbedder()
    app = await _app_with_a_fact(tmp_path, embedder, talked=False)
    try:
        llm = app.llm
        assert isinstance(llm, ScriptedProvider)
        llm.enqueue("Tell me about your pets first.")
        await app.core.reply(_dm("Do you remember anything about the animals I live with at home?")).text()
        await app.core.reply(_dm("the cat?")).text()
        assert embedder.queries[-1] == "Tell me about your pets first.\nthe cat?"
        assert embedder.queries.count(embedder.queries[-1]) == 1
        assert "the cat?" not in embedder.queries  # the early start guessed the message before it right
    finally:
        await app.stop()


async def test_a_failed_early_embedding_is_tried_again_by_the_search(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An early embedding that failed before the search asks is tried again (one that is still under way
    when the search asks is shared, failure included: a reply never waits for two timeouts)."""
    embedder = GatedEmbedder()
    app = await _app_with_a_fact(tmp_path, embedder)
    service = app.cortex.embeddings
    assert service is not None
    embedder.failures = 1
    text = "Which shelter did my cat come from when I adopted her?"
    add_message = app.storage.add_message

    async def add_message_once_the_early_try_failed(*args: Any, **kwargs: Any) -> Any:
        for _ in range(500):
            if embedder.queries and text not in service._queries:
                break
            await asyncio.sleep(0.01)
        return await add_message(*args, **kwargs)

    monkeypatch.setattr(app.storage, "add_message", add_message_once_the_early_try_failed)
    try:
        await app.core.reply(_dm(text)).text()
        assert embedder.queries == [text, text]  # a failure is not kept as the query's answer
        assert "Luna was adopted from the shelter" in _knowledge(app)
        assert "query embedding failed" in caplog.text
    finally:
        await app.stop()


async def test_prefetched_queries_are_bounded_and_dropped_on_close(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import cortex.memory.embedding as embedding_module

    monkeypatch.setattr(embedding_module, "QUERY_CACHE", 3)
    embedder = GatedEmbedder()
    app = await _app_with_a_fact(tmp_path, embedder)
    service = app.cortex.embeddings
    assert service is not None
    try:
        for n in range(5):
            service.prefetch_query(f"question number {n}")
        service.prefetch_query("   ")  # nothing to embed
        assert list(service._queries) == ["question number 2", "question number 3", "question number 4"]
        vector = await service.embed_query("question number 4")
        assert vector is not None and not vector.flags.writeable  # shared, so nobody may change it
        assert embedder.queries.count("question number 4") == 1
    finally:
        await app.stop()
    assert not service._queries


async def test_no_query_is_embedded_for_someone_with_nothing_to_compare_it_with(tmp_path: Path) -> None:
    embedder = GatedEmbedder()
    app = await App(_config(tmp_path), llm=ScriptedProvider(), embedder=embedder).start(workers=False)  # type: ignore[arg-type]
    try:
        for text in ("Hello, I am new here and would like to talk about gardening today.", "What grows in May?"):
            await app.core.reply(_dm(text)).text()
        assert embedder.queries == []  # neither early nor in the search: no vectors of Ann's to compare with
        user = await app.storage.upsert_user("console:ann", "Ann")
        pair = (await app.cortex.store.count_messages(user.id, "Cora", 0)).id
        await app.cortex.memory.remember(pair, "Ann grows tomatoes on her balcony")
        assert app.cortex.embeddings is not None
        await app.cortex.embeddings.backfill()
        first = "Which vegetables do I grow on my balcony these days?"
        await app.core.reply(_dm(first)).text()
        assert embedder.queries == [first]  # the search embeds it; from now on replies start it early
        assert "Ann grows tomatoes" in _knowledge(app)
    finally:
        await app.stop()


async def test_the_backlog_line_says_when_new_texts_are_found_by_meaning(tmp_path: Path) -> None:
    embedder = GatedEmbedder()
    app = await _app_with_a_fact(tmp_path, embedder, talked=False)
    service = app.cortex.embeddings
    assert service is not None
    try:
        assert await service.backlog_line() == "All of it can be found by its words and by its meaning now."
        service._rate = 0.0  # no backfill run has measured its pace yet
        user = await app.storage.upsert_user("console:ann", "Ann")
        pair = (await app.cortex.store.count_messages(user.id, "Cora", 0)).id
        for n in range(3):
            await app.cortex.memory.remember(pair, f"Ann visited museum number {n}")
        line = await service.backlog_line()
        assert line == "All of it can be found by its words now, and by its meaning as the background embedding " \
            "gets to it."
        service._rate = 0.01  # the last backfill run's pace: 3 texts take 5 minutes
        assert "by its meaning in about 5 min" in await service.backlog_line()
    finally:
        await app.stop()


async def test_forget_me_drops_the_kept_query_texts(tmp_path: Path) -> None:
    from bot.commands import CommandContext

    embedder = GatedEmbedder()
    app = await _app_with_a_fact(tmp_path, embedder)
    service = app.cortex.embeddings
    assert service is not None
    try:
        text = "Which shelter did my cat come from when I adopted her?"
        await app.core.reply(_dm(text)).text()
        assert text in service._queries and any("shelter" in t for t in app.core._last_text.values())
        ann = CommandContext("console", "console:ann", "Ann", "console:dm-ann", "Cora", is_dm=True)
        await app.commands.dispatch("!memory forget-me confirm", ann)
        assert not service._queries and not app.core._last_text  # her words are in no cache either
    finally:
        await app.stop()
