"""``!guidelines …`` (a server's own rules for the persona, by its admins) and ``!rules …`` (bot-wide
rules, by the bot's admins). Both are versioned texts: every change is a new version with who and why,
``revert`` brings an old text back as a new version, and the prompt changes at once in this process
(and within seconds in every other one)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from bot.commands import (
    Command,
    CommandContext,
    CommandError,
    CommandRegistry,
    flag,
    number,
    parse_number,
    place_word,
    text,
    word,
)
from bot.prompt import variables_note
from bot.storage import Storage
from bot.storage.personas import BOT_WIDE, TextVersion
from bot.text import shown
from cortex.personas.commands import history_lines
from cortex.personas.registry import PersonaRegistry

MAX_GUIDELINES_CHARS = 8000
MAX_RULE_CHARS = 2000
RULE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}\Z")  # \Z: "$" would let a name end in a newline
DEFAULT_FLAG = "--default"


@dataclass
class GuidelinesCommands:
    registry: PersonaRegistry
    storage: Storage
    prefix: str = "!"

    def register(self, registry: CommandRegistry) -> None:
        self.prefix = registry.prefix
        default = flag("default", "the bot-wide default instead of this server's (bot admins)", token=DEFAULT_FLAG)
        registry.register(Command("guidelines show", "the guidelines in force here (this server's, else the bot's)",
                                  self.show, (default,), aliases=("guidelines",)))
        for name, params, summary, handler in (
            ("set", (default, text("text", "the guidelines", required=True, document=True)),
             "replace this server's guidelines", self.set_text),
            ("history", (default,), "every version of this server's guidelines", self.history),
            ("revert", (default, number("version", "the version to bring back", required=True)),
             "bring back an earlier version", self.revert),
            ("clear", (default,), "remove this server's guidelines (the bot's default applies)", self.clear),
        ):
            registry.register(Command(f"guidelines {name}", summary, handler, params, admin=True))

    def _scope(self, ctx: CommandContext, args: Sequence[str], *, change: bool) -> tuple[str, list[str]]:
        """The server's scope, or the bot-wide default (``--default``, or in a DM) — changing that one
        is for the bot's admins (in a Matrix DM everyone has power 100 in their own room)."""
        rest = [a for a in args if a != DEFAULT_FLAG]
        scope = BOT_WIDE if DEFAULT_FLAG in args or not ctx.server_key else ctx.server_key
        if scope == BOT_WIDE and change and not ctx.is_bot_admin:
            raise CommandError("the bot-wide default guidelines are for the bot's admins; in a server, its admins "
                               "set that server's own")
        return scope, rest

    @staticmethod
    def _where(scope: str) -> str:
        """How a reply names the guidelines: the bot-wide default, or this server's (a Matrix room's) own;
        the scope is always the one the command was sent in, so no id is shown."""
        if scope == BOT_WIDE:
            return "the bot-wide default guidelines"
        return f"this {place_word(scope)}'s guidelines"

    async def show(self, ctx: CommandContext, args: Sequence[str]) -> str:
        if DEFAULT_FLAG in args:
            text, scope = self.registry.guidelines_for(None)
        else:
            text, scope = self.registry.guidelines_for(ctx.server_key)
        if not text.strip():
            return f"No guidelines here. Admins set them with {self.prefix}guidelines set <text>."
        return f"In force: {self._where(scope)}:\n{text.strip()}"

    async def set_text(self, ctx: CommandContext, args: Sequence[str]) -> str:
        scope, rest = self._scope(ctx, args, change=True)
        text = (" ".join(rest) or ctx.body).strip()
        if not text:
            raise CommandError(f"give the text (to remove them: {self.prefix}guidelines clear)")
        if len(text) > MAX_GUIDELINES_CHARS:
            raise CommandError(f"guidelines hold at most {MAX_GUIDELINES_CHARS:,} characters (these are "
                               f"{len(text):,})")
        saved = await self.storage.personas.put("guidelines", scope, "", text, author=ctx.user_key,
                                                reason="set in chat")
        await self.registry.load()
        return f"Saved {self._where(scope)} as version {saved.version}." + variables_note(text)

    async def history(self, ctx: CommandContext, args: Sequence[str]) -> str:
        scope, _ = self._scope(ctx, args, change=False)
        versions = await self.storage.personas.history("guidelines", scope, "")
        if not versions:
            return f"No versions of {self._where(scope)} yet."
        return "\n".join([f"History of {self._where(scope)} (oldest first):", *history_lines(versions, limit=30)])

    async def revert(self, ctx: CommandContext, args: Sequence[str]) -> str:
        scope, rest = self._scope(ctx, args, change=True)
        if not rest:
            raise CommandError("which version?")
        number = parse_number(rest[0], "the version", prefix="v")
        reverted = await self.storage.personas.revert("guidelines", scope, "", number, author=ctx.user_key)
        if reverted is None:
            raise CommandError(f"there is no version {number} of {self._where(scope)}")
        await self.registry.load()
        saved, written = reverted
        if not written:
            return (f"{self._where(scope).capitalize()} hold version {number}'s text already (as version "
                    f"{saved.version}); nothing changed.")
        return f"{self._where(scope).capitalize()} are back to version {number}'s text (as version {saved.version})."

    async def clear(self, ctx: CommandContext, args: Sequence[str]) -> str:
        scope, _ = self._scope(ctx, args, change=True)
        await self.registry.load()  # as stored now: another process or the web page may have changed them
        text, found = self.registry.guidelines_for(None if scope == BOT_WIDE else scope)
        if found != scope or not text.strip():
            return f"There is nothing to clear: {self._where(scope)} are empty."
        saved = await self.storage.personas.put("guidelines", scope, "", "", author=ctx.user_key, reason="cleared")
        await self.registry.load()
        return f"Cleared {self._where(scope)} (version {saved.version}; revert brings them back)."


