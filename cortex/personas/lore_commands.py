"""``!lore …``: the persona's shared knowledge. Reading for admins; changing for the bot's admins (a
persona's lore reaches every server that uses it). Users' own memory items stay private: lore is not
theirs and never holds what they told the bot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bot.commands import (
    Command,
    CommandContext,
    CommandError,
    CommandRegistry,
    flag,
    number,
    option,
    parse_number,
    text,
)
from bot.storage import Storage
from bot.storage.personas import LoreEntry, NewLore
from bot.text import plural, shown
from cortex.memory.guard import guarded
from cortex.personas.cards import MAX_KEY_CHARS, MAX_LORE_ENTRIES, only_punctuation
from cortex.personas.lore import LoreIndex, search
from cortex.personas.registry import PersonaRegistry

MAX_LORE_CHARS = 4000
MAX_KEYS = 50
KEYS_FLAG = "--keys"
AND_KEYS_FLAG = "--and-keys"
NO_KEYS = "-"  # ``--keys -`` / ``--and-keys -``: none
ALWAYS_FLAG, NOT_ALWAYS_FLAG = "--always", "--not-always"
PRIORITY_FLAG = "--priority"
FLAGS = (KEYS_FLAG, AND_KEYS_FLAG, ALWAYS_FLAG, NOT_ALWAYS_FLAG, PRIORITY_FLAG)
PAGE = 20


def split_keys(value: str) -> tuple[str, ...]:
    if value.strip() == NO_KEYS:
        return ()
    keys = tuple(dict.fromkeys(k.strip() for k in value.split(",") if k.strip()))
    if len(keys) > MAX_KEYS or any(len(k) > MAX_KEY_CHARS for k in keys):
        raise CommandError(f"at most {MAX_KEYS} keywords of at most {MAX_KEY_CHARS} characters each")
    for key in keys:
        if only_punctuation(key):
            raise CommandError(f"the keyword {shown(key, 20)} is only punctuation, which nearly every message "
                               "holds; give a word (or - for none)")
    return keys


@dataclass(frozen=True, slots=True)
class LoreInput:
    text: str
    keys: tuple[str, ...] | None = None  # None: not given
    and_keys: tuple[str, ...] | None = None
    always: bool | None = None
    priority: int | None = None


def _take_value(words: list[str], flag: str, example: str) -> str | None:
    """The value after ``flag`` (taken out of ``words`` with it); None when the flag is not there."""
    if flag not in words:
        return None
    if words.count(flag) > 1:
        raise CommandError(f"{flag} is given twice")
    at = words.index(flag)
    if at + 1 >= len(words) or words[at + 1] in FLAGS:  # ("--keys --always": no key called "--always")
        raise CommandError(f"{flag} needs a value, e.g. {flag} {example}")
    value = words[at + 1]
    del words[at:at + 2]
    return value


def lore_input(args: Sequence[str], body: str) -> LoreInput:
    """An entry's words and its options anywhere in the line (``--keys a,b``, ``--and-keys c,d``,
    ``--always``/``--not-always``, ``--priority N``); the text may instead be on the lines after the command."""
    words = list(args)
    keys = _take_value(words, KEYS_FLAG, "Lyon,river")
    and_keys = _take_value(words, AND_KEYS_FLAG, "river,bridge")
    priority = _take_value(words, PRIORITY_FLAG, "10")
    if ALWAYS_FLAG in words and NOT_ALWAYS_FLAG in words:
        raise CommandError(f"choose one of {ALWAYS_FLAG} and {NOT_ALWAYS_FLAG}")
    always = True if ALWAYS_FLAG in words else False if NOT_ALWAYS_FLAG in words else None
    words = [w for w in words if w not in (ALWAYS_FLAG, NOT_ALWAYS_FLAG)]
    text = (" ".join(words) or body).strip()
    if len(text) > MAX_LORE_CHARS:
        raise CommandError(f"a lore entry holds at most {MAX_LORE_CHARS:,} characters (this is {len(text):,})")
    return LoreInput(text, None if keys is None else split_keys(keys),
                     None if and_keys is None else split_keys(and_keys), always,
                     None if priority is None else parse_number(priority, "the priority", minimum=0))


def describe(entry: LoreEntry, full: bool = False) -> str:
    marks = []
    if entry.always_on:
        marks.append("always")
    if entry.keys:
        marks.append("keys " + ", ".join(entry.keys[:8]) + ("…" if len(entry.keys) > 8 else ""))
    if entry.secondary_keys:
        marks.append("and " + ", ".join(entry.secondary_keys[:5]))
    if not entry.enabled:
        marks.append("off")
    text = entry.content.strip() if full else entry.content.strip().replace("\n", " ")[:120]
    return f"#{entry.id} [{'; '.join(marks) or 'search only'}] {text}"


@dataclass
class LoreCommands:
    registry: PersonaRegistry
    storage: Storage
    index: LoreIndex
    prefix: str = "!"

    def register(self, registry: CommandRegistry) -> None:
        self.prefix = registry.prefix
        entry = number("entry", "the entry's number", required=True)
        keys = option("keys", "keywords that bring it in, comma-separated (- for none)")
        and_keys = option("and_keys", "with keywords: one of these must come up too, comma-separated (- for none)",
                          token=AND_KEYS_FLAG)
        always = flag("always", "in every reply, keywords or not")
        not_always = flag("not_always", "only by keyword or search (the default of a new entry)", token=NOT_ALWAYS_FLAG)
        priority = option("priority", "higher goes first (0 and up)", minimum=0)
        for name, params, summary, handler, bot_admin in (
            ("list", (number("page", "which page"),), "the lore of the persona here", self.list_entries, False),
            ("show", (entry,), "one lore entry in full", self.show, False),
            ("search", (text("words", "a message's words", required=True),),
             "which lore entries a message with these words would bring in", self.search, False),
            ("add", (text("text", "what everyone should know", required=True, document=True), keys, and_keys, always,
                     not_always, priority),
             "a lore entry for everyone who talks to this persona", self.add, True),
            ("edit", (entry, text("text", "the new text"), keys, and_keys, always, not_always, priority),
             "rewrite an entry, or change its keywords, always-on or priority",
             self.edit, True),
            ("disable", (entry,), "keep an entry out of the prompt", self.disable, True),
            ("enable", (entry,), "let an entry back in", self.enable, True),
            ("remove", (entry,), "delete an entry for good (its text is in the answer)", self.remove, True),
        ):
            registry.register(Command(f"lore {name}", summary, handler, params, admin=True, bot_admin=bot_admin))

    def _persona_id(self, ctx: CommandContext) -> int:
        persona_id = self.registry.persona_id(ctx.persona)
        if persona_id is None:
            raise CommandError(f"unknown persona {shown(ctx.persona)}")
        return persona_id

    async def _entry(self, ctx: CommandContext, args: Sequence[str]) -> LoreEntry:
        if not args:
            raise CommandError("which entry? (its number, see lore list)")
        number = parse_number(args[0], "the entry", prefix="#")
        entry = await self.storage.lore.get(self._persona_id(ctx), number)
        if entry is None:
            raise CommandError(f"{ctx.persona} has no lore entry #{number}")
        return entry

    async def _changed(self) -> None:
        await self.index.refresh(force=True)

    async def list_entries(self, ctx: CommandContext, args: Sequence[str]) -> str:
        entries = await self.storage.lore.entries(self._persona_id(ctx))
        if not entries:
            return f"{ctx.persona} has no lore yet. Bot admins add some with {self.prefix}lore add <text> --keys a,b."
        pages = max(1, -(-len(entries) // PAGE))
        page = parse_number(args[0], "the page") if args else 1
        if page > pages:  # (an answer, as !memory list's: not a mistake in the command)
            return (f"There {'is only 1 page' if pages == 1 else f'are only {pages} pages'} "
                    f"({plural(len(entries), 'entry', 'entries')}).")
        on_page = entries[(page - 1) * PAGE: page * PAGE]
        return "\n".join([f"Lore of {ctx.persona} ({plural(len(entries), 'entry', 'entries')}, page {page}/{pages}):",
                          *(describe(e) for e in on_page)])

    async def show(self, ctx: CommandContext, args: Sequence[str]) -> str:
        entry = await self._entry(ctx, args)
        source = f", from {entry.source}" + (f" by {entry.created_by}" if entry.created_by else "")
        return describe(entry, full=True) + f"\n(priority {entry.priority}{source})"

    async def search(self, ctx: CommandContext, args: Sequence[str]) -> str:
        query = (" ".join(args) or ctx.body).strip()
        if not query:
            raise CommandError("give some words")
        entries = await self.storage.lore.entries(self._persona_id(ctx))
        language = self.registry.persona(ctx.persona).language  # (as a reply's search reads it)
        picked = self.index.chosen([e for e in entries if e.enabled], query, query, (ctx.persona, ctx.user_name),
                                   language)
        if not picked:
            found = search(entries, query, language=language)
            return "No lore would come in." if not found else "Only disabled entries match:\n" + "\n".join(
                describe(e) for e in found)
        return "A message with these words brings in:\n" + "\n".join(describe(e) for e in picked)

    async def add(self, ctx: CommandContext, args: Sequence[str]) -> str:
        given = lore_input(args, ctx.body)
        if not given.text:
            raise CommandError("give the entry's text")
        guarded("lore entry", given.text, ctx.user_key, CommandError)
        if given.and_keys and not given.keys:
            raise CommandError(f"{AND_KEYS_FLAG} narrows {KEYS_FLAG}: give those too")
        new = NewLore(given.text, given.keys or (), given.and_keys or (), always_on=bool(given.always),
                      priority=given.priority or 0)
        persona_id = self._persona_id(ctx)
        entry_id = await self.storage.lore.add_capped(persona_id, new, source="chat", author=ctx.user_key,
                                                     cap=MAX_LORE_ENTRIES)
        if entry_id is None:
            raise CommandError(f"{ctx.persona} has {MAX_LORE_ENTRIES} lore entries, as many as a character card holds "
                               f"(and {self.prefix}persona export writes one): remove one first "
                               f"({self.prefix}lore remove <id>)")
        await self._changed()
        also = f", together with one of {', '.join(new.secondary_keys)}" if new.secondary_keys else ""
        keys = f"one of {', '.join(new.keys)}" if len(new.keys) > 1 else ", ".join(new.keys)
        how = ("every reply" if new.always_on else f"replies when {keys} comes up{also}"
               if new.keys else "replies when a message is about it (no keywords)")
        return f"Lore #{entry_id} added to {ctx.persona}; it enters {how}."

    async def edit(self, ctx: CommandContext, args: Sequence[str]) -> str:
        entry = await self._entry(ctx, args)
        given = lore_input(args[1:], ctx.body)
        if (not given.text and given.keys is None and given.and_keys is None and given.always is None
                and given.priority is None):
            raise CommandError(f"give the new text, {KEYS_FLAG}, {AND_KEYS_FLAG}, --always/--not-always or --priority")
        if given.and_keys and not (entry.keys if given.keys is None else given.keys):
            raise CommandError(f"{AND_KEYS_FLAG} narrows {KEYS_FLAG}, and entry #{entry.id} would have none")
        if given.text:
            guarded("lore entry", given.text, ctx.user_key, CommandError)
        secondary = () if given.keys == () and given.and_keys is None else given.and_keys  # no keys: none of these
        await self.storage.lore.update(entry.persona_id, entry.id, content=given.text or None, keys=given.keys,
                                       secondary_keys=secondary, always_on=given.always, priority=given.priority)
        await self._changed()
        if given.text and given.text.strip() != entry.content.strip():  # (no version is kept: the old text is said)
            return f"Lore #{entry.id} changed. Its text before, to put back with {self.prefix}lore edit {entry.id}:\n" \
                   f"{entry.content}"
        return f"Lore #{entry.id} changed."

    async def disable(self, ctx: CommandContext, args: Sequence[str]) -> str:
        return await self._switch(ctx, args, on=False)

    async def _switch(self, ctx: CommandContext, args: Sequence[str], *, on: bool) -> str:
        """Switch an entry on or off; one in that state already is left as it is, and said to be."""
        entry = await self._entry(ctx, args)
        state = "on" if on else "off"
        if entry.enabled is on:
            return f"Lore #{entry.id} is {state} already."
        await self.storage.lore.update(entry.persona_id, entry.id, enabled=on)
        await self._changed()
        return f"Lore #{entry.id} is {state}."

    async def remove(self, ctx: CommandContext, args: Sequence[str]) -> str:
        entry = await self._entry(ctx, args)
        if not await self.storage.lore.remove(entry.persona_id, entry.id):
            raise CommandError(f"{ctx.persona} has no lore entry #{entry.id}")  # removed meanwhile
        await self._changed()
        return f"Lore #{entry.id} removed. It said:\n{entry.content}"

    async def enable(self, ctx: CommandContext, args: Sequence[str]) -> str:
        return await self._switch(ctx, args, on=True)
