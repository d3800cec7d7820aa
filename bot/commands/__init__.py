"""The platform-neutral command layer: parse a command line, check permission, run it, render text.

Adapters hand over the raw text (``!stats`` in the terminal and on Matrix; Discord builds the same
call from a slash command) and a :class:`CommandContext` saying who asks where. Handlers return
plain text (Markdown) and never touch a platform.
"""

from __future__ import annotations

import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CommandContext:
    platform: str
    user_key: str
    user_name: str
    channel_key: str
    persona: str
    is_admin: bool = False
    is_dm: bool = False


Handler = Callable[[CommandContext, Sequence[str]], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    summary: str
    handler: Handler
    usage: str = ""
    admin: bool = False
    aliases: tuple[str, ...] = field(default_factory=tuple)


class CommandError(Exception):
    """A command was used wrongly; the message tells the user how to use it."""


class CommandRegistry:
    def __init__(self, prefix: str = "!") -> None:
        self.prefix = prefix
        self._commands: dict[str, Command] = {}
        self.register(Command("help", "list the commands", self._help, usage="help"))

    def register(self, command: Command) -> None:
        for name in (command.name, *command.aliases):
            self._commands[name] = command

    @property
    def commands(self) -> list[Command]:
        unique = {c.name: c for c in self._commands.values()}
        return [unique[n] for n in sorted(unique)]

    def is_command(self, text: str) -> bool:
        return text.startswith(self.prefix) and len(text.strip()) > len(self.prefix)

    async def dispatch(self, text: str, context: CommandContext) -> str:
        try:
            words = shlex.split(text.strip()[len(self.prefix):])
        except ValueError as exc:
            return f"Could not read that command ({exc}). Type {self.prefix}help for the list."
        if not words:
            return f"Type {self.prefix}help for the list of commands."
        name, args = words[0].lower(), words[1:]
        command = self._commands.get(name)
        if command is None:
            return f"Unknown command {self.prefix}{name}. Type {self.prefix}help for the list."
        if command.admin and not context.is_admin:
            return f"{self.prefix}{command.name} is for admins only."
        try:
            return await command.handler(context, args)
        except CommandError as exc:
            usage = f" Usage: {self.prefix}{command.usage}" if command.usage else ""
            return f"{exc}{usage}"

    async def _help(self, context: CommandContext, args: Sequence[str]) -> str:
        lines = ["Commands:"]
        for command in self.commands:
            if command.admin and not context.is_admin:
                continue
            lines.append(f"  {self.prefix}{command.usage or command.name} — {command.summary}")
        lines.append("Anything else you type is sent to the persona.")
        return "\n".join(lines)
