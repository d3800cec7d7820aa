"""One reply at a time per person and conversation.

Someone who sends two messages in quick succession ("hi", then "are you there?") gets the second answer
written after the first one was stored, with the first answer in its prompt, instead of two answers
written side by side, each unaware of the other. Different people in one channel are answered side by
side, as before.

A message takes its place in its line (:meth:`Turns.join`) before it is stored; it is stored once the
message ahead of it is (so the stored order is the order they came in: each one's history holds the ones
before it), at once in practice, and its answer is written once the answer ahead of it is done. An answer
that hangs (a slow model, a stream nobody reads any more) holds the line ``TURN_WAIT_SECONDS`` from when its
turn began, no longer: then the next one goes ahead, and the ones after that wait for it as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Hashable

TURN_WAIT_SECONDS = 90.0


class Place:
    """A message's place in its key's line: :meth:`before_store`, :meth:`stored`, :meth:`wait` for the turn,
    and :meth:`leave` once done (always, also when anything failed)."""

    def __init__(self, turns: Turns, key: Hashable, ahead: Place | None) -> None:
        self._turns, self._key = turns, key
        self._ahead = ahead
        self.waited = ahead is not None  # an answer ahead of it was not done when it joined
        self.waited_seconds = 0.0
        self._stored, self._began, self._done = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._began_at = 0.0
        self._left = False
        self._skipped = False  # it left before its turn (its message failed): the ones behind wait for its ahead

    async def before_store(self) -> None:
        """Until the message ahead is stored (or gone), at most the line's ``wait_seconds``."""
        ahead = self._ahead
        while ahead is not None and ahead._skipped and not ahead._stored.is_set():
            ahead = ahead._ahead
        if ahead is not None:
            await _at_most(ahead._stored.wait(), self._turns.wait_seconds)

    def stored(self) -> None:
        self._stored.set()

    async def wait(self) -> None:
        """Until the answer ahead is done: at most ``wait_seconds`` from when its turn began."""
        started = time.monotonic()
        ahead, self._ahead = self._ahead, None  # (a long line keeps no chain of done places)
        try:
            while ahead is not None:
                # (its turn begins at the latest when the one ahead of it has had its time, or it leaves)
                await ahead._began.wait()
                if ahead._skipped:  # it never had its turn: the answer before it may still be written
                    ahead = ahead._ahead
                    continue
                if not ahead._done.is_set():
                    left = ahead._began_at + self._turns.wait_seconds - time.monotonic()
                    await _at_most(ahead._done.wait(), max(left, 0.0))
                break
        finally:
            self.waited_seconds = time.monotonic() - started
            self._began_at = time.monotonic()
            self._began.set()

    def leave(self) -> None:
        """Give the turn to the next answer and leave the line (again: nothing happens)."""
        if self._left:
            return
        self._left = True
        self._skipped = not self._began.is_set()
        if not self._skipped:
            self._ahead = None
        for event in (self._stored, self._began, self._done):
            event.set()
        self._turns._left(self._key, self)


async def _at_most(waiting: Awaitable[object], seconds: float) -> None:
    """Await ``waiting`` for at most ``seconds``. (``asyncio.timeout``, not ``wait_for``: Python 3.11's
    ``wait_for`` can swallow a cancel that comes just as what it waits for is done.)"""
    try:
        async with asyncio.timeout(seconds):
            await waiting
    except TimeoutError:
        pass


class Turns:
    """Per-key lines (a key: one person in one channel) for the answers of one process."""

    def __init__(self, wait_seconds: float = TURN_WAIT_SECONDS) -> None:
        self.wait_seconds = wait_seconds
        self._last: dict[Hashable, Place] = {}  # key -> the newest place in its line

    def join(self, key: Hashable) -> Place:
        """A place at the end of ``key``'s line; ``waited`` when an answer is in it already."""
        ahead = self._last.get(key)
        place = Place(self, key, ahead if ahead is not None and not ahead._left else None)
        self._last[key] = place
        return place

    def _left(self, key: Hashable, place: Place) -> None:
        if self._last.get(key) is not place:
            return
        # The last one in line leaves: the line ends with the newest one ahead of it still in it, or goes.
        ahead = place._ahead if place._skipped else None
        while ahead is not None and ahead._left:
            ahead = ahead._ahead if ahead._skipped else None
        if ahead is None:
            del self._last[key]  # (no growth per key)
        else:
            self._last[key] = ahead

    def busy(self) -> int:
        """Keys with an answer being written or waiting (tests, metrics)."""
        return len(self._last)
