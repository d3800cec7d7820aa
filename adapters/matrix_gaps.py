"""Redactions a limited sync skipped.

A sync returns at most a room's newest few events (Synapse: 10 by default); when more happened since the
previous sync (the bot was offline, or a busy room), its timeline is *limited* and the events before
``prev_batch`` never reach the callbacks. A message taken back among them would stay stored: its
redaction is looked for here, by paging back from ``prev_batch`` through the room's redactions only (a
filter the server applies) until one older than the previous sync, at most ``MAX_PAGES`` pages.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from nio import AsyncClient, MessageDirection, RedactionEvent, RoomMessagesResponse

log = logging.getLogger(__name__)

PAGE = 100  # redactions asked for at a time
MAX_PAGES = 20  # 2,000 redactions a gap at most: a flood beyond that is not read back
SKEW_SECONDS = 60.0  # server clocks differ: redactions up to this long before the previous sync are read too
ONLY_REDACTIONS = {"types": ["m.room.redaction"]}


async def missed_redactions(client: AsyncClient, room_id: str, prev_batch: str, since: float | None
                            ) -> AsyncIterator[RedactionEvent]:
    """The room's redactions before ``prev_batch``, newest first, back to ``since`` (the previous sync's
    time, seconds; None: as far as ``MAX_PAGES`` reach)."""
    token = prev_batch
    for _ in range(MAX_PAGES):
        response = await client.room_messages(room_id, start=token, direction=MessageDirection.back, limit=PAGE,
                                              message_filter=ONLY_REDACTIONS)
        if not isinstance(response, RoomMessagesResponse):
            log.warning("Matrix: could not read back the redactions a limited sync skipped in %s: %s",
                        room_id, response)
            return
        for event in response.chunk:
            if since is not None and event.server_timestamp / 1000 < since - SKEW_SECONDS:
                return
            if isinstance(event, RedactionEvent):
                yield event
        if not response.chunk or not response.end or response.end == token:
            return
        token = response.end
    log.warning("Matrix: more than %d redactions in one gap of %s; older ones are not read back",
                MAX_PAGES * PAGE, room_id)
