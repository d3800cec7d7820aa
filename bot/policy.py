"""Whether the bot answers a platform message: addressing rules and allow/deny lists.

DMs always (unless DMs are off); in group channels only when the bot is mentioned, replied to, the
channel is configured to always answer, or the message is a command. Never to itself, never to other
bots unless allow-listed. Deny lists win over allow lists; an empty allow list allows everyone.
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
    roles: tuple[str, ...] = ()  # platform-qualified role ids, e.g. "discord:987" or "matrix:power:50"
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
    if _listed(access.deny_servers, *servers) or any(r in access.deny_roles for r in inbound.roles):
        return "denied server or role"
    if user is not None:
        return user
    if not msg.is_dm:
        if access.allow_channels and not _listed(access.allow_channels, *channels):
            return "channel not allowed"
        if access.allow_servers and not _listed(access.allow_servers, *servers):
            return "server not allowed"
        if access.allow_roles and not any(r in access.allow_roles for r in inbound.roles):
            return "role not allowed"
        addressed = msg.mentions_bot or inbound.replied_to_bot or _listed(access.always_answer_channels, *channels)
        if not addressed and not is_command:
            return "not addressed"
    return None
