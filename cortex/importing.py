"""``!memory import``: an export of this or another cortex-bot taken back, for its own user only.

What is already here is skipped (items by text and time, messages by channel, role, text and time; a
file only gets a new version when its text differs). Only personas this bot has are filled. Messages
come back from direct-message channels only (a group channel's history belongs to everyone in it), and
only into the direct-message channel the import is sent in: an archive names channels, and a channel
it names may be someone else's, so it never decides where a message goes. Times must be real ones
(no NaN, nothing before 1970 or in the future). Update runs and summaries are not imported (summaries
are written anew from the messages).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from bot.persona import PersonaSource
from bot.storage.base import Channel, User
from bot.storage.core import Storage
from bot.text import plural
from cortex.export import ArchiveError, ImportReport
from cortex.files import CortexFiles, FileError
from cortex.memory.guard import check_memory_text
from cortex.memory.store import CATEGORIES, SCOPES
from cortex.store import FILENAMES, CortexStore

REASON = "imported from an export"
LATEST_EXPIRY = 253_402_300_799.0  # 9999-12-31 23:59:59 UTC, the last second a date can show
CLOCK_SKEW = 86_400.0  # an export from a bot whose clock ran a day ahead still comes in
MISSING = object()


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _time(value: Any, *, future: bool = False) -> float | None:
    """A usable Unix time: finite, not before 1970 and (unless ``future``, as expiry may be) not ahead of
    now. Anything else would break every later view of the row (dates past year 9999 cannot be shown)."""
    number = _number(value)
    latest = LATEST_EXPIRY if future else time.time() + CLOCK_SKEW
    return number if number is not None and math.isfinite(number) and 0 <= number <= latest else None


def _optional_time(item: Mapping[str, Any], key: str, *, future: bool = False) -> float | None | object:
    """``None`` when the archive leaves the time out, the time when usable, else ``MISSING``."""
    value = item.get(key)
    if value is None:
        return None
    checked = _time(value, future=future)
    return MISSING if checked is None else checked


def _json_as(value: Any, kind: type[list[Any]] | type[dict[str, Any]]) -> Any:
    """``value`` as a ``kind`` (list or dict): itself, or the JSON text of one (as data.json writes them);
    empty when missing; None when it is anything else (every later view of the item would fail on it)."""
    if value is None or value == "":
        return kind()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, kind) else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def item_fields(item: Mapping[str, Any], max_chars: int) -> dict[str, Any] | None:
    """The columns of one exported item as they may be stored, or None when it is not usable."""
    content = str(item.get("content") or "").strip()
    created = _time(item.get("created_at"))
    importance = item.get("importance")
    if not content or len(content) > max_chars or created is None or item.get("category") not in CATEGORIES:
        return None
    if not isinstance(importance, int) or isinstance(importance, bool) or not 1 <= importance <= 10:
        return None
    times = {key: _optional_time(item, key, future=key == "expires_at")
             for key in ("expires_at", "updated_at", "archived_at")}
    if MISSING in times.values():
        return None
    tags, metadata = _json_as(item.get("tags"), list), _json_as(item.get("metadata"), dict)
    if tags is None or metadata is None or not all(isinstance(t, str) for t in tags):
        return None
    return {
        "category": item["category"], "key": str(item.get("key") or "")[:200], "content": content,
        "importance": importance, "pinned": int(bool(item.get("pinned"))),
        "expires_at": times["expires_at"],
        "tags": json.dumps(tags),
        "source": str(item.get("source") or "user") if item.get("source") in ("user", "model", "system") else "user",
        "source_ref": str(item.get("source_ref") or "")[:200],
        "metadata": json.dumps(metadata),
        "created_at": created, "updated_at": times["updated_at"] or created,
        "access_count": 0, "archived_at": times["archived_at"],
        "archive_reason": str(item.get("archive_reason") or "")[:200],
        "scope": item.get("scope") if item.get("scope") in SCOPES else "private",
    }


class Importer:
    def __init__(self, store: CortexStore, files: CortexFiles, personas: PersonaSource, max_item_chars: int) -> None:
        self.store = store
        self.files = files
        self.personas = personas
        self.max_item_chars = max_item_chars
        self.known = {name.casefold(): name for name in personas.names()}

    async def run(self, user: User, data: Mapping[str, Any], dm_channel: Channel | None) -> ImportReport:
        """Import ``data`` for ``user``; direct messages go into ``dm_channel`` (the user's direct-message
        channel the import was sent in), or are left out when it was sent elsewhere."""
        owner = data.get("user", {}).get("key") if isinstance(data.get("user"), dict) else None
        if owner != user.key:
            raise ArchiveError(f"this export belongs to {owner!r}, not to you ({user.key}): only your own data "
                               "can be imported")
        report = ImportReport()
        for persona in _list(data.get("personas")):
            name = self.known.get(str(persona.get("persona", "")).casefold()) if isinstance(persona, dict) else None
            if name is None:
                report.left_out.append(f"persona {persona.get('persona')!r} does not exist here"
                                       if isinstance(persona, dict) else "a damaged persona entry")
                continue
            await self._persona(user, name, persona, report)
        await _Messages(self.store.storage, user, dm_channel, self.known, report).run(_list(data.get("messages")))
        return report

    async def _persona(self, user: User, persona: str, data: Mapping[str, Any], report: ImportReport) -> None:
        _, pair = await self.store.pair_for(user.key, user.display_name, persona)
        latest: dict[str, str] = {}
        for version in _list(data.get("file_versions")):
            if isinstance(version, dict) and version.get("file") in FILENAMES:
                latest[str(version["file"])] = str(version.get("content") or "")
        for filename, content in latest.items():
            if not content.strip() or len(content) > self.files.file_max_chars:
                report.left_out.append(f"{persona}'s {filename} (empty or too long)")
                continue
            try:
                written = await self.files.write(pair, filename, content, "user", REASON)
            except FileError as exc:  # e.g. the guard refused it: the rest still comes in
                report.left_out.append(f"{persona}'s {filename} ({exc})")
                continue
            if written is None:
                report.skipped += 1
            else:
                report.files += 1
        await self._items(pair.id, _list(data.get("memory_items")), report)

    async def _items(self, pair_id: int, items: list[Any], report: ImportReport) -> None:
        repo = self.store.storage.export
        new_ids: dict[int, int] = {}
        for item in items:
            fields = item_fields(item, self.max_item_chars) if isinstance(item, dict) else None
            if fields is None:
                report.left_out.append("an unusable memory item")
            elif not check_memory_text(fields["content"]).ok:
                report.left_out.append("an item that reads like instructions to the bot")
            elif (here := await repo.item_like(pair_id, fields["content"], fields["created_at"])) is not None:
                report.skipped += 1  # here already (an import run before): its corrections still link to it
                if _is_id(item.get("id")):
                    new_ids[item["id"]] = here
            else:
                new_id = await repo.import_item(pair_id, fields)
                if _is_id(item.get("id")):
                    new_ids[item["id"]] = new_id
                report.items += 1
        for item in items:  # corrections between imported items keep their link
            if isinstance(item, dict) and _is_id(item.get("superseded_by")) and _is_id(item.get("id")) \
                    and item["superseded_by"] in new_ids and item["id"] in new_ids:
                await repo.link_correction(pair_id, new_ids[item["id"]], new_ids[item["superseded_by"]])


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Messages:
    """The archive's direct messages, taken into the user's direct-message channel here."""

    def __init__(self, storage: Storage, user: User, channel: Channel | None, personas: Mapping[str, str],
                 report: ImportReport) -> None:
        self.storage, self.user, self.channel, self.personas, self.report = storage, user, channel, personas, report
        self.left_out: Counter[str] = Counter()

    async def run(self, messages: list[Any]) -> None:
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or not isinstance(
                    m.get("text"), str) or not m["text"]:
                continue
            await self._one(m)
        notes = {"group": "{n} from group channels (their history is everyone's)",
                 "elsewhere": "{n} from direct messages: send the import in a direct message with me to bring them "
                              "back",
                 "persona": "{n} with personas this bot does not have",
                 "time": "{n} without a usable time"}
        for reason, count in self.left_out.items():
            self.report.left_out.append(notes[reason].format(n=plural(count, "message")))

    async def _one(self, m: Mapping[str, Any]) -> None:
        persona = self.personas.get(str(m.get("persona") or "").casefold())
        created = _time(m.get("created_at"))
        if not m.get("is_dm"):
            self.left_out["group"] += 1
        elif self.channel is None:
            self.left_out["elsewhere"] += 1
        elif persona is None:
            self.left_out["persona"] += 1
        elif created is None:
            self.left_out["time"] += 1
        elif await self.storage.export.has_message(self.channel.id, m["role"], m["text"], created):
            self.report.skipped += 1
        else:
            await self.storage.add_message(self.channel.id, self.user.id, persona, m["role"],
                                           str(m.get("author_name") or ""), m["text"], 0,
                                           datetime.fromtimestamp(created, tz=UTC))
            self.report.messages += 1
