"""Stored embeddings of one pair, held in memory as float32 matrices for brute-force search.

Vectors live in the database (``memory_items.embedding`` and ``message_vectors``, float32 blobs,
tagged with the embedder's name). Loading a pair's blobs costs far more than scoring them (100k × 384
dims: ~0.7 s to read, ~10-15 ms for the matrix product), so each pair's matrix is loaded once, in
pages straight into a preallocated array (the peak memory stays near the matrix's own size and the
event loop gets a turn between pages), kept in an LRU cache and grown in place as the backfill adds
vectors. Only vectors of the current embedder count; visibility (archived, expired, superseded) is
checked by the caller on the candidates. Large matrices are scored on a worker thread (numpy releases
the GIL), so the full-text part of a search runs meanwhile; above ``SKETCH_ABOVE`` vectors a block is
searched through its sketch (:mod:`cortex.memory.sketch`: a shortlist, then the exact product over it).

The cache belongs to one process: another process writing vectors to the same database is not seen
until this one's entry is evicted or invalidated (SQLite deployments run one bot process). On
PostgreSQL nothing is cached: :class:`DatabaseVectors` searches pgvector's HNSW index instead, so
every process sees every vector at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bot.storage.core import Storage
from bot.storage.memory import ItemScope, MessageScope, VectorScope
from cortex.memory.sketch import REBUILD_GROWTH, SHORTLIST, Sketch
from cortex.memory.sketch import SKETCH_ABOVE as SKETCH_ABOVE  # read here at each search: the bench sets it

log = logging.getLogger(__name__)

Scope = tuple[str, int] | tuple[str, int, str]  # ("items", pair_id) or ("messages", user_id, persona)

PAGE = 4096
THREAD_ABOVE = 20_000  # vectors: bigger matrices are scored on a worker thread
TYPICAL_MIN = 30  # vectors needed to estimate a query's typical similarity from their spread
GATHER = 512  # shortlisted rows copied out of the matrix at a time
# Over all cached scopes, a sketch counting as its share of a vector (~230 MB at 384 dimensions, ~290 MB
# if every block were sketched); least recently used go.
MAX_CACHED_VECTORS = 150_000


@dataclass(frozen=True, slots=True)
class CentredFloor:
    """The relevance floor of memory items: an item found by meaning counts only when its cosine to the
    query stays at least ``least`` once the embedder's typical directions are taken out of both (the
    query minus the mean query, the item minus the mean passage, each re-normalised).

    Why: every e5 vector shares one common direction, so raw cosines sit in a narrow band (0.75-0.9 for
    anything) and a few items ("hubs") come out on top for nearly any query. Gibberish scores 0.8
    against every fact. A floor on raw cosines, however set, either let nearly every unrelated query
    through or dropped most true ones; centred, the hubs are gone and one threshold holds from 12 to 40
    items. How it was chosen: see the README's "Relevance floor"."""

    direction: npt.NDArray[np.float32]  # the query minus the mean query, normalised
    offset: npt.NDArray[np.float32]  # the mean passage
    least: float

    @classmethod
    def of(cls, query: npt.NDArray[np.float32], mean_query: npt.NDArray[np.float32],
           mean_passage: npt.NDArray[np.float32], least: float) -> CentredFloor:
        direction = query - mean_query
        norm = float(np.linalg.norm(direction))
        return cls((direction / norm if norm > 0 else direction).astype(np.float32),
                   np.asarray(mean_passage, dtype=np.float32), least)

    def passes(self, vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.bool_]:
        """Which rows of ``vectors`` (one per item) stand above the floor."""
        if not len(vectors) or vectors.shape[1] != self.direction.shape[0]:
            return np.ones(len(vectors), dtype=np.bool_)
        centred = vectors - self.offset
        norms = np.maximum(np.linalg.norm(centred, axis=1), 1e-6)
        passing: npt.NDArray[np.bool_] = (centred @ self.direction) / norms >= self.least
        return passing


@dataclass(frozen=True, slots=True)
class RelevanceFloors:
    """What a candidate found by meaning alone must pass, items ``item`` and past messages ``message``
    (None: no floor)."""

    item: CentredFloor | None = None
    message: CentredFloor | None = None


