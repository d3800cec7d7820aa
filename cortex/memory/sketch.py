"""The sketch of a large block of vectors: a shortlist before the exact product.

Scoring every vector of a block is a matrix-vector product over all of them: at 100k × 384 float32
(154 MB) it is bound by memory bandwidth, ~8-12 ms on this project's 2-core machine. Above
``SKETCH_ABOVE`` vectors a block keeps a sketch beside its matrix: each vector's coordinates on the
block's ``DIMS`` main directions (principal components of a sample of its rows, centred on their
mean). A search scores the sketch (a quarter of the bytes), takes the ``SHORTLIST`` best rows and
scores only those exactly; rows added after the sketch was built are always scored exactly. The
result is approximate: measured at 100k e5 vectors (``bench/search_latency.py``: 2,000 really embedded
texts and variants of them), the best 10 of the search's 100 candidates are the exact top-10 99.8 % of
the time and the candidates hold 99.5 % of the exact top-100, in about a third of the time.

The typical level a hit's score is measured against (mean + 2σ of the query's similarity over the
whole block, see :meth:`vectors.Block.top`) cannot come from the shortlist: it comes from the sketched
rows' mean (exact) and their covariance (estimated from the sample), so the query's similarity over
all of them has mean ``q·μ`` and variance ``qᵀCq`` without scoring them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SKETCH_ABOVE = 50_000  # vectors: bigger blocks are searched through a sketch (below, exact costs < ~4 ms)
DIMS = 96  # main directions kept (of e5's 384): the sketch adds a quarter of the matrix's memory
SHORTLIST = 4000  # rows scored exactly per search (at least 20 × the candidates asked for)
SAMPLE = 4096  # rows the main directions and the covariance are estimated from
REBUILD_GROWTH = 1.5  # a block grown to 1.5 × the rows its sketch covers gets a new one
CHUNK = 4096  # rows projected at a time (bounds the temporary copies while building)


@dataclass(frozen=True, slots=True)
class Sketch:
    """Rows ``[0, covered)`` of a block, projected on ``basis`` after subtracting ``mean``."""

    covered: int
    mean: npt.NDArray[np.float32]  # (d,) the covered rows' mean
    basis: npt.NDArray[np.float32]  # (d, DIMS) their main directions, strongest first
    codes: npt.NDArray[np.float32]  # (covered, DIMS) each row's coordinates on them
    spread: npt.NDArray[np.float32]  # (d, d): |spread @ q|² is the variance of q·row over the rows

    @classmethod
    def build(cls, matrix: npt.NDArray[np.float32]) -> Sketch:
        """The sketch of every row of ``matrix`` (CPU-bound, ~0.2-0.3 s at 100k × 384: run it on a thread)."""
        rows, dims = matrix.shape
        mean = matrix.mean(axis=0, dtype=np.float64).astype(np.float32)
        sample = matrix[:: max(1, rows // SAMPLE)] - mean
        covariance = (sample.T @ sample) / len(sample)
        variances, directions = np.linalg.eigh(covariance.astype(np.float64))  # ascending
        order = np.argsort(variances)[::-1]
        variances, directions = np.clip(variances[order], 0.0, None), directions[:, order]
        basis = np.ascontiguousarray(directions[:, : min(DIMS, dims)], dtype=np.float32)
        codes = np.empty((rows, basis.shape[1]), dtype=np.float32)
        shift = mean @ basis  # (row − mean) @ basis, without a centred copy of the rows
        for start in range(0, rows, CHUNK):
            np.subtract(matrix[start:start + CHUNK] @ basis, shift, out=codes[start:start + CHUNK])
        spread = (np.sqrt(variances)[:, None] * directions.T).astype(np.float32)
        return cls(rows, mean, basis, codes, spread)

    def fits(self, rows: int, dims: int) -> bool:
        """Whether this sketch describes a block of ``rows`` vectors of ``dims`` dimensions."""
        return self.covered <= rows and self.mean.shape[0] == dims

    def shortlist(self, query: npt.NDArray[np.float32], count: int) -> npt.NDArray[np.int64]:
        """The ``count`` covered rows whose sketched similarity to ``query`` is highest (unordered)."""
        if count >= self.covered:
            return np.arange(self.covered, dtype=np.int64)
        approximate = self.codes @ (self.basis.T @ query)  # q·(row − mean): the same order as q·row
        return np.argpartition(-approximate, count)[:count].astype(np.int64)

    def moments(self, query: npt.NDArray[np.float32]) -> tuple[float, float]:
        """Σ q·row and Σ (q·row)² over the covered rows, from their mean and covariance."""
        mean = float(self.mean @ query)
        variance = float(np.sum(np.square(self.spread @ query)))
        return self.covered * mean, self.covered * (variance + mean * mean)

    def stale(self, rows: int) -> bool:
        """Whether a block of ``rows`` vectors has outgrown this sketch (its exactly scored tail is long)."""
        return rows >= self.covered * REBUILD_GROWTH
