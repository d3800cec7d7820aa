"""The platform-neutral path of a chat message, shared by the Discord and Matrix adapters.

An adapter turns a platform event into an :class:`bot.policy.Inbound` and hands it to
:meth:`Router.handle` together with a :class:`ChatSink` that knows how to send, edit, show typing and
answer privately on that platform. The router decides whether to answer (``bot.policy``), runs
commands (private answers stay private), applies the per-user rate limit, picks the channel's
persona and streams the reply (``bot.streaming``). LLM failures become one short message; the
user's message is already stored by then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Protocol

from bot.commands import TERMINAL, Command, CommandContext, CommandRegistry, CommandReply, words
from bot.config import Config, ConfigError
from bot.conversation import ConversationCore, ReplyResult, ReplyStream
from bot.errors import MessageWithdrawn, UserFacingError
from bot.llm.errors import LLMError
from bot.persona import ConfigPersonas, PersonaSource
from bot.policy import Inbound, refusal
from bot.ports import IncomingMessage
from bot.ratelimit import FleetRateLimiter, SharedCount, slow_down
from bot.storage.base import Storage
from bot.storage.core import channel_persona_key, user_persona_key
from bot.streaming import MessageSink, StreamedReply
from bot.text import error_line

log = logging.getLogger(__name__)
SOMETHING_WENT_WRONG = ("Something went wrong on my side while answering (the details are in the bot's log). "
                        "Please try again in a moment.")
DATABASE_UNAVAILABLE = ("My database cannot be used right now (the admins can see why in the bot's log). Please try "
                        "again in a few minutes.")


# Counts a send of (kind, key) under a limit per minute where every process of the fleet sees it: 0, or the wait.
CountShared = Callable[[str, str, int], Awaitable[float]]


class ChatSink(MessageSink, Protocol):
    """What an adapter offers the router for one incoming message."""

    def typing(self) -> AbstractAsyncContextManager[None]: ...

    async def send_reply(self, reply: CommandReply) -> None:
        """Answer in the conversation (attachments included)."""

    async def send_private(self, reply: CommandReply) -> None:
        """Answer only the author (Discord: ephemeral; Matrix: a DM plus a short notice in the room)."""


STILL_WORKING = "⏳ still working…"
INCOGNITO_MARK = "🕶️ "


async def _still_working(stream: ReplyStream, shown: StreamedReply, seconds: float) -> None:
    """The "still working" line, counted from when the reply's turn came (bot.turns): before, it would stand
    between the pieces of the same person's answer before it."""
    await stream.turn_taken.wait()
    await shown.placeholder_after(seconds, STILL_WORKING)


