"""Personas as data, and the versioned texts that make them up: soul sections, guidelines, global rules.

One table, ``versioned_texts``, keeps every version of every such text: a change never updates a
row, it adds the next version, so the history (before/after, who, when, why) is simply the rows of
one name in order, and the newest version of a name is the live one. A ``kind`` says what the text
is, a ``scope`` whose it is (a persona's id, a server's key, ``*`` for bot-wide), a ``name`` which one
(a soul section, a rule; empty for guidelines). Removing a text is a version with empty content.
"""

from __future__ import annotations

import json
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from bot.config import SOUL_SECTIONS
from bot.storage.cortex import CortexRepository
from bot.storage.engine import Database, Row, Tx, is_conflict, serialise
from bot.storage.rows import dt
from bot.storage.textsearch import restem
from bot.text import name_key, persona_key

TextKind = Literal["soul", "guidelines", "rule"]
BOT_WIDE = "*"
VERSION_ATTEMPTS = 5  # two processes writing the same text at once: the loser takes the next number
# The newest versions kept of each text, as of a cortex file: every change is a new version, so an admin or a
# script editing a text in a loop would otherwise grow the table without end.
KEEP_VERSIONS = CortexRepository.KEEP_VERSIONS


@dataclass(frozen=True, slots=True)
class TextVersion:
    kind: str
    scope: str
    name: str
    version: int
    content: str
    position: int
    enabled: bool
    author: str
    reason: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class PersonaRow:
    id: int
    name: str
    language: str
    settings: Mapping[str, Any]
    source: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class NameTaken:
    """Why a persona was not made: the persona (live, or deleted) that holds its name, as it is spelled there
    (``Cora`` holds ``Сora`` with a Cyrillic С)."""
    name: str
    deleted: bool


def _text(row: Row) -> TextVersion:
    return TextVersion(str(row["kind"]), str(row["scope"]), str(row["name"]), int(row["version"]),
                       str(row["content"]), int(row["position"]), bool(row["enabled"]), str(row["author"]),
                       str(row["reason"]), dt(row["created_at"]))


def _persona(row: Row) -> PersonaRow:
    try:
        settings = json.loads(str(row["settings"]))
    except ValueError:
        settings = {}
    return PersonaRow(int(row["id"]), str(row["name"]), str(row["language"]),
                      settings if isinstance(settings, dict) else {}, str(row["source"]), dt(row["created_at"]))


LATEST = ("version = (SELECT max(version) FROM versioned_texts v WHERE v.kind = t.kind AND v.scope = t.scope"
          " AND v.name = t.name)")
# The versions of a text older than its newest KEEP_VERSIONS (the parameter) of every text, for a DELETE.
TOO_OLD = ("version <= (SELECT max(version) FROM versioned_texts v WHERE v.kind = versioned_texts.kind"
           " AND v.scope = versioned_texts.scope AND v.name = versioned_texts.name) - ?")


def _new_persona(name: str, language: str, settings: Mapping[str, Any], source: str, ts_config: str
                 ) -> tuple[str, tuple[Any, ...]]:
    """The INSERT of a new persona (RETURNING it; nothing when the name was taken a moment ago), with its
    parameters."""
    return ("INSERT INTO personas (name, created_at, ts_config, language, settings, source)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING *",
            (name, time.time(), ts_config, language, json.dumps(dict(settings)), source))


def _next_version(kind: TextKind, scope: str, name: str, content: str, author: str, reason: str,
                  position: int | None, enabled: bool | None, based_on: int | None = None
                  ) -> tuple[str, tuple[Any, ...]]:
    """The INSERT of a text's next version (RETURNING it), with its parameters; with ``based_on``, it inserts
    nothing unless that is still the newest version (0: none yet)."""
    live = f"FROM versioned_texts t WHERE kind = ? AND scope = ? AND name = ? AND {LATEST}"
    having = "" if based_on is None else " HAVING coalesce(max(version), 0) = ?"
    return (
        "INSERT INTO versioned_texts (kind, scope, name, version, content, position, enabled, author,"
        " reason, created_at)"
        " SELECT ?, ?, ?, coalesce(max(version), 0) + 1, ?,"
        f" coalesce(CAST(? AS INTEGER), (SELECT position {live}),"
        "   (SELECT coalesce(max(position), 0) + 1 FROM versioned_texts WHERE kind = ? AND scope = ?)),"
        f" coalesce(CAST(? AS INTEGER), (SELECT enabled {live}), 1), ?, ?, CAST(? AS DOUBLE PRECISION)"
        f" FROM versioned_texts WHERE kind = ? AND scope = ? AND name = ?{having} RETURNING *",
        (kind, scope, name, content, position, kind, scope, name, kind, scope,
         None if enabled is None else int(enabled), kind, scope, name, author, reason, time.time(),
         kind, scope, name, *(() if based_on is None else (based_on,))))


class PersonaRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- personas --------------------------------------------------------------------------------

    async def list_personas(self) -> list[PersonaRow]:
        rows = await self.db.fetch_all("SELECT * FROM personas WHERE deleted_at IS NULL ORDER BY id")
        return [_persona(r) for r in rows]

    async def get_persona(self, name: str) -> PersonaRow | None:
        """The live persona called ``name`` in any case (Unicode's: "ZOË" is "Zoë", "STRASSE" is "Straße")."""
        row = await self._named(name, live_only=True)
        return None if row is None else _persona(row)

    async def _named(self, name: str, *, live_only: bool, tx: Tx | None = None,
                     key: Callable[[str], str] = name_key) -> Row | None:
        """The row called ``name`` under Unicode case folding (or, with ``key``, another folding; a live one before
        a deleted one). Folded here: SQL's lower() and NOCASE fold ASCII letters only, and a bot has few personas."""
        where = " WHERE deleted_at IS NULL" if live_only else ""
        wanted = key(name)
        sql = f"SELECT * FROM personas{where} ORDER BY deleted_at IS NULL DESC, id"
        rows = await (tx or self.db).fetch_all(sql)
        return next((r for r in rows if key(str(r["name"])) == wanted), None)

    async def _claim(self, tx: Tx, name: str, language: str, settings: Mapping[str, Any], source: str,
                     ts_config: str) -> tuple[Row | None, Row | None]:
        """Inside ``tx``: the new persona's row, or None and the row that holds the name (folded: "ZOË" and
        "Zoë" are one name). Names are claimed one after the other by every process: the unique index
        folds ASCII letters only, so two claims of "Zoë" and "ZOË" at once would both pass their check."""
        await serialise(self.db, tx, "persona-names")
        # live rows first; a look-alike ("Сora" with a Cyrillic С, "Ｃｏｒａ") is the name it looks like
        taken = await self._named(name, live_only=False, tx=tx, key=persona_key)
        if taken is not None:
            return None, taken
        return await tx.fetch_one(*_new_persona(name, language, settings, source, ts_config)), None

    async def create_persona(self, name: str, language: str, settings: Mapping[str, Any], source: str,
                             ts_config: str, *, revive: bool = True) -> PersonaRow | None:
        """A new persona (or, with ``revive``, one deleted earlier, brought back with these values and its
        soul and lore as they were); None if the name is taken (by a deleted one too, without ``revive``)."""
        name = unicodedata.normalize("NFC", name)  # one spelling of "Zoë" in the store, however typed
        async with self.db.transaction() as tx:
            row, taken = await self._claim(tx, name, language, settings, source, ts_config)
        if row is not None:
            return _persona(row)
        if not revive or taken is None or taken["deleted_at"] is None:
            return None
        revived = await self.db.write_one(
            "UPDATE personas SET deleted_at = NULL, language = ?, settings = ?, source = ?, ts_config = ?"
            " WHERE id = ? AND deleted_at IS NOT NULL RETURNING *",
            (language, json.dumps(dict(settings)), source, ts_config, int(taken["id"])))
        return None if revived is None else _persona(revived)

    async def import_persona(self, name: str, language: str, source: str, ts_config: str,
                             sections: Sequence[tuple[str, str]], lore: Sequence[NewLore], *, author: str,
                             reason: str, lore_author: str) -> PersonaRow | NameTaken:
        """A new persona with its soul sections (``(key, content)`` in order) and lore, all or nothing: a
        failure (or a process killed) half-way left a persona without its soul, whose name then blocked the
        import. If the name is taken (by a deleted persona too, made a moment ago by another process too):
        which persona holds it."""
        name = unicodedata.normalize("NFC", name)
        async with self.db.transaction() as tx:
            row, taken = await self._claim(tx, name, language, {}, source, ts_config)
            if row is None:
                assert taken is not None
                return NameTaken(str(taken["name"]), taken["deleted_at"] is not None)
            for position, (key, content) in enumerate(sections, start=1):
                await tx.fetch_one(*_next_version("soul", str(row["id"]), key, content, author, reason, position, None))
            for entry in lore:
                await tx.fetch_one(*_lore_insert(int(row["id"]), entry, "card", lore_author, time.time()))
        return _persona(row)

    async def update_persona(self, persona_id: int, language: str, settings: Mapping[str, Any],
                             ts_config: str, *, source: str | None = None) -> None:
        """Set a persona's language, settings and text-search configuration (and, given, where it comes from);
        a new configuration stems its stored words again (:func:`restem`)."""
        async with self.db.transaction() as tx:
            old = await tx.fetch_one("SELECT name, ts_config FROM personas WHERE id = ?", (persona_id,))
            await tx.execute("UPDATE personas SET language = ?, settings = ?, ts_config = ?,"
                             " source = coalesce(?, source) WHERE id = ?",
                             (language, json.dumps(dict(settings)), ts_config, source, persona_id))
            if old is not None and str(old[1]) != ts_config:
                await restem(tx, self.db.dialect, str(old[0]))

    async def delete_persona(self, persona_id: int) -> None:
        """Hide a persona (its soul's history and its users' memory stay; creating the name again revives it)."""
        await self.db.write("UPDATE personas SET deleted_at = ? WHERE id = ?", (time.time(), persona_id))

    # -- versioned texts -------------------------------------------------------------------------

    async def current(self, kind: TextKind, scope: str) -> list[TextVersion]:
        """The live version of every name of ``kind`` in ``scope`` (empty ones included), by position."""
        rows = await self.db.fetch_all(
            f"SELECT * FROM versioned_texts t WHERE kind = ? AND scope = ? AND {LATEST} ORDER BY position, name",
            (kind, scope))
        return [_text(r) for r in rows]

    async def _put_in_standard_order(self, scope: str, name: str, content: str, author: str, reason: str,
                                     enabled: bool | None, based_on: int | None) -> TextVersion | None:
        """A version of the standard soul section ``name``; a new one goes where :func:`in_standard_order` puts
        it, the sections from there on moved down one (gaps kept), all in one transaction, one at a time per
        soul. A section written first once went last: a persona made in chat with its backstory written before
        its identity read the backstory first, and nothing could move it. None when ``based_on`` is no longer
        the newest version (nothing changes then)."""
        try:
            async with self.db.transaction() as tx:
                await serialise(self.db, tx, f"soul-order:{scope}")
                rows = await tx.fetch_all(f"SELECT name, position FROM versioned_texts t WHERE kind = 'soul' AND"
                                          f" scope = ? AND {LATEST} ORDER BY position, name", (scope,))
                names, positions = [str(r[0]) for r in rows], [int(r[1]) for r in rows]
                slot = None
                if name not in names:
                    at = in_standard_order(names, name).index(name)
                    slot = positions[at] if at < len(names) else max(positions, default=0) + 1
                    await tx.execute("UPDATE versioned_texts SET position = position + 1 WHERE kind = 'soul'"
                                     " AND scope = ? AND position >= ?", (scope, slot))
                row = await tx.fetch_one(*_next_version("soul", scope, name, content, author, reason, slot, enabled,
                                                        based_on))
                if row is None:
                    raise _NotWritten
                return _text(row)
        except _NotWritten:
            return None

    async def order_souls(self, scope: str, order: Sequence[str]) -> bool:
        """Put the live soul sections named in ``order`` in that order, in the places they hold together (a
        section of another name keeps its place between them); one transaction, one at a time per soul. True
        when a section moved."""
        async with self.db.transaction() as tx:
            await serialise(self.db, tx, f"soul-order:{scope}")
            rows = await tx.fetch_all(f"SELECT name, position FROM versioned_texts t WHERE kind = 'soul' AND"
                                      f" scope = ? AND {LATEST} ORDER BY position, name", (scope,))
            held = [(str(r[0]), int(r[1])) for r in rows if str(r[0]) in order]
            wanted = sorted((name for name, _ in held), key=list(order).index)
            if [name for name, _ in held] == wanted:
                return False
            for name, (_, position) in zip(wanted, held, strict=True):
                await tx.execute("UPDATE versioned_texts SET position = ? WHERE kind = 'soul' AND scope = ? AND"
                                 " name = ?", (position, scope, name))
            return True

    async def current_all(self, kind: TextKind) -> list[TextVersion]:
        """The live versions of ``kind`` in every scope (one query for the whole cache)."""
        rows = await self.db.fetch_all(
            f"SELECT * FROM versioned_texts t WHERE kind = ? AND {LATEST} ORDER BY scope, position, name", (kind,))
        return [_text(r) for r in rows]

    async def history(self, kind: TextKind, scope: str, name: str | None = None) -> list[TextVersion]:
        """Every version, oldest first (of one name, or of all names in the scope)."""
        if name is None:
            rows = await self.db.fetch_all(
                "SELECT * FROM versioned_texts WHERE kind = ? AND scope = ? ORDER BY created_at, id", (kind, scope))
        else:
            rows = await self.db.fetch_all(
                "SELECT * FROM versioned_texts WHERE kind = ? AND scope = ? AND name = ? ORDER BY version",
                (kind, scope, name))
        return [_text(r) for r in rows]

    async def version(self, kind: TextKind, scope: str, name: str, version: int) -> TextVersion | None:
        row = await self.db.fetch_one(
            "SELECT * FROM versioned_texts WHERE kind = ? AND scope = ? AND name = ? AND version = ?",
            (kind, scope, name, version))
        return None if row is None else _text(row)

    async def revert(self, kind: TextKind, scope: str, name: str, number: int, *, author: str
                     ) -> tuple[TextVersion, bool] | None:
        """Bring back version ``number``'s text as the next version: (that version, True); None when there is no
        such version. The live version's on/off state stays (a revert to a text saved while a rule was off
        switched a live rule off, and one to an older text switched a rule an admin had switched off back on,
        neither said). When the live version holds the text already, (the live version, False) and nothing is
        written (a version each time changed nothing, and buried the history)."""
        old = await self.version(kind, scope, name, number)
        if old is None:
            return None
        live = next((t for t in await self.current(kind, scope) if t.name == name), None)  # (not every version)
        if live is not None and live.content == old.content:
            return live, False
        return await self.put(kind, scope, name, old.content, author=author,
                              reason=f"reverted to version {number}"), True

    async def put(self, kind: TextKind, scope: str, name: str, content: str, *, author: str, reason: str = "",
                  position: int | None = None, enabled: bool | None = None) -> TextVersion:
        """Add the next version of a text (position and enabled carried over from the live one unless
        given; a new name goes last, but a standard soul section where :func:`in_standard_order` puts it). Safe
        when several processes write the same text at once."""
        if position is None and kind == "soul" and name in SOUL_SECTIONS:
            placed = await self._put_in_standard_order(scope, name, content, author, reason, enabled, None)
            assert placed is not None  # (without based_on, a version is always written)
            return await self._trimmed(placed)
        for attempt in range(VERSION_ATTEMPTS):
            try:
                row = await self.db.write_one(*_next_version(kind, scope, name, content, author, reason, position,
                                                             enabled))
            except Exception as exc:
                if is_conflict(exc) and attempt < VERSION_ATTEMPTS - 1:
                    continue
                raise
            assert row is not None  # an aggregate query always yields one row
            return await self._trimmed(_text(row))
        raise AssertionError("unreachable")

    async def put_based_on(self, based_on: int, kind: TextKind, scope: str, name: str, content: str, *,
                           author: str, reason: str = "", enabled: bool | None = None) -> TextVersion | None:
        """Like :meth:`put`, but only while ``based_on`` is still the newest version (0: the text has none):
        one statement, so of two edits based on the same version (two admins, two tabs, two processes) one
        lands and the other gets None instead of silently replacing it."""
        if kind == "soul" and name in SOUL_SECTIONS:
            try:
                placed = await self._put_in_standard_order(scope, name, content, author, reason, enabled, based_on)
            except Exception as exc:
                if is_conflict(exc):
                    return None
                raise
            return None if placed is None else await self._trimmed(placed)
        try:
            row = await self.db.write_one(*_next_version(kind, scope, name, content, author, reason, None,
                                                         enabled, based_on))
        except Exception as exc:
            if is_conflict(exc):  # another writer took the same next version a moment earlier
                return None
            raise
        return None if row is None else await self._trimmed(_text(row))

    async def _trimmed(self, newest: TextVersion) -> TextVersion:
        """``newest``, after deleting the versions of its text older than the newest :data:`KEEP_VERSIONS` (none
        at all while it has fewer). All of them, not one: a process stopped between a save and its trim leaves
        the excess to the next save, or to :meth:`prune_versions`."""
        if newest.version > KEEP_VERSIONS:
            await self.db.write(
                "DELETE FROM versioned_texts WHERE kind = ? AND scope = ? AND name = ? AND version <= ?",
                (newest.kind, newest.scope, newest.name, newest.version - KEEP_VERSIONS))
        return newest

    async def prune_versions(self) -> int:
        """Delete the versions of every text older than its newest :data:`KEEP_VERSIONS` (the periodic upkeep:
        texts that grew before versions were pruned, or whose save's trim did not run); how many went."""
        return len(await self.db.write(f"DELETE FROM versioned_texts WHERE {TOO_OLD} RETURNING id", (KEEP_VERSIONS,)))


