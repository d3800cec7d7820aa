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
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import discord
import yarl
from discord import app_commands

from bot.app import App
from bot.commands import CommandContext, CommandReply
from bot.config import DiscordConfig
from bot.policy import Inbound
from bot.ports import IncomingMessage
from bot.splitting import split_message
from bot.streaming import RateLimited
from cortex.memory.store import CATEGORIES
from cortex.store import FILENAMES

log = logging.getLogger(__name__)

PLATFORM = "discord"
LIMIT = 2000
NO_PINGS = discord.AllowedMentions.none()
API_BASE_ENV = "CORTEXBOT_DISCORD_API_BASE"  # testing aids: see the module docstring
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


async def redirect_for_tests(environ: Mapping[str, str], token: str) -> bool:
    """Testing aid (see the module docstring): point discord.py at a fake Discord. True when redirected."""
    base = environ.get(API_BASE_ENV, "").strip().rstrip("/")
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


def _reply_payload(reply: CommandReply) -> tuple[str, list[discord.File]]:
    """Text within the limit and files; an over-long text goes as an attached file."""
    files = [_as_file(a.filename, a.data) for a in reply.attachments]
    text = reply.text
    if len(text) > LIMIT:
        files.append(_as_file("reply.md", text.encode()))
        text = text[: LIMIT - 80].rsplit("\n", 1)[0] + "\n… (the whole text is attached as reply.md)"
    return text, files


class DiscordSink:
    """Delivery for one incoming message (see :class:`bot.router.ChatSink`)."""

    limit = LIMIT

    def __init__(self, message: discord.Message, typing_indicator: bool = True) -> None:
        self.message = message
        self.channel = message.channel
        self.typing_indicator = typing_indicator

    async def send(self, text: str) -> discord.Message:
        try:
            return await self.channel.send(text, allowed_mentions=NO_PINGS)
        except discord.HTTPException as exc:
            raise _rate_limited(exc) from exc

    async def edit(self, handle: discord.Message, text: str) -> None:
        try:
            await handle.edit(content=text, allowed_mentions=NO_PINGS)
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
        text, files = _reply_payload(reply)
        pieces = split_message(text, LIMIT) or [""]
        for piece in pieces[:-1]:
            await self.channel.send(piece, allowed_mentions=NO_PINGS)
        await self.channel.send(pieces[-1] or None, files=files, allowed_mentions=NO_PINGS)

    async def send_private(self, reply: CommandReply) -> None:
        text, files = _reply_payload(reply)
        try:
            await self.message.author.send(text, files=files, allowed_mentions=NO_PINGS)
        except discord.Forbidden:
            await self.channel.send(
                "I could not send you a direct message (your DMs are closed). Use the slash command instead: "
                "its answer is visible only to you.", allowed_mentions=NO_PINGS,
            )
            return
        await self.channel.send("I answered you in a direct message.", allowed_mentions=NO_PINGS)


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
        self.bot.event(self.on_message)
        self.bot.event(self.on_ready)
        build_slash_commands(self)

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, token: str) -> None:
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
        if self.config.test_guild_ids:
            for guild_id in self.config.test_guild_ids:
                guild = discord.Object(id=guild_id)
                self.tree.copy_global_to(guild=guild)
                await self.tree.sync(guild=guild)
        else:
            await self.tree.sync()

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
        is_dm = message.guild is None
        text = message.content
        mentions_bot = me is not None and any(u.id == me.id for u in message.mentions)
        if me is not None:
            text = re.sub(rf"<@!?{me.id}>", "", text).strip()
        reference = message.reference.resolved if message.reference else None
        replied_to_bot = isinstance(reference, discord.Message) and me is not None and reference.author.id == me.id
        roles = tuple(f"{PLATFORM}:{r.id}" for r in getattr(message.author, "roles", []) if not r.is_default())
        channel_name = getattr(message.channel, "name", None) or f"DM with {message.author.display_name}"
        incoming = IncomingMessage(
            platform=PLATFORM,
            channel_id=str(message.channel.id),
            author_id=str(message.author.id),
            author_name=message.author.display_name,
            text=text,
            is_dm=is_dm,
            channel_name=str(channel_name),
            server_id=None if is_dm else str(message.guild.id),  # type: ignore[union-attr]
            mentions_bot=mentions_bot,
            reply_to=str(message.reference.message_id) if message.reference else None,
            sent_at=message.created_at,
            parent_channel_id=_parent_id(message.channel),
        )
        return Inbound(
            incoming,
            is_self=me is not None and message.author.id == me.id,
            author_is_bot=message.author.bot,
            replied_to_bot=replied_to_bot,
            roles=roles,
            is_admin=_is_admin(message.author, self.config),
            is_bot_admin=message.author.id in self.config.admin_ids,
        )

    async def on_message(self, message: discord.Message) -> None:
        sink = DiscordSink(message, self.app.config.chat.typing_indicator)
        try:
            await self.app.router.handle(self.inbound(message), sink)
        except Exception:
            log.exception("Discord: failed to handle message %s", message.id)

    # -- slash commands --------------------------------------------------------------------------

    def context(self, interaction: discord.Interaction, persona: str) -> CommandContext:
        user = interaction.user
        is_dm = interaction.guild is None
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
        )

    async def run_slash(self, interaction: discord.Interaction, line: str, *, always_private: bool = False) -> None:
        """Dispatch ``line`` through the command layer and answer the interaction."""
        incoming = IncomingMessage(
            PLATFORM, str(interaction.channel_id), str(interaction.user.id), interaction.user.display_name, line,
            is_dm=interaction.guild is None, server_id=None if interaction.guild is None else str(interaction.guild_id),
            parent_channel_id=_parent_id(interaction.channel),
        )
        persona = await self.app.router.persona_for(Inbound(incoming))
        reply = await self.app.commands.dispatch(line, self.context(interaction, persona))
        text, files = _reply_payload(reply)
        await interaction.response.send_message(
            text, files=files, ephemeral=reply.private or always_private, allowed_mentions=NO_PINGS
        )


