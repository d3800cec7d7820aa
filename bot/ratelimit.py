"""Per-user rate limits: at most N messages (or commands) in any 60-second window (a sliding window)."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable


class RateLimiter:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._seen: dict[str, deque[float]] = {}
        self._told: dict[str, float] = {}  # key -> until when it was told to wait

    def check(self, key: str) -> float:
        """0 when ``key`` may send now (and counts it), else seconds until it may."""
        if self.per_minute <= 0:
            return 0.0
        now = self.clock()
        self._forget_idle(now)
        if wait := self._wait(key, now):
            return wait
        window = self._seen.pop(key, None) or deque()
        window.append(now)
        self._seen[key] = window  # to the end: the dict stays in the order of each key's latest send
        return 0.0

    def _forget_idle(self, now: float) -> None:
        """Drop the keys whose latest send left the window. The dict is in the order of latest sends, so
        they are at its front: each check looks at those it drops and one more (a scan of every key at
        each check cost a bot with 10k users active in a minute 10k steps a message)."""
        while self._seen:
            oldest = next(iter(self._seen))
            window = self._seen[oldest]
            if window and now - window[-1] < 60.0:
                return
            del self._seen[oldest]

    def waiting(self, key: str) -> float:
        """Seconds until ``key`` may send again (0: now), without counting anything."""
        return self._wait(key, self.clock()) if self.per_minute > 0 else 0.0

    def _wait(self, key: str, now: float) -> float:
        """Seconds until ``key`` may send again, its window's older sends dropped first."""
        window = self._seen.get(key)
        while window and now - window[0] >= 60.0:
            window.popleft()
        return 60.0 - (now - window[0]) if window and len(window) >= self.per_minute else 0.0

    def tell(self, key: str, wait: float) -> bool:
        """Whether to tell ``key`` to wait ``wait`` seconds: once per wait, not at every refused message (a
        flood would otherwise get as many notices as it sent)."""
        now = self.clock()
        while self._told and next(iter(self._told.values())) <= now:  # in the order told: the oldest first
            del self._told[next(iter(self._told))]
        if self._told.get(key, 0.0) > now:
            return False
        self._told.pop(key, None)
        self._told[key] = now + wait
        return True


def slow_down(what: str, wait: float) -> str:
    """The notice for someone over their limit of ``what`` ("messages", "commands"). It names nobody: a display
    name such as "[Claim your prize](https://…)" would be a link in the bot's words, in the channel."""
    return f"You are sending {what} faster than I can answer them well. Please wait {math.ceil(wait)} s."
