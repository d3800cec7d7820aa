"""Remember this / forget this on Matrix, by reaction: 🧠 on a message stores it as the reacting user's
memory item (its source is that event); ❌ on the bot's confirmation archives what was remembered from
it. Allowed on one's own messages and on the bot's messages in one's DM with it. Confirmations are
answered in the DM (memory is private). They run the same ``!memory remember --from`` and ``!memory
forget --from`` commands as typed."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from nio import MatrixRoom, ReactionEvent
from nio.api import MessageDirection, RelationshipType

from bot.commands import CommandReply
from bot.policy import Inbound
from bot.ports import IncomingMessage

if TYPE_CHECKING:
    from adapters.matrix import MatrixAdapter

log = logging.getLogger(__name__)

REMEMBER, UNDO = "🧠", "❌"
NOT_YOURS = "You can do that with your own messages, and with mine in our direct messages."
KEEP = 1000  # confirmations whose ❌ still undoes (per process)


def _key(reaction: ReactionEvent) -> str:
    return str(reaction.key).replace("\ufe0f", "").strip()


class Reactions:
    def __init__(self, adapter: MatrixAdapter) -> None:
        self.adapter = adapter
        self._confirmed: OrderedDict[str, tuple[str, str]] = OrderedDict()  # confirmation -> (user, source)

    async def on_reaction(self, room: MatrixRoom, event: ReactionEvent) -> None:
        if event.sender == self.adapter.config.user_id:
            return
        key = _key(event)
        if key == REMEMBER and event.reacts_to not in self._confirmed:  # a confirmation is no memory
            self.adapter._spawn(self._guarded(self._remember(room, event)))
        elif key == UNDO and event.reacts_to in self._confirmed:
            self.adapter._spawn(self._guarded(self._undo(room, event)))

    async def _guarded(self, work: Any) -> None:
        try:
            await work
        except Exception:
            log.exception("Matrix: a reaction could not be handled")

    async def _remember(self, room: MatrixRoom, event: ReactionEvent) -> None:
        adapter = self.adapter
        response = await adapter.client.room_get_event(room.room_id, event.reacts_to)
        target = getattr(response, "event", None)
        body = await self._latest_text(room.room_id, event.reacts_to, getattr(target, "body", None))
        if target is None or not isinstance(body, str) or not body.strip():
            return  # not a text message (an image, a state event): nothing to remember
        is_dm = adapter.is_dm(room)
        if not (target.sender == event.sender or (target.sender == adapter.config.user_id and is_dm)):
            await self._answer(event.sender, NOT_YOURS)
            return
        source = f"matrix-message:{event.reacts_to}"
        reply = await self._run(room, event, f"!memory remember --from {source}\n{body}")
        confirmation = await self._answer(event.sender, f"{reply.text} React {UNDO} to this message to undo.")
        if reply.text.startswith("Remembered"):
            self._confirmed[confirmation] = (event.sender, source)
            while len(self._confirmed) > KEEP:
                self._confirmed.popitem(last=False)

    async def _latest_text(self, room_id: str, event_id: str, body: Any) -> Any:
        """The message's text after its last edit (a streamed reply is one event edited many times;
        servers no longer apply edits when an event is fetched)."""
        latest = body
        async for related in self.adapter.client.room_get_event_relations(
                room_id, event_id, RelationshipType.replacement, "m.room.message", MessageDirection.back, limit=1):
            new = related.source.get("content", {}).get("m.new_content", {}).get("body")
            if isinstance(new, str):
                latest = new
            break  # newest first
        return latest

    async def _undo(self, room: MatrixRoom, event: ReactionEvent) -> None:
        user, source = self._confirmed[event.reacts_to]
        if user != event.sender:
            return
        reply = await self._run(room, event, f"!memory forget --from {source}")
        await self._answer(event.sender, reply.text)

    async def _run(self, room: MatrixRoom, event: ReactionEvent, line: str) -> CommandReply:
        adapter = self.adapter
        is_dm = adapter.is_dm(room)
        incoming = IncomingMessage("matrix", room.room_id, event.sender, room.user_name(event.sender) or event.sender,
                                   line, is_dm=is_dm, server_id=None if is_dm else room.room_id,
                                   author_home=event.sender.split(":", 1)[-1])
        inbound = Inbound(incoming, is_bot_admin=event.sender in adapter.config.admin_ids)
        router = adapter.app.router
        context = router.context_for(inbound, await router.persona_for(inbound))
        return await adapter.app.commands.dispatch(line, context)

    async def _answer(self, user_id: str, text: str) -> str:
        from adapters.matrix import render

        room = await self.adapter.dm_room(user_id)
        return await self.adapter.send(room, render(text, self.adapter.config.msgtype))
