"""The Discord adapter (discord.py): messages and slash commands in, streamed replies out.

It only translates. A ``discord.Message`` becomes a :class:`bot.policy.Inbound` for
:class:`bot.router.Router`; a :class:`DiscordSink` sends, edits, shows typing and answers privately
(a DM for text commands, ephemeral for slash commands). Slash commands are built from the same
command layer: each one composes the equivalent ``!…`` line and dispatches it. Everything the bot
sends carries ``AllowedMentions.none()``: no @everyone, @here, role or user pings, ever.

Sharding: with ``[discord] shard_count`` the client is discord.py's :class:`discord.AutoShardedClient`
running ``shard_ids`` (all shards when unset), so a fleet of processes splits the shards between them.
Slash commands are synced by one process only: the one whose shards include shard 0, or an unsharded
one (:func:`syncs_commands`); the others log that they skip it.

Testing aid (never set it in production): when the environment variable ``CORTEXBOT_DISCORD_API_BASE``
is set (e.g. ``http://127.0.0.1:8800/api/v10``), :meth:`DiscordAdapter.run` points discord.py's
``Route.BASE`` at it, and the gateway websocket at ``CORTEXBOT_DISCORD_GATEWAY`` when that is set, else
at the ``url`` the server's ``GET /gateway/bot`` answers. That lets a ``cortexbot run`` subprocess talk
to the fake Discord of ``tests/fakes/discord_server.py``; it logs a warning when in use.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import aiohttp
import discord
import yarl
from discord import app_commands

from adapters.discord_slash import (
    MAX_FILES,
    build_context_menus,
    build_slash_commands,
    in_dm,
    message_text,
    read_attachment,
)
from adapters.reachable import wait_until_answers
from bot.app import App
from bot.commands import CommandContext, CommandReply
from bot.config import ConfigError, DiscordConfig, read_secret
from bot.policy import Inbound, refusal
from bot.ports import IncomingMessage
from bot.ratelimit import slow_down
from bot.splitting import closing_fence, split_message
from bot.streaming import CannotPost, MessageGone, RateLimited
from bot.text import error_line

log = logging.getLogger(__name__)

PLATFORM = "discord"
LIMIT = 2000
SLASH_NEEDS_TEXT = ("That needs its text: give it in the command's text option. An option holds one line; for a "
                    "text of several lines, type the command with ! and put the text on the lines after it.")
MESSAGES_PER_REPLY = 4  # a command's answer up to this many messages long is sent as messages, not a file
NO_PINGS = discord.AllowedMentions.none()
ANSWERED_PRIVATELY = "Answered privately."
SLASH_PATIENCE = 2.0  # Discord wants an interaction's first response within 3 s: slower commands defer
INTERACTION_DEADLINE = 3.0
SLASH_REFUSED = "This bot does not take commands from you here (its access settings)."
SLASH_STALE = ("Discord sent that command as it was before the bot was updated. Reload Discord (Ctrl+R, or "
               "restart the app) so that it shows the current commands, then try again.")
SLASH_FAILED = "Sorry, that failed. Try again, or tell an admin (the details are in the bot's log)."
CHAT_TYPES = (discord.MessageType.default, discord.MessageType.reply)  # not joins, pins, boosts, thread starts
TOO_LARGE = ("The file is larger than Discord lets me send here (its upload limit), so it is not attached. "
             "The web page (!dashboard), where this bot runs one, has the same export as a download.")


def _too_large(exc: discord.HTTPException) -> bool:
    return exc.status == 413 or exc.code == 40005


def _with_note(text: str, note: str) -> str:
    """``text`` shortened so that ``note`` fits after it within one message."""
    room = LIMIT - len(note) - 3
    return (text if len(text) <= room else text[:room].rstrip() + "…") + "\n" + note
API_BASE_ENV = "CORTEXBOT_DISCORD_API_BASE"  # testing aids: see the module docstring
CONNECT_RETRY_FIRST, CONNECT_RETRY_LONGEST = 1.0, 60.0  # seconds between tries to reach Discord at start
GATEWAY_ENV = "CORTEXBOT_DISCORD_GATEWAY"
INTENTS_HELP = (
    "Discord refused the message content intent. Open https://discord.com/developers/applications → your "
    "application → Bot → Privileged Gateway Intents, switch on MESSAGE CONTENT INTENT, save, and start again."
)


def default_intents() -> discord.Intents:
    intents = discord.Intents.default()
    intents.message_content = True  # privileged: must be enabled in the developer portal
    return intents


def build_client(config: DiscordConfig, intents: discord.Intents) -> discord.Client:
    """A plain client, or with ``shard_count`` the auto-sharded one running ``shard_ids`` (all when unset)."""
    # The bot never joins voice: discord.py's start-up warnings about voice libraries are noise here.
    discord.VoiceClient.warn_nacl = False
    discord.VoiceClient.warn_dave = False
    if config.shard_count is None:
        return discord.Client(intents=intents, allowed_mentions=NO_PINGS)
    sharding: dict[str, Any] = {"shard_count": config.shard_count}
    if config.shard_ids is not None:
        sharding["shard_ids"] = config.shard_ids
    return discord.AutoShardedClient(intents=intents, allowed_mentions=NO_PINGS, **sharding)


def syncs_commands(config: DiscordConfig) -> bool:
    """Whether this process syncs the slash commands: one process per fleet, the one running shard 0."""
    return config.shard_count is None or config.shard_ids is None or 0 in config.shard_ids


def _shards_label(config: DiscordConfig) -> str:
    if config.shard_count is None:
        return "unsharded"
    if config.shard_ids is None:
        return f"all {config.shard_count} shard(s)"
    return f"shard(s) {', '.join(map(str, config.shard_ids))} of {config.shard_count}"


def test_api_base(environ: Mapping[str, str]) -> str:
    """The fake Discord's API a test names (see the module docstring), or ""."""
    return environ.get(API_BASE_ENV, "").strip().rstrip("/")