FileChoice = app_commands.Choice[str]
FILE_CHOICES = [app_commands.Choice(name=f, value=f) for f in FILENAMES]


def build_slash_commands(adapter: DiscordAdapter) -> None:
    """The command layer as application commands: /memory …, /cortex …, /help, /summary, /stats, /persona."""
    tree = adapter.tree
    memory = app_commands.Group(name="memory", description="Your own cortex files with this persona")
    cortex = app_commands.Group(name="cortex", description="Cortex updates and settings")
    admin = app_commands.Group(
        name="cortex-admin", description="Cortex settings and stats (admins)",
        default_permissions=discord.Permissions(manage_guild=True),
    )

    @memory.command(name="show", description="Show your cortex files (all, or one)")
    @app_commands.choices(file=FILE_CHOICES)
    async def show(interaction: discord.Interaction, file: FileChoice | None = None) -> None:
        await adapter.run_slash(interaction, "!memory show" + (f" {file.value}" if file else ""))

    @memory.command(name="history", description="The versions of a file: who changed it, when and why")
    @app_commands.choices(file=FILE_CHOICES)
    async def history(interaction: discord.Interaction, file: FileChoice) -> None:
        await adapter.run_slash(interaction, f"!memory history {file.value}")

    async def version_choices(interaction: discord.Interaction, current: str) -> list[app_commands.Choice[int]]:
        """The caller's own versions of the chosen file, newest first."""
        namespace = interaction.namespace
        filename = getattr(namespace, "file", None) or "memory.md"
        user = await adapter.app.storage.get_user(f"{PLATFORM}:{interaction.user.id}")
        if user is None:
            return []
        incoming = IncomingMessage(PLATFORM, str(interaction.channel_id), str(interaction.user.id),
                                   interaction.user.display_name, "", is_dm=interaction.guild is None)
        persona = await adapter.app.router.persona_for(Inbound(incoming))
        pair = await adapter.app.cortex.store.get_pair(user.id, persona)
        if pair is None:
            return []
        versions = await adapter.app.cortex.store.versions(pair.id, str(filename))
        return [
            app_commands.Choice(name=f"v{v.version} · {v.author} · {v.created_at:%Y-%m-%d %H:%M}", value=v.version)
            for v in reversed(versions) if current in str(v.version)
        ][:25]

    @memory.command(name="diff", description="What changed between two versions of a file")
    @app_commands.choices(file=FILE_CHOICES)
    @app_commands.autocomplete(v1=version_choices, v2=version_choices)
    async def diff(interaction: discord.Interaction, file: FileChoice, v1: int, v2: int) -> None:
        await adapter.run_slash(interaction, f"!memory diff {file.value} {v1} {v2}")

    @memory.command(name="revert", description="Bring back an earlier version (saved as a new version)")
    @app_commands.choices(file=FILE_CHOICES)
    @app_commands.autocomplete(version=version_choices)
    async def revert(interaction: discord.Interaction, file: FileChoice, version: int) -> None:
        await adapter.run_slash(interaction, f"!memory revert {file.value} {version}")

    @memory.command(name="reset", description="Start a file (or all) over from the template")
    @app_commands.choices(file=FILE_CHOICES)
    async def reset(interaction: discord.Interaction, file: FileChoice | None = None) -> None:
        await adapter.run_slash(interaction, "!memory reset" + (f" {file.value}" if file else ""))

    @memory.command(name="edit", description="Replace a file with your own text")
    @app_commands.choices(file=FILE_CHOICES)
    async def edit(interaction: discord.Interaction, file: FileChoice, content: str) -> None:
        await adapter.run_slash(interaction, f"!memory edit {file.value}\n{content}")

    @memory.command(name="export", description="Download all your files and their versions")
    async def export(interaction: discord.Interaction) -> None:
        await adapter.run_slash(interaction, "!memory export")

    @memory.command(name="forget-me", description="Delete everything the bot stores about you")
    async def forget_me(interaction: discord.Interaction, confirm: bool = False) -> None:
        await adapter.run_slash(interaction, "!memory forget-me" + (" confirm" if confirm else ""))

    categories = [app_commands.Choice(name=c, value=c) for c in CATEGORIES]

    @memory.command(name="remember", description="Store a fact about you in the persona's long-term memory")
    @app_commands.choices(category=categories)
    async def remember(
        interaction: discord.Interaction, text: str, category: FileChoice | None = None,
        importance: app_commands.Range[int, 1, 10] | None = None, pin: bool = False,
    ) -> None:
        line = "!memory remember" + (f" --category {category.value}" if category else "")
        line += (f" --importance {importance}" if importance else "") + (" --pin" if pin else "")
        await adapter.run_slash(interaction, f"{line}\n{text}", always_private=True)

    for name, description in (
        ("forget", "Archive one of your memory items (restore brings it back)"),
        ("pin", "Always keep an item in the persona's mind"),
        ("unpin", "Stop pinning an item"),
        ("restore", "Bring an archived item back"),
    ):
        memory.add_command(app_commands.Command(
            name=name, description=description, callback=_item_command(adapter, name),
        ))

    @memory.command(name="list", description="Your memory items, newest first")
    @app_commands.choices(category=categories)
    async def list_items(
        interaction: discord.Interaction, category: FileChoice | None = None,
        page: app_commands.Range[int, 1] = 1,
    ) -> None:
        line = "!memory list" + (f" {category.value}" if category else "") + f" {page}"
        await adapter.run_slash(interaction, line, always_private=True)

    @memory.command(name="search", description="Search your memory items and past messages")
    async def search(interaction: discord.Interaction, words: str) -> None:
        await adapter.run_slash(interaction, "!memory search\n" + words, always_private=True)

    @memory.command(name="archived", description="Your archived (forgotten or pruned) items")
    async def archived(interaction: discord.Interaction, page: app_commands.Range[int, 1] = 1) -> None:
        await adapter.run_slash(interaction, f"!memory archived {page}", always_private=True)

    @cortex.command(name="update", description="Update your cortex files now")
    async def update(interaction: discord.Interaction) -> None:
        await adapter.run_slash(interaction, "!cortex update")

    @admin.command(name="settings", description="Show the cortex settings, or set one (value 'default' resets)")
    async def settings(
        interaction: discord.Interaction, key: str | None = None, value: str | None = None,
        persona_scope: bool = False,
    ) -> None:
        line = "!cortex settings" + (f" {key} {value}" if key and value else f" {key}" if key else "")
        await adapter.run_slash(interaction, line + (" --persona" if persona_scope else ""), always_private=True)

    @admin.command(name="stats", description="Cortex update runs, tokens and recent errors")
    async def stats(interaction: discord.Interaction) -> None:
        await adapter.run_slash(interaction, "!cortex stats", always_private=True)

    @admin.command(name="prune", description="Archive unused memory items now (report per category)")
    async def prune(interaction: discord.Interaction) -> None:
        await adapter.run_slash(interaction, "!cortex prune", always_private=True)

    @admin.command(name="weights", description="Show or set the search weights, e.g. vector=0.6 text=0.3, or default")
    async def weights(interaction: discord.Interaction, values: str | None = None) -> None:
        await adapter.run_slash(interaction, "!cortex weights" + (f" {values}" if values else ""),
                                always_private=True)

    @admin.command(name="budgets", description="Token budgets of prompts and cortex updates, and today's spending")
    async def budgets(interaction: discord.Interaction) -> None:
        await adapter.run_slash(interaction, "!cortex budgets", always_private=True)

    @admin.command(name="embedder", description="The embedder, backfill progress and errors")
    async def embedder(interaction: discord.Interaction) -> None:
        await adapter.run_slash(interaction, "!cortex embedder", always_private=True)

    @tree.command(name="help", description="List the commands")
    async def help_command(interaction: discord.Interaction) -> None:
        await adapter.run_slash(interaction, "!help", always_private=True)

    @tree.command(name="summary", description="This conversation's rolling summary")
    async def summary(interaction: discord.Interaction) -> None:
        await adapter.run_slash(interaction, "!summary", always_private=True)

    @tree.command(name="persona", description="Show the persona here, or pick one")
    async def persona(interaction: discord.Interaction, name: str | None = None) -> None:
        await adapter.run_slash(interaction, "!persona" + (f" {name}" if name else ""))

    @persona.autocomplete("name")
    async def persona_names(interaction: discord.Interaction, current: str) -> list[FileChoice]:
        return [app_commands.Choice(name=p, value=p) for p in adapter.app.personas.names()
                if current.lower() in p.lower()][:25]

    tree.add_command(memory)
    tree.add_command(cortex)
    tree.add_command(admin)


def _item_command(
    adapter: DiscordAdapter, name: str
) -> Callable[[discord.Interaction, int], Coroutine[Any, Any, None]]:
    async def callback(interaction: discord.Interaction, item: int) -> None:
        await adapter.run_slash(interaction, f"!memory {name} {item}", always_private=True)

    return callback


def read_token(config: DiscordConfig) -> str:
    import os

    token = os.environ.get(config.token_env, "").strip()
    if not token:
        raise RuntimeError(f"[discord] is enabled but ${config.token_env} holds no bot token")
    return token
