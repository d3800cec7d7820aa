"""The per-pair vector cache on real SQLite: paged loading, growth, the similarity floor, invalidation."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

import cortex.memory.embedding as embedding_module
import cortex.memory.vectors as vectors_module
from bot.app import App
from bot.config import parse_config
from cortex.memory.embedders import HashEmbedder, normalize
from cortex.memory.vectors import Block, CentredFloor, VectorIndex
from tests.fakes.provider import ScriptedProvider


async def _app(tmp_path: Path) -> App:
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "memory": {"embedder": "none"}})
    return await App(config, llm=ScriptedProvider()).start(workers=False)


async def _items(app: App, count: int, dim: int = 8, model: str = "m") -> tuple[int, list[int], np.ndarray]:
    user = await app.storage.upsert_user("console:ann", "Ann")
    pair = (await app.cortex.store.count_messages(user.id, "Cora", 0)).id
    rng = np.random.default_rng(3)
    matrix = normalize(rng.standard_normal((count, dim)))
    ids = []
    for n in range(count):
        item = await app.cortex.memory.remember(pair, f"item {n}")
        await app.storage.db.write("UPDATE memory_items SET embedding = ?, embedding_model = ? WHERE id = ?",
                                (matrix[n].tobytes(), model, item.id))
        ids.append(item.id)
    return pair, ids, matrix


async def test_pages_fill_one_array_and_survive_concurrent_growth(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    app = await _app(tmp_path)
    try:
        pair, ids, matrix = await _items(app, 11)
        await app.cortex.memory.archive(pair, ids[4], "gone")
        await app.storage.db.write("UPDATE memory_items SET embedding_model = 'old' WHERE id = ?", (ids[5],))
        monkeypatch.setattr(vectors_module, "PAGE", 3)
        block = await VectorIndex(app.storage, "m").items(pair)
        keep = [n for n in range(11) if n not in (4, 5)]  # archived and stale vectors stay out
        assert block.ids.tolist() == [ids[n] for n in keep]
        assert np.array_equal(block.matrix, matrix[keep])
        # vectors written between the count and the last page: the array grows
        real_count = app.storage.memory.count_vectors

        async def stale_count(*args: object) -> int:
            return await real_count(*args) - 5  # type: ignore[arg-type]

        monkeypatch.setattr(app.storage.memory, "count_vectors", stale_count)
        grown = await VectorIndex(app.storage, "m").items(pair)
        assert grown.ids.tolist() == block.ids.tolist() and np.array_equal(grown.matrix, block.matrix)
    finally:
        await app.stop()


async def test_similarity_is_scored_above_the_typical_level(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    matrix = normalize(rng.standard_normal((200, 16)))
    block = Block(np.arange(200, dtype=np.int64), matrix)
    query = matrix[17]
    sims = matrix @ query
    top = block.top(query, 5)
    assert len(top) == 5 and max(top, key=lambda i: top[i]) == 17
    floor = sims.mean() + 2 * sims.std()
    assert top[17] == pytest.approx(1.0 - floor, abs=1e-5)
    assert sum(1 for value in block.top(query, 200).values() if value > 0) <= 20  # few stand out
    small = Block(np.arange(3, dtype=np.int64), matrix[:3])  # too few to estimate a spread: the minimum
    values = small.top(matrix[0], 3)
    assert values[0] == pytest.approx(1.0 - float((matrix[:3] @ matrix[0]).min()), abs=1e-5)
    assert min(values.values()) == pytest.approx(0.0, abs=1e-6)
    assert Block(np.arange(3, dtype=np.int64), matrix[:3]).top(np.ones(4, dtype=np.float32), 3) == {}


async def test_cached_blocks_grow_with_the_backfill_and_drop_on_restore(tmp_path: Path) -> None:
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        user = await app.storage.upsert_user("console:ann", "Ann")
        pair = (await app.cortex.store.count_messages(user.id, "Cora", 0)).id
        memory, index = app.cortex.memory, app.cortex.embeddings.index
        first = await memory.remember(pair, "Ann plays the cello")
        await app.cortex.embeddings.backfill()
        assert (await index.items(pair)).ids.tolist() == [first.id]  # cached now
        second = await memory.remember(pair, "Ann grows tomatoes")
        await app.cortex.embeddings.backfill()
        assert (await index.items(pair)).ids.tolist() == [first.id, second.id]  # grown in place
        await memory.archive(pair, first.id, "test")
        index.invalidate(("items", pair))
        assert (await index.items(pair)).ids.tolist() == [second.id]
        await memory.restore(pair, first.id)
        assert sorted((await index.items(pair)).ids.tolist()) == [first.id, second.id]


class Recording(HashEmbedder):
    """The test embedder, keeping every text it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def embed(self, texts):  # type: ignore[no-untyped-def]
        self.texts.extend(texts)
        return super().embed(texts)


