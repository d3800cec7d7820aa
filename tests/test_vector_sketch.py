"""The sketch of a large vector block: a shortlist by the block's main directions, then the exact product.

The thresholds are lowered here (a few thousand rows of 96 dimensions stand in for 100k of 384), and
the vectors are shaped like an embedder's: one direction every vector shares, a spread that fades.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import cortex.memory.sketch as sketch_module
import cortex.memory.vectors as vectors_module
from cortex.memory.embedders import normalize
from cortex.memory.sketch import Sketch
from cortex.memory.vectors import Block

DIM = 96


@pytest.fixture(autouse=True)
def small_sketches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vectors_module, "THREAD_ABOVE", 500)
    monkeypatch.setattr(vectors_module, "SKETCH_ABOVE", 2000)
    monkeypatch.setattr(vectors_module, "SHORTLIST", 600)
    monkeypatch.setattr(sketch_module, "DIMS", 24)


def embedding_like(rows: int, seed: int) -> npt.NDArray[np.float32]:
    """Unit vectors as an embedder gives them: around one direction every vector shares, in topics
    (texts about the same thing), with a spread that fades over the directions like e5's (whose 96
    strongest of 384 directions hold 90 % of its variance): the sketch relies on the last two."""
    rng = np.random.default_rng(seed)
    rotation, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((DIM, DIM)))
    spread = (1 + np.arange(DIM)) ** -0.5
    spread /= np.linalg.norm(spread)
    topics = (np.random.default_rng(1).standard_normal((200, DIM)) * spread) @ rotation
    near = (rng.standard_normal((rows, DIM)) * spread) @ rotation
    return normalize(np.full(DIM, 0.9 / DIM ** 0.5) + 0.35 * topics[rng.integers(0, 200, rows)] + 0.2 * near)


def ranked(scores: dict[int, float], count: int) -> list[int]:
    return sorted(scores, key=lambda i: -scores[i])[:count]


@pytest.fixture
def sketched_scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the searches that went through a sketch (so an exact fallback cannot pass for one)."""
    calls: list[int] = []
    real = vectors_module._sketched_scan

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(vectors_module, "_sketched_scan", counting)
    return calls


async def test_a_sketched_block_finds_what_the_exact_product_finds(
        monkeypatch: pytest.MonkeyPatch, sketched_scans: list[int]) -> None:
    monkeypatch.setattr(sketch_module, "SAMPLE", 250)  # every 24th row, as 4,096 of 100k: the spread is estimated
    matrix = embedding_like(6000, seed=1)
    block = Block(np.arange(1, 6001, dtype=np.int64), matrix)
    assert await block.sketched()
    assert block._sketch is not None and block._sketch.covered == 6000
    assert block.footprint == 6000 + 6000 * 24 // DIM  # what the cache's budget counts for it
    rng = np.random.default_rng(2)
    recall, deviations = [], []
    for row in rng.choice(6000, size=60, replace=False):
        query = normalize((matrix[row] + 0.001 * rng.standard_normal(DIM))[None, :])[0]
        approximate, exact = await block.top_async(query, 30), block.top(query, 30)
        assert ranked(approximate, 1) == ranked(exact, 1) == [row + 1]
        recall.append(len(set(ranked(approximate, 10)) & set(ranked(exact, 10))) / 10)
        spread = float(np.std(matrix @ query))
        # the excess over the typical level: the same up to the estimate of the spread (the mean is exact)
        deviations.append(max(abs(approximate[i] - exact[i]) for i in approximate.keys() & exact.keys()) / spread)
    assert len(sketched_scans) == 60
    assert np.mean(recall) >= 0.97
    assert max(deviations) <= 0.3 and np.mean(deviations) <= 0.12


