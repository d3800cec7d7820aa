"""``!persona …``: list, show, create, edit, history, revert and delete personas while the bot runs.

Reading is for admins (of a server or the bot); changing a persona is for the bot's admins, because a
persona is shared by every server. Every change is a new version of one soul section (who, when, why);
``!persona NAME`` (pick one for your DMs, or an admin's pick for a channel) stays in the router.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from bot.commands import (
    Command,
    CommandContext,
    CommandError,
    CommandRegistry,
    CommandReply,
    flag,
    number,
    operators,
    parse_number,
    text,
    word,
    words,
)
from bot.config import SOUL_SECTIONS, ConfigError
from bot.persona import section_title
from bot.prompt import variables_note
from bot.storage import Storage
from bot.storage.personas import TextVersion
from bot.storage.textsearch import text_search_config
from bot.text import ONLY_DOTS, QUOTE_MARKS, name_key, only_dots, plural, readable, shown
from cortex.personas.cards import MAX_FIELD_CHARS
from cortex.personas.registry import PersonaRegistry

MAX_SECTION_CHARS = MAX_FIELD_CHARS  # as a card's field: a section imported from one can be edited as it came
MAX_NAME_CHARS = 80
SECTION_KEY = re.compile(r"^[a-z][a-z0-9_]{0,39}\Z")

EMPTY_FLAG = "--empty"


def taken_by(registry: PersonaRegistry, name: str) -> str | None:
    """The live persona whose name ``name`` is, as it is spelled (``nemo`` is ``Nemo``'s name; ``Сora`` with a
    Cyrillic С is ``Cora``'s); None when none is (a deleted one's, or one made by another process a moment ago)."""
    try:
        return registry.persona(name).name
    except ConfigError:
        return None


def taken_message(existing: str, name: str) -> str:
    """Why ``name`` cannot be a new persona's: ``existing`` has it."""
    if existing == name:
        return f"a persona called {shown(name)} exists already"
    why = ("case does not" if existing.casefold() == name.casefold() else
           "quote marks do not" if name_key(existing.translate(QUOTE_MARKS)) == name_key(name.translate(QUOTE_MARKS))
           else "letters that look alike do not")
    return (f"a persona called {shown(existing)} exists already ({shown(name)} is the same name: {why} tell "
            "names apart)")


def section_key(text: str) -> str:
    """``Communication style`` → ``communication_style``; a free-form name must be a short word."""
    key = "_".join(text.strip().lower().replace("-", " ").split())
    if not SECTION_KEY.match(key):
        raise CommandError(f"a section is one word like {', '.join(SOUL_SECTIONS[:3])} or a name of your own "
                           "(letters, digits, _; at most 40)")
    return key


def new_section_refusal(persona: str, key: str) -> str | None:
    """Why ``key`` may not become a new section of ``persona`` (None: it may): a typo of a standard name would
    make a section of its own, beside the one meant."""
    if key in SOUL_SECTIONS:
        return None
    close = difflib.get_close_matches(key, SOUL_SECTIONS, n=1, cutoff=0.75)
    if not close:
        return None
    return (f"{persona} has no section {key}: did you mean {close[0]}? (a section of your own needs a name that is "
            "not this close to a standard one)")


def history_lines(versions: Sequence[TextVersion], *, named: bool = False, limit: int = 40) -> list[str]:
    """One line per version (the newest ``limit``): when (UTC, as every other command's times say), who, how
    long, on/off, why."""
    lines = []
    for v in versions[-limit:]:
        name = f"{v.name} " if named else ""
        state = "" if v.enabled else ", disabled"
        why = f" — {v.reason}" if v.reason else ""
        lines.append(f"  {name}v{v.version} {v.created_at:%Y-%m-%d %H:%M} UTC by {v.author}, "
                     f"{len(v.content):,} chars{state}{why}")
    return lines


def check_persona_name(name: str, commands: CommandRegistry | None) -> None:
    """Refuse a name nobody could pick or read: empty, too long, with control or invisible characters,
    starting with a subcommand (``!persona History Buff`` runs ``!persona history``), or dots alone, which the
    web page's addresses cannot hold (:func:`only_dots`)."""
    if len(name) > MAX_NAME_CHARS or not readable(name):
        raise CommandError(f"give the persona a name of 1 to {MAX_NAME_CHARS} printable characters, on one line")
    if only_dots(name):
        raise CommandError(ONLY_DOTS)
    prefix = commands.prefix if commands is not None else "!"
    if name.lstrip().startswith(("-", "\u2014", "\u2013", prefix)):  # (an em dash is how a phone writes --)
        raise CommandError(f"a persona's name cannot start with {shown(name.lstrip()[0])}: {prefix}persona "
                           f"{shown(name, 20)} would be read as an option or a command")
    first = name.split(None, 1)[0].casefold()
    if commands is not None and first in commands.subcommands("persona"):
        raise CommandError(f"a persona's name cannot start with {shown(first)}: {commands.prefix}persona {first} "
                           "is a command, so nobody could pick it")