async def test_a_message_is_embedded_with_the_one_it_answers(tmp_path: Path) -> None:
    embedder = Recording()
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    async with App(config, llm=ScriptedProvider(), embedder=embedder) as app:
        ann = await app.storage.upsert_user("console:ann", "Ann")
        dm = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        room = await app.storage.upsert_channel("console:room", "room", is_dm=False)
        await app.storage.add_message(dm.id, ann.id, "Cora", "assistant", "Cora", "What are your pets' names?", 7)
        await app.storage.add_message(room.id, ann.id, "Cora", "user", "Ann", "unrelated " * 100, 100)
        await app.storage.add_message(dm.id, ann.id, "Cora", "user", "Ann", "Luna and Oliver!", 5)
        await app.storage.add_message(room.id, ann.id, "Cora", "user", "Ann", "hello room", 3)
        report = await app.cortex.embeddings.backfill()
        assert report.messages == 4
        assert "Cora: What are your pets' names?\nAnn: Luna and Oliver!" in embedder.texts
        answer_in_room = next(t for t in embedder.texts if t.endswith("Ann: hello room"))
        assert answer_in_room.startswith("Ann: unrelated") and len(answer_in_room) < 260  # context is cut
        rows = await app.storage.db.fetch_all("SELECT DISTINCT model FROM message_vectors")
        assert [r[0] for r in rows] == [f"{embedder.name}|prev-turn"]