class _NotWritten(Exception):
    """The version was not written (another edit landed first): the transaction's renumbering goes too."""


def in_standard_order(names: Sequence[str], key: str) -> list[str]:
    """``names`` (a soul's sections, in their order) with the standard section ``key`` put where the standard
    order has it: before the first standard section that comes after it, else after the last that comes
    before it (first when there is none); the others keep their places."""
    rank = SOUL_SECTIONS.index(key)
    ranks = [SOUL_SECTIONS.index(n) if n in SOUL_SECTIONS else None for n in names]
    later = [i for i, r in enumerate(ranks) if r is not None and r > rank]
    earlier = [i for i, r in enumerate(ranks) if r is not None and r < rank]
    at = later[0] if later else (earlier[-1] + 1 if earlier else 0)
    return [*names[:at], key, *names[at:]]


@dataclass(frozen=True, slots=True)
class LoreEntry:
    id: int
    persona_id: int
    name: str
    content: str
    keys: tuple[str, ...]
    secondary_keys: tuple[str, ...]
    always_on: bool
    priority: int
    enabled: bool
    source: str
    created_by: str
    updated_at: datetime


def _keys(raw: object) -> tuple[str, ...]:
    try:
        value = json.loads(str(raw))
    except ValueError:
        return ()
    return tuple(str(k) for k in value if str(k).strip()) if isinstance(value, list) else ()


