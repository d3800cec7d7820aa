"""``!memory import``: an export of this or another cortex-bot taken back, for its own user only.

What is already here is skipped (items by text and time, messages by channel, role, text and time; a
file only gets a new version when its text differs). Only personas this bot has are filled. Messages
come back for direct-message channels only: a group channel's history belongs to everyone in it.
Update runs and summaries are not imported (summaries are written anew from the messages).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from bot.persona import PersonaSource
from bot.storage.base import User
from cortex.export import ArchiveError, ImportReport
from cortex.files import CortexFiles
from cortex.memory.guard import check_memory_text
from cortex.memory.store import CATEGORIES, SCOPES
from cortex.store import FILENAMES, CortexStore

REASON = "imported from an export"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def item_fields(item: Mapping[str, Any], max_chars: int) -> dict[str, Any] | None:
    """The columns of one exported item as they may be stored, or None when it is not usable."""
    content = str(item.get("content") or "").strip()
    created = _number(item.get("created_at"))
    importance = item.get("importance")
    if not content or len(content) > max_chars or created is None or item.get("category") not in CATEGORIES:
        return None
    if not isinstance(importance, int) or not 1 <= importance <= 10:
        return None
    tags, metadata = item.get("tags"), item.get("metadata")
    return {
        "category": item["category"], "key": str(item.get("key") or "")[:200], "content": content,
        "importance": importance, "pinned": int(bool(item.get("pinned"))),
        "expires_at": _number(item.get("expires_at")),
        "tags": tags if isinstance(tags, str) else json.dumps(tags or []),
        "source": str(item.get("source") or "user") if item.get("source") in ("user", "model", "system") else "user",
        "source_ref": str(item.get("source_ref") or "")[:200],
        "metadata": metadata if isinstance(metadata, str) else json.dumps(metadata or {}),
        "created_at": created, "updated_at": _number(item.get("updated_at")) or created,
        "access_count": 0, "archived_at": _number(item.get("archived_at")),
        "archive_reason": str(item.get("archive_reason") or "")[:200],
        "scope": item.get("scope") if item.get("scope") in SCOPES else "private",
    }


class Importer:
    def __init__(self, store: CortexStore, files: CortexFiles, personas: PersonaSource, max_item_chars: int) -> None:
        self.store = store
        self.files = files
        self.personas = personas
        self.max_item_chars = max_item_chars

    async def run(self, user: User, data: Mapping[str, Any]) -> ImportReport:
        owner = data.get("user", {}).get("key") if isinstance(data.get("user"), dict) else None
        if owner != user.key:
            raise ArchiveError(f"this export belongs to {owner!r}, not to you ({user.key}): only your own data "
                               "can be imported")
        report = ImportReport()
        known = {name.casefold(): name for name in self.personas.names()}
        for persona in data.get("personas") or []:
            name = known.get(str(persona.get("persona", "")).casefold()) if isinstance(persona, dict) else None
            if name is None:
                report.left_out.append(f"persona {persona.get('persona')!r} does not exist here"
                                       if isinstance(persona, dict) else "a damaged persona entry")
                continue
            await self._persona(user, name, persona, report)
        await self._messages(user, data.get("messages") or [], report)
        return report

    async def _persona(self, user: User, persona: str, data: Mapping[str, Any], report: ImportReport) -> None:
        _, pair = await self.store.pair_for(user.key, user.display_name, persona)
        latest: dict[str, str] = {}
        for version in data.get("file_versions") or []:
            if isinstance(version, dict) and version.get("file") in FILENAMES:
                latest[str(version["file"])] = str(version.get("content") or "")
        for filename, content in latest.items():
            if not content.strip() or len(content) > self.files.file_max_chars:
                report.left_out.append(f"{persona}'s {filename} (empty or too long)")
            elif await self.files.write(pair, filename, content, "user", REASON) is None:
                report.skipped += 1
            else:
                report.files += 1
        await self._items(pair.id, data.get("memory_items") or [], report)

    async def _items(self, pair_id: int, items: list[Any], report: ImportReport) -> None:
        repo = self.store.storage.export
        new_ids: dict[int, int] = {}
        for item in items:
            fields = item_fields(item, self.max_item_chars) if isinstance(item, dict) else None
            if fields is None:
                report.left_out.append("an unusable memory item")
            elif not check_memory_text(fields["content"]).ok:
                report.left_out.append("an item that reads like instructions to the bot")
            elif await repo.has_item(pair_id, fields["content"], fields["created_at"]):
                report.skipped += 1
            else:
                new_ids[int(item.get("id") or 0)] = await repo.import_item(pair_id, fields)
                report.items += 1
        for item in items:  # corrections between imported items keep their link
            if isinstance(item, dict) and item.get("superseded_by") in new_ids and item.get("id") in new_ids:
                await repo.link_correction(pair_id, new_ids[item["id"]], new_ids[item["superseded_by"]])

    async def _messages(self, user: User, messages: list[Any], report: ImportReport) -> None:
        storage = self.store.storage
        groups = 0
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or not m.get("text"):
                continue
            if not m.get("is_dm"):
                groups += 1
                continue
            channel = await storage.upsert_channel(str(m.get("channel")), str(m.get("channel_name") or ""), True)
            created = _number(m.get("created_at")) or 0.0
            if await storage.export.has_message(channel.id, m["role"], str(m["text"]), created):
                report.skipped += 1
                continue
            await storage.add_message(channel.id, user.id, str(m.get("persona") or ""), m["role"],
                                      str(m.get("author_name") or ""), str(m["text"]), 0,
                                      datetime.fromtimestamp(created, tz=UTC))
            report.messages += 1
        if groups:
            report.left_out.append(f"{groups:,} messages from group channels (their history is everyone's)")
