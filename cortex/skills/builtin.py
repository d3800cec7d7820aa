"""The built-in skills: the user's memory (``remember``, ``search_memory``), the persona's lore
(``search_lore``), the time (``current_time``) and, for admins, the persona's soul and the server's
guidelines (``read_soul``/``edit_soul``, ``read_guidelines``/``edit_guidelines``).

The memory skills act for the user being answered only: their pair with the persona in use, the
store's poisoning guard and size cap, and the privacy scope (in a group channel only shared items are
searched, and what is remembered there is shared, unless the server lets DM memory into its prompts: there
the reply read the private items, so they are searched and what is remembered is private). Changes to soul
and guidelines are new versions with the reason the model gives, exactly as the chat commands write them.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from bot.config import SOUL_SECTIONS, Config
from bot.prompt import resolve_variables
from bot.storage.core import Storage
from bot.storage.cortex import Pair
from bot.storage.engine import StaleReference
from bot.storage.personas import BOT_WIDE
from cortex.memory.store import CATEGORIES, AlreadyRemembered, MemoryError, MemoryStore
from cortex.personas.commands import MAX_SECTION_CHARS
from cortex.personas.guidelines import MAX_GUIDELINES_CHARS
from cortex.personas.lore import LoreIndex, search
from cortex.personas.registry import PersonaRegistry
from cortex.settings import SettingsResolver
from cortex.skills.base import SkillContext, SkillFailure, SkillInfo, SkillResult
from cortex.store import CortexStore

_TEXT = {"type": "string"}
Handler = Callable[[dict[str, Any], SkillContext], Awaitable[SkillResult]]


# The changing skills are offered only when the admin's own message names what they change: in a channel
# the model also reads other people's messages (and tool results), and those must not be able to talk it
# into rewriting the persona or the server's rules while it answers an admin about something else.
SOUL_WORDS = ("soul", "persona", "personality", "character", "yourself", "seele", "persönlichkeit", "charakter",
              "dich selbst")
GUIDELINE_WORDS = ("guideline", "rule", "richtlinie", "regel")
# In a group channel the persona stores a fact in the speaker's memory (shared: it follows them into other
# servers and their DMs) only when their message asks for it: a room's guidelines (on Matrix, whoever makes a
# room writes them) could otherwise have it store whatever they say in everyone who speaks there.
# (Asking is told from words, so "do you remember that day?" opens it too: it narrows what guidelines can do.)
REMEMBER_WORDS = ("remember that", "remember this", "remember my", "remember me", "remember i", "remember:",
                  "please remember", "don't forget", "do not forget", "dont forget", "keep in mind", "note that",
                  "make a note", "merk dir", "merke dir", "vergiss nicht", "notier", "denk dran", "denk daran")


@dataclass(frozen=True, slots=True)
class BuiltinSkill:
    info: SkillInfo
    handler: Handler

    async def run(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        return await self.handler(arguments, context)


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _text(arguments: dict[str, Any], name: str, limit: int = 2000) -> str:
    value = arguments.get(name)
    if not isinstance(value, str) or not value.strip():
        raise SkillFailure(f"'{name}' must be a non-empty string")
    if len(value) > limit:
        raise SkillFailure(f"'{name}' holds at most {limit:,} characters")
    return value.strip()


@dataclass
class Builtins:
    """Builds the built-in skills over the bot's parts."""

    config: Config
    storage: Storage
    cortex: CortexStore
    memory: MemoryStore | None
    lore: LoreIndex | None
    registry: PersonaRegistry | None
    resolver: SettingsResolver | None = None  # where DM memory may enter a group channel's prompt

    def skills(self) -> list[BuiltinSkill]:
        found = [self._time()]
        if self.memory is not None:
            found += [self._remember(), self._search_memory()]
        if self.lore is not None and self.registry is not None:
            found.append(self._search_lore())
        if self.registry is not None:
            found += [self._read_soul(), self._edit_soul(), self._read_guidelines(), self._edit_guidelines()]
        return found

    # -- memory ----------------------------------------------------------------------------------

    async def _private_here(self, context: SkillContext) -> bool:
        """Whether the reply's prompt holds the user's private memory: in a DM, and in a group channel whose
        server lets DM memory in (``use_in_groups``). What the model remembers from such a prompt may carry
        what was said in private, so it is private (a shared item enters every group channel's prompt)."""
        if self.resolver is None:
            return context.is_dm
        return await self.resolver.private_memory_allowed(context.persona, context.server_key, context.is_dm)

    async def _pair(self, context: SkillContext) -> Pair:
        """The pair of the person answered, by their row (never made again by their key: a reply still
        running while they asked to be forgotten must not bring them back)."""
        try:
            return await self.cortex.count_messages(context.user_db_id, context.persona, 0)
        except StaleReference:
            raise SkillFailure("the person you answer has just asked to be forgotten: nothing about them is "
                               "stored or looked up any more") from None

    def _remember(self) -> BuiltinSkill:
        info = SkillInfo("remember", (
            "Store one fact the user asked you to remember (or clearly wants kept) in your long-term memory of "
            "them, at once. One self-contained fact per call, in your own words."),
            _schema({"content": {"type": "string", "description": "The fact, self-contained."},
                     "category": {"type": "string", "enum": list(CATEGORIES)}}, ["content"]), "builtin",
            group_triggers=REMEMBER_WORDS)
        return BuiltinSkill(info, self.remember)

    async def remember(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        assert self.memory is not None
        content = _text(arguments, "content", self.config.memory.max_item_chars)
        category = arguments.get("category", "fact")
        if category not in CATEGORIES:
            raise SkillFailure(f"'category' must be one of {', '.join(CATEGORIES)}")
        pair = await self._pair(context)
        try:
            item = await self.memory.remember(
                # from the message answered: deleting it (or "Forget this" on it) archives this item too
                pair.id, content, category=str(category), source="model",
                source_ref=context.message_key or "remember skill in a reply",
                scope="private" if await self._private_here(context) else "shared", once=True)
        except AlreadyRemembered as same:  # (a second item of the same words would only crowd the prompt)
            return SkillResult(f"item #{same.item.id} says that already: nothing new was stored")
        except MemoryError as exc:
            raise SkillFailure(str(exc)) from None
        return SkillResult(f"remembered as item #{item.id}", changed=True)

    def _search_memory(self) -> BuiltinSkill:
        info = SkillInfo("search_memory", "Search your long-term memory of the user you are answering.",
                         _schema({"query": _TEXT, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
                                 ["query"]), "builtin")
        return BuiltinSkill(info, self.search_memory)

    async def search_memory(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        assert self.memory is not None
        query = _text(arguments, "query", 500)
        limit = arguments.get("limit", 8)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 20:
            raise SkillFailure("'limit' must be a whole number from 1 to 20")
        pair = await self._pair(context)
        scopes = ("private", "shared") if await self._private_here(context) else ("shared",)
        hits = await self.memory.search(pair.id, query, limit=limit, include_messages=False, scopes=scopes,
                                        function_words=True)  # (asked for: "The Who" by its words too; a reply
        # waits on it, so not as long for the query's vector as a person's own search)
        lines = [f"#{h.item.id} [{h.item.category}, {h.item.created_at:%Y-%m-%d}] {h.item.content}"
                 for h in hits if h.item is not None]
        return SkillResult("\n".join(lines) if lines else "nothing found")

    # -- lore and time ---------------------------------------------------------------------------

    def _search_lore(self) -> BuiltinSkill:
        info = SkillInfo("search_lore", "Search your world's lore (background knowledge your persona has).",
                         _schema({"query": _TEXT}, ["query"]), "builtin")
        return BuiltinSkill(info, self.search_lore)

    async def search_lore(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        assert self.lore is not None and self.registry is not None
        query = _text(arguments, "query", 500)
        persona_id = self.registry.persona_id(context.persona)
        entries = await self.lore.entries(persona_id) if persona_id is not None else []
        found = search(entries, query, limit=5)
        # (a card's {{char}} and {{user}} filled in, as the lore section of the prompt fills them)
        names = {"char_name": context.persona, "user_name": context.user_name}
        return SkillResult("\n".join(f"- {resolve_variables(e.content.strip(), names)}" for e in found) if found
                           else "nothing found")

    def _time(self) -> BuiltinSkill:
        info = SkillInfo("current_time", "The current date and time (optionally in an IANA time zone such as "
                         "Europe/Berlin).", _schema({"timezone": _TEXT}, []), "builtin")
        return BuiltinSkill(info, self.current_time)

    async def current_time(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        name = arguments.get("timezone") or self.config.skills.timezone
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_+\-/]{1,64}", name):
            raise SkillFailure("'timezone' must be an IANA zone name such as Europe/Berlin")
        try:
            zone = ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise SkillFailure(f"unknown time zone {name!r}; use an IANA name such as Europe/Berlin") from None
        now = context.now.astimezone(zone)
        return SkillResult(f"{now:%A, %d %B %Y, %H:%M} ({name}, UTC{now:%z})")

    # -- soul and guidelines (admins) ------------------------------------------------------------

    def _read_soul(self) -> BuiltinSkill:
        info = SkillInfo("read_soul", "Read your own soul sections (admins only).", _schema({}, []), "builtin",
                         admin_only=True)
        return BuiltinSkill(info, self.read_soul)

    async def read_soul(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        scope = await self._persona_scope(context.persona)
        live = [t for t in await self.storage.personas.current("soul", scope) if t.content.strip()]
        return SkillResult("\n\n".join(f"[{t.name}] (version {t.version})\n{t.content}" for t in live) or "empty")

    def _edit_soul(self) -> BuiltinSkill:
        info = SkillInfo("edit_soul", "Change one section of your own soul as a bot admin asked (a new version).",
                         _schema({"section": {"type": "string", "enum": list(SOUL_SECTIONS)},
                                  "content": _TEXT, "reason": _TEXT}, ["section", "content", "reason"]),
                         "builtin", admin_only=True, bot_admin=True, triggers=SOUL_WORDS)
        return BuiltinSkill(info, self.edit_soul)

    async def edit_soul(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        if not context.is_bot_admin:
            raise SkillFailure("only the bot's admins may change a persona's soul (it is shared by every server)")
        section = arguments.get("section")
        if section not in SOUL_SECTIONS:
            raise SkillFailure(f"'section' must be one of {', '.join(SOUL_SECTIONS)}")
        content = _text(arguments, "content", MAX_SECTION_CHARS)
        reason = _text(arguments, "reason", 300)
        saved = await self.storage.personas.put("soul", await self._persona_scope(context.persona), str(section),
                                                content, author=context.user_key, reason=f"skill: {reason}")
        assert self.registry is not None
        await self.registry.load()
        return SkillResult(f"saved section {section} as version {saved.version}", changed=True)

    def _read_guidelines(self) -> BuiltinSkill:
        info = SkillInfo("read_guidelines", "Read the guidelines in force here (admins only).", _schema({}, []),
                         "builtin", admin_only=True)
        return BuiltinSkill(info, self.read_guidelines)

    async def read_guidelines(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        assert self.registry is not None
        text, scope = self.registry.guidelines_for(context.server_key)
        where = "bot-wide default" if scope == BOT_WIDE else "this server's own"
        return SkillResult(f"({where})\n{text}" if text.strip() else "no guidelines here")

    def _edit_guidelines(self) -> BuiltinSkill:
        info = SkillInfo("edit_guidelines", "Replace this server's guidelines as an admin asked (a new version).",
                         _schema({"content": _TEXT, "reason": _TEXT}, ["content", "reason"]), "builtin",
                         admin_only=True, triggers=GUIDELINE_WORDS)
        return BuiltinSkill(info, self.edit_guidelines)

    async def edit_guidelines(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        if not context.server_key:
            raise SkillFailure("guidelines belong to a server; in a direct message use the !guidelines command")
        content = _text(arguments, "content", MAX_GUIDELINES_CHARS)
        reason = _text(arguments, "reason", 300)
        saved = await self.storage.personas.put("guidelines", context.server_key, "", content,
                                                author=context.user_key, reason=f"skill: {reason}")
        assert self.registry is not None
        await self.registry.load()
        return SkillResult(f"saved this server's guidelines as version {saved.version}", changed=True)

    async def _persona_scope(self, name: str) -> str:
        row = await self.storage.personas.get_persona(name)
        if row is None:
            raise SkillFailure(f"persona {name!r} is not stored")
        return str(row.id)