async def reachable(base: str) -> None:
    """Wait until Discord's API answers at all (any answer below HTTP 500; the login then says what is wrong with
    the token). discord.py reconnects a gateway that drops, but its first login gives up at once: a bot started
    before the network (at boot, by systemd) ended with "Cannot connect to host discord.com". Tried again,
    doubling the wait up to ``CONNECT_RETRY_LONGEST``; said once, and once more when it answers."""
    await wait_until_answers(
        f"{base}/gateway", first=CONNECT_RETRY_FIRST, longest=CONNECT_RETRY_LONGEST,
        down=lambda problem: log.warning("Discord: cannot reach %s (%s); trying again, at most every %.0f s", base,
                                         problem, CONNECT_RETRY_LONGEST),
        back=lambda: log.warning("Discord: %s answers again; logging in", base))


async def redirect_for_tests(environ: Mapping[str, str], token: str) -> bool:
    """Testing aid (see the module docstring): point discord.py at a fake Discord. True when redirected."""
    base = test_api_base(environ)
    if not base:
        return False
    log.warning("Discord: $%s is set: talking to %s instead of Discord (a testing aid)", API_BASE_ENV, base)
    discord.http.Route.BASE = base
    gateway = environ.get(GATEWAY_ENV, "").strip() or await _bot_gateway(base, token)
    discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(gateway)
    return True


