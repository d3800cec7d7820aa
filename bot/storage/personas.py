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
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from bot.storage.engine import Database, Row, is_conflict
from bot.storage.rows import dt

TextKind = Literal["soul", "guidelines", "rule"]
BOT_WIDE = "*"
VERSION_ATTEMPTS = 5  # two processes writing the same text at once: the loser takes the next number


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


class PersonaRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- personas --------------------------------------------------------------------------------

    async def list_personas(self) -> list[PersonaRow]:
        rows = await self.db.fetch_all("SELECT * FROM personas WHERE deleted_at IS NULL ORDER BY id")
        return [_persona(r) for r in rows]

    async def get_persona(self, name: str) -> PersonaRow | None:
        row = await self.db.fetch_one(
            "SELECT * FROM personas WHERE lower(name) = lower(?) AND deleted_at IS NULL", (name,))
        return None if row is None else _persona(row)

    async def create_persona(self, name: str, language: str, settings: Mapping[str, Any], source: str,
                             ts_config: str) -> PersonaRow | None:
        """A new persona (or one deleted earlier, brought back with these values); None if the name is taken."""
        now = time.time()
        row = await self.db.write_one(
            "INSERT INTO personas (name, created_at, ts_config, language, settings, source) VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING RETURNING *",
            (name, now, ts_config, language, json.dumps(dict(settings)), source))
        if row is not None:
            return _persona(row)
        revived = await self.db.write_one(
            "UPDATE personas SET deleted_at = NULL, language = ?, settings = ?, source = ?, ts_config = ?"
            " WHERE lower(name) = lower(?) AND deleted_at IS NOT NULL RETURNING *",
            (language, json.dumps(dict(settings)), source, ts_config, name))
        return None if revived is None else _persona(revived)

    async def update_persona(self, persona_id: int, language: str, settings: Mapping[str, Any],
                             ts_config: str) -> None:
        await self.db.write("UPDATE personas SET language = ?, settings = ?, ts_config = ? WHERE id = ?",
                            (language, json.dumps(dict(settings)), ts_config, persona_id))

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

    async def put(self, kind: TextKind, scope: str, name: str, content: str, *, author: str, reason: str = "",
                  position: int | None = None, enabled: bool | None = None) -> TextVersion:
        """Add the next version of a text (position and enabled carried over from the live one unless
        given; a new name goes last). Safe when several processes write the same text at once."""
        for attempt in range(VERSION_ATTEMPTS):
            try:
                live = f"FROM versioned_texts t WHERE kind = ? AND scope = ? AND name = ? AND {LATEST}"
                row = await self.db.write_one(
                    "INSERT INTO versioned_texts (kind, scope, name, version, content, position, enabled, author,"
                    " reason, created_at)"
                    " SELECT ?, ?, ?, coalesce(max(version), 0) + 1, ?,"
                    f" coalesce(CAST(? AS INTEGER), (SELECT position {live}),"
                    "   (SELECT coalesce(max(position), 0) + 1 FROM versioned_texts WHERE kind = ? AND scope = ?)),"
                    f" coalesce(CAST(? AS INTEGER), (SELECT enabled {live}), 1), ?, ?, CAST(? AS DOUBLE PRECISION)"
                    " FROM versioned_texts WHERE kind = ? AND scope = ? AND name = ? RETURNING *",
                    (kind, scope, name, content, position, kind, scope, name, kind, scope,
                     None if enabled is None else int(enabled), kind, scope, name, author, reason, time.time(),
                     kind, scope, name))
            except Exception as exc:
                if is_conflict(exc) and attempt < VERSION_ATTEMPTS - 1:
                    continue
                raise
            assert row is not None  # an aggregate query always yields one row
            return _text(row)
        raise AssertionError("unreachable")