async def _stop(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class Router:
    def __init__(
        self, config: Config, storage: Storage, core: ConversationCore, commands: CommandRegistry,
        personas: PersonaSource | None = None, count_shared: CountShared | None = None,
    ) -> None:
        self.config = config
        self._count_shared = count_shared
        self.personas = personas or ConfigPersonas(config)
        self.storage = storage
        self.core = core
        self.commands = commands
        self.limiter = FleetRateLimiter(config.chat.rate_limit_per_minute, self._shared_count("chat"))
        self.command_limiter = FleetRateLimiter(config.chat.command_rate_limit_per_minute,
                                                self._shared_count("commands"))
        commands.register(Command(
            "persona", "show the persona here, or pick one (in a DM for yourself; in a channel admins only)",
            self._persona_command, (words("name", "a persona's name", complete="personas"),), public=True,
        ))

    def _shared_count(self, kind: str) -> SharedCount | None:
        """How the processes sharing the database count a user's sends of ``kind`` together (``count_shared``:
        PostgreSQL's); None with SQLite (one process per file: each counts in memory)."""
        count = self._count_shared
        return None if count is None else lambda key, per_minute: count(kind, key, per_minute)

    async def persona_for(self, inbound: Inbound) -> str:
        """A DM's persona is its user's pick; a channel's is the admins' pick for it, else its parent
        channel's (threads and forum posts), else the default."""
        msg = inbound.message
        keys = [user_persona_key(msg.author_key)] if msg.is_dm else []
        keys += [channel_persona_key(key) for key in (msg.channel_key, msg.parent_channel_key) if key]
        for key in keys:
            name = await self.storage.get_setting(key)
            if name:
                try:
                    return self.personas.persona(name).name
                except ConfigError:
                    log.warning("setting %s names a persona that no longer exists", key)
        return self.personas.persona(None).name

    async def handle(self, inbound: Inbound, sink: ChatSink, *, on_stored: Callable[[], object] | None = None) -> None:
        """Answer or run ``inbound``; ``on_stored`` is called once a message to answer is stored (not for a command
        or a message that is not answered: the caller knows when ``handle`` returns)."""
        msg = inbound.message
        text = msg.text.strip()
        is_command = self.commands.is_command(text)
        if is_command and not self._for_this_bot(msg, text):
            log.debug("not answering %s in %s: another bot's command, perhaps", text[:40], msg.channel_key)
            return
        if not await self.admits(inbound, sink, is_command=is_command):
            return
        persona = await self.persona_for(inbound)
        if is_command:
            await self._command(inbound, sink, text, persona)
            return
        await self._reply(inbound, sink, persona, on_stored)

    async def admits(self, inbound: Inbound, sink: ChatSink, *, is_command: bool) -> bool:
        """Whether to answer: the access lists let the author in here, and they are within their rate limit
        (for what an adapter handles itself, such as Matrix's !leave, as for everything else)."""
        reason = refusal(inbound, self.config.access, is_command=is_command)
        if reason is not None:
            log.debug("not answering message in %s: %s", inbound.message.channel_key, reason)
            return False
        return inbound.counted or not await self._too_fast(inbound.message, sink, is_command)

    async def _too_fast(self, msg: IncomingMessage, sink: ChatSink, is_command: bool) -> bool:
        """Whether the author is over their rate limit (messages and commands each have one; the terminal's
        commands none: its user runs the bot). They are told once per wait; what they send meanwhile is
        dropped without another notice."""
        limiter = self.command_limiter if is_command else self.limiter
        wait = await (self._command_wait(msg) if is_command else limiter.check(msg.author_key))
        if not wait:
            return False
        if limiter.tell(msg.author_key, wait):
            await sink.send_reply(CommandReply(slow_down("commands" if is_command else "messages", wait)))
        return True

    async def claim_files(self, inbound: Inbound) -> Inbound | None:
        """Whether an adapter should download the files sent with this message: only for a command of this
        bot's that takes a file (a card to import), from someone who may run it now (the access lists, its
        admin rights, the command rate limit); never for chat or another bot's command (``!play`` with a
        file). The command is counted against the author's rate limit here, before the download (a burst of
        file commands would otherwise all pass and download at once): the inbound to handle, marked counted,
        or None (the command then runs without its files and says what is missing or refused)."""
        msg = inbound.message
        text = msg.text.strip()
        if not (self.commands.is_command(text) and self._for_this_bot(msg, text)):
            return None
        if not (self.commands.takes_files_from(text, self.context_for(inbound, ""))
                and refusal(inbound, self.config.access, is_command=True) is None):
            return None
        if await self._command_wait(msg):
            return None
        return replace(inbound, counted=True)

    async def _command_wait(self, msg: IncomingMessage) -> float:
        """Count a command against its author's limit: how long they must wait, or 0 (the terminal's commands
        have no limit: its user runs the bot)."""
        return 0.0 if msg.platform == TERMINAL else await self.command_limiter.check(msg.author_key)

    def _for_this_bot(self, msg: IncomingMessage, text: str) -> bool:
        """Whether a command line is this bot's to answer: in a DM, with a mention, or one of its commands
        (in a channel shared with other bots, ``!play`` is theirs)."""
        return msg.is_dm or msg.mentions_bot or self.commands.knows(text)

    async def _command(self, inbound: Inbound, sink: ChatSink, text: str, persona: str) -> None:
        reply = await self.commands.dispatch(text, self.context_for(inbound, persona))
        if reply.private and not inbound.message.is_dm:
            await sink.send_private(reply)
        else:
            await sink.send_reply(reply)

    @staticmethod
    def context_for(inbound: Inbound, persona: str) -> CommandContext:
        """Who runs a command where, with which persona: the same on every platform and the terminal."""
        msg = inbound.message
        return CommandContext(
            platform=msg.platform,
            user_key=msg.author_key,
            user_name=msg.display_name,
            channel_key=msg.channel_key,
            persona=persona,
            is_admin=inbound.is_admin or inbound.is_bot_admin,
            is_bot_admin=inbound.is_bot_admin,
            attachments=inbound.attachments,
            attachments_seen_by_all=bool(inbound.attachments) and not msg.is_dm,  # (a slash command's are not)
            seen_by_all=not msg.is_dm,
            is_dm=msg.is_dm,
            server_key=msg.server_key,
            parent_channel_key=msg.parent_channel_key,
            reply_to=msg.reply_to,
            message_key=msg.message_key,
            sent_at=msg.sent_at,
            history_since_join=inbound.history_since_join,
        )

    async def _reply(self, inbound: Inbound, sink: ChatSink, persona: str,
                     on_stored: Callable[[], object] | None = None) -> None:
        message = inbound.message
        if not message.text.strip():  # a bare mention (or a picture alone): who answers, and how to talk
            if not (message.is_dm or message.mentions_bot or inbound.replied_to_bot):
                # An always-answer channel: a picture or sticker there is for its members, and the line after
                # each one was the bot talking over them. Nothing of it is stored or shown to the model either.
                log.debug("not answering a message without text in %s: not addressed to the bot", message.channel_key)
                return
            where = "" if message.is_dm else " after the mention (or as a reply to one of mine)"
            await sink.send_reply(CommandReply(
                # (no display name: one such as "[Claim your prize](https://…)" would be a link in the bot's words)
                f"Hi, {persona} here. I read text: write your message{where}, or send "
                f"{self.commands.prefix}help to see what I can do."))
            return
        try:
            stream = self.core.reply(message, persona, is_admin=inbound.is_admin, is_bot_admin=inbound.is_bot_admin)
        except UserFacingError as exc:
            await sink.send_reply(CommandReply(exc.user_message))
            return
        chat = self.config.chat
        shown = StreamedReply(sink, chat.edit_interval_seconds, chat.streaming)
        stream.on_status = shown.status
        stream.on_answered = shown.finish
        waiting = asyncio.create_task(_still_working(stream, shown, chat.still_working_seconds)) \
            if chat.still_working_seconds else None
        told: list[BaseException] = []

        async def fail(exc: BaseException) -> None:  # (called by the core while it holds the turn: see ReplyStream)
            if not told:
                told.append(exc)
                await self._show_failure(message, shown, sink, waiting, exc)

        stream.on_failed = fail
        stream.on_stored = on_stored
        try:
            async with sink.typing():
                async for delta in stream:
                    if stream.incognito and not shown.text:
                        await shown.feed(INCOGNITO_MARK)  # shown on the platform, never stored with the reply
                    await shown.feed(delta)
        except Exception as exc:
            await fail(exc)
            return
        finally:
            await _stop(waiting)
        try:
            handles = await shown.finish()
        except Exception as exc:  # the platform refused the reply itself (no right to send here, a form it refused)
            if shown.sent or stream.result is None:
                raise
            # Nothing of it reached the person: kept, it would enter later prompts as something they had read.
            await self.core.unshown(stream.result)
            log.warning("the reply in %s could not be shown (%s); it is not kept", message.channel_key,
                        error_line(exc))
            return
        await self._link(sink, handles, stream.result, gone=shown.gone)

    async def _show_failure(self, message: IncomingMessage, shown: StreamedReply, sink: ChatSink,
                            waiting: asyncio.Task[None] | None, exc: BaseException) -> None:
        """What a reply that failed leaves on the platform."""
        if shown.refused is not None and not shown.sent:  # (nothing can be shown there: not a bug, no second try)
            await _stop(waiting)
            log.warning("the reply in %s failed (%s), and the platform refuses the bot's messages there (%s)",
                        message.channel_key, error_line(exc), error_line(shown.refused))
        elif isinstance(exc, LLMError | UserFacingError):
            await self._failed(shown, sink, waiting, exc.user_message)
        elif isinstance(exc, MessageWithdrawn):  # deleted on the platform before its reply: nothing to answer
            await _stop(waiting)
            if shown.sent:
                await shown.finish()
        elif (trouble := self.storage.unavailable(exc)) is not None:  # what to do, not a driver's traceback
            log.error("reply in %s failed: %s", message.channel_key, trouble)
            await self._failed(shown, sink, waiting, DATABASE_UNAVAILABLE)
        else:  # a bug: said in one line, never a silent end
            log.error("reply in %s failed", message.channel_key, exc_info=exc)
            await self._failed(shown, sink, waiting, SOMETHING_WENT_WRONG)

    @staticmethod
    async def _failed(shown: StreamedReply, sink: ChatSink, waiting: asyncio.Task[None] | None, why: str) -> None:
        await _stop(waiting)
        if shown.sent and not shown.text:  # the error takes the place of the "still working…" line
            await shown.finish(fallback=f"⚠️ {why}")
        else:  # keep what was said so far, then say what went wrong
            await shown.finish()
            await sink.send_reply(CommandReply(f"⚠️ {why}"))

    async def incognito(self, user_key: str, persona: str) -> bool:
        """Whether the user is in an incognito stretch with the persona (``!memory pause``)."""
        user = await self.storage.get_user(user_key)
        return user is not None and await self.storage.incognito.active(user.id, persona)

    async def _link(self, sink: ChatSink, handles: Sequence[object], result: ReplyResult | None, *,
                    gone: bool = False) -> None:
        """Note which platform messages show the reply (for a platform's "Why?" on one of them); a sink
        that cannot name its messages (the terminal, tests) is skipped. A reply a moderator deleted while it
        was written or stored (``gone``, or its deletion came before this link) leaves the store too."""
        key_of = getattr(sink, "message_key", None)
        if result is None or key_of is None:
            return
        keys = [key for key in (key_of(handle) for handle in handles) if key]
        if keys:
            await self.storage.sources.link(keys, result.reply.id)
            if gone or any(self.core.key_withdrawn(key) for key in keys):
                await self.core.withdraw(keys[0])

    async def _persona_command(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        """Only a channel's new persona is announced to the channel; everything else answers the asker."""
        names = ", ".join(self.personas.names())
        if not args:
            return CommandReply(f"Here you talk to {ctx.persona}. Personas: {names}.", private=True)
        try:
            chosen = self.personas.persona(" ".join(args)).name
        except ConfigError as exc:
            return CommandReply(str(exc), private=True)
        if ctx.is_dm:
            await self.storage.set_setting(user_persona_key(ctx.user_key), chosen)
            return CommandReply(f"In your direct messages you now talk to {chosen}.", private=True)
        if not ctx.is_admin:
            return CommandReply("Only admins pick the persona of a channel.", private=True)
        await self.storage.set_setting(channel_persona_key(ctx.channel_key), chosen)
        return CommandReply(f"{chosen} now answers in this channel.")
