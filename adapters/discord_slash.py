"""Discord's slash commands, generated from the command layer's declarations (``bot.commands.Command``).

Every command of the registry becomes one: ``memory show`` → ``/memory show``, ``help`` → ``/help``.
Commands for admins go into a group of their own, ``/<group>-admin``, that Discord shows only to members
with Manage Server (Discord sets that per top-level command, not per subcommand); the command layer
still checks the caller's rights on every use. Each parameter becomes a typed option (choices, number
ranges, autocompletion); the values are turned back into the command's ``!`` line and dispatched like
any other line, so nothing here knows what a command does.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal, Optional, cast

import discord
from discord import app_commands

from bot.commands import Attachment, Command, Param
from bot.commands.files import MAX_ATTACHMENT_BYTES
from bot.policy import refusal
from bot.text import shown

if TYPE_CHECKING:
    from adapters.discord import DiscordAdapter

MAX_FILES = 1
MAX_FILE_BYTES = MAX_ATTACHMENT_BYTES  # larger ones are refused before download


async def read_attachment(attachment: discord.Attachment) -> Attachment:
    """The bytes of one attachment a command came with; ValueError (one line) when it is too large."""
    if attachment.size > MAX_FILE_BYTES:
        raise ValueError(f"{shown(attachment.filename)} is {attachment.size / 1e6:.1f} MB; commands take files of at "
                         f"most {MAX_FILE_BYTES // 1024 // 1024} MB")
    return Attachment(attachment.filename, await attachment.read())

PLATFORM = "discord"
ADMIN_SUFFIX = "-admin"
DESCRIPTION_LIMIT = 100  # Discord's limit for command and option descriptions
GROUP_DESCRIPTIONS = {
    "memory": "Your own cortex files and memory items with this persona",
    "cortex": "Cortex updates and settings",
    "persona": "The personas: their souls and history",
    "guidelines": "This server's guidelines for the persona",
    "rules": "The bot-wide rules",
    "lore": "What the persona knows for everyone",
    "skills": "The persona's skills: tools it may call",
}
Completer = Callable[[discord.Interaction, str], Coroutine[Any, Any, list[app_commands.Choice[Any]]]]


def build_slash_commands(adapter: DiscordAdapter) -> None:
    """Add every declared command to the adapter's command tree."""
    groups: dict[str, app_commands.Group] = {}
    for command in adapter.app.commands.commands:
        head, _, sub = command.name.partition(" ")
        slash = slash_command(adapter, command, sub or head)
        if not sub:
            adapter.tree.add_command(slash)
            continue
        admin = command.admin or command.bot_admin
        name = head + (ADMIN_SUFFIX if admin else "")
        group = groups.get(name)
        if group is None:
            about = GROUP_DESCRIPTIONS.get(head, f"The {head} commands") + (" (admins)" if admin else "")
            group = groups[name] = app_commands.Group(
                name=name, description=about[:DESCRIPTION_LIMIT],
                default_permissions=discord.Permissions(manage_guild=True) if admin else None)
            adapter.tree.add_command(group)
        group.add_command(slash)


def slash_command(adapter: DiscordAdapter, command: Command, name: str) -> app_commands.Command[Any, Any, None]:
    prefix = adapter.app.commands.prefix

    files = [p.name for p in command.params if p.kind == "file"]

    async def callback(interaction: discord.Interaction, **values: Any) -> None:
        # The files are read as part of the command (after the access check, within the reply's patience).
        await adapter.run_slash(interaction, command.line(prefix, values), always_private=not command.public,
                                files=tuple(values[name] for name in files if values.get(name)))

    ordered = sorted(command.params, key=lambda p: not _required(p))  # Discord: required options first
    callback.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("interaction", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=discord.Interaction)]
        + [_parameter(p) for p in ordered])
    described = {p.name: (p.help or p.name)[:DESCRIPTION_LIMIT] for p in command.params}
    if described:
        app_commands.describe(**described)(callback)
    completers = {p.name: _completer(adapter, p.complete) for p in command.params if p.complete and not p.choices}
    if completers:
        app_commands.autocomplete(**completers)(callback)
    return app_commands.Command(name=name, description=command.summary[:DESCRIPTION_LIMIT],
                                callback=cast(Any, callback))  # its signature is the one set above


def _required(param: Param) -> bool:
    return param.required and param.kind not in ("flag", "option")


def _parameter(param: Param) -> inspect.Parameter:
    annotation: Any
    if param.kind == "flag":
        return inspect.Parameter(param.name, inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=False)
    if param.kind == "file":
        annotation = discord.Attachment
    elif param.kind == "number" or param.minimum is not None:
        low = param.minimum if param.minimum is not None else 1
        annotation = app_commands.Range[int, low, param.maximum] if param.maximum else app_commands.Range[int, low]
    elif param.choices:
        annotation = Literal[param.choices]
    else:
        annotation = str
    if _required(param):
        return inspect.Parameter(param.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation)
    return inspect.Parameter(param.name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[annotation],  # noqa: UP045
                             default=None)


def _completer(adapter: DiscordAdapter, kind: str) -> Completer:
    def refused(interaction: discord.Interaction) -> bool:  # the [access] lists hold for suggestions too
        return refusal(adapter.slash_inbound(interaction, ""), adapter.app.config.access, is_command=True) is not None

    async def versions(interaction: discord.Interaction, current: str) -> list[app_commands.Choice[Any]]:
        return [] if refused(interaction) else await version_choices(adapter, interaction, current)

    if kind == "versions":
        return versions

    async def personas(interaction: discord.Interaction, current: str) -> list[app_commands.Choice[Any]]:
        if refused(interaction):
            return []
        return [app_commands.Choice(name=p, value=p) for p in adapter.app.personas.names()
                if current.lower() in p.lower()][:25]

    return personas