async def _bot_gateway(base: str, token: str) -> str:
    """The gateway URL the (fake) server names in ``GET /gateway/bot``."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/gateway/bot", headers={"Authorization": f"Bot {token}"}) as response:
            response.raise_for_status()
            return str((await response.json())["url"])


def _as_file(name: str, data: bytes) -> discord.File:
    return discord.File(io.BytesIO(data), filename=name)


def _parent_id(channel: object) -> str | None:
    """A thread's (or forum post's) parent channel, whose persona it inherits."""
    if isinstance(channel, discord.Thread) and channel.parent_id is not None:
        return str(channel.parent_id)
    return None


def _is_admin(member: discord.abc.User, config: DiscordConfig) -> bool:
    if member.id in config.admin_ids:
        return True
    permissions = getattr(member, "guild_permissions", None)
    return bool(permissions and (permissions.manage_guild or permissions.administrator))


def _role_keys(user: discord.abc.User, guild_id: int | None) -> tuple[str, ...]:
    """The member's roles as ``[access]`` names them, from the role ids Discord sent with the member.
    Not ``Member.roles``: it looks the ids up in the cached server, and a server not loaded yet (at start,
    after a reconnect) has none there, so a slash command from it passed ``deny_roles`` and failed every
    ``allow_roles``. discord.py keeps the ids it was sent in ``_roles`` and has no public name for them."""
    if not isinstance(user, discord.Member):  # (a DM's user has no roles)
        return ()
    return tuple(f"{PLATFORM}:{role_id}" for role_id in user._roles if role_id != guild_id)  # (not @everyone)


def _reply_payload(reply: CommandReply) -> tuple[str, list[discord.File]]:
    """Text within the limit and files; an over-long text goes as an attached file (the part shown is cut
    before a code block is put around it, so the block is always closed)."""
    files = [_as_file(a.filename, a.data) for a in reply.attachments]
    text = reply.markdown()
    if len(text) > LIMIT:
        files.append(_as_file("reply.txt" if reply.preformatted else "reply.md", reply.text.encode()))
        room = LIMIT - 100 - (len(text) - len(reply.text))  # what the code block's fences take
        shown = replace(reply, text=reply.text[:max(room, 0)].rsplit("\n", 1)[0]).markdown()
        fence = closing_fence(shown)  # (a block of the text's own, cut open: the note would be inside it)
        text = shown + (f"\n{fence}" if fence else "") + f"\n… (the whole text is attached as {files[-1].filename})"
    return text, files


class DiscordSink:
    """Delivery for one incoming message (see :class:`bot.router.ChatSink`)."""

    limit = LIMIT

    def __init__(self, message: discord.Message, typing_indicator: bool = True) -> None:
        self.message = message
        self.channel = message.channel
        self.typing_indicator = typing_indicator

    @staticmethod
    def message_key(handle: discord.Message) -> str:
        return f"{PLATFORM}-message:{handle.id}"

    # What the bot sends shows no link previews (replies here; command answers, which may quote what a model
    # wrote, below): Discord's servers fetch a previewed link at once, so a model talked into writing
    # https://attacker.example/?secret=… (by a fetched page, a lore entry, another member) would hand the secret
    # over without anyone clicking. Links stay links.
    async def send(self, text: str) -> discord.Message:
        try:
            return await self.channel.send(text, allowed_mentions=NO_PINGS, suppress_embeds=True)
        except discord.Forbidden as exc:  # (no right to send here: so for every later piece of the reply too)
            raise CannotPost(str(exc)) from exc
        except discord.HTTPException as exc:
            raise _rate_limited(exc) from exc

    async def edit(self, handle: discord.Message, text: str) -> None:
        try:
            await handle.edit(content=text, allowed_mentions=NO_PINGS, suppress=True)
        except discord.NotFound as exc:  # deleted meanwhile (a moderator): not to be sent again
            raise MessageGone() from exc
        except discord.HTTPException as exc:
            raise _rate_limited(exc) from exc

    @asynccontextmanager
    async def typing(self) -> AsyncIterator[None]:
        """Typing indicator while the reply is written; never lets a failure of it stop the reply."""
        manager = self.channel.typing() if self.typing_indicator else None
        try:
            if manager is not None:
                await manager.__aenter__()
        except Exception as exc:  # e.g. no permission to type in this channel
            log.debug("Discord: no typing indicator (%s)", type(exc).__name__)
            manager = None
        try:
            yield
        finally:
            if manager is not None:
                await manager.__aexit__(None, None, None)

    async def send_reply(self, reply: CommandReply) -> None:
        # A text of a few messages (the help) is sent as those messages; a longer one as a file.
        whole = reply.markdown()
        if len(whole) <= MESSAGES_PER_REPLY * LIMIT:
            text, files = whole, [_as_file(a.filename, a.data) for a in reply.attachments]
        else:
            text, files = _reply_payload(reply)
        pieces = split_message(text, LIMIT) or [""]
        for piece in pieces[:-1]:
            await self.channel.send(piece, allowed_mentions=NO_PINGS, suppress_embeds=True)
        await _send_with_files(self.channel, pieces[-1], files)

    async def send_private(self, reply: CommandReply) -> None:
        text, files = _reply_payload(reply)
        try:
            await _send_with_files(self.message.author, text, files)
            note = "I answered you in a direct message."
        except discord.Forbidden:
            note = ("I could not send you a direct message (your DMs are closed). Use the slash command instead: "
                    "its answer is visible only to you.")
        try:
            await self.channel.send(note, allowed_mentions=NO_PINGS)
        except discord.Forbidden as exc:  # nor may the bot write here: the person cannot be told (one line, no trace)
            log.warning("Discord: a private answer's note could not be sent in channel %s (%s)", self.channel.id,
                        error_line(exc))


async def _send_with_files(target: discord.abc.Messageable, text: str, files: list[discord.File]) -> None:
    """Send ``text`` with ``files``; files over Discord's upload limit are replaced by a line saying so."""
    try:
        await target.send(text or None, files=files, allowed_mentions=NO_PINGS, suppress_embeds=True)
    except discord.HTTPException as exc:
        if isinstance(exc, discord.Forbidden) or not (files and _too_large(exc)):
            raise
        await target.send(_with_note(text, TOO_LARGE), allowed_mentions=NO_PINGS, suppress_embeds=True)


