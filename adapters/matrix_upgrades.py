"""Room upgrades (a client's "Upgrade this room"): which room the bot was in a new room replaces.

An upgrade makes a new room whose create event names the old one as its ``predecessor`` and puts a tombstone
in the old room naming the new one. Anyone can make a room naming any room as its predecessor, so a room
counts as the successor of one the bot knows only when that room's tombstone, as the homeserver holds it,
names it back (only someone who may change the old room's state can write that).
"""

from __future__ import annotations

from collections.abc import Container

from nio import AsyncClient

from adapters.matrix_content import json_object


async def verified_predecessor(client: AsyncClient, room_id: str, known: Container[str]) -> str | None:
    """The room ``room_id`` replaces: one in ``known`` that its create event names as its predecessor and whose
    tombstone names ``room_id``; None when there is none (or the homeserver did not say)."""
    create = await client.room_get_state_event(room_id, "m.room.create")
    predecessor = json_object(json_object(getattr(create, "content", None)).get("predecessor")).get("room_id")
    if not isinstance(predecessor, str) or predecessor == room_id or predecessor not in known:
        return None
    tombstone = await client.room_get_state_event(predecessor, "m.room.tombstone")
    if json_object(getattr(tombstone, "content", None)).get("replacement_room") != room_id:
        return None
    return predecessor
