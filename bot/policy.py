"""Whether the bot answers a platform message: addressing rules and allow/deny lists.

DMs always (unless DMs are off); in group channels only when the bot is mentioned, replied to, the
channel is configured to always answer, or the message is a command. Never to itself, never to other
bots unless allow-listed. Deny lists win over allow lists; an empty allow list allows everyone.

A role is listed as it is (``discord:987``), except a ranked one: the adapter says what rank the user holds
(``("matrix:power", 100)``, a Matrix power level), and a listed ``matrix:power:50`` is held from 50 up.
"""

from __future__ import annotations

from dataclasses import dataclass

from bot.commands import Attachment
from bot.config import AccessConfig
from bot.ports import IncomingMessage


@dataclass(frozen=True, slots=True)
class Inbound:
    """A platform message as an adapter sees it, before the bot decides to answer."""

    message: IncomingMessage
    is_self: bool = False
    author_is_bot: bool = False
    replied_to_bot: bool = False
    roles: tuple[str, ...] = ()  # platform-qualified role ids, e.g. "discord:987"
    ranks: tuple[tuple[str, int], ...] = ()  # ranked roles and the user's level in each, e.g. ("matrix:power", 100)
    is_admin: bool = False  # the adapter's verdict: Manage Server / power level ≥ 50 / configured admin id
    is_bot_admin: bool = False  # a configured admin id: admin of the whole bot, not only of one server
    attachments: tuple[Attachment, ...] = ()  # files sent with a command (read only for commands)
    counted: bool = False  # already counted against the command rate limit (a file command, before its download)

    @property
    def history_since_join(self) -> bool:
        """The platform shows this channel's earlier messages only to those who were in it then (Matrix rooms
        whose history visibility is "joined" or "invited"): what the bot keeps of them is not for all in it now."""
        return self.message.history_from is not None


def _listed(values: list[str], *candidates: str | None) -> bool:
    return any(c is not None and c in values for c in candidates)


def _holds_role(inbound: Inbound, listed: list[str]) -> bool:
    """Whether the user holds a listed role: one of theirs as it is, or a rank at the listed level or above (a
    list's "matrix:power:50" let in only level 50, not the room's admins at 100)."""
    if any(r in listed for r in inbound.roles):
        return True
    ranks = dict(inbound.ranks)
    for entry in listed:
        rank, _, least = entry.rpartition(":")
        if rank in ranks and least.lstrip("-").isdigit() and ranks[rank] >= int(least):
            return True
    return False


def user_refusal(access: AccessConfig, user_key: str) -> str | None:
    """Why the user lists leave this user out, wherever they come (a chat, the web page), or None."""
    if user_key in access.deny_users:
        return "denied user"
    if access.allow_users and user_key not in access.allow_users:
        return "user not allowed"
    return None


def refusal(inbound: Inbound, access: AccessConfig, *, is_command: bool) -> str | None:
    """Why the bot stays silent (for logs), or None when it answers."""
    msg = inbound.message
    if inbound.is_self:
        return "own message"
    if inbound.author_is_bot and msg.author_key not in access.allow_bots:
        return "message from a bot"
    if msg.is_dm and not access.dms:
        return "direct messages are off"
    user = user_refusal(access, msg.author_key)
    # A thread or forum post is part of its channel: the channel lists hold for it too.
    channels = (msg.channel_key, msg.parent_channel_key)
    if user == "denied user" or _listed(access.deny_channels, *channels):
        return "denied user or channel"
    # Servers: where it was sent, and the author's own home server where the platform has one (Matrix).
    servers = (msg.server_key, msg.author_home_key)
    if _listed(access.deny_servers, *servers) or _holds_role(inbound, access.deny_roles):
        return "denied server or role"
    if user is not None:
        return user
    if not msg.is_dm:
        if access.allow_channels and not _listed(access.allow_channels, *channels):
            return "channel not allowed"
        if access.allow_servers and not _listed(access.allow_servers, *servers):
            return "server not allowed"
        if access.allow_roles and not _holds_role(inbound, access.allow_roles):
            return "role not allowed"
        addressed = msg.mentions_bot or inbound.replied_to_bot or _listed(access.always_answer_channels, *channels)
        if not addressed and not is_command:
            return "not addressed"
    return None
