"""Messages a limited sync skipped, handed to the usual handling (see ``adapters.matrix_gaps``).

When a sync's timeline in a room is limited (the bot was stopped, or the room is busy), the stretch before it
is read back from ``prev_batch`` to where the previous sync ended, and its messages are handled oldest first in
the place the sync took in the room's line (``adapters.matrix_order``), before the sync's own events: they are
stored, and answered, as if they had come one by one. At most ``BACKLOG_MESSAGES`` per stretch, the newest; past
that, the log says how many were not read, and so is the user of a direct chat, once.

Each stretch is kept in the session file (``message_gaps``: its room, where it ends, the last of its messages
handled) with the sync token that skipped it, until all of it is handled: a restart midway goes on after the last
one handled, and handles none twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from nio import (
    MatrixRoom,
    MegolmEvent,
    SyncResponse,
)

from adapters.matrix_content import MEDIA_EVENTS, RECEIVED_EVENTS
from adapters.matrix_gaps import Backlog, missed_messages, own_join
from adapters.matrix_order import Slot
from bot.commands import CommandReply

if TYPE_CHECKING:
    from adapters.matrix import MatrixAdapter

log = logging.getLogger(__name__)


def unread_note(backlog: Backlog, read: int) -> str:
    """What the user of a direct chat is told of the messages not read back."""
    many = f"more than {backlog.beyond}" if backlog.more and backlog.beyond else \
        "some" if backlog.more else str(backlog.beyond)
    return (f"While I was away, {many} of your messages here came in before the last {read} I read: those earlier "
            "ones I did not read. Send again what still matters.")


class Backlogs:
    """The stretches limited syncs skipped, per ``prev_batch``: their messages read back and handled in order."""

    def __init__(self, adapter: MatrixAdapter, saved: dict[str, Any]) -> None:
        self.adapter = adapter
        # prev_batch -> {"room", "to" (the previous sync's token), "done" (the last event handled), "told"}
        self._gaps: dict[str, dict[str, str]] = {
            key: {"done": "", "told": ""} | {k: str(v) for k, v in gap.items()} for key, gap in saved.items()
            if isinstance(gap, dict) and isinstance(gap.get("room"), str) and isinstance(gap.get("to"), str)}
        self._saved: set[str] = set(self._gaps)  # written with the sync token that skipped them

    def resume(self) -> None:
        """Go on with the stretches an earlier run left unfinished (before the first sync's own events)."""
        for key, gap in self._gaps.items():
            self.adapter._spawn(self._read(key, self.adapter._order.take(gap["room"])))

    def note(self, response: SyncResponse, since: str | None) -> None:
        """Before a sync's events are handed out: each room whose timeline it cut short takes its place in the
        room's line for what it skipped (none on a first start, or in a room the bot joined within it: what came
        before its join was said to others)."""
        if not since:
            return
        me = self.adapter.config.user_id
        for room_id, info in response.rooms.join.items():
            timeline = info.timeline
            if not (timeline.limited and timeline.prev_batch) or timeline.prev_batch in self._gaps:
                continue
            if any(own_join(event, me) for event in timeline.events):
                continue
            self._gaps[timeline.prev_batch] = {"room": room_id, "to": since, "done": "", "told": ""}
            self.adapter._spawn(self._read(timeline.prev_batch, self.adapter._order.take(room_id)))

    def to_save(self) -> dict[str, dict[str, str]]:
        """The stretches to keep in the session file with a sync's token (which is past them): all known now."""
        self._saved.update(self._gaps)
        return self.saved()

    def saved(self) -> dict[str, dict[str, str]]:
        return {key: gap for key, gap in self._gaps.items() if key in self._saved}

    def _save(self) -> None:
        self.adapter._save_state(message_gaps=self.saved())

    async def _read(self, key: str, slot: Slot) -> None:
        """Read a stretch back and hand its messages on in ``slot``'s place, oldest first."""
        gap = self._gaps[key]
        adapter = self.adapter
        try:
            backlog = await missed_messages(adapter.client, gap["room"], key, gap["to"], adapter.config.user_id)
            await adapter._synced(lambda: gap["room"] in adapter.client.rooms)  # (a restart's first sync)
            room = adapter.client.rooms.get(gap["room"])
            events = _after(backlog.events, gap["done"]) if room is not None else []
            if room is not None and (backlog.beyond or backlog.more) and not gap["told"]:
                await self._tell(room, backlog, len(backlog.events))
                gap["told"] = "1"
            slots = slot.split(len(events))
            for event, place in zip(events, slots, strict=True):
                self._hand_on(room, event, place)
            for event, place in zip(events, slots, strict=True):
                await place.passed.wait()
                gap["done"] = event.event_id
                self._save()
        except Exception:
            log.exception("Matrix: handling the messages a limited sync skipped in %s failed", gap["room"])
        slot.pass_on()
        self._gaps.pop(key, None)  # (not when cancelled: a stop midway leaves it to the next run)
        self._save()

    def _hand_on(self, room: MatrixRoom, event: Any, slot: Slot) -> None:
        """A message read back, handled as the callbacks would, in ``slot``'s place."""
        adapter = self.adapter
        if not adapter.serves(room):  # (an encrypted room without e2ee: the sync's own events tell it, once)
            slot.pass_on()
            return
        if isinstance(event, RECEIVED_EVENTS) and adapter._takes(room, event):
            file = adapter._command_file(event) if isinstance(event, MEDIA_EVENTS) else None
            adapter._spawn(adapter._handle(room, event, slot, file=file, read_back=True))
            return
        slot.pass_on()
        if isinstance(event, MegolmEvent) and adapter.config.e2ee:  # (one the device has no keys for)
            adapter._spawn(self._undecryptable(room, event))

    async def _undecryptable(self, room: MatrixRoom, event: MegolmEvent) -> None:
        try:
            await self.adapter._on_undecryptable(room, event)
        except Exception:
            log.exception("Matrix: an undecryptable message read back in %s failed", room.room_id)

    async def _tell(self, room: MatrixRoom, backlog: Backlog, read: int) -> None:
        log.warning("Matrix: %s%d messages a limited sync skipped in %s were not read back (only the last %d)",
                    "more than " if backlog.more else "", backlog.beyond, room.room_id, read)
        if self.adapter.is_dm(room):
            await self.adapter.deliver(room.room_id, CommandReply(unread_note(backlog, read)))


def _after(events: list[Any], done: str) -> list[Any]:
    """``events`` after the one handled last (``done``) before a restart; all when none was."""
    ids = [event.event_id for event in events]
    return events[ids.index(done) + 1:] if done in ids else events
