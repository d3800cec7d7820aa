"""What a limited sync skipped: messages, and redactions.

A sync returns at most a room's newest few events (Synapse: 10 by default); when more happened since the
previous sync (the bot was offline, or a busy room), its timeline is *limited* and the events before
``prev_batch`` never reach the callbacks. They are read back here, by paging back from ``prev_batch`` to the
previous sync's token (``to``: exactly the gap), through the events of the kinds asked for only (a filter the
server applies):

- the messages (:func:`missed_messages`), handed to the usual handling oldest first, before the sync's own
  events: at most ``BACKLOG_MESSAGES``, the newest, within ``BACKLOG_PAGES`` pages; none from before the bot's
  own join (the room's history shown to a newcomer was said to others);
- the redactions (:func:`missed_redactions`): a message taken back among them would stay stored. At most
  ``MAX_PAGES`` pages.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from nio import AsyncClient, Event, MessageDirection, RedactionEvent, RoomMemberEvent, RoomMessagesResponse

log = logging.getLogger(__name__)

PAGE = 100  # events asked for at a time
MAX_PAGES = 20  # a gap's pages read at most for its redactions: a flood beyond that is not read back
ONLY_REDACTIONS = {"types": ["m.room.redaction"]}
BACKLOG_MESSAGES = 30  # a gap's messages handed on at most (the newest): each may be answered
BACKLOG_PAGES = 5  # a gap's pages read at most for its messages (what lies beyond is counted as not read)
MESSAGES = ["m.room.message", "m.room.member", "m.room.encrypted"]  # (members: to find the bot's own join)


async def _pages(client: AsyncClient, room_id: str, prev_batch: str, since: str | None, kinds: dict[str, Any],
                 pages: int) -> AsyncGenerator[list[Event], None]:
    """The room's events of ``kinds`` between ``since`` (None: as far as ``pages`` reach) and ``prev_batch``, a
    page at a time, newest first; a last empty page when ``pages`` did not reach ``since``."""
    token = prev_batch
    for _ in range(pages):
        response = await client.room_messages(room_id, start=token, end=since, direction=MessageDirection.back,
                                              limit=PAGE, message_filter=kinds)
        if not isinstance(response, RoomMessagesResponse):
            raise GapUnread(f"{response}")
        yield list(response.chunk)
        # An empty page with a token is not the end (a filter may leave a page empty): only a missing or
        # unchanged token is.
        if not response.end or response.end == token:
            return
        token = response.end
    raise GapTooLong()


class GapUnread(Exception):
    """The server did not give a page of the gap."""


class GapTooLong(Exception):
    """The gap goes on past the pages read."""


async def missed_redactions(client: AsyncClient, room_id: str, prev_batch: str, since: str | None
                            ) -> AsyncIterator[RedactionEvent]:
    """The room's redactions between ``since`` (the previous sync's token; None: as far as ``MAX_PAGES``
    reach) and ``prev_batch``, newest first."""
    try:
        async for page in _pages(client, room_id, prev_batch, since, ONLY_REDACTIONS, MAX_PAGES):
            for event in page:
                if isinstance(event, RedactionEvent):
                    yield event
    except GapUnread as exc:
        log.warning("Matrix: could not read back the redactions a limited sync skipped in %s: %s", room_id, exc)
    except GapTooLong:
        log.warning("Matrix: a gap of %s longer than %d pages; its older redactions are not read back",
                    room_id, MAX_PAGES)


@dataclass
class Backlog:
    """The messages of a gap, oldest first (at most ``BACKLOG_MESSAGES``), and how many more were not read
    (``beyond``: at least that many when ``more`` says the gap went on past the pages read)."""

    events: list[Event] = field(default_factory=list)
    beyond: int = 0
    more: bool = False


async def missed_messages(client: AsyncClient, room_id: str, prev_batch: str, since: str, me: str) -> Backlog:
    """The messages (and uploads, emotes, encrypted events: whatever the callbacks handle) of others between
    ``since`` and ``prev_batch`` that came after the bot's own latest join (``me``)."""
    found: list[Event] = []
    backlog = Backlog()
    pages = _pages(client, room_id, prev_batch, since, {"types": MESSAGES}, BACKLOG_PAGES)
    try:
        async for page in pages:
            joined = next((n for n, event in enumerate(page) if own_join(event, me)), None)
            found += [event for event in page[:joined] if not isinstance(event, RoomMemberEvent)
                      and event.sender != me]
            if joined is not None:
                break  # what came before was said before the bot was there
    except GapUnread as exc:
        log.warning("Matrix: could not read back the messages a limited sync skipped in %s: %s", room_id, exc)
        backlog.more = True
    except GapTooLong:
        backlog.more = True
    finally:
        await pages.aclose()
    backlog.events = list(reversed(found[:BACKLOG_MESSAGES]))
    backlog.beyond = max(len(found) - BACKLOG_MESSAGES, 0)
    return backlog


def own_join(event: Event, me: str) -> bool:
    """Whether ``event`` is the bot's own join (not a change of its name, a join after a join)."""
    return isinstance(event, RoomMemberEvent) and event.state_key == me and event.membership == "join" \
        and event.prev_membership != "join"
