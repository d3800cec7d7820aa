"""How PostgreSQL keeps a memory search cheap on a real server: a common word's rarity read from the
column's statistics instead of counted, and a large scope's typical similarity from its measured spread
instead of a sample scored on every search."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import bot.storage.memory as memory_module
from bot.storage import Storage, open_storage
from bot.storage.memory import STATS_MIN_ROWS, TYPICAL_SAMPLE, ItemScope, MemoryRepository, MessageScope
from bot.storage.spread import TTL as SPREAD_TTL
from bot.storage.spread import Spread, Spreads
from tests.engines import index_scans, settled_index_scans

DIMS = 384
MODEL = "e5-test"


@pytest.fixture
def pg(pg_storage: Storage) -> Storage:
    return pg_storage


async def _pair(storage: Storage, key: str = "discord:1") -> int:
    user = await storage.upsert_user(key, "Ann")
    return (await storage.cortex.ensure_pair(user.id, "Cora")).id


async def _items(storage: Storage, pair_id: int, texts: list[str],
                 vectors: npt.NDArray[np.float32] | None = None) -> None:
    async with storage.db.transaction() as tx:
        await tx.executemany(
            "INSERT INTO memory_items (pair_id, category, content, created_at, updated_at, embedding, embedding_model)"
            " VALUES (?, 'fact', ?, 1, 1, ?, ?)",
            [(pair_id, text, None if vectors is None else vectors[n], "" if vectors is None else MODEL)
             for n, text in enumerate(texts)])


# -- a word's rarity ------------------------------------------------------------------------------------


def _texts(rows: int, **every: int) -> list[str]:
    """Row n holds each word whose period divides n, and a word of its own."""
    return [" ".join([f"w{n}x"] + [word for word, period in every.items() if n % period == 0]) for n in range(rows)]


async def test_a_common_words_rarity_is_read_from_the_statistics_and_a_rare_one_is_counted(pg: Storage) -> None:
    pair = await _pair(pg)
    rows = STATS_MIN_ROWS + 2000
    await _items(pg, pair, _texts(rows, heron=4, kestrel=20, osprey=2000))
    await pg.db.write("ANALYZE memory_items")
    counts = await pg.memory.fts_term_counts("memory_fts", ['"heron"', '"kestrel"', '"osprey"', '"wren"'], 1001,
                                             pair_id=pair)
    assert counts[0] == 1001  # capped, as a count would be
    assert abs(counts[1] - rows / 20) <= rows / 20 * 0.15, counts  # an estimate, close to the 600 rows
    assert counts[2:] == [6, 0]
    # What is read is the statistics: rows added since ANALYZE are not seen for a word they list, but are
    # counted for one they do not.
    await _items(pg, pair, _texts(400, kestrel=1, wren=50))
    again = await pg.memory.fts_term_counts("memory_fts", ['"kestrel"', '"wren"'], 1001, pair_id=pair)
    assert again == [counts[1], 8]


async def test_a_small_table_counts_every_word(pg: Storage) -> None:
    pair = await _pair(pg)
    await _items(pg, pair, _texts(2000, heron=4))
    await pg.db.write("ANALYZE memory_items")
    await _items(pg, pair, _texts(200, heron=1))
    assert await pg.memory.fts_term_counts("memory_fts", ['"heron"'], 1001, pair_id=pair) == [700]
    # The caller that knows the table is small spares the statistics' query: the same counts.
    assert await pg.memory.fts_term_counts("memory_fts", ['"heron"', '"wren"'], 1001, pair_id=pair,
                                           rows=2200) == [700, 0]


async def test_a_message_search_with_several_words_leaves_out_the_window(pg: Storage) -> None:
    """The messages' query numbers the words, their weights, then the excluded ids."""
    user = await pg.upsert_user("discord:1", "Ann")
    channel = await pg.upsert_channel("discord:c", "general", is_dm=False)
    said = [await pg.add_message(channel.id, user.id, "Cora", "user", "Ann", text, 4) for text in (
        "my heron is called Ed", "a kestrel flew by", "heron and kestrel together", "nothing of note")]
    rows = await pg.memory.message_text_candidates(user.id, "Cora", {'"heron"': 1.0, '"kestrel"': 2.0},
                                                   newest=False, limit=10, exclude=[said[2].id])
    assert [r["text"] for r in rows] == ["a kestrel flew by", "my heron is called Ed"]


