"""Per-user rate limits: at most N messages (or commands) in any 60-second window (a sliding window)."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# Counts a send of a key in a store the fleet shares, under a limit per minute: 0, or the seconds to wait.
SharedCount = Callable[[str, int], Awaitable[float]]


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


class FleetRateLimiter:
    """A :class:`RateLimiter` whose count the processes sharing a database share (``shared``: PostgreSQL's
    count, one statement a check), or this process's alone (None: SQLite, one process per file, whose reply path
    makes no round trip for it). A check the database cannot answer is counted here alone, rather than failing
    the message; so is each send it counted (what this process knows when the database is gone). Who was told to
    wait is this process's: a flood over several processes gets a notice per wait from each."""

    def __init__(self, per_minute: int, shared: SharedCount | None = None) -> None:
        self.local = RateLimiter(per_minute)
        self.shared = shared
        self._warned_at = -math.inf  # (monotonic) an outage is said once a minute, not at every message

    @property
    def per_minute(self) -> int:
        return self.local.per_minute

    @per_minute.setter
    def per_minute(self, value: int) -> None:
        self.local.per_minute = value

    async def check(self, key: str) -> float:
        """0 when ``key`` may send now (and counts it), else seconds until it may."""
        if self.shared is None or self.per_minute <= 0:
            return self.local.check(key)
        try:
            wait = await self.shared(key, self.per_minute)
        except Exception as exc:
            if time.monotonic() - self._warned_at >= 60.0:
                self._warned_at = time.monotonic()
                log.warning("rate limits are counted by this process alone while the database cannot count them: %s",
                            str(exc) or type(exc).__name__)
            return self.local.check(key)
        if not wait:
            self.local.check(key)
        return wait

    def waiting(self, key: str) -> float:
        """Seconds until ``key`` may send again as far as this process knows (0: now), counting nothing."""
        return self.local.waiting(key)

    def tell(self, key: str, wait: float) -> bool:
        return self.local.tell(key, wait)


def slow_down(what: str, wait: float) -> str:
    """The notice for someone over their limit of ``what`` ("messages", "commands"). It names nobody: a display
    name such as "[Claim your prize](https://…)" would be a link in the bot's words, in the channel."""
    return f"You are sending {what} faster than I can answer them well. Please wait {math.ceil(wait)} s."
