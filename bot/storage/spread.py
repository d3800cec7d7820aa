"""A query's typical similarity over a large scope of vectors, without scoring them (PostgreSQL).

A search measures each hit against the query's typical level in its scope: the mean plus two standard
deviations of the query's similarity to the scope's vectors (``cortex.memory.vectors``). On PostgreSQL a
statement scored a sample of the scope beside the k-NN query, which cost the database about as much as
the k-NN itself, on every search. Over many vectors that level follows from their mean μ and covariance
C: the query's similarity has mean ``q·μ`` and variance ``qᵀCq`` (as SQLite's sketched blocks do it,
``cortex.memory.sketch``). So a scope of at least ``TYPICAL_SAMPLE`` vectors gets a :class:`Spread`,
measured on a random sample of ``SAMPLE`` of them in the background after the first search that needed
it, and renewed in the background once ``TTL`` old; one not renewed for twice that is dropped. Each
process keeps at most ``BUDGET`` bytes of them, the least recently used going first; a forget-me drops
them all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

SAMPLE = 4096  # vectors a spread is measured on (as the sketch's covariance)
TTL = 300.0  # seconds before a spread is measured again (meanwhile the old one serves)
BUDGET = 32 * 2**20  # bytes of spreads per process (a 384-dimension one takes 0.6 MB)
BLOCK = 512  # rows multiplied at a time while measuring
LEAST = 100  # a sample smaller than this makes no spread (the scope shrank: the statement serves)


@dataclass(frozen=True, slots=True)
class Spread:
    """The mean and covariance of a scope's vectors (a sample of them), and when they were measured."""

    mean: npt.NDArray[np.float32]
    covariance: npt.NDArray[np.float32]
    measured: float  # time.monotonic()

    @classmethod
    def of(cls, vectors: npt.NDArray[np.float32]) -> Spread:
        """The spread of the rows of ``vectors`` (CPU-bound, ~10 ms at 4,096 × 384: run it on a thread).
        C = XᵀX/n − μμᵀ, summed over blocks of rows: no centred copy of the sample is made."""
        rows, dims = vectors.shape
        mean = vectors.mean(axis=0, dtype=np.float64)
        products = np.zeros((dims, dims), dtype=np.float64)
        for start in range(0, rows, BLOCK):
            block = vectors[start:start + BLOCK]
            products += block.T @ block
        covariance = products / rows - np.outer(mean, mean)
        return cls(mean.astype(np.float32), covariance.astype(np.float32), time.monotonic())

    def level(self, query: npt.NDArray[np.float32]) -> float:
        """The query's typical similarity: the mean of its similarities to the vectors plus two standard
        deviations (inner products: every embedder's vectors have unit length)."""
        q = np.asarray(query, dtype=np.float32)
        variance = float(q @ (self.covariance @ q))
        return float(q @ self.mean) + 2.0 * math.sqrt(max(variance, 0.0))

    @property
    def nbytes(self) -> int:
        return int(self.mean.nbytes + self.covariance.nbytes)


class Spreads:
    """The spreads of one process, by scope; at most ``budget`` bytes, least recently used first out."""

    def __init__(self, budget: int = BUDGET) -> None:
        self._budget = budget
        self._spreads: OrderedDict[Hashable, Spread] = OrderedDict()
        self._measuring: dict[Hashable, asyncio.Task[None]] = {}
        self._failed: dict[Hashable, float] = {}  # scopes whose last measurement failed, and when
        self._bytes = 0
        self._swept = time.monotonic()

    def get(self, key: Hashable) -> Spread | None:
        """The scope's spread (renew it with :meth:`measure` once ``TTL`` old). Spreads not renewed for
        ``2 × TTL`` are dropped meanwhile: one of a user forgotten by another process lives no longer."""
        now = time.monotonic()
        if now - self._swept > TTL / 10:
            self._swept = now
            for old in [k for k, spread in self._spreads.items() if now - spread.measured > 2 * TTL]:
                self._drop(old)
        spread = self._spreads.get(key)
        if spread is not None:
            self._spreads.move_to_end(key)
        return spread

    def measure(self, key: Hashable, dims: int, sample: Callable[[], Awaitable[npt.NDArray[np.float32]]]) -> None:
        """Measure the scope's spread in the background from ``sample()`` (its vectors, a sample of them)
        unless that is under way, failed less than ``TTL`` ago, or would not fit the budget (a covariance of
        3,072 dimensions takes 38 MB); until it is done, searches go on as they were."""
        if key in self._measuring or 4 * dims * (dims + 1) > self._budget:
            return
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed < TTL:
            return
        task = asyncio.create_task(self._measure(key, sample), name="storage-vector-spread")
        self._measuring[key] = task
        task.add_done_callback(lambda _: self._measuring.pop(key, None))

    async def _measure(self, key: Hashable, sample: Callable[[], Awaitable[npt.NDArray[np.float32]]]) -> None:
        try:
            vectors = await sample()
            spread = await asyncio.to_thread(Spread.of, vectors) if len(vectors) >= LEAST else None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the pool closing, a lost connection: the statement serves meanwhile
            log.warning("could not measure the spread of a scope's vectors (%s: %s); searches sample them "
                        "instead", type(exc).__name__, exc)
            spread = None
        self._drop(key)
        if spread is None:
            if len(self._failed) > 10_000:
                self._failed.clear()
            self._failed[key] = time.monotonic()
            return
        self._failed.pop(key, None)
        self._spreads[key] = spread
        self._bytes += spread.nbytes
        while self._bytes > self._budget and self._spreads:
            self._drop(next(iter(self._spreads)))

    def _drop(self, key: Hashable) -> None:
        spread = self._spreads.pop(key, None)
        if spread is not None:
            self._bytes -= spread.nbytes

    def clear(self) -> None:
        """Forget every spread (a forget-me: what is kept derives from the forgotten user's vectors too)."""
        self._spreads.clear()
        self._bytes = 0
        for task in self._measuring.values():
            task.cancel()

    async def settled(self) -> None:
        """Wait for the measurements under way (tests, and closing)."""
        while self._measuring:
            await asyncio.gather(*self._measuring.values(), return_exceptions=True)

    async def close(self) -> None:
        for task in self._measuring.values():
            task.cancel()
        await self.settled()
