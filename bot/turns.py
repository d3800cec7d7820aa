"""One reply at a time per person and conversation.

Someone who sends two messages in quick succession ("hi", then "are you there?") gets the second answer
written after the first one was stored, with the first answer in its prompt, instead of two answers
written side by side, each unaware of the other. Every message is stored the moment it arrives; only
the writing of its answer waits for its turn. Different people in one channel are answered side by
side, as before.

A message takes its place in line (:meth:`Turns.join`) before it is stored, so whether an answer was
still being written then is known exactly, and turns come in the order the messages came; it waits for
its turn after it is stored. A turn is never
waited for longer than ``TURN_WAIT_SECONDS``: an answer that hangs (a slow model, a stream nobody reads
any more) delays the next one by that much at most, which then goes ahead anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from typing import Literal

TURN_WAIT_SECONDS = 90.0


class Place:
    """A message's place in its key's line: :meth:`wait` for the turn, :meth:`leave` once done (always).
    The turn is asked for when the place is taken, so turns come in the order the messages joined, however
    long each one's store takes."""

    def __init__(self, turns: Turns, key: Hashable, lock: asyncio.Lock, waited: bool) -> None:
        self._turns, self._key, self._lock = turns, key, lock
        self.waited = waited  # an answer before it was being written when it joined (it may be stored after it)
        self.waited_seconds = 0.0
        self._turn: asyncio.Task[Literal[True]] | None = asyncio.ensure_future(lock.acquire())
        self._left = False

    async def wait(self) -> None:
        """Until the answers before this one are done (at most the line's ``wait_seconds``)."""
        started = time.monotonic()
        turn = self._turn
        try:
            if turn is not None:
                await asyncio.wait_for(turn, self._turns.wait_seconds)  # (timed out: the turn is given up)
        except TimeoutError:
            self._turn = None  # it goes ahead without the turn
        finally:
            self.waited_seconds = time.monotonic() - started

    def leave(self) -> None:
        """Give the turn to the next answer and leave the line (again: nothing happens)."""
        turn, self._turn = self._turn, None
        if turn is not None:
            if not turn.done():
                turn.cancel()  # never got it (the message failed before its turn came): nobody waits for it
            elif not turn.cancelled() and turn.exception() is None:
                self._lock.release()
        if not self._left:
            self._left = True
            self._turns._left(self._key)


class Turns:
    """Per-key lines (a key: one person in one channel) for the answers of one process."""

    def __init__(self, wait_seconds: float = TURN_WAIT_SECONDS) -> None:
        self.wait_seconds = wait_seconds
        self._locks: dict[Hashable, asyncio.Lock] = {}
        self._members: dict[Hashable, int] = {}  # key -> answers in its line (writing or waiting)

    def join(self, key: Hashable) -> Place:
        """A place in ``key``'s line; ``waited`` when an answer is in it already."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        ahead = self._members.get(key, 0)
        self._members[key] = ahead + 1
        return Place(self, key, lock, ahead > 0)

    def _left(self, key: Hashable) -> None:
        self._members[key] -= 1
        if not self._members[key]:  # nobody in line: the key's lock goes (no growth per channel)
            del self._members[key], self._locks[key]

    def busy(self) -> int:
        """Keys with an answer being written or waiting (tests, metrics)."""
        return len(self._locks)
