"""Redactions a limited sync skipped.

A sync returns at most a room's newest few events (Synapse: 10 by default); when more happened since the
previous sync (the bot was offline, or a busy room), its timeline is *limited* and the events before
``prev_batch`` never reach the callbacks. A message taken back among them would stay stored: its
redaction is looked for here, by paging back from ``prev_batch`` to the previous sync's token (``to``:
exactly the gap) through the room's redactions only (a filter the server applies), at most ``MAX_PAGES``
pages.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from nio import AsyncClient, MessageDirection, RedactionEvent, RoomMessagesResponse

log = logging.getLogger(__name__)

PAGE = 100  # events asked for at a time
MAX_PAGES = 20  # a gap's pages read at most: a flood beyond that is not read back
ONLY_REDACTIONS = {"types": ["m.room.redaction"]}


async def missed_redactions(client: AsyncClient, room_id: str, prev_batch: str, since: str | None
                            ) -> AsyncIterator[RedactionEvent]:
    """The room's redactions between ``since`` (the previous sync's token; None: as far as ``MAX_PAGES``
    reach) and ``prev_batch``, newest first."""
    token = prev_batch
    for _ in range(MAX_PAGES):
        response = await client.room_messages(room_id, start=token, end=since, direction=MessageDirection.back,
                                              limit=PAGE, message_filter=ONLY_REDACTIONS)
        if not isinstance(response, RoomMessagesResponse):
            log.warning("Matrix: could not read back the redactions a limited sync skipped in %s: %s",
                        room_id, response)
            return
        for event in response.chunk:
            if isinstance(event, RedactionEvent):
                yield event
        # An empty page with a token is not the end (a filter may leave a page empty): only a missing or
        # unchanged token is.
        if not response.end or response.end == token:
            return
        token = response.end
    log.warning("Matrix: a gap of %s longer than %d pages; its older redactions are not read back",
                room_id, MAX_PAGES)