class Block:
    """One scope's vectors: ``ids`` and ``matrix`` are views of buffers that grow by doubling, so the
    backfill's small additions cost no copy of the whole matrix. A large block also keeps a
    :class:`Sketch` of its rows, rebuilt in the background once the block has outgrown it."""

    __slots__ = ("_ids", "_matrix", "_size", "_known", "_sketch", "_building", "_generation", "_failed_at")

    def __init__(self, ids: npt.NDArray[np.int64], matrix: npt.NDArray[np.float32]) -> None:
        self._ids = ids
        self._matrix = matrix
        self._size = len(ids)
        self._known: dict[int, int] | None = None  # id -> row, built on the first append only
        self._sketch: Sketch | None = None
        self._building: asyncio.Task[None] | None = None
        self._generation = 0  # bumped when the rows are replaced: a sketch built before is dropped
        self._failed_at = 0  # rows when a sketch build last failed: tried again once the block has grown

    @property
    def ids(self) -> npt.NDArray[np.int64]:
        return self._ids[: self._size]

    @property
    def matrix(self) -> npt.NDArray[np.float32]:
        return self._matrix[: self._size]

    def append(self, ids: Sequence[int], vectors: npt.NDArray[np.float32]) -> None:
        if not len(ids):
            return
        if not self._size or self._matrix.shape[1] != vectors.shape[1]:  # empty, or another dimension
            self._ids, self._matrix, self._size = np.asarray(ids, dtype=np.int64), vectors.copy(), len(ids)
            self._known, self._sketch = None, None
            self._generation += 1
            return
        if self._known is None:
            self._known = {int(i): row for row, i in enumerate(self.ids.tolist())}
        known = self._known
        replaced = [(n, known[int(i)]) for n, i in enumerate(ids) if int(i) in known]
        if replaced:  # embedded again (its context changed, a neighbour was deleted): the new vector counts
            for n, row in replaced:
                self._matrix[row] = vectors[n]
            self._sketch = None
            self._generation += 1
        keep = [n for n, i in enumerate(ids) if int(i) not in known]
        if not keep:
            return
        need = self._size + len(keep)
        if need > len(self._ids):
            capacity = max(need, 2 * len(self._ids), 64)
            grown_ids = np.zeros(capacity, dtype=np.int64)
            grown_ids[: self._size] = self.ids
            grown = np.zeros((capacity, self._matrix.shape[1]), dtype=np.float32)
            grown[: self._size] = self.matrix
            self._ids, self._matrix = grown_ids, grown
        self._ids[self._size:need] = [ids[n] for n in keep]
        self._matrix[self._size:need] = vectors[keep]
        known.update((int(ids[n]), self._size + k) for k, n in enumerate(keep))
        self._size = need

    def top(self, query: npt.NDArray[np.float32], k: int, floor: CentredFloor | None = None) -> dict[int, float]:
        """The ``k`` best ids, each with how far its cosine similarity to ``query`` rises above what is
        typical for this query in this block (the mean plus two standard deviations over all its
        vectors; over fewer than ``TYPICAL_MIN`` vectors, the lowest similarity).

        Raw cosines of one embedder sit in a narrow band (e5: ~0.75-0.9 for anything), so min-max
        scaling over a few candidates inflates small differences; the excess over the typical level
        says how much a vector stands out. Measured on LoCoMo (R@10): 64.8 against 60.2 for min-max.
        Values can be negative (less similar than typical); callers clip. None fails ``floor`` (the
        relevance floor, applied after the typical level was measured over all). Exact: a sketched
        block's search (:meth:`top_async`) is approximate and estimates the typical level instead."""
        ids, matrix = self.ids, self.matrix
        if not len(ids) or matrix.shape[1] != query.shape[0]:
            return {}
        return _floored(_combine([_scan(matrix, query, k, 0)], ids, k), ids, matrix, floor)

    def top_among(self, query: npt.NDArray[np.float32], among: Sequence[int], k: int,
                  floor: CentredFloor | None = None) -> dict[int, float]:
        """:meth:`top` over the rows of the ids ``among`` only (a group channel's shared items), against the
        typical level of the whole block, so that its scores mean what :meth:`top`'s do. (The best of the
        whole block, filtered after, lost a shared item behind hundreds of private ones.) Exact, always."""
        ids, matrix = self.ids, self.matrix
        if not len(ids) or not len(among) or matrix.shape[1] != query.shape[0]:
            return {}
        sims = matrix @ query
        rows = np.nonzero(np.isin(ids, np.asarray(among, dtype=np.int64)))[0]
        if not len(rows):
            return {}
        best = rows[np.argpartition(-sims[rows], k)[:k]] if k < len(rows) else rows
        scan = _Scan(best, sims[best], len(sims), float(sims.sum(dtype=np.float64)), float(np.dot(sims, sims)),
                     float(sims.min()))
        return _floored(_combine([scan], ids, k), ids, matrix, floor)

    async def top_async(self, query: npt.NDArray[np.float32], k: int, floor: CentredFloor | None = None
                        ) -> dict[int, float]:
        """:meth:`top`; a big block is scanned in two halves on two worker threads (numpy releases the
        GIL, so both cores work while the event loop waits), a sketched one through its sketch."""
        ids, matrix = self.ids, self.matrix  # views: the backfill appending meanwhile shifts no row
        if len(ids) <= THREAD_ABOVE or matrix.shape[1] != query.shape[0]:
            return self.top(query, k, floor)
        sketch = self._current_sketch()
        if sketch is not None:
            scan = await asyncio.to_thread(_sketched_scan, matrix, sketch, query, k)
            return _floored(_combine([scan], ids, k), ids, matrix, floor)
        half = len(ids) // 2
        parts = await asyncio.gather(
            asyncio.to_thread(_scan, matrix[:half], query, k, 0),
            asyncio.to_thread(_scan, matrix[half:], query, k, half),
        )
        return _floored(_combine(list(parts), ids, k), ids, matrix, floor)

    @property
    def footprint(self) -> int:
        """The memory it holds, in vectors: its rows, and its sketch's (a quarter more at 384 dimensions)."""
        sketch = self._sketch
        return self._size + (sketch.covered * sketch.codes.shape[1] // max(self._matrix.shape[1], 1) if sketch else 0)

    def _current_sketch(self) -> Sketch | None:
        """The sketch to search with (None: scan exactly), starting a rebuild in the background when
        the block has none or has outgrown it; an outgrown sketch serves until the new one is ready."""
        sketch, rows = self._sketch, self._size
        if sketch is not None and not sketch.fits(rows, self._matrix.shape[1]):
            sketch = self._sketch = None
        idle = self._building is None or self._building.done()  # done: also one cancelled before it ran
        if rows > SKETCH_ABOVE and (sketch is None or sketch.stale(rows)) and idle \
                and rows >= self._failed_at * REBUILD_GROWTH:
            # The rows as they are now: rows replaced before the build runs make its result stale.
            self._building = asyncio.ensure_future(self._build_sketch(self._generation, self.matrix))
        return sketch

    async def sketched(self) -> bool:
        """Build the sketch now if the block is large enough and has none (or an outgrown one); whether
        a sketch now covers every row."""
        self._current_sketch()
        building = self._building
        if building is not None and not building.done():
            await asyncio.shield(building)
        return self._sketch is not None and self._sketch.covered == self._size

    async def _build_sketch(self, generation: int, matrix: npt.NDArray[np.float32]) -> None:
        try:
            sketch = await asyncio.to_thread(Sketch.build, matrix)
            if generation == self._generation:
                self._sketch = sketch
        except Exception:  # searches go on exactly; tried again once the block has grown by half
            self._failed_at = len(matrix)
            log.exception("building the sketch of a block of %d vectors failed", len(matrix))
        finally:
            self._building = None


def _floored(found: tuple[npt.NDArray[np.int64], dict[int, float]], ids: npt.NDArray[np.int64],
             matrix: npt.NDArray[np.float32], floor: CentredFloor | None) -> dict[int, float]:
    """``found``'s scores without the rows that fail ``floor``."""
    rows, scores = found
    if floor is None or not scores:
        return scores
    for gone in ids[rows[~floor.passes(matrix[rows])]].tolist():
        del scores[gone]
    return scores


@dataclass(frozen=True, slots=True)
class _Scan:
    rows: npt.NDArray[np.int64]  # the best rows of this part (indexes into the whole block)
    sims: npt.NDArray[np.float32]
    count: int
    total: float
    squares: float
    lowest: float


def _scan(matrix: npt.NDArray[np.float32], query: npt.NDArray[np.float32], k: int, offset: int) -> _Scan:
    sims = matrix @ query
    best = np.argpartition(-sims, k)[:k] if k < len(sims) else np.arange(len(sims))
    return _Scan(best + offset, sims[best], len(sims), float(sims.sum(dtype=np.float64)),
                 float(np.dot(sims, sims)), float(sims.min()))


def _sketched_scan(matrix: npt.NDArray[np.float32], sketch: Sketch, query: npt.NDArray[np.float32], k: int
                   ) -> _Scan:
    """:func:`_scan` through ``sketch``: its shortlist and the rows added since, scored exactly; the sums
    for the typical level from the sketch's moments (covered rows) and the exact scores (the rest)."""
    short = np.sort(sketch.shortlist(query, max(SHORTLIST, 20 * k)))
    scored = np.empty(len(short), dtype=np.float32)
    for start in range(0, len(short), GATHER):  # in slices: a worker thread's memory keeps no 6 MB copy
        scored[start:start + GATHER] = matrix[short[start:start + GATHER]] @ query
    tail = matrix[sketch.covered:] @ query  # the rows added since: contiguous, one product
    rows = np.concatenate([short, np.arange(sketch.covered, len(matrix), dtype=np.int64)])
    sims = np.concatenate([scored, tail])
    best = np.argpartition(-sims, k)[:k] if k < len(sims) else np.arange(len(sims))
    total, squares = sketch.moments(query)
    return _Scan(rows[best], sims[best], len(matrix), total + float(tail.sum(dtype=np.float64)),
                 squares + float(np.dot(tail, tail)), float(sims.min()))


def _combine(parts: list[_Scan], ids: npt.NDArray[np.int64], k: int) -> tuple[npt.NDArray[np.int64], dict[int, float]]:
    """The ``k`` best of the parts as excess over the typical level (by id), and their rows."""
    count = sum(p.count for p in parts)
    if count >= TYPICAL_MIN:
        mean = sum(p.total for p in parts) / count
        variance = max(sum(p.squares for p in parts) / count - mean * mean, 0.0)
        floor = mean + 2.0 * variance ** 0.5
    else:
        floor = min(p.lowest for p in parts) if count > 1 else 0.0
    rows = np.concatenate([p.rows for p in parts])
    sims = np.concatenate([p.sims for p in parts])
    if k < len(sims):
        keep = np.argpartition(-sims, k)[:k]
        rows, sims = rows[keep], sims[keep]
    return rows, dict(zip(ids[rows].tolist(), (sims - floor).tolist(), strict=True))


def _empty() -> Block:
    return Block(np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32))