async def test_a_search_ranks_by_the_rarer_word_with_weights_as_parameters(pg: Storage) -> None:
    """The weights of the words travel as parameters (one prepared statement for any weights): the rarer
    word still weighs more."""
    pair = await _pair(pg)
    await _items(pg, pair, ["heron " * 3 + "filler", "kestrel only once", *(f"heron number {n}" for n in range(60))])
    rows = await pg.memory.item_text_candidates(pair, {'"heron"': 0.2, '"kestrel"': 4.0}, newest=False, now=2.0,
                                                 limit=5)
    assert rows[0]["content"] == "kestrel only once"
    flipped = await pg.memory.item_text_candidates(pair, {'"heron"': 4.0, '"kestrel"': 0.2}, newest=False, now=2.0,
                                                   limit=5)
    assert flipped[0]["content"].startswith("heron heron heron")


# -- a scope's typical similarity --------------------------------------------------------------------------


def _unit(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return np.asarray(rows / np.linalg.norm(rows, axis=1, keepdims=True), dtype=np.float32)


def _two_clusters(old: int, new: int) -> npt.NDArray[np.float32]:
    """``old`` vectors around one direction, then ``new`` around another: a sample of the first rows sees
    only the first cluster."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal(DIMS), rng.standard_normal(DIMS)
    return _unit(np.vstack([a + 0.9 * rng.standard_normal((old, DIMS)), b + 0.9 * rng.standard_normal((new, DIMS))]
                           ).astype(np.float32))


def _level(vectors: npt.NDArray[np.float32], query: npt.NDArray[np.float32]) -> float:
    similarities = vectors @ query
    return float(similarities.mean() + 2 * similarities.std())


async def _floor_used(pg: Storage, pair: int, vectors: npt.NDArray[np.float32], query: npt.NDArray[np.float32]
                      ) -> float:
    """The typical level a k-NN measured its hits against (similarity minus the excess it reported)."""
    scores = await pg.memory.vector_top(ItemScope(pair), MODEL, query, 5)
    first = next(iter(scores))
    return float(vectors[first - 1] @ query) - scores[first]


async def test_a_large_scopes_typical_level_comes_from_its_spread_over_all_its_vectors(pg: Storage) -> None:
    pair = await _pair(pg)
    vectors = _two_clusters(TYPICAL_SAMPLE, 600)
    await _items(pg, pair, [f"item {n}" for n in range(len(vectors))], vectors)
    query = vectors[-1]
    everything, first_rows = _level(vectors, query), _level(vectors[:TYPICAL_SAMPLE], query)
    assert abs(everything - first_rows) > 0.05  # the data tells the two apart
    # The first search scores a sample of the scope (its first rows), and has the spread measured meanwhile.
    assert await _floor_used(pg, pair, vectors, query) == pytest.approx(first_rows, abs=1e-4)
    await pg.memory.spreads_settled()
    # The next ones take the level from the spread: measured on every vector of a scope this small.
    assert await _floor_used(pg, pair, vectors, query) == pytest.approx(everything, abs=1e-4)
    other = vectors[5]
    assert await _floor_used(pg, pair, vectors, other) == pytest.approx(_level(vectors, other), abs=1e-4)
    # A forget-me (of anyone) drops what the process kept: the sample serves again.
    await pg.upsert_user("discord:2", "Bo")
    await pg.forget_user("discord:2")
    assert await _floor_used(pg, pair, vectors, query) == pytest.approx(first_rows, abs=1e-4)


async def test_a_users_messages_get_their_spread_too(pg: Storage) -> None:
    user = await pg.upsert_user("discord:1", "Ann")
    channel = await pg.upsert_channel("discord:c", "general", is_dm=False)
    vectors = _two_clusters(TYPICAL_SAMPLE, 600)
    async with pg.db.transaction() as tx:
        await tx.executemany(
            "INSERT INTO messages (id, channel_id, user_id, persona, role, author_name, text, token_count, seq,"
            " created_at) VALUES (?, ?, ?, 'Cora', 'user', 'Ann', ?, 2, ?, 1)",
            [(n + 1, channel.id, user.id, f"message {n}", n + 1) for n in range(len(vectors))])
    await pg.memory.store_message_vectors(MODEL, [(n + 1, user.id, "Cora", v) for n, v in enumerate(vectors)])
    scope, query = MessageScope(user.id, "Cora"), vectors[-1]

    async def floor() -> float:
        scores = await pg.memory.vector_top(scope, MODEL, query, 5)
        first = next(iter(scores))
        return float(vectors[first - 1] @ query) - scores[first]

    assert await floor() == pytest.approx(_level(vectors[:TYPICAL_SAMPLE], query), abs=1e-4)
    await pg.memory.spreads_settled()
    assert await floor() == pytest.approx(_level(vectors, query), abs=1e-4)


async def test_a_small_scope_is_sampled_every_time(pg: Storage) -> None:
    pair = await _pair(pg)
    vectors = _two_clusters(200, 50)
    await _items(pg, pair, [f"item {n}" for n in range(len(vectors))], vectors)
    query = vectors[-1]
    assert await _floor_used(pg, pair, vectors, query) == pytest.approx(_level(vectors, query), abs=1e-4)
    await pg.memory.spreads_settled()
    await _items(pg, pair, [f"more {n}" for n in range(100)], _two_clusters(100, 0))
    grown = np.vstack([vectors, _two_clusters(100, 0)])
    assert await _floor_used(pg, pair, grown, query) == pytest.approx(_level(grown, query), abs=1e-4)


def _spread_of(seed: int) -> Any:
    async def sample() -> npt.NDArray[np.float32]:
        return _unit(np.random.default_rng(seed).standard_normal((200, 8)).astype(np.float32))
    return sample


async def test_spreads_keep_to_their_budget_and_drop_the_least_recently_used() -> None:
    one = Spread.of(await _spread_of(0)())
    spreads = Spreads(budget=2 * one.nbytes)
    for key in ("a", "b"):
        spreads.measure(key, 8, _spread_of(1))
        await spreads.settled()
    assert spreads.get("a") is not None  # "a" is now the more recently used
    spreads.measure("c", 8, _spread_of(2))
    await spreads.settled()
    assert spreads.get("b") is None and spreads.get("a") is not None and spreads.get("c") is not None
    sampled = 0

    async def counted() -> npt.NDArray[np.float32]:
        nonlocal sampled
        sampled += 1
        return await _spread_of(3)()

    spreads.measure("huge", 3072, counted)  # its covariance alone would not fit: never measured
    await spreads.settled()
    assert spreads.get("huge") is None and sampled == 0
    spreads.measure("d", 8, counted)
    await spreads.settled()
    assert spreads.get("d") is not None and sampled == 1


async def test_a_failed_measurement_is_logged_and_not_tried_again_at_once(caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    async def broken() -> npt.NDArray[np.float32]:
        nonlocal calls
        calls += 1
        raise ConnectionError("the pool is closing")

    spreads = Spreads()
    with caplog.at_level(logging.WARNING):
        spreads.measure("a", 8, broken)
        await spreads.settled()
    assert spreads.get("a") is None and calls == 1
    assert "could not measure the spread" in caplog.text and "the pool is closing" in caplog.text
    spreads.measure("a", 8, broken)  # every search of the scope asks again: not before the TTL
    await spreads.settled()
    assert calls == 1
    spreads.measure("b", 8, _spread_of(3))  # and a closed one stops what is under way
    await spreads.close()
    assert spreads.get("b") is None
    await asyncio.sleep(0)


async def test_a_spread_not_renewed_for_twice_its_ttl_is_dropped() -> None:
    """A scope nobody searches any more (its user was forgotten by another process) is not kept."""
    spreads = Spreads()
    for key in ("old", "new"):
        spreads.measure(key, 8, _spread_of(4))
        await spreads.settled()
    aged = spreads.get("old")
    assert aged is not None
    spreads._spreads["old"] = dataclasses.replace(aged, measured=aged.measured - 2 * SPREAD_TTL - 1)
    spreads._swept -= SPREAD_TTL  # the sweep runs at most every TTL / 10
    assert spreads.get("new") is not None and spreads.get("old") is None


def test_a_spreads_level_is_the_mean_plus_two_deviations_of_the_similarities() -> None:
    vectors = _unit(np.random.default_rng(9).standard_normal((500, 16)).astype(np.float32))
    query = vectors[0]
    assert Spread.of(vectors).level(query) == pytest.approx(_level(vectors, query), abs=1e-5)


# -- the vector index ----------------------------------------------------------------------------------


async def _index_state(pg: Storage, name: str) -> tuple[int, bool] | None:
    row = await pg.db.fetch_one("SELECT indexrelid::bigint, indisvalid FROM pg_index WHERE indexrelid = to_regclass(?)",
                                (name,))
    return None if row is None else (int(row[0]), bool(row[1]))


async def test_a_vector_index_left_half_built_by_a_dead_process_is_built_again(
        pg: Storage, caplog: pytest.LogCaptureFixture) -> None:
    pair = await _pair(pg)
    await _items(pg, pair, [f"item {n}" for n in range(50)], _two_clusters(40, 10))
    await pg.memory.ensure_vector_index(DIMS)
    first = await _index_state(pg, f"memory_items_hnswh_{DIMS}")
    assert first is not None and first[1]
    assert (await _index_state(pg, f"message_vectors_hnswh_{DIMS}") or (0, False))[1]
    # What a CREATE INDEX CONCURRENTLY leaves when its process is killed: the index, marked invalid.
    await pg.db.write("UPDATE pg_index SET indisvalid = false WHERE indexrelid = to_regclass(?)",
                      (f"memory_items_hnswh_{DIMS}",))
    with caplog.at_level(logging.INFO):
        await MemoryRepository(pg.db).ensure_vector_index(DIMS)  # the next process to start
    again = await _index_state(pg, f"memory_items_hnswh_{DIMS}")
    assert again is not None and again[1] and again[0] != first[0]
    assert "dropped the vector index memory_items_hnswh_384, which a build that stopped half-way" in caplog.text
    query = _two_clusters(40, 10)[-1]
    assert len(await pg.memory.vector_top(ItemScope(pair), MODEL, query, 5)) == 5


async def test_an_index_another_process_is_building_is_left_to_it(pg: Storage, pg_url: str) -> None:
    import asyncpg

    await pg.memory.ensure_vector_index(DIMS)
    name = f"memory_items_hnswh_{DIMS}"
    first = await _index_state(pg, name)
    await pg.db.write("UPDATE pg_index SET indisvalid = false WHERE indexrelid = to_regclass(?)", (name,))
    builder = await asyncpg.connect(pg_url)  # what a process building it holds meanwhile
    try:
        await builder.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", f"cortex-bot maintenance: {name}")
        await MemoryRepository(pg.db).ensure_vector_index(DIMS)
        assert await _index_state(pg, name) == (first[0] if first else 0, False)  # neither dropped nor rebuilt
    finally:
        await builder.close()
    await MemoryRepository(pg.db).ensure_vector_index(DIMS)  # its process died: the next one builds it
    again = await _index_state(pg, name)
    assert again is not None and again[1] and first is not None and again[0] != first[0]


async def test_a_database_with_an_older_versions_full_precision_index_searches_by_it_until_the_new_one_is_ready(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an upgrade meets: the index of cortex-bot before half precision (full-precision vectors, another
    name). Searches go by it until the half-precision one is built (over a big table that takes minutes: they
    must not scan every vector meanwhile), then by the new one, and the old one is dropped."""
    monkeypatch.setattr(memory_module, "OLD_INDEX_GRACE_SECONDS", 0.0)
    pg = await open_storage(pg_url + "?enable_seqscan=off")  # a tiny table: only then is an index worth it
    try:
        await pg.migrate()
        pair = await _pair(pg)
        vectors = _two_clusters(40, 10)
        await _items(pg, pair, [f"item {n}" for n in range(50)], vectors)
        old, new = f"memory_items_hnsw_{DIMS}", f"memory_items_hnswh_{DIMS}"
        await pg.db.write(f"CREATE INDEX {old} ON memory_items USING hnsw ((embedding::vector({DIMS}))"
                          f" vector_cosine_ops) WITH (m = 32) WHERE vector_dims(embedding) = {DIMS}")
        await pg.db.write("ANALYZE memory_items")
        top = await pg.memory.vector_top(ItemScope(pair), MODEL, vectors[-1], 5)
        assert len(top) == 5
        assert await index_scans(pg, old, above=0) >= 1  # by the old index, not by reading every row
        await pg.memory.ensure_vector_index(DIMS)  # the backfill, once it runs
        assert await _index_state(pg, old) is None  # dropped
        state = await _index_state(pg, new)
        assert state is not None and state[1]
        before = await index_scans(pg, new)
        assert await pg.memory.vector_top(ItemScope(pair), MODEL, vectors[-1], 5) == top  # the same neighbours
        assert await index_scans(pg, new, above=before) > before  # now by the new index
    finally:
        await pg.close()


async def test_searches_of_a_large_index_look_at_more_candidates_unless_the_url_says_how_many(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph walk misses more of the exact neighbours the bigger the graph (at a million vectors, 0.94 of
    the top-10 with 100 candidates, 0.96 with 150): a search of an index of LARGE_INDEX vectors or more runs on
    a connection set to 150, one of a smaller index on one set to 100 (a pooled connection keeps what a search
    set); an operator's own setting in the URL stays as it is."""
    monkeypatch.setattr(memory_module, "INDEX_SIZE_SECONDS", 0.0)  # every search reads the index's size
    pg = await open_storage(pg_url, pool_size=1)  # one connection: what the searches left on it shows

    async def setting(storage: Storage) -> str:
        return str((await storage.db.fetch_one("SELECT current_setting('hnsw.ef_search')"))[0])

    try:
        await pg.migrate()
        pair = await _pair(pg)
        vectors = _two_clusters(40, 10)
        await _items(pg, pair, [f"item {n}" for n in range(50)], vectors)
        await pg.memory.ensure_vector_index(DIMS)  # its size: the 50 vectors
        expected = await pg.memory.vector_top(ItemScope(pair), MODEL, vectors[-1], 5)
        assert len(expected) == 5 and await setting(pg) == "100"  # a small index
        monkeypatch.setattr(memory_module, "LARGE_INDEX", 50)
        assert await pg.memory.vector_top(ItemScope(pair), MODEL, vectors[-1], 5) == expected
        assert await setting(pg) == "150"
        monkeypatch.setattr(memory_module, "LARGE_INDEX", 51)  # small again: the connection goes back
        assert await pg.memory.vector_top(ItemScope(pair), MODEL, vectors[-1], 5) == expected
        assert await setting(pg) == "100"
        monkeypatch.setattr(memory_module, "LARGE_INDEX", 50)
        operators = await open_storage(pg_url + "?hnsw.ef_search=77", pool_size=1)
        try:
            assert await operators.memory.vector_top(ItemScope(pair), MODEL, vectors[-1], 5) == expected
            assert await setting(operators) == "77"
        finally:
            await operators.close()
    finally:
        await pg.close()


async def test_a_scope_without_vectors_of_the_model_is_told_by_its_index_at_every_run(pg: Storage) -> None:
    """A prepared statement runs by a generic plan from its sixth run on; with the model bound, that plan took
    it for one every row had (the column held one other model) and read the whole table for a LIMIT 1, at
    every reply: 57 ms at 100k items an embedder of another model had embedded. The model is in the
    statement's text now, and every run goes by an index, on every pooled connection: the (pair, model) one,
    or the backlog's (migration 22), where a model no item has yet has no entry either."""
    pair = await _pair(pg)
    rng = np.random.default_rng(3)
    await _items(pg, pair, [f"item {n}" for n in range(3000)], rng.standard_normal((3000, DIMS)).astype(np.float32))
    await pg.db.write("ANALYZE memory_items")
    repo = MemoryRepository(pg.db)
    indexes = ("memory_items_by_pair_model", "memory_items_backlog")
    before = await settled_index_scans(pg, indexes)  # (the migrations' scans reported: not counted as the test's)
    for _ in range(30):
        assert not await repo.has_vectors(ItemScope(pair), "another-model")
    assert await index_scans(pg, indexes, above=before + 29) == before + 30
    assert await repo.has_vectors(ItemScope(pair), MODEL)  # (the common one: its first row answers)


async def test_the_embedding_backlog_is_read_by_the_primary_key_after_runs_with_nothing_to_do(pg_url: str) -> None:
    """Bound, the model of the backlog's queries met a generic plan from their sixth run on: runs with
    nothing to embed taught it that every row has the model, and once an embedder of another model had work
    (a new embedder, an import), each batch read the whole table (2.8 s at 100k messages). The model is in
    the statements' text now: the newest rows without its vectors come by the primary key, run after run.
    (10,000 items: the backlog's count goes by its index from a few thousand on; below, PostgreSQL rightly
    finds reading the small table cheaper.)"""
    pg = await open_storage(pg_url, pool_size=1)  # one backend: its statistics are its statements'
    try:
        await pg.migrate()
        pair = await _pair(pg)
        rng = np.random.default_rng(5)
        await _items(pg, pair, [f"item {n}" for n in range(10_000)],
                     rng.standard_normal((10_000, DIMS)).astype(np.float32))
        await pg.db.write("ANALYZE memory_items")

        async def seq_scans() -> int:
            await pg.db.fetch_one("SELECT pg_stat_force_next_flush()")
            row = await pg.db.fetch_one("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'memory_items'")
            assert row is not None
            return int(row[0])

        for _ in range(8):  # nothing to do: every item has the model's vector
            assert await pg.memory.items_to_embed(MODEL, 10) == []
        before = await seq_scans()
        for _ in range(8):  # another model's embedder: all of them are its work
            assert len(await pg.memory.items_to_embed("another-model", 10)) == 10
        assert await seq_scans() == before
    finally:
        await pg.close()


async def test_a_search_of_the_newest_messages_walks_back_even_by_a_generic_plan(pg_url: str) -> None:
    """From a statement's sixth run on, PostgreSQL may plan it without its values. Searching the newest
    matches of common words, that generic plan combined the GIN index of the words with the user's index,
    then fetched and sorted every match (157 ms for a user of 100k messages), instead of walking back through
    the user's messages to the first few. Now the words' index is never used for it, whatever the plan."""
    pg = await open_storage(pg_url, pool_size=1)  # one backend: its statistics are its statements'
    try:
        await pg.migrate()
        users = [await pg.upsert_user(f"discord:{n}", f"U{n}") for n in range(301)]
        for user in users:
            channel = await pg.upsert_channel(f"discord:dm-{user.id}", "dm", True)
            await pg.db.write(
                "INSERT INTO messages (channel_id, user_id, persona, role, author_name, text, token_count, seq,"
                " created_at) SELECT ?, ?, 'Cora', 'user', 'x', CASE WHEN g % 5 = 0 THEN 'w' || g || 'x river'"
                " ELSE 'That sounds lovely. Tell me more about the tomatoes in your garden' END, 5, g, 1"
                " FROM generate_series(1, ?) AS g", (channel.id, user.id, 100_000 if user is users[0] else 10))
        await pg.db.write("VACUUM ANALYZE messages")
        # What PostgreSQL chose by itself from the sixth run on, in an audit on a database of 100k messages
        # of one user among 300 (in a test's smaller one it is left to chance): the generic plan.
        await pg.db.write("SET plan_cache_mode = force_generic_plan")

        async def word_index_scans() -> int:
            await pg.db.fetch_one("SELECT pg_stat_force_next_flush()")
            row = await pg.db.fetch_one("SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelname = 'messages_ts'")
            return int(row[0]) if row else 0

        before = await word_index_scans()
        for run in range(12):
            user = users[0] if run % 2 else users[1 + run]
            found = await pg.memory.message_text_candidates(user.id, "Cora", {'"tomato"': 1.0, '"garden"': 1.0},
                                                            newest=True, limit=50, exclude=[1, 2, 3])
            assert len(found) == (50 if user is users[0] else 8)
            assert [int(r["id"]) for r in found] == sorted((int(r["id"]) for r in found), reverse=True)
        assert await word_index_scans() == before
    finally:
        await pg.close()


async def test_a_search_of_a_pairs_newest_items_walks_back_even_by_a_generic_plan(pg_url: str) -> None:
    """The newest items matching common words, by a generic plan (from a statement's sixth run on), came from
    the words' GIN index combined with the pair's index, then every match fetched and sorted: 25-67 ms for a
    pair of 100k items in an audit. They are found by walking back through the pair's live items now (an index
    of those, migration 22), whatever the plan."""
    pg = await open_storage(pg_url, pool_size=1)  # one backend: its statistics are its statements'
    try:
        await pg.migrate()
        await pg.db.write("INSERT INTO users (key, display_name, created_at, updated_at)"
                          " SELECT 'discord:' || g, 'U', 0, 0 FROM generate_series(1, 301) AS g")
        await pg.db.write("INSERT INTO cortex_pairs (user_id, persona, created_at) SELECT id, 'Cora', 0 FROM users")
        pairs = [int(r[0]) for r in await pg.db.fetch_all("SELECT id FROM cortex_pairs ORDER BY id")]
        await pg.db.write(
            "INSERT INTO memory_items (pair_id, category, content, created_at, updated_at, archived_at)"
            " SELECT p.id, 'fact', CASE WHEN g % 5 = 0 THEN 'w' || g || 'x river'"
            " ELSE 'Ann grows tomatoes in her garden' END, g, g, CASE WHEN g % 7 = 0 THEN 1 END"
            " FROM cortex_pairs AS p, generate_series(1, CASE WHEN p.id = ? THEN 100000 ELSE 10 END) AS g", (pairs[0],))
        await pg.db.write("VACUUM ANALYZE memory_items")
        await pg.db.write("SET plan_cache_mode = force_generic_plan")

        async def word_index_scans() -> int:
            await pg.db.fetch_one("SELECT pg_stat_force_next_flush()")
            row = await pg.db.fetch_one("SELECT idx_scan FROM pg_stat_user_indexes"
                                        " WHERE indexrelname = 'memory_items_ts'")
            return int(row[0]) if row else 0

        before = await word_index_scans()
        for run in range(12):
            pair = pairs[0] if run % 2 else pairs[1 + run]
            found = await pg.memory.item_text_candidates(pair, {'"tomato"': 1.0, '"garden"': 1.0}, newest=True,
                                                         now=time.time(), limit=50)
            assert len(found) == (50 if pair == pairs[0] else 7)  # (of 10: 5 and 10 say river, 7 is archived)
            ids = [int(r["id"]) for r in found]
            assert ids == sorted(ids, reverse=True)
            if pair == pairs[0]:  # the newest live matches of the big pair, none archived
                live = await pg.db.fetch_all(
                    "SELECT id FROM memory_items WHERE pair_id = ? AND archived_at IS NULL AND content LIKE 'Ann%'"
                    " ORDER BY id DESC LIMIT 50", (pair,))
                assert ids == [int(r[0]) for r in live]
        assert await word_index_scans() == before
    finally:
        await pg.close()


async def test_the_newest_of_a_key_a_pair_or_a_channel_come_from_an_index_even_by_a_generic_plan(pg_url: str) -> None:
    """A generic plan (PostgreSQL's choice from a statement's sixth run on) took the newest jobs of a key by
    walking every job back from the newest, a pair's runs every run, and the last reply to a user in a
    channel from two indexes of all the user's messages, sorted. Each has an index in its order now."""
    pg = await open_storage(pg_url, pool_size=1)  # one backend: its statistics are its statements'
    try:
        await pg.migrate()
        # 500 users, each with a DM channel, a pair, 40 jobs, 40 runs and 40 messages, the first user's oldest
        await pg.db.write("INSERT INTO users (key, display_name, created_at, updated_at)"
                          " SELECT 'discord:' || g, 'U', 0, 0 FROM generate_series(1, 500) AS g")
        await pg.db.write("INSERT INTO channels (key, name, is_dm, created_at, updated_at)"
                          " SELECT 'discord:dm-' || id, 'dm', 1, 0, 0 FROM users ORDER BY id")
        await pg.db.write("INSERT INTO cortex_pairs (user_id, persona, created_at) SELECT id, 'Cora', 0 FROM users")
        await pg.db.write("INSERT INTO jobs (kind, key, payload, status, max_attempts, run_after, created_at,"
                          " updated_at) SELECT 'x', 'key' || u, '{}', 'done', 1, 0, 0, 0"
                          " FROM generate_series(1, 40) AS g, generate_series(1, 500) AS u ORDER BY u <> 1, g")
        await pg.db.write("INSERT INTO cortex_runs (pair_id, tier, status, started_at) SELECT p.id, '50', 'success', 0"
                          " FROM generate_series(1, 40) AS g, cortex_pairs AS p ORDER BY p.id, g")
        await pg.db.write(
            "INSERT INTO messages (channel_id, user_id, persona, role, author_name, text, token_count, seq, created_at)"
            " SELECT c.id, u.id, 'Cora', CASE WHEN g % 2 = 0 THEN 'assistant' ELSE 'user' END, 'x', 'hi', 1, g, 1"
            " FROM generate_series(1, 40) AS g JOIN users AS u ON true"
            " JOIN channels AS c ON c.key = 'discord:dm-' || u.id ORDER BY u.id, g")
        await pg.db.write("VACUUM ANALYZE")
        await pg.db.write("SET plan_cache_mode = force_generic_plan")
        first = await pg.get_user("discord:1")
        assert first is not None
        pair = (await pg.cortex.ensure_pair(first.id, "Cora")).id

        async def scans(index: str) -> int:
            await pg.db.fetch_one("SELECT pg_stat_force_next_flush()")
            row = await pg.db.fetch_one("SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelname = ?", (index,))
            return int(row[0]) if row else 0

        indexes = ("jobs_by_key_id", "cortex_runs_by_pair_id", "messages_by_channel_user")
        before = [await scans(i) for i in indexes]
        for _ in range(6):
            assert len(await pg.recent_jobs("key1")) == 5
            assert len(await pg.cortex.runs(pair)) == 20
            assert (await pg.sources.last_reply(first.id, f"discord:dm-{first.id}") or (0,))[0] > 0
        after = [await scans(i) for i in indexes]
        assert [a - b for a, b in zip(after, before, strict=True)] == [6, 6, 6]
    finally:
        await pg.close()


async def test_the_prompts_files_are_read_without_the_pairs_older_versions(pg_url: str) -> None:
    """Each reply past the cache reads the pair's current files; joined to all of the pair's versions, that
    query read every one of them (8-16 ms at 1,500 versions). Now it reads each file's newest, whatever the
    history holds."""
    pg = await open_storage(pg_url, pool_size=1)  # one backend: its statistics are its statements'
    try:
        await pg.migrate()
        user = await pg.upsert_user("discord:1", "Ann")
        pair = (await pg.cortex.ensure_pair(user.id, "Cora")).id

        async def read_rows() -> int:
            pg.cortex._prompt_files.clear()
            await pg.db.fetch_one("SELECT pg_stat_force_next_flush()")
            row = await pg.db.fetch_one("SELECT coalesce(idx_tup_fetch, 0) + seq_tup_read FROM pg_stat_user_tables"
                                        " WHERE relname = 'cortex_versions'")
            assert row is not None
            return int(row[0])

        for versions in (1000, 2000):
            await pg.db.write("INSERT INTO cortex_versions (pair_id, filename, version, content, author, created_at)"
                              " SELECT ?, f, g, f || ' v' || g, 'model', 0 FROM generate_series(1, ?) AS g,"
                              " unnest(ARRAY['memory.md', 'soul.md']) AS f ON CONFLICT DO NOTHING", (pair, versions))
            await pg.db.write("VACUUM ANALYZE cortex_versions")
            before = await read_rows()
            files = await pg.cortex.files_for_prompt(user.id, "Cora")
            assert files == {"memory.md": f"memory.md v{versions}", "soul.md": f"soul.md v{versions}"}
            assert await read_rows() - before <= 20, versions  # the two newest rows (and their max), not all 4,000
    finally:
        await pg.close()


async def test_the_vector_indexes_are_loaded_into_the_buffers_where_pg_prewarm_is_installed(
        pg: Storage, caplog: pytest.LogCaptureFixture) -> None:
    """Right after a build or a server restart, a search of a large index read its pages from disk (at 1M
    items the first searches had twice the p95 of warm ones). With the operator's pg_prewarm installed, a
    process that finds the indexes ready loads them; without it, nothing is tried and nothing is said."""
    pair = await _pair(pg)
    await _items(pg, pair, [f"item {n}" for n in range(50)], _two_clusters(40, 10))
    with caplog.at_level(logging.INFO):
        await pg.memory.ensure_vector_index(DIMS)
    assert "pg_prewarm" not in caplog.text
    await pg.db.write("CREATE EXTENSION IF NOT EXISTS pg_prewarm")  # (the test's user is a superuser)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        await MemoryRepository(pg.db).ensure_vector_index(DIMS)  # the next process to start
    for table in ("memory_items", "message_vectors"):
        row = await pg.db.fetch_one("SELECT pg_relation_size(to_regclass(?)) / current_setting('block_size')::int",
                                    (f"{table}_hnswh_{DIMS}",))
        assert row is not None and int(row[0]) > 0
        assert (f"loaded the vector index {table}_hnswh_{DIMS} into PostgreSQL's buffers ({int(row[0])} blocks, "
                "pg_prewarm)") in caplog.text
    assert "could not load" not in caplog.text