async def test_rows_added_after_the_sketch_are_scored_exactly_and_a_grown_block_gets_a_new_sketch(
        sketched_scans: list[int]) -> None:
    matrix = embedding_like(3000, seed=3)
    block = Block(np.arange(3000, dtype=np.int64), matrix)
    await block.sketched()
    first = block._sketch
    fresh = embedding_like(1000, seed=4)
    block.append(list(range(3000, 4000)), fresh)
    for row in (717, 3, 999):  # in the tail the sketch does not cover, and counted in the typical level
        found, exact = await block.top_async(fresh[row], 10), block.top(fresh[row], 10)
        assert ranked(found, 1) == [3000 + row]
        assert all(found[i] == pytest.approx(exact[i], abs=1e-3) for i in found.keys() & exact.keys())
    assert len(sketched_scans) == 3
    assert block._sketch is first and block._building is None  # 4000 < 1.5 × 3000: no rebuild yet
    block.append(list(range(4000, 4600)), embedding_like(600, seed=5))
    await block.top_async(fresh[0], 10)  # the search that notices starts the rebuild and still answers
    assert await block.sketched()
    assert block._sketch is not first and block._sketch is not None and block._sketch.covered == 4600


async def test_rows_of_another_dimension_replace_the_block_and_its_sketch() -> None:
    block = Block(np.arange(2500, dtype=np.int64), embedding_like(2500, seed=6))
    await block.sketched()
    assert block._sketch is not None
    other = normalize(np.random.default_rng(7).standard_normal((5, 8)))
    block.append([1, 2, 3, 4, 5], other)
    assert block._sketch is None
    assert ranked(await block.top_async(other[2], 3), 1) == [3]


async def test_a_sketch_of_rows_replaced_before_it_was_built_is_dropped() -> None:
    block = Block(np.arange(2500, dtype=np.int64), embedding_like(2500, seed=12))
    block._current_sketch()  # a search scheduled the build: it has not run yet
    building = block._building
    assert building is not None
    block.append([1, 2], normalize(np.ones((2, 8))))  # the rows are replaced before it runs
    await building
    assert block._sketch is None


async def test_a_build_cancelled_before_it_ran_does_not_block_the_next() -> None:
    block = Block(np.arange(2500, dtype=np.int64), embedding_like(2500, seed=13))
    block._current_sketch()
    assert block._building is not None
    block._building.cancel()  # e.g. the bot shutting down, or a test's loop closing
    await asyncio.sleep(0)
    assert await block.sketched() and block._sketch is not None


async def test_a_failed_sketch_build_is_logged_and_the_search_stays_exact(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(matrix: npt.NDArray[np.float32]) -> Sketch:
        raise np.linalg.LinAlgError("eigh did not converge")

    monkeypatch.setattr(Sketch, "build", staticmethod(broken))
    matrix = embedding_like(2500, seed=8)
    block = Block(np.arange(2500, dtype=np.int64), matrix)
    with caplog.at_level(logging.ERROR, logger="cortex.memory.vectors"):
        await block.sketched()
        for _ in range(3):  # no new attempt per search: only once the block has grown by half
            found, exact = await block.top_async(matrix[42], 20), block.top(matrix[42], 20)
            assert found.keys() == exact.keys() and all(found[i] == pytest.approx(exact[i], abs=1e-4) for i in exact)
            await block.sketched()
    assert block._sketch is None
    assert caplog.text.count("building the sketch of a block of 2500 vectors failed") == 1
    block.append(list(range(2500, 3750)), embedding_like(1250, seed=11))
    with caplog.at_level(logging.ERROR, logger="cortex.memory.vectors"):
        await block.sketched()
    assert caplog.text.count("building the sketch of a block of 3750 vectors failed") == 1


def test_the_moments_give_the_typical_level_without_scoring_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    matrix = embedding_like(5000, seed=9)
    query = embedding_like(1, seed=10)[0]
    sims = matrix.astype(np.float64) @ query
    whole = Sketch.build(matrix)  # every row sampled: the covariance is the rows' own
    total, squares = whole.moments(query)
    assert total == pytest.approx(sims.sum(), rel=1e-4) and squares == pytest.approx(sims @ sims, rel=1e-4)
    monkeypatch.setattr(sketch_module, "SAMPLE", 400)  # every 12th row: the spread is estimated
    total, squares = Sketch.build(matrix).moments(query)
    assert total == pytest.approx(sims.sum(), rel=1e-4)  # the mean is taken over all rows
    variance = squares / 5000 - (total / 5000) ** 2
    assert variance == pytest.approx(sims.var(), rel=0.2)