VERSIONS_KEPT_SECONDS = 5.0  # an autocompletion's list of versions serves the next keystrokes for this long


async def version_choices(adapter: DiscordAdapter, interaction: discord.Interaction,
                          current: str) -> list[app_commands.Choice[Any]]:
    """The caller's own versions of the chosen file, newest first. Read once per few seconds per user, channel
    (whose persona they are) and file (Discord asks at every keystroke), and not at all for someone the rate limit
    holds off."""
    filename = str(getattr(interaction.namespace, "file", None) or "memory.md")
    if adapter.app.router.command_limiter.waiting(f"{PLATFORM}:{interaction.user.id}"):  # (the lists: by the caller)
        return []
    key, now = (interaction.user.id, interaction.channel_id, filename), time.monotonic()
    seen = adapter.versions_seen
    kept = seen.get(key)
    if kept is None or now - kept[0] > VERSIONS_KEPT_SECONDS:
        kept = (now, await _versions(adapter, interaction, filename))
        if len(seen) > 1000:
            seen.clear()
        seen[key] = kept
    return [app_commands.Choice(name=name, value=number) for number, name in kept[1] if current in str(number)][:25]


async def _versions(adapter: DiscordAdapter, interaction: discord.Interaction, filename: str) -> list[tuple[int, str]]:
    user = await adapter.app.storage.get_user(f"{PLATFORM}:{interaction.user.id}")
    if user is None:
        return []
    # As a command would see it (a thread's or forum post's persona is its channel's)
    persona = await adapter.app.router.persona_for(adapter.slash_inbound(interaction, ""))
    pair = await adapter.app.cortex.store.get_pair(user.id, persona)
    if pair is None:
        return []
    versions, _ = await adapter.app.cortex.store.versions_listed(pair.id, filename, 200)  # newest, no text
    return [(v.version, f"v{v.version} · {v.author} · {v.created_at:%Y-%m-%d %H:%M} UTC") for v in versions]


def build_context_menus(adapter: DiscordAdapter) -> None:
    """Right-click a message → Apps → "Remember this" / "Forget this": the same ``!memory remember`` and
    ``!memory forget`` as typed, with the message as the item's source. Allowed on one's own messages and
    on the bot's messages in one's DM with it (in a server the bot's messages answer many people).
    "Why?" on one of the bot's replies runs ``!memory why`` for it (only the caller's own replies answer)."""
    prefix = adapter.app.commands.prefix

    async def remember(interaction: discord.Interaction, message: discord.Message) -> None:
        if await adapter.refuse_slash(interaction):  # the access lists first: a denied user learns nothing else
            return
        if not _yours(interaction, message):
            await interaction.response.send_message(NOT_YOURS, ephemeral=True)
            return
        if not (words := message_text(message)).strip():  # an image, a sticker, an embed: no words to keep
            await interaction.response.send_message(NO_TEXT, ephemeral=True)
            return
        line = f"{prefix}memory remember --from {message_ref(message)}\n{words}"
        await adapter.run_slash(interaction, line, always_private=True)

    async def forget(interaction: discord.Interaction, message: discord.Message) -> None:
        if await adapter.refuse_slash(interaction):
            return
        if not _yours(interaction, message):
            await interaction.response.send_message(NOT_YOURS, ephemeral=True)
            return
        await adapter.run_slash(interaction, f"{prefix}memory forget --from {message_ref(message)}",
                                always_private=True)

    async def why(interaction: discord.Interaction, message: discord.Message) -> None:
        await adapter.run_slash(interaction, f"{prefix}memory why --of {message_ref(message)}", always_private=True)

    adapter.tree.add_command(app_commands.ContextMenu(name="Why?", callback=why))
    adapter.tree.add_command(app_commands.ContextMenu(name="Remember this", callback=remember))
    adapter.tree.add_command(app_commands.ContextMenu(name="Forget this", callback=forget))


NOT_YOURS = "You can do that with your own messages, and with mine in our direct messages."
NO_TEXT = "That message has no text to remember (only an image, a file or an embed)."


def message_ref(message: discord.Message) -> str:
    return f"{PLATFORM}-message:{message.id}"


def message_text(message: discord.Message) -> str:
    """A message's words. A forwarded message has none of its own: its words are those of the message it
    forwards, marked as forwarded (they are someone's, not necessarily the sender's; and never a command)."""
    if message.content or not message.message_snapshots:
        return message.content
    forwarded = "\n".join(s.content for s in message.message_snapshots if s.content)
    return f"(forwarded) {forwarded}" if forwarded else ""


def in_dm(channel: object) -> bool:
    """Whether ``channel`` is a direct chat. Not ``message.guild is None``: a server's message whose server
    discord.py has not loaded yet (at start, after a reconnect) has no guild either, and must never be
    answered as a DM (privately meant answers, no mention needed, private memory in the prompt)."""
    if isinstance(channel, discord.PartialMessageable):  # (a menu's target message in a DM comes with one)
        return channel.guild_id is None and channel.type in (None, discord.ChannelType.private)
    return isinstance(channel, discord.DMChannel | discord.GroupChannel)


def _yours(interaction: discord.Interaction, message: discord.Message) -> bool:
    if message.author.id == interaction.user.id:
        return True
    me = interaction.client.user
    return me is not None and message.author.id == me.id and in_dm(message.channel)