@dataclass
class RulesCommands:
    registry: PersonaRegistry
    storage: Storage
    prefix: str = "!"

    def register(self, registry: CommandRegistry) -> None:
        self.prefix = registry.prefix
        name = word("name", "the rule's name", required=True)
        rule = text("text", "the rule", required=True, document=True)
        for sub, params, summary, handler, bot_admin in (
            ("list", (), "the bot-wide rules in prompt order, on or off", self.list_rules, False),
            ("history", (name,), "every version of a rule", self.history, False),
            ("add", (name, rule), "a new bot-wide rule (last in order)", self.add, True),
            ("edit", (name, rule), "rewrite a rule", self.edit, True),
            ("disable", (name,), "switch a rule off (kept, with its history)", self.disable, True),
            ("enable", (name,), "switch a rule back on", self.enable, True),
            ("revert", (name, number("version", "the version to bring back", required=True)),
             "bring back an earlier version of a rule", self.revert, True),
        ):
            registry.register(Command(f"rules {sub}", summary, handler, params, admin=True, bot_admin=bot_admin))

    def _name(self, args: Sequence[str]) -> str:
        if not args:
            raise CommandError(f"which rule? (see the names with {self.prefix}rules list)")
        name = args[0].lower()
        if not RULE_NAME.match(name):
            raise CommandError("a rule's name is one word of letters, digits, - or _ (at most 40)")
        return name

    def _live(self, name: str) -> TextVersion:
        for rule in self.registry.rules():
            if rule.name == name:
                return rule
        raise CommandError(f"there is no rule {shown(name)} (see {self.prefix}rules list)")

    @staticmethod
    def _text(args: Sequence[str], ctx: CommandContext) -> str:
        text = (" ".join(args[1:]) or ctx.body).strip()
        if not text:
            raise CommandError("give the rule's text")
        if len(text) > MAX_RULE_CHARS:
            raise CommandError(f"a rule holds at most {MAX_RULE_CHARS:,} characters (this is {len(text):,})")
        return text

    async def _put(self, ctx: CommandContext, name: str, text: str, reason: str, enabled: bool | None = None) -> int:
        saved = await self.storage.personas.put("rule", BOT_WIDE, name, text, author=ctx.user_key, reason=reason,
                                                enabled=enabled)
        await self.registry.load()
        return saved.version

    async def list_rules(self, ctx: CommandContext, args: Sequence[str]) -> str:
        rules = [r for r in self.registry.rules() if r.content.strip()]
        if not rules:
            return f"No global rules. Bot admins add one with {self.prefix}rules add <name> <text>."
        return "\n".join(["Global rules (prompt order):", *(
            f"  {r.name} [{'on' if r.enabled else 'off'}] v{r.version}: {r.content.strip()[:200]}" for r in rules)])

    async def history(self, ctx: CommandContext, args: Sequence[str]) -> str:
        name = self._name(args)
        versions = await self.storage.personas.history("rule", BOT_WIDE, name)
        if not versions:
            raise CommandError(f"there is no rule {shown(name)}")
        return "\n".join([f"History of rule {name} (oldest first):", *history_lines(versions, limit=30)])

    async def add(self, ctx: CommandContext, args: Sequence[str]) -> str:
        name, text = self._name(args), self._text(args, ctx)
        if any(r.name == name and r.content.strip() for r in self.registry.rules()):
            raise CommandError(f"rule {shown(name)} exists already: change it with {self.prefix}rules edit")
        version = await self._put(ctx, name, text, "added in chat", enabled=True)
        return f"Rule {name} added (version {version})." + variables_note(text)

    async def edit(self, ctx: CommandContext, args: Sequence[str]) -> str:
        name, text = self._name(args), self._text(args, ctx)
        live = self._live(name)
        version = await self._put(ctx, name, text, "edited in chat")
        return f"Rule {name} is now version {version}.{self._off_note(live.enabled, name)}" + variables_note(text)

    def _off_note(self, enabled: bool, name: str) -> str:
        """What an admin editing a rule that is switched off needs to hear: the new text has no effect yet."""
        return "" if enabled else f" It is off: {self.prefix}rules enable {name} puts it into replies."

    async def disable(self, ctx: CommandContext, args: Sequence[str]) -> str:
        return await self._switch(ctx, args, False)

    async def enable(self, ctx: CommandContext, args: Sequence[str]) -> str:
        return await self._switch(ctx, args, True)

    async def _switch(self, ctx: CommandContext, args: Sequence[str], enabled: bool) -> str:
        name, state = self._name(args), "on" if enabled else "off"
        await self.registry.load()  # as stored now: another process or the web page may have switched it
        live = self._live(name)
        if live.enabled == enabled:  # (a version each time changed nothing, and buried the history)
            return f"Rule {name} is {state} already (version {live.version}); nothing changed."
        version = await self._put(ctx, name, live.content, f"switched {state}", enabled=enabled)
        return f"Rule {name} is {state} (version {version})."

    async def revert(self, ctx: CommandContext, args: Sequence[str]) -> str:
        name = self._name(args)
        if len(args) < 2:
            raise CommandError("which version?")
        number = parse_number(args[1], "the version", prefix="v")
        reverted = await self.storage.personas.revert("rule", BOT_WIDE, name, number, author=ctx.user_key)
        if reverted is None:
            raise CommandError(f"rule {name} has no version {number}")
        await self.registry.load()
        saved, written = reverted
        off = self._off_note(saved.enabled, name)
        if not written:
            return (f"Rule {name} holds version {number}'s text already (as version {saved.version}); nothing "
                    f"changed.{off}")
        return f"Rule {name} is back to version {number}'s text (as version {saved.version}).{off}"