def _expired(exc: discord.HTTPException) -> bool:
    """Whether Discord refused an interaction's follow-up as too late (its token lasts 15 minutes)."""
    return exc.code in (50027, 10015) or exc.status in (401, 404)  # (Invalid Webhook Token, Unknown Webhook)


def _patience(interaction: discord.Interaction) -> float:
    """How long a slash command may run before it defers: ``SLASH_PATIENCE`` from when Discord made the interaction
    (a busy event loop may get to it late). An age past Discord's 3 s says the clocks disagree: not counted."""
    age = (datetime.now(UTC) - interaction.created_at).total_seconds()
    if age <= 0.0 or age >= INTERACTION_DEADLINE:
        return SLASH_PATIENCE
    return max(0.0, SLASH_PATIENCE - age)


def _rate_limited(exc: discord.HTTPException) -> Exception:
    if exc.status == 429:
        retry = getattr(exc, "retry_after", None) or 1.0
        return RateLimited(float(retry))
    return exc


class DiscordAdapter:
    name = PLATFORM

    def __init__(self, app: App, config: DiscordConfig, *, intents: discord.Intents | None = None) -> None:
        self.app = app
        self.config = config
        self.bot = build_client(config, intents or default_intents())
        self.tree = app_commands.CommandTree(self.bot)
        # (user id, file) -> (when read, [(version, its line)]): an autocompletion's answer, kept a few seconds
        self.versions_seen: dict[tuple[int, int | None, str], tuple[float, list[tuple[int, str]]]] = {}
        self._synced = False  # the slash commands, once per process (on_ready comes again after a reconnect)
        self.bot.event(self.on_message)
        self.bot.event(self.on_ready)
        self.bot.event(self.on_raw_message_delete)
        self.bot.event(self.on_raw_bulk_message_delete)
        self.bot.event(self.on_guild_channel_delete)
        self.bot.event(self.on_raw_thread_delete)
        build_slash_commands(self)
        build_context_menus(self)
        self.tree.error(self.on_slash_error)

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, token: str) -> None:
        await reachable(test_api_base(os.environ) or discord.http.Route.BASE)
        await redirect_for_tests(os.environ, token)
        try:
            async with self.bot:
                await self.bot.start(token)
        except discord.PrivilegedIntentsRequired:
            raise RuntimeError(INTENTS_HELP) from None
        except discord.LoginFailure:
            raise RuntimeError(f"Discord rejected the bot token (from ${self.config.token_env}).") from None

    async def on_ready(self) -> None:
        log.info("Discord: logged in as %s in %d server(s), %s", self.bot.user, len(self.bot.guilds),
                 _shards_label(self.config))
        if not self.config.sync_commands:
            return
        if not syncs_commands(self.config):
            log.info("Discord: not syncing slash commands: %s do not include shard 0, whose process syncs them",
                     _shards_label(self.config))
            return
        if self._synced:  # a reconnect: the commands are Discord's already (syncing is rate-limited)
            return
        try:
            if self.config.test_guild_ids:
                for guild_id in self.config.test_guild_ids:
                    guild = discord.Object(id=guild_id)
                    self.tree.copy_global_to(guild=guild)
                    await self.tree.sync(guild=guild)
            else:
                await self.tree.sync()
        except discord.HTTPException as exc:  # tried again at the next ready; the bot answers meanwhile
            log.warning("Discord: syncing the slash commands failed (%s); they are tried again after a reconnect",
                        exc)
            return
        self._synced = True

    async def close(self, grace: float = 10.0) -> None:
        """Let replies and commands in flight finish (at most ``grace`` seconds), then disconnect:
        ``Client.close`` alone would cut their requests off mid-send."""
        current = asyncio.current_task()
        handlers = [t for t in asyncio.all_tasks() if t is not current and not t.done()
                    and (t.get_name().startswith("discord.py: on_") or t.get_name() == "CommandTree-invoker")]
        if handlers:
            await asyncio.wait(handlers, timeout=grace)
        await self.bot.close()

    # -- messages --------------------------------------------------------------------------------

    def inbound(self, message: discord.Message) -> Inbound:
        me = self.bot.user
        is_dm = in_dm(message.channel)
        text = message_text(message)
        mentions_bot = me is not None and any(u.id == me.id for u in message.mentions)
        # Typing "@Bot" in a server, the client often inserts the bot's own (managed) role instead of the bot.
        own_role = message.guild.self_role if message.guild is not None else None
        if own_role is not None and any(r.id == own_role.id for r in message.role_mentions):
            mentions_bot = True
            text = text.replace(f"<@&{own_role.id}>", "").strip()
        if me is not None:
            text = re.sub(rf"<@!?{me.id}>", "", text).strip()
        reference = message.reference.resolved if message.reference else None
        replied_to_bot = isinstance(reference, discord.Message) and me is not None and reference.author.id == me.id
        roles = _role_keys(message.author, message.guild.id if message.guild is not None else None)
        channel_name = getattr(message.channel, "name", None) or f"DM with {message.author.display_name}"
        incoming = IncomingMessage(
            platform=PLATFORM,
            channel_id=str(message.channel.id),
            author_id=str(message.author.id),
            author_name=message.author.display_name,
            author_handle=str(message.author),  # (a nickname is anyone's to take; the user name is one member's)
            text=text,
            is_dm=is_dm,
            channel_name=str(channel_name),
            server_id=None if is_dm else str(getattr(message.guild, "id", "")),
            mentions_bot=mentions_bot,
            reply_to=f"{PLATFORM}-message:{message.reference.message_id}" if message.reference else None,
            sent_at=message.created_at,
            parent_channel_id=_parent_id(message.channel),
            message_key=DiscordSink.message_key(message),
        )
        return Inbound(
            incoming,
            is_self=me is not None and message.author.id == me.id,
            # A webhook's message (an integration's, a relay's, a followed channel's) is no person's: Discord marks
            # it by ``webhook_id``; the author it names is the webhook, whose ``bot`` flag is optional.
            author_is_bot=message.author.bot or message.webhook_id is not None,
            replied_to_bot=replied_to_bot,
            roles=roles,
            is_admin=_is_admin(message.author, self.config),
            is_bot_admin=message.author.id in self.config.admin_ids,
        )

    async def on_message(self, message: discord.Message) -> None:
        if message.type not in CHAT_TYPES:
            return
        if message.guild is None and not in_dm(message.channel):
            log.info("Discord: a message in channel %s of a server not loaded yet is left unanswered",
                     message.channel.id)
            return
        if isinstance(message.channel, discord.PartialMessageable) and not await self._known_channel(message):
            return
        sink = DiscordSink(message, self.app.config.chat.typing_indicator)
        try:
            inbound = self.inbound(message)
            if message.attachments and (claimed := await self.app.router.claim_files(inbound)) is not None:
                with_files = await self._with_files(message, claimed, sink)
                if with_files is None:
                    return
                inbound = with_files
            await self.app.router.handle(inbound, sink)
        except discord.Forbidden as exc:
            # Discord refused what the bot said (a channel it may read but not write in; a DM of someone whose
            # DMs are closed to it): a line saying so, as for a refused reply; nobody there can be told.
            log.warning("Discord: the answer to message %s could not be sent in channel %s (%s)", message.id,
                        message.channel.id, error_line(exc))
        except Exception:
            log.exception("Discord: failed to handle message %s", message.id)

    async def _with_files(self, message: discord.Message, inbound: Inbound, sink: DiscordSink) -> Inbound | None:
        """``inbound`` with the file its command takes, read from Discord; None when the person was told why not."""
        if len(message.attachments) > MAX_FILES:  # (which one is meant cannot be told: a screenshot first)
            await sink.send_reply(CommandReply(
                f"{len(message.attachments)} files came with the command: attach only the one it takes."))
            return None
        try:
            files = tuple([await read_attachment(a) for a in message.attachments[:MAX_FILES]])
        except ValueError as exc:
            await sink.send_reply(CommandReply(str(exc)))
            return None
        except (discord.HTTPException, aiohttp.ClientError, TimeoutError) as exc:
            await sink.send_reply(CommandReply(
                f"The file could not be downloaded from Discord ({type(exc).__name__}); send it again."))
            return None
        return replace(inbound, attachments=files)

    async def _known_channel(self, message: discord.Message) -> bool:
        """A server's channel discord.py has not loaded (a thread it has not seen yet) comes as a stand-in
        without its parent: its parent's access lists, persona and switches would not apply. It is fetched; one
        that cannot be is left unanswered, as a server not loaded yet is."""
        try:
            channel = await self.bot.fetch_channel(message.channel.id)
        except (discord.HTTPException, aiohttp.ClientError, TimeoutError) as exc:
            log.info("Discord: a message in channel %s, which could not be loaded (%s), is left unanswered",
                     message.channel.id, type(exc).__name__)
            return False
        if not isinstance(channel, discord.abc.Messageable):
            return False
        message.channel = channel  # (as discord.py gives a loaded one)
        return True

    async def on_raw_message_delete(self, payload: discord.RawMessageDeleteEvent) -> None:
        """A message deleted (by its author or a moderator): the bot's copy goes too (``withdraw``)."""
        await self._withdraw([payload.message_id])

    async def on_raw_bulk_message_delete(self, payload: discord.RawBulkMessageDeleteEvent) -> None:
        await self._withdraw(sorted(payload.message_ids))

    async def on_guild_channel_delete(self, channel: discord.abc.GuildChannel) -> None:
        """A channel deleted: Discord deletes every message in it and says so only with this event (its
        cached threads come as thread deletions)."""
        await self._withdraw_channel(channel.id)

    async def on_raw_thread_delete(self, payload: discord.RawThreadDeleteEvent) -> None:
        """A thread or forum post deleted, with its messages (raw: the thread may not be cached)."""
        await self._withdraw_channel(payload.thread_id)

    async def _withdraw_channel(self, channel_id: int) -> None:
        try:
            await self.app.core.withdraw_channel(f"{PLATFORM}:{channel_id}")
        except Exception:
            log.exception("Discord: could not remove the messages of deleted channel %s", channel_id)

    async def _withdraw(self, message_ids: list[int]) -> None:
        for message_id in message_ids:
            try:
                await self.app.core.withdraw(f"{PLATFORM}-message:{message_id}")
            except Exception:
                log.exception("Discord: could not remove deleted message %s", message_id)

    # -- slash commands --------------------------------------------------------------------------

    def context(self, interaction: discord.Interaction, persona: str) -> CommandContext:
        user, parent = interaction.user, _parent_id(interaction.channel)
        is_dm = interaction.guild_id is None  # (a server's interaction has its id even where it is not loaded)
        return CommandContext(
            platform=PLATFORM,
            user_key=f"{PLATFORM}:{user.id}",
            user_name=user.display_name,
            channel_key=f"{PLATFORM}:{interaction.channel_id}",
            persona=persona,
            # In an interaction Discord sends the member's resolved permissions in this channel.
            is_admin=_is_admin(user, self.config) or (
                not is_dm and (interaction.permissions.manage_guild or interaction.permissions.administrator)
            ),
            is_bot_admin=user.id in self.config.admin_ids,
            is_dm=is_dm,
            server_key=None if is_dm else f"{PLATFORM}:{interaction.guild_id}",
            parent_channel_key=None if parent is None else f"{PLATFORM}:{parent}",
            sent_at=interaction.created_at,
        )

    async def run_slash(self, interaction: discord.Interaction, line: str, *, always_private: bool = False,
                        files: tuple[discord.Attachment, ...] = ()) -> None:
        """Dispatch ``line`` (with the files of its attachment options) and answer the interaction."""
        inbound = self.slash_inbound(interaction, line)
        if await self.refuse_slash(interaction, inbound):  # nothing is downloaded for a refused user
            return
        wait = await self.app.router.command_limiter.check(inbound.message.author_key)  # as typed commands are
        if wait:
            await interaction.response.send_message(slow_down("commands", wait), ephemeral=True,
                                                    allowed_mentions=NO_PINGS)
            return
        work = asyncio.ensure_future(self._dispatch_slash(interaction, inbound, line, files))
        if not (await asyncio.wait({work}, timeout=_patience(interaction)))[0]:
            # Slow (an export, a first search, a forget-me): "thinking…" now, the answer follows in its
            # place, as private as the command's answers are.
            try:
                await interaction.response.defer(ephemeral=always_private, thinking=True)
            except BaseException:
                work.cancel()
                raise
        try:
            reply = await work
        except Exception:  # a command may fail, but the interaction must get an answer ("did not respond")
            log.exception("Discord: the slash command %r failed", line.split("\n", 1)[0][:80])
            reply = CommandReply(SLASH_FAILED, private=True)
        if reply.needs_body:  # "send it on the lines after the command": a slash command has no such lines
            reply = CommandReply(SLASH_NEEDS_TEXT, private=True)
        try:
            await self._answer(interaction, reply, always_private)
        except discord.HTTPException as exc:
            if not (reply.attachments and _too_large(exc)):
                raise
            await self._answer(interaction, CommandReply(_with_note(reply.text, TOO_LARGE), private=True), True)

    async def _dispatch_slash(self, interaction: discord.Interaction, inbound: Inbound, line: str,
                              files: tuple[discord.Attachment, ...]) -> CommandReply:
        persona = await self.app.router.persona_for(inbound)
        context = self.context(interaction, persona)
        if files and not self.app.commands.takes_files_from(line, context):  # (its rights first, as typed ones)
            files = ()
        try:
            attachments = tuple([await read_attachment(f) for f in files])
        except ValueError as exc:  # too large, unreadable: one private line
            return CommandReply(str(exc), private=True)
        except (discord.HTTPException, aiohttp.ClientError, TimeoutError) as exc:  # the download failed
            return CommandReply(f"The file could not be downloaded from Discord ({type(exc).__name__}); send it "
                                "again.", private=True)
        return await self.app.commands.dispatch(line, replace(context, attachments=attachments))

    @staticmethod
    def slash_inbound(interaction: discord.Interaction, line: str) -> Inbound:
        """A slash command as the access policy sees a message: who, where, with which roles."""
        user = interaction.user
        incoming = IncomingMessage(
            PLATFORM, str(interaction.channel_id), str(user.id), user.display_name, line,
            is_dm=interaction.guild_id is None,
            server_id=None if interaction.guild_id is None else str(interaction.guild_id),
            parent_channel_id=_parent_id(interaction.channel),
        )
        return Inbound(incoming, author_is_bot=user.bot, roles=_role_keys(user, interaction.guild_id))

    async def refuse_slash(self, interaction: discord.Interaction, inbound: Inbound | None = None) -> bool:
        """Answer (privately) that the access settings leave this user or place out, as ``!`` commands
        are; a slash command must get some answer, or Discord shows an error."""
        reason = refusal(inbound or self.slash_inbound(interaction, ""), self.app.config.access, is_command=True)
        if reason is None:
            return False
        log.debug("refusing a slash command in %s: %s", interaction.channel_id, reason)
        await interaction.response.send_message(SLASH_REFUSED, ephemeral=True, allowed_mentions=NO_PINGS)
        return True

    async def on_slash_error(self, interaction: discord.Interaction, error: app_commands.AppCommandError) -> None:
        """An interaction the command tree could not run still gets a private answer, never Discord's "The
        application did not respond": a command or option Discord still shows from before an update (a
        subcommand gone, an option now required), or a failure outside the command layer."""
        stale = isinstance(error, (app_commands.CommandNotFound, app_commands.CommandSignatureMismatch))
        if stale:
            log.warning("Discord: a slash command from before an update (%s)", error)
        else:
            name = getattr(interaction.command, "qualified_name", "?")  # (never the options: a user's words)
            log.error("Discord: the slash command %s failed", name, exc_info=error)
        if interaction.type is not discord.InteractionType.application_command:
            return  # an autocompletion gets no message
        text = SLASH_STALE if stale else SLASH_FAILED
        try:
            if interaction.response.is_done():
                await interaction.followup.send(text, ephemeral=True, allowed_mentions=NO_PINGS, suppress_embeds=True)
            else:
                await interaction.response.send_message(text, ephemeral=True, allowed_mentions=NO_PINGS,
                                                        suppress_embeds=True)
        except discord.HTTPException as exc:  # the interaction expired meanwhile
            log.warning("Discord: could not answer the failed interaction (%s)", exc)

    @staticmethod
    async def _answer(interaction: discord.Interaction, reply: CommandReply, always_private: bool) -> None:
        try:
            await DiscordAdapter._answer_in_place(interaction, reply, always_private)
        except discord.HTTPException as exc:
            if not (interaction.response.is_done() and _expired(exc)):
                raise
            # A follow-up after Discord's 15 minutes (an export queued behind others): the work is done, and comes
            # by direct message instead of being lost with the interaction.
            log.warning("Discord: the answer of a slash command came after its interaction expired; sent by DM")
            text, files = _reply_payload(reply)
            try:
                await _send_with_files(interaction.user, text, files)
            except discord.HTTPException as dm_failed:
                log.warning("Discord: nor could it be sent by DM (%s)", error_line(dm_failed))

    @staticmethod
    async def _answer_in_place(interaction: discord.Interaction, reply: CommandReply, always_private: bool) -> None:
        text, files = _reply_payload(reply)
        if interaction.response.is_done():  # deferred: the first follow-up takes the "thinking…" place
            if reply.private and not always_private:
                # That place is as public as the deferral was, whatever the follow-up asks: it is filled
                # with a neutral line, and the private answer comes as a second follow-up, which can be.
                await interaction.edit_original_response(content=ANSWERED_PRIVATELY, allowed_mentions=NO_PINGS)
            await interaction.followup.send(text, files=files, ephemeral=reply.private or always_private,
                                            allowed_mentions=NO_PINGS, suppress_embeds=True)
        else:
            await interaction.response.send_message(
                text, files=files, ephemeral=reply.private or always_private, allowed_mentions=NO_PINGS,
                suppress_embeds=True)


def read_token(config: DiscordConfig) -> str:
    if not config.token_env:
        raise RuntimeError("[discord] token_env is empty: name the environment variable that holds the bot token "
                           "(DISCORD_TOKEN by default)")
    try:
        token = read_secret(config.token_env)
    except ConfigError as exc:
        raise RuntimeError(str(exc)) from None
    if not token:
        raise RuntimeError(f"[discord] is enabled but ${config.token_env} holds no bot token: set it to the bot's "
                           "token (developer portal: your application, Bot, Reset Token), or name the variable that "
                           "holds it with [discord] token_env")
    return token
