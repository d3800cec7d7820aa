"""Per-user chat rate limit: at most N messages in any 60-second window (a sliding window)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RateLimiter:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._seen: dict[str, deque[float]] = {}

    def check(self, key: str) -> float:
        """0 when ``key`` may send now (and counts it), else seconds until it may."""
        if self.per_minute <= 0:
            return 0.0
        now = self.clock()
        window = self._seen.setdefault(key, deque())
        while window and now - window[0] >= 60.0:
            window.popleft()
        if len(window) >= self.per_minute:
            return 60.0 - (now - window[0])
        window.append(now)
        if len(self._seen) > 10_000:  # forget idle users
            for idle in [k for k, w in self._seen.items() if not w or now - w[-1] >= 60.0]:
                del self._seen[idle]
        return 0.0