@dataclass
class PersonaCommands:
    registry: PersonaRegistry
    storage: Storage
    prefix: str = "!"
    commands: CommandRegistry | None = None

    def register(self, registry: CommandRegistry) -> None:
        self.prefix = registry.prefix
        self.commands = registry
        name = words("name", "a persona's name", complete="personas")
        section = word("section", "identity, personality, … or a name of your own", required=True)
        for sub, params, summary, handler, bot_admin in (
            ("list", (), "every persona, where it comes from, its language", self.list_personas, False),
            ("show", (name,), "a persona's soul sections with their versions", self.show, False),
            ("history", (word("section", "only this section"),),
             "how the soul of the persona here changed: who, when, why", self.history, False),
            ("create", (words("name", "the new persona's name", required=True),),
             "a new persona (then give it a soul with edit)", self.create, True),
            ("edit", (section, text("text", "the section's new text"), flag("empty", "empty the section")),
             "rewrite one soul section of the persona here", self.edit, True),
            ("revert", (section, number("version", "the version to bring back", required=True)),
             "bring back an earlier version of a section", self.revert, True),
            ("delete", (words("name", "a persona's name", required=True, complete="personas"),),
             "remove a persona made in chat (where it was picked, the default answers; its history stays)",
             self.delete, True),
        ):
            registry.register(Command(f"persona {sub}", summary, handler, params, admin=True, bot_admin=bot_admin))

    def _row_name(self, args: Sequence[str], ctx: CommandContext) -> str:
        try:
            return self.registry.persona(" ".join(args) if args else ctx.persona).name
        except ConfigError as exc:
            raise CommandError(str(exc)) from None

    async def _scope(self, name: str) -> str:
        row = await self.storage.personas.get_persona(name)
        if row is None:
            raise CommandError(f"unknown persona {shown(name)}")
        return str(row.id)

    async def list_personas(self, ctx: CommandContext, args: Sequence[str]) -> str:
        rows = await self.storage.personas.list_personas()
        default = self.registry.default_name.casefold()
        lines = ["Personas:"]
        for row in rows:
            source = row.source
            if source == "config" and not self.registry.from_config(row.name):  # (renamed or removed there since)
                source = "chat, once from the config file"
            marks = [f"from {'the config file' if source == 'config' else source}", row.language]
            if row.name.casefold() == default:
                marks.append("default")
            lines.append(f"  {row.name} ({', '.join(marks)})")
        return "\n".join(lines)

    async def show(self, ctx: CommandContext, args: Sequence[str]) -> str:
        name = self._row_name(args, ctx)
        live = [t for t in await self.storage.personas.current("soul", await self._scope(name)) if t.content.strip()]
        if not live:
            return f"{name} has no soul yet: {self.prefix}persona edit identity You are … (bot admins)."
        blocks = [f"── {section_title(t.name)} [{t.name}] (version {t.version}, {t.author}, "
                  f"{t.created_at:%Y-%m-%d %H:%M} UTC)\n{t.content.strip()}" for t in live]
        return f"Persona {name}:\n" + "\n\n".join(blocks)

    async def history(self, ctx: CommandContext, args: Sequence[str]) -> str:
        scope = await self._scope(ctx.persona)
        key = section_key(args[0]) if args else None
        versions = await self.storage.personas.history("soul", scope, key)
        if not versions:
            names = [*SOUL_SECTIONS, *(t.name for t in await self.storage.personas.current("soul", scope))]
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.75) if key else []
            if key and key not in names and not close:
                return (f"{ctx.persona} has no section {shown(key)}; the sections are "
                        f"{', '.join(dict.fromkeys(names))}.")
            return (f"No history for {ctx.persona}" + (f" section {key}." if key else ".")
                    + (f" Did you mean {close[0]}?" if close else ""))
        title = f"History of {ctx.persona}" + (f" section {key}" if key else "") + " (oldest first):"
        return "\n".join([title, *history_lines(versions, named=True)])

    async def create(self, ctx: CommandContext, args: Sequence[str]) -> str:
        name = " ".join(args).strip()
        check_persona_name(name + ("\n" if ctx.body.strip() else ""), self.commands)  # a second line: refused
        default = self.registry.persona(None)
        row = await self.storage.personas.create_persona(name, default.language, {}, "chat",
                                                         text_search_config(default.language))
        if row is None:
            raise CommandError(self._taken(name))
        await self.registry.load()
        pick = f"Pick it for a channel with {self.prefix}persona {row.name}"
        if any(t.content.strip() for t in await self.storage.personas.current("soul", str(row.id))):
            return (f"Persona {row.name} is back ({row.language}), with the soul it had when it was deleted "
                    f"({self.prefix}persona show {row.name}). {pick}.")  # (a deleted persona, created again)
        return f"Persona {row.name} created ({row.language}). {pick}, then give it a soul there: " \
               f"{self.prefix}persona edit identity You are …"

    def _taken(self, name: str) -> str:
        return taken_message(taken_by(self.registry, name) or name, name)

    async def edit(self, ctx: CommandContext, args: Sequence[str]) -> str | CommandReply:
        empty, words_given = EMPTY_FLAG in args, [a for a in args if a != EMPTY_FLAG]
        if not words_given:
            raise CommandError("which section? e.g. " + ", ".join(SOUL_SECTIONS))
        key = section_key(words_given[0])
        text = (" ".join(words_given[1:]) or ctx.body).strip()
        if text and empty:
            raise CommandError(f"give either the new text or {EMPTY_FLAG}, not both")
        if not text and not empty:
            return CommandReply(f"Give the new text of {key} after the command or on the lines below it "
                                f"(to empty the section: {self.prefix}persona edit {key} {EMPTY_FLAG}).",
                                needs_body=f"Type the new text of {key}; end with a line holding only a dot (.)")
        if len(text) > MAX_SECTION_CHARS:
            raise CommandError(f"a soul section holds at most {MAX_SECTION_CHARS:,} characters (this is "
                               f"{len(text):,})")
        scope = await self._scope(ctx.persona)
        names = [t.name for t in await self.storage.personas.current("soul", scope)]
        if key not in names and (refused := new_section_refusal(ctx.persona, key)) is not None:
            raise CommandError(refused)
        if key not in names and key not in SOUL_SECTIONS and not text:
            raise CommandError(f"{ctx.persona} has no section {key} to empty (a new section needs its text)")
        saved = await self.storage.personas.put("soul", scope, key, text, author=ctx.user_key,
                                                reason="edited in chat")
        await self.registry.load()
        done = (f"{ctx.persona}: section {key} is now version {saved.version}" if text
                else f"{ctx.persona}: section {key} emptied (version {saved.version})")
        return f"{done}.{variables_note(text)}"

    async def revert(self, ctx: CommandContext, args: Sequence[str]) -> str:
        if len(args) < 2:
            raise CommandError("give the section and the version, e.g. identity 2")
        key, number = section_key(args[0]), parse_number(args[1], "the version", prefix="v")
        reverted = await self.storage.personas.revert("soul", await self._scope(ctx.persona), key, number,
                                                      author=ctx.user_key)
        if reverted is None:
            raise CommandError(f"{ctx.persona} has no version {number} of section {key} "
                               f"(see {self.prefix}persona history {key})")
        await self.registry.load()
        saved, written = reverted
        if not written:
            return (f"{ctx.persona}: section {key} holds version {number}'s text already (as version "
                    f"{saved.version}); nothing changed.")
        return f"{ctx.persona}: section {key} is back to version {number}'s text (as version {saved.version})."

    async def delete(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        name = self._row_name(args, ctx) if args else ""
        if not name:
            raise CommandError("which persona?")
        if self.registry.from_config(name):
            raise CommandError(f"{name} comes from the config file: remove its [[personas]] entry there instead")
        row = await self.storage.personas.get_persona(name)
        assert row is not None
        await self.storage.personas.delete_persona(row.id)
        await self.registry.load()
        # Where it was picked (any member's DMs, a channel) goes back to the default: a pick held it before, and
        # any member could keep the bot's admins from deleting a persona by picking it in their DMs.
        moved = [where for key, value, where in await self._picked_in(name)
                 if await self.storage.delete_setting_if(key, value)]
        # Channels by name, privately outside a DM (they may be other servers' and rooms'); a member's pick for
        # their own DMs is theirs: counted, never named.
        channels = [where for where in moved if where.startswith("channel ")]
        places = channels[:5] + (["…"] if len(channels) > 5 else [])
        if dms := len(moved) - len(channels):
            places.append(f"the direct messages of {plural(dms, 'member')}")
        back = (f" The {len(moved)} place(s) that had picked it ({'; '.join(places)}) now talk to "
                f"{self.registry.default_name}." if moved else "")
        return operators(ctx, f"Persona {name} deleted; its soul's history and its users' memory stay (create it "
                              f"again to revive).{back}")

    async def _picked_in(self, name: str) -> list[tuple[str, str, str]]:
        """(setting key, its value, where) of every pick of the persona ``name``."""
        places = []
        for key, value in await self.storage.settings_with_prefix("persona."):
            if value.casefold() == name.casefold():
                kind, _, where = key.removeprefix("persona.").partition(".")
                places.append((key, value, f"{'channel' if kind == 'channel' else 'direct messages of'} {where}"))
        return places
