"""A room's messages handled in the order they came.

Each message is handled as a task of its own, and its handling asks the homeserver things (the room's creators,
its members, whose message a reply answers) before the message reaches its line (``bot.turns``) and is stored:
a burst, or a backlog read after a restart, came out shuffled. So each event takes a :class:`Slot` in its room's
line the moment it arrives (synchronously, in timeline order), waits in :meth:`Slot.wait` until the one before
it was stored or handled (at most ``ORDER_WAIT_SECONDS``: a slow command does not hold the room up longer), and
passes on (:meth:`Slot.pass_on`) once stored, or when its handling ends without storing anything. Its answer is
written afterwards, as ``bot.turns`` decides: rooms, and answers, go on side by side.
"""

from __future__ import annotations

import asyncio
import contextlib

ORDER_WAIT_SECONDS = 30.0  # how long an event waits for the one before it in its room, at most


class Slot:
    """An event's place in its room's line."""

    def __init__(self, order: InOrder, key: str, ahead: asyncio.Event | None,
                 passed: asyncio.Event | None = None) -> None:
        self._order, self._key = order, key
        self._ahead = ahead
        self.passed = passed if passed is not None else asyncio.Event()

    async def wait(self) -> None:
        """Until the event before it passed on (at most the line's ``wait_seconds``)."""
        ahead, self._ahead = self._ahead, None  # (a long line keeps no chain of events)
        if ahead is not None and not ahead.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._order.wait_seconds):
                    await ahead.wait()

    def pass_on(self) -> None:
        """Let the next event go ahead (again: nothing happens)."""
        self.passed.set()
        if self._order._last.get(self._key) is self.passed:
            del self._order._last[self._key]  # (no growth per room)

    def split(self, count: int) -> list[Slot]:
        """``count`` slots in this one's place, one after the other: the events of a stretch read back later.
        The last one passing on is this one passing on (none: it passes on now)."""
        if count <= 0:
            self.pass_on()
            return []
        slots: list[Slot] = []
        ahead = self._ahead
        for n in range(count):
            slot = Slot(self._order, self._key, ahead, self.passed if n == count - 1 else None)
            ahead = slot.passed
            slots.append(slot)
        return slots


class InOrder:
    """Per key (a room): the line of its events."""

    def __init__(self, wait_seconds: float = ORDER_WAIT_SECONDS) -> None:
        self.wait_seconds = wait_seconds
        self._last: dict[str, asyncio.Event] = {}  # key -> the newest event's

    def take(self, key: str) -> Slot:
        """A slot at the end of ``key``'s line."""
        slot = Slot(self, key, self._last.get(key))
        self._last[key] = slot.passed
        return slot

    def busy(self) -> int:
        """Keys with an event not passed on yet (tests)."""
        return len(self._last)