class Slow(Recording):
    """Recording, taking ``seconds`` per batch (as a real embedder takes its time on the backfill's thread)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def embed(self, texts):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)
        return super().embed(texts)


async def test_the_backfill_embeds_each_message_once_in_overlapping_batches(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """While one batch is embedded the next is read and the last stored: every message is embedded exactly once,
    each with the one before it, findable by its vector; a run that runs out of time says so and the next run
    goes on where it stopped."""
    monkeypatch.setattr(embedding_module, "BATCH", 3)
    embedder = Slow(0.2)
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    async with App(config, llm=ScriptedProvider(), embedder=embedder) as app:
        ann = await app.storage.upsert_user("console:ann", "Ann")
        dm = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        ids = [await app.storage.add_message(dm.id, ann.id, "Cora", role, name, f"turn{n} about topic{n}", 5)
               for n, (role, name) in enumerate([("user", "Ann"), ("assistant", "Cora")] * 5)]
        service = app.cortex.embeddings
        assert service is not None
        first = await service.backfill(max_seconds=0.3)
        assert first.more and 3 <= first.messages < 10, first
        second = await service.backfill()
        assert not second.more and first.messages + second.messages == 10
        said = [t.rsplit("\n", 1)[-1] for t in embedder.texts]
        assert sorted(said) == sorted(f"{n}: turn{i} about topic{i}" for i, n in enumerate(["Ann", "Cora"] * 5))
        assert "Ann: turn4 about topic4\nCora: turn5 about topic5" in embedder.texts
        vectors = await app.storage.db.fetch_one("SELECT count(*) FROM message_vectors")
        assert vectors is not None and vectors[0] == 10
        for n in (0, 5, 9):
            query = embedder.embed([embedder.texts[said.index(f"{['Ann', 'Cora'][n % 2]}: turn{n} about topic{n}")]])
            found = await service.index.top(("messages", ann.id, "Cora"), query[0], 1)
            assert list(found) == [ids[n].id]


async def test_no_message_vector_keeps_the_words_of_a_forgotten_or_incognito_neighbour(tmp_path: Path) -> None:
    """Each message is embedded with the one before it in its channel: Bob's "ok" after Ann's secret kept her
    words in its vector after her forget-me (his search for them found it), and a message said in an incognito
    stretch (deleted when it ends) became the context of the next one."""
    embedder = Recording()
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    async with App(config, llm=ScriptedProvider(), embedder=embedder) as app:
        storage = app.storage
        ann, bob, cy = [await storage.upsert_user(f"console:{n}", n.title()) for n in ("ann", "bob", "cy")]
        room = await storage.upsert_channel("console:room", "room", is_dm=False)
        await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "how was the doctor?", 5)
        await storage.add_message(room.id, ann.id, "Cora", "user", "Ann", "my diagnosis is zanzibar syndrome", 7)
        ok = await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "ok", 1)
        assert ann.id
        await app.cortex.embeddings.backfill()
        assert "Ann: my diagnosis is zanzibar syndrome\nBob: ok" in embedder.texts
        embedder.texts.clear()
        await app.cortex.commands.forget_user("console:ann")
        await app.cortex.embeddings.backfill()
        assert embedder.texts == ["Bob: how was the doctor?\nBob: ok"]  # embedded again, without her words
        stored = await storage.db.fetch_one("SELECT vector FROM message_vectors WHERE message_id = ?", (ok.id,))
        assert stored is not None
        assert np.array_equal(np.frombuffer(stored[0], dtype=np.float32),
                              embedder.embed(["Bob: how was the doctor?\nBob: ok"])[0])

        await storage.incognito.start(cy.id, "Cora")
        await storage.add_message(room.id, cy.id, "Cora", "user", "Cy", "off the record: I quit tomorrow", 8)
        embedder.texts.clear()
        reply = await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "wow", 1)
        await app.cortex.embeddings.backfill()
        assert embedder.texts == ["Bob: wow"]  # the incognito message is nobody's context
        assert reply.id > ok.id

        # The cached vectors follow: a message embedded again replaces its old vector in a loaded block too
        # (a withdrawal or the end of a stretch does not empty the cache, as forget-me does).
        dan = await storage.upsert_user("console:dan", "Dan")
        said = await storage.add_message(room.id, dan.id, "Cora", "user", "Dan", "my pin is 4711", 5)
        await storage.sources.link(["console-message:pin"], said.id)  # as a platform's message key is kept
        after = await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "noted", 1)
        await app.cortex.embeddings.backfill()
        block = await app.cortex.embeddings.index.messages(bob.id, "Cora")  # loaded (and kept) now
        row = block.ids.tolist().index(after.id)
        assert np.array_equal(block.matrix[row], embedder.embed(["Dan: my pin is 4711\nBob: noted"])[0])
        assert (await storage.withdraw_message("console-message:pin", 0.0))[0] and said.id
        await app.cortex.embeddings.backfill()
        block = await app.cortex.embeddings.index.messages(bob.id, "Cora")
        assert np.array_equal(block.matrix[block.ids.tolist().index(after.id)],
                              embedder.embed(["Bob: wow\nBob: noted"])[0])


async def test_a_big_block_scanned_in_two_halves_gives_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(9)
    matrix = normalize(rng.standard_normal((501, 16)))
    block = Block(np.arange(1000, 1501, dtype=np.int64), matrix)
    query = matrix[333]
    whole = block.top(query, 40)
    monkeypatch.setattr(vectors_module, "THREAD_ABOVE", 100)
    halves = await block.top_async(query, 40)
    assert halves.keys() == whole.keys() and max(halves, key=lambda i: halves[i]) == 1333
    for key, value in whole.items():
        assert halves[key] == pytest.approx(value, abs=1e-5)


async def test_vectors_added_while_a_block_loads_are_kept_and_a_cancelled_caller_cancels_nobody(
        tmp_path: Path) -> None:
    app = await _app(tmp_path)
    try:
        pair, ids, matrix = await _items(app, 4)
        index = VectorIndex(app.storage, "m")
        gate = asyncio.Event()
        real_load = index._load

        async def slow_load(scope):  # type: ignore[no-untyped-def]
            await gate.wait()
            return await real_load(scope)

        index._load = slow_load  # type: ignore[method-assign]
        first = asyncio.ensure_future(index.items(pair))
        second = asyncio.ensure_future(index.items(pair))
        await asyncio.sleep(0.01)
        extra = normalize(np.ones((1, 8)))
        index.add(("items", pair), [999], extra)  # the backfill writes while the block loads
        first.cancel()  # a reply gives up: the load goes on for the other caller
        gate.set()
        block = await second
        assert block.ids.tolist() == [*ids, 999] and np.array_equal(block.matrix[-1], extra[0])
        assert (await index.items(pair)) is block  # cached, with the addition
        with pytest.raises(asyncio.CancelledError):
            await first
        # an invalidation during a load is not lost either
        index.invalidate()
        gate.clear()
        loading = asyncio.ensure_future(index.items(pair))
        await asyncio.sleep(0.01)
        index.invalidate(("items", pair))
        gate.set()
        await loading
        assert ("items", pair) not in index._blocks
    finally:
        await app.stop()


def test_a_block_grows_without_copying_on_every_append() -> None:
    block = Block(np.arange(3, dtype=np.int64), normalize(np.eye(3, 8)))
    buffers = []
    for n in range(3, 200):
        block.append([n, 1], normalize(np.ones((2, 8))))  # id 1 is known: kept once
        buffers.append(id(block._matrix))
    assert block.ids.tolist() == list(range(200)) and block.matrix.shape == (200, 8)
    assert len(set(buffers)) <= 4  # doubling: a handful of reallocations for 197 appends


def test_the_centred_floor_looks_past_the_direction_every_vector_shares() -> None:
    """Every vector leans the same way (as e5's do), so raw cosines are all high; once the typical
    directions are taken out, only the item that shares the query's own direction passes."""
    common = np.eye(8, dtype=np.float32)[0]
    items = normalize(np.stack([3 * common + np.eye(8, dtype=np.float32)[i + 1] for i in range(5)]))
    query = normalize((3 * common + np.eye(8, dtype=np.float32)[2])[None, :])[0]
    assert (items @ query).min() > 0.8  # raw: everything looks related
    floor = CentredFloor.of(query, mean_query=common * 0.95, mean_passage=items.mean(axis=0), least=0.5)
    assert floor.passes(items).tolist() == [False, True, False, False, False]
    block = Block(np.arange(10, 15, dtype=np.int64), items)
    assert set(block.top(query, 5)) == {10, 11, 12, 13, 14}
    assert set(block.top(query, 5, floor=floor)) == {11}
    assert floor.passes(np.zeros((0, 8), dtype=np.float32)).tolist() == []
    assert floor.passes(np.ones((2, 4), dtype=np.float32)).tolist() == [True, True]  # another embedder: no floor


@pytest.mark.both_engines
async def test_the_message_floor_keeps_the_same_messages_on_both_engines(tmp_path: Path) -> None:
    """The centred floor of past messages: numpy on SQLite (the cached block), SQL on PostgreSQL (the
    k-NN computes each hit's centred cosine): both keep exactly the hits numpy says pass."""
    from cortex.memory.vectors import DatabaseVectors
    from tests.engines import db_url_for

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"}})
    app = await App(config, llm=ScriptedProvider()).start(workers=False)
    try:
        user = await app.storage.upsert_user("console:ann", "Ann")
        dm = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        rng = np.random.default_rng(5)
        common = normalize(rng.standard_normal((1, 8)))[0]
        matrix = normalize(rng.standard_normal((30, 8)) * 0.6 + common)  # every vector leans one way, like e5's
        ids = [(await app.storage.add_message(dm.id, user.id, "Cora", "user", "Ann", f"m{n}", 2)).id
               for n in range(30)]
        await app.storage.memory.store_message_vectors(
            "m", [(i, user.id, "Cora", v) for i, v in zip(ids, matrix, strict=True)])
        query = normalize(matrix[3:4] + 0.3 * rng.standard_normal((1, 8)))[0]
        floor = CentredFloor.of(query, mean_query=common * 0.9, mean_passage=matrix.mean(axis=0), least=0.3)
        index = (DatabaseVectors(app.storage, "m") if app.storage.db.dialect == "postgres"
                 else VectorIndex(app.storage, "m"))
        scope = ("messages", user.id, "Cora")
        everything = await index.top(scope, query, 30)
        kept = await index.top(scope, query, 30, floor=floor)
        expected = {i for i, ok in zip(ids, floor.passes(matrix).tolist(), strict=True) if ok}
        assert len(everything) == 30 and 0 < len(kept) < 30
        assert set(kept) == expected and all(kept[i] == pytest.approx(everything[i], abs=1e-5) for i in kept)
    finally:
        await app.stop()


async def test_a_backfill_with_nothing_new_reads_only_above_its_mark_and_all_of_them_now_and_then(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run (every minute) read all of the users' messages to find that none lacked a vector. Once a run
    has read to the end, the next ones read above the newest id it saw (less a window), and only every
    FULL_SCAN_SECONDS all of them: a vector dropped below the mark (a neighbour deleted, in any process) is
    embedded again then."""
    monkeypatch.setattr(embedding_module, "MARK_WINDOW", 2)
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        ann = await app.storage.upsert_user("console:ann", "Ann")
        dm = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        ids = [(await app.storage.add_message(dm.id, ann.id, "Cora", "user", "Ann", f"turn {n}", 3)).id
               for n in range(12)]
        service = app.cortex.embeddings
        assert service is not None
        assert (await service.backfill()).messages == 12
        reads: list[int] = []
        from bot.storage.memory import MemoryRepository

        original = MemoryRepository.messages_to_embed

        async def spy(repo: MemoryRepository, model: str, below: int, limit: int, *, above: int = 0) -> list:
            reads.append(above)
            return await original(repo, model, below, limit, above=above)

        monkeypatch.setattr(MemoryRepository, "messages_to_embed", spy)
        await app.storage.db.write("DELETE FROM message_vectors WHERE message_id = ?", (ids[1],))
        newer = await app.storage.add_message(dm.id, ann.id, "Cora", "user", "Ann", "turn 12", 3)
        assert (await service.backfill()).messages == 1  # the new one; the old one is below the mark
        assert reads and set(reads) == {ids[-1] - 2}  # (every read of the run: above the mark, less the window)
        assert await app.storage.db.fetch_one("SELECT 1 FROM message_vectors WHERE message_id = ?", (newer.id,))
        monkeypatch.setattr(embedding_module, "FULL_SCAN_SECONDS", 0.0)
        assert (await service.backfill()).messages == 1 and reads[-1] == 0  # all of them: the dropped one again
        assert await app.storage.db.fetch_one("SELECT 1 FROM message_vectors WHERE message_id = ?", (ids[1],))


async def test_a_forget_me_has_the_next_backfill_read_all_messages_again(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the backfill's mark, Bob's "ok" after a forgotten message of Ann's (its vector dropped, below the
    mark) waited for the next full scan, ten minutes on: the process that ran the forget-me reads all of them
    at its next run."""
    monkeypatch.setattr(embedding_module, "MARK_WINDOW", 0)
    embedder = Recording()
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    async with App(config, llm=ScriptedProvider(), embedder=embedder) as app:
        storage = app.storage
        ann, bob = [await storage.upsert_user(f"console:{n}", n.title()) for n in ("ann", "bob")]
        room = await storage.upsert_channel("console:room", "room", is_dm=False)
        await storage.add_message(room.id, ann.id, "Cora", "user", "Ann", "my diagnosis is zanzibar syndrome", 7)
        await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "ok", 1)
        await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "see you", 2)
        assert app.cortex.embeddings is not None
        await app.cortex.embeddings.backfill()
        embedder.texts.clear()
        await app.cortex.commands.forget_user("console:ann")
        await app.cortex.embeddings.backfill()
        assert embedder.texts == ["Bob: ok"]  # embedded again at once, without her words


def test_the_best_among_some_ids_are_scored_as_the_whole_blocks_best_are() -> None:
    """A group channel compares its query with the shared items' rows only, against the typical level of the
    whole block: the scores mean what a search over every row gives them."""
    rng = np.random.default_rng(7)
    block = Block(np.arange(1, 301, dtype=np.int64), normalize(rng.normal(size=(300, 16))))
    query = normalize(rng.normal(size=16))[0]
    everything = block.top(query, 300)
    among = list(range(2, 301, 7))
    best = block.top_among(query, among, 5)
    wanted = sorted(among, key=lambda i: -everything[i])[:5]
    assert sorted(best) == sorted(wanted)
    assert all(abs(best[i] - everything[i]) < 1e-5 for i in best)
    assert block.top_among(query, [], 5) == {} and block.top_among(query, [9999], 5) == {}
