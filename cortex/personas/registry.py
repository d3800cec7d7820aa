"""The personas of the bot, from the database: seeded from the config, cached, reloaded every few seconds.

**Seeding rule** (run at every start, idempotent): each ``[[personas]]`` entry becomes a persona row
(its language and model settings always follow the config) and each of its soul sections is compared
with the text the config gave *last time* (the newest version written by ``config``):

* unchanged → nothing happens, whatever admins edited in chat since;
* new or changed, and nobody edited the section in chat since the config's last text → the config's
  text becomes the next version (author ``config``);
* changed, but an admin edited the section in chat since → the config's text is recorded as a version
  (so ``!persona revert`` can bring it in) and the admin's text is put back on top of it: **the newer
  deliberate edit in chat wins** over a config file that was changed without knowing of it; the log
  says so once, with the version numbers.

``[bot] global_rules`` seeds the global rule named ``config`` by the same rule. Guidelines and rules are
cached here too (one query each per reload) for the prompt sections in ``cortex.personas.sections``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence

from bot.config import Config, ConfigError, PersonaConfig
from bot.persona import Persona, unknown_persona
from bot.prompt import variables_note
from bot.storage import Storage
from bot.storage.personas import BOT_WIDE, PersonaRow, TextKind, TextVersion
from bot.storage.textsearch import text_search_config
from bot.text import name_key, persona_key

log = logging.getLogger(__name__)

CONFIG = "config"
CONFIG_RULE = "config"  # the rule [bot] global_rules seeds
SEED_LOCK = "persona-seed"
SEED_LOCK_SECONDS = 60.0
SETTING_KEYS = ("model", "temperature", "history_tokens", "summary_tokens")


def config_settings(entry: PersonaConfig) -> dict[str, object]:
    return {key: getattr(entry, key) for key in SETTING_KEYS if getattr(entry, key) is not None}


def persona_from(row: PersonaRow, sections: Sequence[TextVersion]) -> Persona:
    settings = row.settings

    def number(key: str) -> float | None:
        value = settings.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def whole(key: str) -> int | None:
        value = number(key)
        return None if value is None else int(value)

    model = settings.get("model")
    return Persona(row.name, row.language, model if isinstance(model, str) and model else None,
                   number("temperature"), whole("history_tokens"), whole("summary_tokens"),
                   tuple((s.name, s.content) for s in sorted(sections, key=lambda s: (s.position, s.name))))


class PersonaRegistry:
    """A :class:`bot.persona.PersonaSource` over the database (one query per reload for all personas)."""

    def __init__(self, config: Config, storage: Storage) -> None:
        self.config = config
        self.storage = storage
        self._personas: dict[str, Persona] = {}  # name_key(name) -> persona, in creation order
        self._ids: dict[str, int] = {}  # name_key(name) -> persona row id
        self._guidelines: dict[str, str] = {}  # server key (or BOT_WIDE) -> live guidelines
        self._rules: list[TextVersion] = []  # live rules by position, enabled or not

    # -- PersonaSource ---------------------------------------------------------------------------

    def persona(self, name: str | None = None) -> Persona:
        """The persona of that name, or else the one it looks like (typed in full-width letters, "Ｃｏｒａ", or
        with a Cyrillic "С") when only one does (a database of an older release may hold look-alikes)."""
        wanted = name or self.default_name
        found = self._personas.get(name_key(wanted))
        if found is None:
            alike = [p for p in self._personas.values() if persona_key(p.name) == persona_key(wanted)]
            found = alike[0] if len(alike) == 1 else None
        if found is None:
            raise unknown_persona(wanted, self.names())
        return found

    def names(self) -> list[str]:
        return [p.name for p in self._personas.values()]

    @property
    def default_name(self) -> str:
        return self.config.bot.default_persona or self.config.personas[0].name

    def guidelines_for(self, server_key: str | None) -> tuple[str, str]:
        """The guidelines in force (a server's own, else the bot-wide default) and whose they are."""
        own = self._guidelines.get(server_key or "", "") if server_key else ""
        if own.strip():
            return own, server_key or ""
        return self._guidelines.get(BOT_WIDE, ""), BOT_WIDE

    def rules(self) -> list[TextVersion]:
        return list(self._rules)

    def persona_id(self, name: str) -> int | None:
        return self._ids.get(name_key(name))

    def from_config(self, name: str) -> bool:
        return any(name_key(p.name) == name_key(name) for p in self.config.personas)

    # -- loading ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.seed()
        await self.load()

    async def load(self) -> None:
        """Read every persona and its live soul (edits made by another process arrive this way)."""
        repo = self.storage.personas
        rows = await repo.list_personas()
        by_scope: dict[str, list[TextVersion]] = {}
        for text in await repo.current_all("soul"):
            by_scope.setdefault(text.scope, []).append(text)
        self._personas = {name_key(row.name): persona_from(row, by_scope.get(str(row.id), [])) for row in rows}
        self._ids = {name_key(row.name): row.id for row in rows}
        self._guidelines = {t.scope: t.content for t in await repo.current_all("guidelines")}
        self._rules = sorted(await repo.current_all("rule"), key=lambda t: (t.position, t.name))

    async def seed(self) -> None:
        """Bring the config's personas into the database (see the module's rule), once at a time."""
        owner = f"seed-{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + SEED_LOCK_SECONDS
        while await self.storage.fleet.acquire_lock(SEED_LOCK, owner, SEED_LOCK_SECONDS) is not None:
            if time.monotonic() > deadline:
                raise ConfigError("another process has been seeding the personas for a minute; try again")
            await asyncio.sleep(0.2)
        try:
            for entry in self.config.personas:
                row = await self._seed_row(entry)
                for position, key in enumerate(entry.soul_order, start=1):
                    await self._seed_text("soul", str(row.id), key, getattr(entry, key), position,
                                          f"persona {row.name}: section {key}", f"!persona revert {key}")
                if await self.storage.personas.order_souls(str(row.id), entry.soul_order):  # (changed since)
                    log.info("persona %s: soul sections put in the config file's soul_order", row.name)
            await self._seed_text("rule", BOT_WIDE, CONFIG_RULE, self.config.bot.global_rules, 0,
                                  f"global rule {CONFIG_RULE!r} ([bot] global_rules)", f"!rules revert {CONFIG_RULE}")
        finally:
            await self.storage.fleet.release_lock(SEED_LOCK, owner)
        for where, note in unknown_placeholders(self.config):  # (as !rules and !persona edit say at once)
            log.warning("the config file's %s:%s", where, note)

    async def _seed_row(self, entry: PersonaConfig) -> PersonaRow:
        repo = self.storage.personas
        ts_config = text_search_config(entry.language)
        row = await repo.get_persona(entry.name)
        if row is None:
            row = await repo.create_persona(entry.name, entry.language, config_settings(entry), CONFIG, ts_config)
            if row is None:  # created a moment ago by a process that did not take the lock
                row = await repo.get_persona(entry.name)
            if row is None:  # the name is held by one that looks like it ("Nеmo" with a Cyrillic е, "Ｎｅｍｏ")
                raise ConfigError(
                    f"[[personas]] {entry.name!r} in the config file looks like the name of a persona made in chat or "
                    "from a character card (names that look alike, such as one with a Cyrillic letter, count as one, "
                    "and a deleted one would come back for it): rename it in the config")
            log.info("persona %s added from the config file", entry.name)
        elif row.source != CONFIG:  # made in chat (or by a card) before the config named it
            await repo.update_persona(row.id, entry.language, config_settings(entry), ts_config, source=CONFIG)
            made = "a character card" if row.source == "import" else "!persona create"
            log.warning("persona %s in the config file has the name of a persona made with %s (its chat edits of "
                        "the soul stay); the config's entry now applies to it: rename one of them in the config to "
                        "keep them apart", entry.name, made)
        elif (row.language, dict(row.settings)) != (entry.language, config_settings(entry)):
            await repo.update_persona(row.id, entry.language, config_settings(entry), ts_config)
        return row

    async def _seed_text(self, kind: TextKind, scope: str, key: str, text: str, position: int, what: str,
                         revert: str) -> None:
        repo = self.storage.personas
        history = await repo.history(kind, scope, key)
        from_config = [v for v in history if v.author == CONFIG]
        last_config = from_config[-1] if from_config else None
        live = history[-1] if history else None
        if last_config is not None and last_config.content == text:
            return  # the config has not changed this section
        if last_config is None and not text.strip():
            return  # the config has never said anything here, and still says nothing
        # (a section that has a place keeps it: chat may have put new sections before it since)
        recorded = await repo.put(kind, scope, key, text, author=CONFIG, reason="from the config file",
                                  position=position if live is None else live.position)
        if live is None or live.author == CONFIG:
            log.info("%s %s from the config file (version %d)", what, "set" if live is None else "updated",
                     recorded.version)
            return
        await repo.put(kind, scope, key, live.content, author=live.author, position=live.position,
                       enabled=live.enabled, reason=f"kept the chat edit of version {live.version} over the config "
                                                    f"file's new text (version {recorded.version})")
        log.warning(
            "%s changed in the config file, but %s edited it in chat (version %d) after the config last set it; "
            "the chat edit stays, the config's text is version %d (bring it in with %s %d)", what, live.author,
            live.version, recorded.version, revert, recorded.version)


def unknown_placeholders(config: Config) -> list[tuple[str, str]]:
    """The config's texts that hold placeholders the prompt leaves as written (``{bogus}``, a misspelt
    ``{user_nmae}``): where, and the note ``!rules`` and ``!persona edit`` give for them."""
    texts = [("[bot] global_rules", config.bot.global_rules)] + [
        (f"[[personas]] {p.name}'s {key}", str(getattr(p, key))) for p in config.personas for key in p.soul_order]
    return [(where, note) for where, text in texts if (note := variables_note(text))]

