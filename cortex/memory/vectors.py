"""Stored embeddings of one pair, held in memory as float32 matrices for brute-force search.

Vectors live in the database (``memory_items.embedding`` and ``message_vectors``, float32 blobs,
tagged with the embedder's name). Loading a pair's blobs costs far more than scoring them (10k × 384
dims: ~20 ms to read, ~0.6 ms for the matrix product), so each pair's matrix is loaded once, kept in
an LRU cache and grown in place as the backfill adds vectors. Only vectors of the current embedder
count; visibility (archived, expired, superseded) is checked by the caller on the candidates.

The cache belongs to one process: another process writing vectors to the same database is not seen
until this one's entry is evicted or invalidated (SQLite deployments run one bot process).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bot.storage.sqlite import SQLiteStorage

ItemScope = tuple[str, int]  # ("items", pair_id)
MessageScope = tuple[str, int, str]  # ("messages", user_id, persona)
Scope = ItemScope | MessageScope


@dataclass(slots=True)
class Block:
    ids: npt.NDArray[np.int64]
    matrix: npt.NDArray[np.float32]

    def top(self, query: npt.NDArray[np.float32], k: int) -> dict[int, float]:
        """The ``k`` best ids by dot product with ``query`` (cosine: all vectors are unit length)."""
        if not len(self.ids) or self.matrix.shape[1] != query.shape[0]:
            return {}
        sims = self.matrix @ query
        if k < len(sims):
            best = np.argpartition(-sims, k)[:k]
        else:
            best = np.arange(len(sims))
        return {int(self.ids[i]): float(sims[i]) for i in best}


class VectorIndex:
    def __init__(self, storage: SQLiteStorage, model: str, *, max_scopes: int = 256) -> None:
        self.storage = storage
        self.model = model
        self.max_scopes = max_scopes
        self._blocks: OrderedDict[Scope, Block] = OrderedDict()

    async def items(self, pair_id: int) -> Block:
        return await self._block(("items", pair_id))

    async def messages(self, user_id: int, persona: str) -> Block:
        return await self._block(("messages", user_id, persona))

    async def _block(self, scope: Scope) -> Block:
        block = self._blocks.get(scope)
        if block is not None:
            self._blocks.move_to_end(scope)
            return block
        if len(scope) == 2:
            rows = await self.storage.fetch_all(
                "SELECT id, embedding FROM memory_items WHERE pair_id = ? AND embedding_model = ?"
                " AND embedding IS NOT NULL AND archived_at IS NULL",
                (scope[1], self.model),
            )
        else:
            rows = await self.storage.fetch_all(
                "SELECT message_id, vector FROM message_vectors WHERE user_id = ? AND persona = ? AND model = ?",
                (scope[1], scope[2], self.model),
            )
        block = self._from_rows((int(r[0]), bytes(r[1])) for r in rows)
        self._blocks[scope] = block
        if len(self._blocks) > self.max_scopes:
            self._blocks.popitem(last=False)
        return block

    @staticmethod
    def _from_rows(rows: Iterable[tuple[int, bytes]]) -> Block:
        listed = list(rows)
        size = len(listed[-1][1]) if listed else 0  # the newest vector's size; older odd ones are skipped
        pairs = [(i, blob) for i, blob in listed if len(blob) == size and size]
        if not pairs:
            return Block(np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32))
        ids = np.fromiter((i for i, _ in pairs), dtype=np.int64, count=len(pairs))
        matrix = np.frombuffer(b"".join(blob for _, blob in pairs), dtype=np.float32).reshape(len(pairs), size // 4)
        return Block(ids, matrix)

    def add(self, scope: Scope, ids: Sequence[int], vectors: npt.NDArray[np.float32]) -> None:
        """Grow a cached scope with freshly stored vectors (an uncached scope loads them later)."""
        block = self._blocks.get(scope)
        if block is None or not len(ids):
            return
        vectors = vectors.astype(np.float32)
        if not len(block.ids) or block.matrix.shape[1] != vectors.shape[1]:
            block.ids = np.asarray(ids, dtype=np.int64)
            block.matrix = vectors
            return
        known = set(block.ids.tolist())
        keep = [n for n, i in enumerate(ids) if i not in known]
        if not keep:
            return
        block.ids = np.concatenate([block.ids, np.asarray([ids[n] for n in keep], dtype=np.int64)])
        block.matrix = np.concatenate([block.matrix, vectors[keep]])

    def invalidate(self, scope: Scope | None = None) -> None:
        if scope is None:
            self._blocks.clear()
        else:
            self._blocks.pop(scope, None)