def _lore(row: Row) -> LoreEntry:
    return LoreEntry(int(row["id"]), int(row["persona_id"]), str(row["name"]), str(row["content"]),
                     _keys(row["keys"]), _keys(row["secondary_keys"]), bool(row["always_on"]), int(row["priority"]),
                     bool(row["enabled"]), str(row["source"]), str(row["created_by"]), dt(row["updated_at"]))


@dataclass(frozen=True, slots=True)
class NewLore:
    content: str
    keys: tuple[str, ...] = ()
    secondary_keys: tuple[str, ...] = ()
    always_on: bool = False
    priority: int = 0
    enabled: bool = True
    name: str = ""


def _lore_insert(persona_id: int, e: NewLore, source: str, author: str, now: float) -> tuple[str, tuple[Any, ...]]:
    """The INSERT of one lore entry (RETURNING its id), with its parameters."""
    return (
        "INSERT INTO lore_entries (persona_id, name, content, keys, secondary_keys, always_on, priority,"
        " enabled, source, created_by, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " RETURNING id",
        (persona_id, e.name, e.content, json.dumps(list(e.keys)), json.dumps(list(e.secondary_keys)),
         int(e.always_on), e.priority, int(e.enabled), source, author, now, now))


class LoreRepository:
    """Lore entries of personas: plain rows (no versions), changed only by the bot's admins."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def add(self, persona_id: int, entries: Sequence[NewLore], *, source: str, author: str) -> list[int]:
        """Add entries in one transaction (a card's whole book, or one from chat); returns their ids."""
        now = time.time()
        ids: list[int] = []
        async with self.db.transaction() as tx:
            for e in entries:
                row = await tx.fetch_one(*_lore_insert(persona_id, e, source, author, now))
                assert row is not None
                ids.append(int(row[0]))
        return ids

    async def add_capped(self, persona_id: int, entry: NewLore, *, source: str, author: str, cap: int) -> int | None:
        """Add one entry while the persona has fewer than ``cap``: its id, or None at the cap. Two adds at
        once (two admins, two processes) are counted one after the other."""
        async with self.db.transaction() as tx:
            await serialise(self.db, tx, f"lore-cap:{persona_id}")
            held = await tx.fetch_one("SELECT count(*) FROM lore_entries WHERE persona_id = ?", (persona_id,))
            if held is not None and int(held[0]) >= cap:
                return None
            row = await tx.fetch_one(*_lore_insert(persona_id, entry, source, author, time.time()))
        assert row is not None
        return int(row[0])

    async def remove(self, persona_id: int, entry_id: int) -> bool:
        """Delete one entry; False when the persona has no such entry."""
        return await self.db.write_one("DELETE FROM lore_entries WHERE persona_id = ? AND id = ? RETURNING id",
                                       (persona_id, entry_id)) is not None

    async def get(self, persona_id: int, entry_id: int) -> LoreEntry | None:
        row = await self.db.fetch_one("SELECT * FROM lore_entries WHERE persona_id = ? AND id = ?",
                                      (persona_id, entry_id))
        return None if row is None else _lore(row)

    async def entries(self, persona_id: int) -> list[LoreEntry]:
        rows = await self.db.fetch_all("SELECT * FROM lore_entries WHERE persona_id = ? ORDER BY id", (persona_id,))
        return [_lore(r) for r in rows]

    async def enabled_all(self) -> list[LoreEntry]:
        rows = await self.db.fetch_all("SELECT * FROM lore_entries WHERE enabled = 1 ORDER BY persona_id, id")
        return [_lore(r) for r in rows]

    async def stamp(self) -> tuple[int, float]:
        """Changes since a cache was filled show here (count and newest change)."""
        row = await self.db.fetch_one("SELECT count(*), coalesce(max(updated_at), 0) FROM lore_entries")
        return (int(row[0]), float(row[1])) if row else (0, 0.0)

    async def update(self, persona_id: int, entry_id: int, *, content: str | None = None,
                     keys: Sequence[str] | None = None, secondary_keys: Sequence[str] | None = None,
                     enabled: bool | None = None, always_on: bool | None = None, priority: int | None = None) -> bool:
        """Change the given fields of one entry (None: leave as is)."""
        def number(flag: bool | None) -> int | None:
            return None if flag is None else int(flag)

        def listed(keys: Sequence[str] | None) -> str | None:
            return None if keys is None else json.dumps(list(keys))

        row = await self.db.write_one(
            "UPDATE lore_entries SET content = coalesce(?, content), keys = coalesce(?, keys),"
            " secondary_keys = coalesce(?, secondary_keys),"
            " enabled = coalesce(CAST(? AS INTEGER), enabled), always_on = coalesce(CAST(? AS INTEGER), always_on),"
            " priority = coalesce(CAST(? AS INTEGER), priority), updated_at = ? WHERE persona_id = ? AND id = ?"
            " RETURNING id",
            (content, listed(keys), listed(secondary_keys), number(enabled), number(always_on), priority,
             time.time(), persona_id, entry_id))
        return row is not None
