"""Remember this / forget this on Matrix, by reaction: 🧠 on a message stores it as the reacting user's
memory item (its source is that event); ❌ on the bot's confirmation archives what was remembered from
it. Allowed on one's own messages and on the bot's messages in one's DM with it. Confirmations are
answered in the DM (memory is private). They run the same ``!memory remember --from`` and ``!memory
forget --from`` commands as typed, under the same access rules (deny lists, DMs off) and rate limit as
messages. Which confirmation undoes what, for whom, is kept in the database (``bot.storage.undo``): a ❌ on
one sent before a restart undoes it too."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from nio import Event, MatrixRoom, ReactionEvent
from nio.api import MessageDirection, RelationshipType

from adapters.matrix_content import author_of, json_object, message_key, reply_target, without_reply_fallback
from bot.commands import CommandReply
from bot.policy import Inbound, refusal
from bot.ports import IncomingMessage
from bot.storage.undo import KEPT_DAYS, UndoOfferRepository

if TYPE_CHECKING:
    from adapters.matrix import MatrixAdapter

log = logging.getLogger(__name__)

REMEMBER, UNDO = "🧠", "❌"
NOT_YOURS = "You can do that with your own messages, and with mine in our direct messages."
UNDO_OFFER = f"React {UNDO} to this message to undo."
EXPIRED = (f"That undo has expired (it is kept {KEPT_DAYS} days): forget the item by its number with "
           "!memory forget.")
EDITS_READ = 50  # edits looked through for the sender's own latest one


def _key(reaction: ReactionEvent) -> str:
    return str(reaction.key).replace("\ufe0f", "").strip()


class Reactions:
    def __init__(self, adapter: MatrixAdapter) -> None:
        self.adapter = adapter

    @property
    def offers(self) -> UndoOfferRepository:
        """Which confirmation undoes what, for whom (the app's storage is opened after the adapter is made)."""
        return self.adapter.app.storage.undo_offers

    async def on_reaction(self, room: MatrixRoom, event: ReactionEvent) -> None:
        if event.sender == self.adapter.config.user_id or self.adapter._before_join(room):
            return  # (a reaction in the history shown to the bot as it joined was made before it was there)
        key = _key(event)
        if key == REMEMBER:
            self.adapter._spawn(self._guarded(self._remember(room, event)))
        elif key == UNDO:
            self.adapter._spawn(self._guarded(self._undo(room, event)))

    async def _guarded(self, work: Any) -> None:
        try:
            await work
        except Exception:
            log.exception("Matrix: a reaction could not be handled")

    async def _remember(self, room: MatrixRoom, event: ReactionEvent) -> None:
        adapter = self.adapter
        if await self.offers.find(message_key(event.reacts_to)) is not None:
            return  # a confirmation is no memory
        inbound = await self.inbound(room, event)
        if not await self.allowed(inbound):
            return
        response = await adapter.client.room_get_event(room.room_id, event.reacts_to)
        target = getattr(response, "event", None)
        body = await self._latest_text(room.room_id, target)
        if target is None or not isinstance(body, str) or not body.strip():
            return  # not a text message (an image, a state event): nothing to remember
        # The bot's own words only in the reactor's own direct chat (not one they joined after its owner left).
        if not (target.sender == event.sender or (target.sender == adapter.config.user_id and inbound.message.is_dm)):
            await self._answer(event.sender, NOT_YOURS)
            return
        source = message_key(event.reacts_to)
        reply = await self._run(inbound, f"!memory remember --from {source}\n{body}")
        if not reply.text.startswith("Remembered"):  # refused (a guard, a pause, the cap): nothing to undo
            await self._answer(event.sender, reply.text)
            return
        confirmation = await self._answer(event.sender, f"{reply.text} {UNDO_OFFER}")
        await self.offers.offer(message_key(confirmation), inbound.message.author_key, source)

    async def _latest_text(self, room_id: str, target: Any) -> Any:
        """The message's text after its sender's last edit (a streamed reply is one event edited many times;
        servers no longer apply edits when an event is fetched). Anyone can send an edit of any message:
        another sender's is no edit."""
        if target is None:
            return None
        read = 0
        async for related in self.adapter.client.room_get_event_relations(
                room_id, target.event_id, RelationshipType.replacement, "m.room.message", MessageDirection.back,
                limit=20):  # newest first
            new = json_object(json_object(related.source.get("content")).get("m.new_content")).get("body")
            if related.sender == target.sender and isinstance(new, str):
                return new
            read += 1
            if read >= EDITS_READ:
                break
        body = getattr(target, "body", None)
        # A reply's body may start with the quoted message (older clients): that is someone else's words.
        source = getattr(target, "source", None)
        content = source.get("content") if isinstance(source, dict) else None
        return without_reply_fallback(body) if isinstance(body, str) and reply_target(content) else body

    async def _undo(self, room: MatrixRoom, event: ReactionEvent) -> None:
        offer = await self.offers.find(message_key(event.reacts_to))
        if offer is None:
            # Once an undo: it was pruned since. Confirmations are sent in DMs only, so a ❌ in a room (a common
            # reaction) costs no look at the homeserver.
            inbound = await self.inbound(room, event)
            if (inbound.message.is_dm and await self._offered_undo(room.room_id, event.reacts_to)
                    and await self.allowed(inbound)):
                await self._answer(event.sender, EXPIRED)
            return  # (a ❌ on any other message is no undo)
        user, source = offer
        inbound = await self.inbound(room, event)
        if user != inbound.message.author_key or not await self.allowed(inbound):
            return
        reply = await self._run(inbound, f"!memory forget --from {source}")
        await self._answer(event.sender, reply.text)

    async def _offered_undo(self, room_id: str, event_id: str) -> bool:
        """Whether ``event_id`` is one of the bot's confirmations that offered an undo."""
        response = await self.adapter.client.room_get_event(room_id, event_id)
        target = getattr(response, "event", None)
        body = getattr(target, "body", None)
        return (getattr(target, "sender", None) == self.adapter.config.user_id and isinstance(body, str)
                and body.endswith(UNDO_OFFER))

    async def inbound(self, room: MatrixRoom, event: Event) -> Inbound:
        """The reaction (or another event) as a message of its sender (for the access rules and the command's
        context)."""
        adapter = self.adapter
        is_dm, channel_id, parent = await adapter.conversation(room, event.sender)  # (as a message there)
        name, handle = author_of(room, event.sender, shared=not is_dm)
        incoming = IncomingMessage("matrix", channel_id, event.sender, name, "", author_handle=handle,
                                   is_dm=is_dm, server_id=None if is_dm else room.room_id,
                                   author_home=event.sender.split(":", 1)[-1], parent_channel_id=parent)
        return Inbound(incoming, is_self=event.sender == adapter.config.user_id,
                       ranks=await adapter.ranks_of(room, event.sender),
                       is_bot_admin=event.sender in adapter.config.admin_ids)

    async def allowed(self, inbound: Inbound, what: str = "a reaction") -> bool:
        """Whether the reaction may run: the access rules a typed command meets (deny lists, DMs off...), and as
        it stores something, the router's per-user rate limit of messages."""
        app = self.adapter.app
        reason = refusal(inbound, app.config.access, is_command=True)
        if reason is None and await app.router.limiter.check(inbound.message.author_key):
            reason = "rate limit"
        if reason is not None:
            log.info("Matrix: ignored %s by %s: %s", what, inbound.message.author_id, reason)
        return reason is None

    async def _run(self, inbound: Inbound, line: str) -> CommandReply:
        router = self.adapter.app.router
        inbound = replace(inbound, message=replace(inbound.message, text=line))
        context = router.context_for(inbound, await router.persona_for(inbound))
        return await self.adapter.app.commands.dispatch(line, context)

    async def _answer(self, user_id: str, text: str) -> str:
        from adapters.matrix import render

        room = await self.adapter.dm_room(user_id)
        return await self.adapter.send(room, render(text, self.adapter.config.msgtype))

