"""What every skill is: a name, a description and a JSON schema for the model, and ``run``.

A skill never raises to its caller for anything the model or the outside world did wrong (bad
arguments, a timeout, an HTTP error, a server that is down): it answers a :class:`SkillResult` with
``is_error`` set and a message the model can act on. Whatever a skill returns is data for the model,
never instructions (the reply loop wraps it as a tool result and caps its size).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol

from bot.text import one_line, storable

Origin = Literal["builtin", "http", "mcp"]
REDACTED = "[redacted]"
_MODEL_NAME_MAX = 64
_INVALID_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def model_name(name: str) -> str:
    """A name the model APIs accept (letters, digits, ``_`` and ``-``; at most 64 characters): an MCP tool's
    ``fs.delete`` is offered (and shown) as ``fs_delete``."""
    return _INVALID_NAME_CHARS.sub("_", name)[:_MODEL_NAME_MAX] or "tool"


def from_environment(mapping: dict[str, str], where: str, what: str) -> dict[str, str]:
    """``key -> the value of the environment variable it names`` (an ``env_from`` / ``headers_env`` table: secrets
    kept out of the config file). A variable unset or empty raises ValueError naming it and ``where`` it is asked
    for (``what`` names its key): the start stops with that one line, and ``doctor`` shows it, rather than a
    skill that fails every call."""
    values: dict[str, str] = {}
    for key, variable in mapping.items():
        # (a secret mounted from a file ends in a line break: as a header it was refused, and the refusal quoted
        # it escaped, past the redaction of its raw value, in the log and in !skills list)
        value = os.environ.get(variable, "").strip()
        if not value:
            raise ValueError(f"{where}: environment variable {variable} (for {what} {key}) is not set")
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise ValueError(f"{where}: environment variable {variable} (for {what} {key}) holds a line break or "
                             "another control character: put the secret alone in it")
        values[key] = value
    return values


def redaction_values(secrets: tuple[str, ...]) -> tuple[str, ...]:
    """The secrets, and the credential after a scheme word ("Bearer abc" -> also "abc"), longest first:
    what is replaced wherever a skill's text could show a secret (results, logs, the audit)."""
    values = {s for s in secrets if s}
    for secret in secrets:
        _, _, credential = secret.partition(" ")
        if len(credential.strip()) >= 8:
            values.add(credential.strip())
    return tuple(sorted(values, key=len, reverse=True))


def redact(text: str, values: tuple[str, ...]) -> str:
    """``text`` with each of ``values`` (from :func:`redaction_values`) replaced by ``[redacted]``."""
    for value in values:
        text = text.replace(value, REDACTED)
    return text


PIECE_CHARS = 4  # the shortest start of a secret that is redacted where a cut ends a text


def redact_cut(text: str, values: tuple[str, ...], limit: int) -> str:
    """``text`` on one line, redacted, then cut to ``limit`` characters ("…" at the end when longer), and no start
    of a secret left at its end: cut before redacting, a secret split by the cut (or by the byte limit a body
    was read with) lost only its end, and the rest of it got through."""
    cut = one_line(redact(text, values), limit)
    end = cut.removesuffix("\u2026")
    for value in values:
        for size in range(min(len(value) - 1, len(end)), PIECE_CHARS - 1, -1):
            if end.endswith(value[:size]):
                return end[:-size] + REDACTED + cut[len(end):]
    return cut


class SkillFailure(Exception):
    """Raised inside a skill for an expected failure; the loop turns it into a tool error."""


@dataclass(frozen=True, slots=True)
class SkillContext:
    """Who the skill runs for, and where."""

    user_db_id: int
    user_key: str
    user_name: str
    persona: str
    channel_key: str
    server_key: str | None
    is_dm: bool
    is_admin: bool  # admin where this message was sent (server admin or bot admin)
    now: datetime
    is_bot_admin: bool = False  # one of the bot's own admins (changes that reach every server)
    message_key: str | None = None  # the platform message answered (discord-message:123), when it has one


@dataclass(frozen=True, slots=True)
class SkillResult:
    """What a skill answers. Its content never holds a lone surrogate or a NUL: an outside API or MCP server
    can send both as JSON escapes, and neither a model's API nor a store takes them."""

    content: str
    is_error: bool = False
    changed: bool = False  # the skill stored or changed something (shown in the audit)

    def __post_init__(self) -> None:
        object.__setattr__(self, "content", storable(self.content))


@dataclass(frozen=True, slots=True)
class SkillInfo:
    """How a skill presents itself: to the model (name, description, schema) and to admins."""

    name: str
    description: str
    input_schema: dict[str, Any]
    origin: Origin
    admin_only: bool = False
    bot_admin: bool = False  # an admin_only built-in that changes what every server shares (a persona's soul)
    triggers: tuple[str, ...] = ()  # empty: always offered (where allowed)
    group_triggers: tuple[str, ...] = ()  # in a group channel, offered only when the message says one of them
    server: str = ""  # the MCP server it comes from
    secrets: tuple[str, ...] = field(default=())  # argument/header values never written to the audit
    tool: str = ""  # an MCP tool's name on its server

    @property
    def key(self) -> str:
        """What admins' switches are kept under: the offered name, except for an MCP tool, whose offered
        name changes when another server offers a tool of the same name (``server/tool`` instead)."""
        return f"{self.server}/{self.tool}" if self.server and self.tool else self.name

    @property
    def for_bot_admins(self) -> bool:
        """Whether only the bot's admins may use it: an ``admin_only`` http or MCP tool from the config, or a
        built-in that changes what every server shares; other ``admin_only`` built-ins act on this server."""
        return self.admin_only and (self.origin != "builtin" or self.bot_admin)

    @property
    def shown_key(self) -> str:
        """The key as ``!skills list`` shows it: an MCP tool's name spelled as offered (``files/fs_delete`` for
        the server's ``fs.delete``)."""
        return f"{self.server}/{model_name(self.tool)}" if self.server and self.tool else self.name

    @property
    def switch_names(self) -> tuple[str, ...]:
        """Every name a switch of this skill may be kept under or named by: its key, the key as shown, then its
        offered name (a switch kept before keys were stable)."""
        return tuple(dict.fromkeys((self.key, self.shown_key, self.name)))


def admitted(info: SkillInfo, *, is_admin: bool, is_bot_admin: bool) -> bool:
    """Whether an ``admin_only`` skill may be offered to (and run for) someone: a built-in acts on this
    server (its admins may); an http or MCP tool from the config reaches the operator's own systems (a
    file server, an internal API), and editing a persona's soul changes it in every server, so only the
    bot's admins, never whoever made a Matrix room or invited the bot into their Discord server."""
    if not info.admin_only:
        return True
    return is_bot_admin if info.for_bot_admins else is_admin


class Skill(Protocol):
    @property
    def info(self) -> SkillInfo: ...

    async def run(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult: ...