def repo_scope(scope: Scope) -> VectorScope:
    return ItemScope(int(scope[1])) if len(scope) == 2 else MessageScope(int(scope[1]), str(scope[2]))


class VectorIndex:
    """Vectors of the SQLite engine: loaded per scope into numpy matrices, scanned by brute force."""

    def __init__(
        self, storage: Storage, model: str, *, message_model: str | None = None,
        max_vectors: int = MAX_CACHED_VECTORS,
    ) -> None:
        self.repo = storage.memory
        self.model = model  # the tag of item vectors
        self.message_model = message_model or model  # the tag of message vectors
        self.max_vectors = max_vectors
        self._blocks: OrderedDict[Scope, Block] = OrderedDict()
        self._loading: dict[Scope, asyncio.Task[Block]] = {}
        # While a scope loads, what the backfill adds meanwhile (applied after) and whether it was
        # invalidated (then the loaded block is not kept).
        self._pending: dict[Scope, list[tuple[list[int], npt.NDArray[np.float32]]]] = {}
        self._stale: set[Scope] = set()

    def model_of(self, scope: Scope) -> str:
        return self.model if len(scope) == 2 else self.message_model

    async def has_vectors(self, scope: Scope) -> bool:
        return bool(len((await self._block(scope)).ids))

    async def top(self, scope: Scope, query: npt.NDArray[np.float32], k: int, floor: CentredFloor | None = None
                  ) -> dict[int, float]:
        """The ``k`` most similar ids of the scope (see :meth:`Block.top`), none failing ``floor``."""
        return await (await self._block(scope)).top_async(query, k, floor)

    async def top_among(self, scope: Scope, query: npt.NDArray[np.float32], among: Sequence[int], k: int,
                        floor: CentredFloor | None = None) -> dict[int, float]:
        """The ``k`` most similar of the ids ``among`` in the scope (see :meth:`Block.top_among`)."""
        block = await self._block(scope)
        if len(block.ids) > THREAD_ABOVE:  # (a product over the whole block: off the event loop)
            return await asyncio.to_thread(block.top_among, query, among, k, floor)
        return block.top_among(query, among, k, floor)

    async def items(self, pair_id: int) -> Block:
        return await self._block(("items", pair_id))

    async def messages(self, user_id: int, persona: str) -> Block:
        return await self._block(("messages", user_id, persona))

    async def _block(self, scope: Scope) -> Block:
        block = self._blocks.get(scope)
        if block is not None:
            self._blocks.move_to_end(scope)
            return block
        task = self._loading.get(scope)
        if task is None:
            # The load is a task of its own that every caller shields: a caller that is cancelled
            # (a reply abandoned, a job losing its lease) never cancels the load for the others.
            task = asyncio.ensure_future(self._load_and_keep(scope))
            self._loading[scope] = task
            self._pending[scope] = []
        return await asyncio.shield(task)

    async def _load_and_keep(self, scope: Scope) -> Block:
        try:
            block = await self._load(scope)
            for ids, vectors in self._pending.get(scope, []):
                block.append(ids, vectors)
            if scope not in self._stale:
                self._blocks[scope] = block
                self._evict(keep=scope)
            return block
        finally:
            del self._loading[scope]
            self._pending.pop(scope, None)
            self._stale.discard(scope)

    def _evict(self, keep: Scope) -> None:
        """Drop least recently used scopes while the cache holds more than ``max_vectors`` vectors (their
        sketches included, see :attr:`Block.footprint`)."""
        total = sum(b.footprint for b in self._blocks.values())
        for scope in list(self._blocks):
            if total <= self.max_vectors:
                break
            if scope != keep:
                total -= self._blocks.pop(scope).footprint

    async def _load(self, scope: Scope) -> Block:
        where, model = repo_scope(scope), self.model_of(scope)
        capacity = await self.repo.count_vectors(where, model)
        ids = np.zeros(capacity, dtype=np.int64)
        matrix: npt.NDArray[np.float32] | None = None
        filled = 0
        after = 0
        while True:
            rows = await self.repo.load_vectors(where, model, after, PAGE)
            if not rows:
                break
            after = rows[-1][0]
            if matrix is None:
                matrix = np.zeros((capacity, len(rows[-1][1]) // 4), dtype=np.float32)
            page = [(i, blob) for i, blob in rows if len(blob) == matrix.shape[1] * 4]
            if filled + len(page) > capacity:  # the backfill added vectors meanwhile
                capacity = filled + len(page) + PAGE
                ids = np.resize(ids, capacity)
                matrix = np.resize(matrix, (capacity, matrix.shape[1]))
            if page:
                ids[filled:filled + len(page)] = [i for i, _ in page]
                matrix[filled:filled + len(page)] = np.frombuffer(
                    b"".join(blob for _, blob in page), dtype=np.float32).reshape(len(page), -1)
                filled += len(page)
            if len(rows) < PAGE:
                break
        if matrix is None or not filled:
            return _empty()
        return Block(ids[:filled], matrix[:filled])

    def add(self, scope: Scope, ids: Sequence[int], vectors: npt.NDArray[np.float32]) -> None:
        """Grow a cached (or loading) scope with freshly stored vectors; an uncached scope loads them later."""
        if not len(ids):
            return
        vectors = vectors.astype(np.float32)
        if scope in self._pending:
            self._pending[scope].append((list(ids), vectors))
        block = self._blocks.get(scope)
        if block is not None:
            block.append(ids, vectors)

    def invalidate(self, scope: Scope | None = None) -> None:
        if scope is None:
            self._blocks.clear()
            self._stale.update(self._loading)
        else:
            self._blocks.pop(scope, None)
            if scope in self._loading:
                self._stale.add(scope)


class DatabaseVectors:
    """Vectors of the PostgreSQL engine: searched where they are stored (pgvector, HNSW), never cached,
    so a vector written by any process is found by every process at once."""

    def __init__(self, storage: Storage, model: str, *, message_model: str | None = None) -> None:
        self.repo = storage.memory
        self.model = model
        self.message_model = message_model or model

    def model_of(self, scope: Scope) -> str:
        return self.model if len(scope) == 2 else self.message_model

    async def has_vectors(self, scope: Scope) -> bool:
        return await self.repo.has_vectors(repo_scope(scope), self.model_of(scope))

    async def top(self, scope: Scope, query: npt.NDArray[np.float32], k: int, floor: CentredFloor | None = None
                  ) -> dict[int, float]:
        if floor is None:
            return await self.repo.vector_top(repo_scope(scope), self.model_of(scope), query, k)
        scores, centred = await self.repo.vector_top_centred(repo_scope(scope), self.model_of(scope), query, k,
                                                             floor.direction, floor.offset)
        return {i: score for i, score in scores.items() if centred[i] >= floor.least}

    def add(self, scope: Scope, ids: Sequence[int], vectors: npt.NDArray[np.float32]) -> None:
        """Nothing to do: the database is the index."""

    def invalidate(self, scope: Scope | None = None) -> None:
        """Nothing to do: nothing is cached."""


VectorSearch = VectorIndex | DatabaseVectors


def vector_search(storage: Storage, model: str, *, message_model: str, max_vectors: int) -> VectorSearch:
    """The engine's way to search vectors: in the database (PostgreSQL) or over cached matrices (SQLite)."""
    if storage.memory.vectors_in_database:
        return DatabaseVectors(storage, model, message_model=message_model)
    return VectorIndex(storage, model, message_model=message_model, max_vectors=max_vectors)
