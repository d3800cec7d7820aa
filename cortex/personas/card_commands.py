"""``!persona import`` and ``!persona export``: Character Card V2/V3 in, V2 JSON out.

A card comes as an attachment (Discord, Matrix: sent with the command) or, in the terminal only, as a
path (the person at the terminal runs the bot; a chat user never names a file on the bot's machine).
The whole card is checked before anything is written: a bad card gets one line and changes nothing.
Its texts become soul sections (author ``import``), its ``character_book`` becomes lore.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from bot.commands import (
    Attachment,
    Command,
    CommandContext,
    CommandError,
    CommandRegistry,
    CommandReply,
    file,
    words,
)
from bot.commands.files import attached_file
from bot.config import ConfigError
from bot.prompt import variables_note
from bot.storage import Storage
from bot.storage.personas import NameTaken, NewLore
from bot.storage.textsearch import text_search_config
from bot.text import one_line_name, plural, shown
from cortex.memory.guard import check_memory_text
from cortex.personas.cards import (
    MAX_CARD_BYTES,
    CardError,
    CardLoreEntry,
    export_card_v2,
    only_punctuation,
    parse_card,
)
from cortex.personas.commands import check_persona_name, taken_message
from cortex.personas.registry import PersonaRegistry

IMPORT = "import"


@dataclass
class CardCommands:
    registry: PersonaRegistry
    storage: Storage
    prefix: str = "!"
    commands: CommandRegistry | None = None

    def register(self, registry: CommandRegistry) -> None:
        self.prefix = registry.prefix
        self.commands = registry
        registry.register(Command(
            "persona import", "a new persona from a character card (V2/V3, PNG or JSON)", self.import_card,
            (file("card", "the card: a PNG or JSON file (in the terminal: its path)", required=True),),
            admin=True, bot_admin=True))
        registry.register(Command(
            "persona export", "a persona as a Character Card V2 (JSON)", self.export_card,
            (words("name", "a persona's name", complete="personas"),), admin=True))

    async def import_card(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        sent_as, data = await attached_file(ctx, args, "the card (a PNG or JSON file)", MAX_CARD_BYTES)
        # (a name as the sender's client wrote it: stored in the history's reason, so storable and on one line)
        filename = one_line_name(sent_as) or "the card"
        try:  # (beside the chat: 8 MB of JSON, a million short texts, take seconds to read and check)
            card = await asyncio.to_thread(parse_card, data)
        except CardError as exc:
            raise CommandError(f"{shown(filename)}: {exc}") from None
        try:
            check_persona_name(card.name, self.commands)
        except CommandError as exc:
            raise CommandError(f"{shown(filename)}: {exc}; nothing was imported") from None
        for number, entry in enumerate(card.lore, start=1):  # lore reaches every user: the guard applies
            verdict = check_memory_text(entry.content)
            if not verdict.ok:
                why = verdict.line().removeprefix("refused: it ")
                raise CommandError(f"{shown(filename)}: lore entry {number} {why}; nothing was imported")
        default = self.registry.persona(None)
        # Not into a deleted persona of that name: its old soul sections and lore would come back mixed
        # with the card's (a revival is what "!persona create" is for).
        lore, dropped = _lore_of(card.lore)
        row = await self.storage.personas.import_persona(  # all of it, or nothing
            card.name, default.language, IMPORT, text_search_config(default.language), card.sections, lore,
            author=IMPORT, reason=f"imported from {filename} by {ctx.user_key}", lore_author=ctx.user_key)
        if isinstance(row, NameTaken) and not row.deleted:  # (the store's word: made by any process)
            raise CommandError(f"{taken_message(row.name, card.name)}: delete it first ({self.prefix}persona delete "
                               f"{row.name}), or change the name in the card; nothing was imported")
        if isinstance(row, NameTaken):
            raise CommandError(f"a deleted persona was called {shown(row.name)}; its soul and lore are kept, and "
                               f"{self.prefix}persona create {row.name} brings it back. To import the card, give it "
                               "another name; nothing was imported")
        await self.registry.load()
        patterns = sum(1 for e in card.lore if e.use_regex)
        note = (f" {patterns} lore entr{'y' if patterns == 1 else 'ies'} had regular expressions as keys: this bot "
                f"takes them as plain keywords (check them with {self.prefix}lore list)." if patterns else "")
        if dropped:
            note += (f" {plural(dropped, 'lore entry', 'lore entries')} had keywords of punctuation alone (such as "
                     "\".\"), which nearly every message holds: those were left out (check with "
                     f"{self.prefix}lore list).")
        # (another program's macros, such as {{original}}: named, as !persona edit names them)
        note += variables_note("\n".join(content for _, content in card.sections))
        return CommandReply(
            f"Imported {card.name} from {filename} ({card.spec}): {len(card.sections)} soul section(s), "
            f"{len(card.lore)} lore entr{'y' if len(card.lore) == 1 else 'ies'}. Pick it for a channel with "
            f"{self.prefix}persona {card.name}.{note}")

    async def export_card(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        try:
            persona = self.registry.persona(" ".join(args) if args else ctx.persona)
        except ConfigError as exc:
            raise CommandError(str(exc)) from None
        persona_id = self.registry.persona_id(persona.name)
        assert persona_id is not None
        lore = [CardLoreEntry(e.content, e.keys, e.secondary_keys, e.always_on, e.priority, e.enabled, e.name)
                for e in await self.storage.lore.entries(persona_id)]
        data = export_card_v2(persona.name, persona.soul_sections(), lore)
        try:  # what this bot could not import again is no backup: say what stands in the way instead
            await asyncio.to_thread(parse_card, data)  # (megabytes of JSON with a big lore book)
        except CardError as exc:
            hint = (f"remove entries with {self.prefix}lore remove" if "lore" in str(exc) else
                    "shorten it (the card's description holds every soul section without a card field of its own)")
            raise CommandError(f"{persona.name} does not fit in a character card: {exc}. Nothing was exported; "
                               f"{hint} and export again") from None
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in persona.name)[:60] or "persona"
        return CommandReply(f"{persona.name} as a Character Card V2 ({len(lore)} lore entries).",
                            attachments=(Attachment(f"{safe}.card.json", data),), private=True)


def _lore_of(entries: Sequence[CardLoreEntry]) -> tuple[list[NewLore], int]:
    """The card's lore as stored, without keywords of punctuation alone (``!lore`` refuses them); how many
    entries had some."""
    lore, dropped = [], 0
    for e in entries:
        keys = tuple(k for k in e.keys if not only_punctuation(k))
        secondary = tuple(k for k in e.secondary_keys if not only_punctuation(k))
        dropped += (keys, secondary) != (e.keys, e.secondary_keys)
        lore.append(NewLore(e.content, keys, secondary, e.always_on, e.priority, e.enabled, e.name))
    return lore, dropped
