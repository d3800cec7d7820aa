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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence

from bot.config import Config, ConfigError, PersonaConfig
from bot.persona import Persona, unknown_persona
from bot.storage import Storage
from bot.storage.personas import PersonaRow, TextVersion
from bot.storage.textsearch import text_search_config

log = logging.getLogger(__name__)

CONFIG = "config"
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
        self._personas: dict[str, Persona] = {}  # casefolded name -> persona, in creation order

    # -- PersonaSource ---------------------------------------------------------------------------

    def persona(self, name: str | None = None) -> Persona:
        wanted = name or self.default_name
        found = self._personas.get(wanted.casefold())
        if found is None:
            raise unknown_persona(wanted, self.names())
        return found

    def names(self) -> list[str]:
        return [p.name for p in self._personas.values()]

    @property
    def default_name(self) -> str:
        return self.config.bot.default_persona or self.config.personas[0].name

    def from_config(self, name: str) -> bool:
        return any(p.name.casefold() == name.casefold() for p in self.config.personas)

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
        self._personas = {row.name.casefold(): persona_from(row, by_scope.get(str(row.id), [])) for row in rows}

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
                    await self._seed_section(row, key, getattr(entry, key), position)
        finally:
            await self.storage.fleet.release_lock(SEED_LOCK, owner)

    async def _seed_row(self, entry: PersonaConfig) -> PersonaRow:
        repo = self.storage.personas
        ts_config = text_search_config(entry.language)
        row = await repo.get_persona(entry.name)
        if row is None:
            row = await repo.create_persona(entry.name, entry.language, config_settings(entry), CONFIG, ts_config)
            if row is None:  # created a moment ago by a process that did not take the lock
                row = await repo.get_persona(entry.name)
            assert row is not None
            log.info("persona %s added from the config file", entry.name)
        elif (row.language, dict(row.settings)) != (entry.language, config_settings(entry)):
            await repo.update_persona(row.id, entry.language, config_settings(entry), ts_config)
        return row

    async def _seed_section(self, row: PersonaRow, key: str, text: str, position: int) -> None:
        repo = self.storage.personas
        scope = str(row.id)
        history = await repo.history("soul", scope, key)
        from_config = [v for v in history if v.author == CONFIG]
        last_config = from_config[-1] if from_config else None
        live = history[-1] if history else None
        if last_config is not None and last_config.content == text:
            return  # the config has not changed this section
        if live is None and not text.strip():
            return  # nothing to say
        recorded = await repo.put("soul", scope, key, text, author=CONFIG, reason="from the config file",
                                  position=position)
        if live is None or live.author == CONFIG:
            log.info("persona %s: section %s %s from the config file (version %d)", row.name, key,
                     "set" if live is None else "updated", recorded.version)
            return
        await repo.put("soul", scope, key, live.content, author=live.author, position=live.position,
                       reason=f"kept the chat edit of version {live.version} over the config file's new text "
                              f"(version {recorded.version})")
        log.warning(
            "persona %s: section %s changed in the config file, but %s edited it in chat (version %d) after the "
            "config last set it; the chat edit stays, the config's text is version %d (bring it in with "
            "!persona revert %s %d)", row.name, key, live.author, live.version, recorded.version, key,
            recorded.version)
