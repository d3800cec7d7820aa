"""One reply at a time per person and conversation.

Someone who sends two messages in quick succession ("hi", then "are you there?") gets the second answer
written after the first one was stored, with the first answer in its prompt, instead of two answers
written side by side, each unaware of the other. Every message is stored the moment it arrives; only
the writing of its answer waits for its turn. Different people in one channel are answered side by
side, as before.

A turn is never waited for longer than ``TURN_WAIT_SECONDS``: an answer that hangs (a slow model, a
stream nobody reads any more) delays the next one by that much at most, which then goes ahead anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager, suppress

TURN_WAIT_SECONDS = 90.0


class Turns:
    """Per-key turns (a key: one person in one channel) for the answers of one process."""

    def __init__(self, wait_seconds: float = TURN_WAIT_SECONDS) -> None:
        self.wait_seconds = wait_seconds
        self._locks: dict[Hashable, asyncio.Lock] = {}
        self._holders: dict[Hashable, int] = {}  # key -> answers holding or waiting for its lock

    @asynccontextmanager
    async def turn(self, key: Hashable) -> AsyncIterator[bool]:
        """Hold ``key``'s turn for the block; yields whether an earlier answer was waited for (then the
        caller may find answers stored after its own message). After ``wait_seconds`` the block runs
        without the turn."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._holders[key] = self._holders.get(key, 0) + 1
        waited = lock.locked()
        held = False
        try:
            with suppress(TimeoutError):
                held = await asyncio.wait_for(lock.acquire(), self.wait_seconds) if waited else await lock.acquire()
            yield waited
        finally:
            if held:
                lock.release()
            self._holders[key] -= 1
            if not self._holders[key]:  # nobody holds or waits: the key's lock goes (no growth per channel)
                del self._holders[key], self._locks[key]

    def busy(self) -> int:
        """Keys with an answer being written or waiting (tests, metrics)."""
        return len(self._locks)
