"""``!memory import``: an export of this or another cortex-bot taken back, for its own user only.

What is already here is skipped (items by text and time, messages by channel, role, text and time; a
file only gets a new version when its text differs). Only personas this bot has are filled. Messages
come back from direct-message channels only (a group channel's history belongs to everyone in it), and
only into the direct-message channel the import is sent in: an archive names channels, and a channel
it names may be someone else's, so it never decides where a message goes. Nor do the messages of a
``!memory pause`` that was running when the export was made (its ``paused``): the resume deletes them, and
an import must not make them permanent. Times must be real ones
(no NaN, nothing before 1970 or in the future). Update runs and summaries are not imported (summaries
are written anew from the messages).

An archive can be edited by hand, so it is read as untrusted input, and read whole before anything is
written: every entry is checked and cleaned first (sizes as the chat enforces them, text PostgreSQL and
UTF-8 can store, the guard against instruction-like text, tags and metadata of a sane size), and only
then are the usable ones written. A bad value leaves that entry out (the report says why); it never stops
an import halfway. Writing again after an interruption skips what came in already.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from bot.conversation import MAX_REPLY_CHARS
from bot.persona import PersonaSource
from bot.storage.base import Channel, User
from bot.storage.core import Storage
from bot.storage.engine import is_missing_reference
from bot.text import plural, storable, storable_json
from cortex.export import ArchiveError, ImportReport, during_pause, loads_archive_json, named, paused_since
from cortex.files import CortexFiles, FileError
from cortex.memory.guard import check_memory_text
from cortex.memory.store import CATEGORIES, MAX_KEY_CHARS, PAIR_ITEMS, SCOPES
from cortex.memory.tools import MAX_TAG_CHARS
from cortex.store import FILENAMES, CortexStore

REASON = "imported from an export"
LATEST_EXPIRY = 253_402_300_799.0  # 9999-12-31 23:59:59 UTC, the last second a date can show
CLOCK_SKEW = 86_400.0  # an export from a bot whose clock ran a day ahead still comes in (items)
MAX_TAGS = 10  # as the remember tool keeps them
MAX_METADATA_CHARS = 4_000  # an item's metadata as JSON (every read of the item parses it)
# Tags or metadata written as a JSON text: longer than this is over their caps whatever it holds. (A string of
# 32 MB of long numbers zips to a few KB; json.loads holds Python's lock, and so the event loop, while it reads.)
MAX_JSON_TEXT_CHARS = 4 * MAX_METADATA_CHARS
MAX_NAME_CHARS = 100  # a message's author name
# What one import brings at most: a small archive can hold a lot (40,000 items zip to 120 kB), and what it brings
# is checked, stored and embedded for minutes. More comes in with another import, up to PAIR_ITEMS per persona.
IMPORT_ITEMS = 20_000  # memory items per persona
IMPORT_MESSAGES = 100_000  # direct messages
MISSING = object()
Role = Literal["user", "assistant"]


@dataclass(frozen=True, slots=True)
class ImportLimits:
    item_chars: int  # [memory] max_item_chars
    message_chars: int  # [bot] max_message_chars: a user's message, as the chat takes it
    tokens: Callable[[str], int]  # a message's tokens as the chat counts them (the history window's budget)
    reply_chars: int = MAX_REPLY_CHARS  # a reply, as the bot stores its own
    items: int = field(default_factory=lambda: IMPORT_ITEMS)
    messages: int = field(default_factory=lambda: IMPORT_MESSAGES)
    pair_items: int = field(default_factory=lambda: PAIR_ITEMS)


def _number(value: Any) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None


def _time(value: Any, *, latest: float | None = None) -> float | None:
    """A usable Unix time: finite, not before 1970 and not after ``latest`` (default: now, give or take
    ``CLOCK_SKEW``). Anything else would break every later view of the row (dates past year 9999 cannot
    be shown)."""
    number = _number(value)
    latest = time.time() + CLOCK_SKEW if latest is None else latest
    return number if number is not None and math.isfinite(number) and 0 <= number <= latest else None


def _optional_time(item: Mapping[str, Any], key: str, *, latest: float | None = None) -> float | None | object:
    """``None`` when the archive leaves the time out, the time when usable, else ``MISSING``."""
    value = item.get(key)
    if value is None:
        return None
    checked = _time(value, latest=latest)
    return MISSING if checked is None else checked


def _json_as(value: Any, kind: type[list[Any]] | type[dict[str, Any]]) -> Any:
    """``value`` as a ``kind`` (list or dict): itself, or the JSON text of one (as data.json writes them);
    empty when missing; None when it is anything else (every later view of the item would fail on it)."""
    if value is None or value == "":
        return kind()
    if isinstance(value, str):
        if len(value) > MAX_JSON_TEXT_CHARS:  # (far over what an item keeps: parsed, it held the event loop)
            return None
        try:
            value = loads_archive_json(value)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, kind) else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: Any, limit: int) -> str:
    """An optional text field; one of another type (a number, a list) counts as missing, never as its repr."""
    return storable(value)[:limit] if isinstance(value, str) else ""


def _tags_and_metadata(item: Mapping[str, Any]) -> tuple[str, str] | None:
    """The item's tags and metadata as stored (JSON), or None when they are damaged or oversized."""
    tags, metadata = _json_as(item.get("tags"), list), _json_as(item.get("metadata"), dict)
    if tags is None or metadata is None or len(tags) > MAX_TAGS \
            or not all(isinstance(t, str) and len(t) <= MAX_TAG_CHARS for t in tags):
        return None
    try:
        metadata_json = json.dumps(storable_json(metadata), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):  # e.g. a float too large, nesting too deep
        return None
    if len(metadata_json) > MAX_METADATA_CHARS:
        return None
    return json.dumps([storable(t) for t in tags], ensure_ascii=False), metadata_json


def item_fields(item: Mapping[str, Any], max_chars: int) -> dict[str, Any] | None:
    """The columns of one exported item as they may be stored, or None when it is not usable."""
    content = storable(item["content"]).strip() if isinstance(item.get("content"), str) else ""
    created = _time(item.get("created_at"))
    importance = item.get("importance")
    if not content or len(content) > max_chars or created is None or item.get("category") not in CATEGORIES:
        return None
    if not isinstance(importance, int) or isinstance(importance, bool) or not 1 <= importance <= 10:
        return None
    times = {key: _optional_time(item, key, latest=LATEST_EXPIRY if key == "expires_at" else None)
             for key in ("expires_at", "updated_at", "archived_at", "last_accessed")}
    uses = item.get("access_count")  # how often it was used: the upkeep archives items never used
    uses = min(uses, 1_000_000) if isinstance(uses, int) and not isinstance(uses, bool) and uses > 0 else 0
    extras = _tags_and_metadata(item)
    if MISSING in times.values() or extras is None:
        return None
    return {
        "category": item["category"], "key": _text(item.get("key"), MAX_KEY_CHARS), "content": content,
        "importance": importance, "pinned": int(bool(item.get("pinned"))),
        "expires_at": times["expires_at"],
        "tags": extras[0],
        "source": str(item["source"]) if item.get("source") in ("user", "model", "system") else "user",
        "source_ref": _text(item.get("source_ref"), 200),
        "metadata": extras[1],
        "created_at": created, "updated_at": times["updated_at"] or created,
        "access_count": uses,
        "last_accessed": times["last_accessed"], "archived_at": times["archived_at"],
        "archive_reason": _text(item.get("archive_reason"), 200),
        "scope": item.get("scope") if item.get("scope") in SCOPES else "private",
    }


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class _PersonaPlan:
    """One persona's part of the archive, checked: what may be written."""

    name: str
    files: dict[str, str] = field(default_factory=dict)
    versions: dict[str, set[str]] = field(default_factory=dict)  # every text of each file the archive holds
    items: list[tuple[int | None, dict[str, Any]]] = field(default_factory=list)  # (id in the archive, columns)
    corrections: list[tuple[int, int]] = field(default_factory=list)  # (archive id, archive id of its correction)


class Importer:
    def __init__(self, store: CortexStore, files: CortexFiles, personas: PersonaSource, limits: ImportLimits) -> None:
        self.store = store
        self.files = files
        self.personas = personas
        self.limits = limits
        self.known = {name.casefold(): name for name in personas.names()}

    async def run(self, user: User, data: Mapping[str, Any], dm_channel: Channel | None) -> ImportReport:
        """Import ``data`` for ``user``; direct messages go into ``dm_channel`` (the user's direct-message
        channel the import was sent in), or are left out when it was sent elsewhere. Everything is checked
        before the first write."""
        owner = data.get("user", {}).get("key") if isinstance(data.get("user"), dict) else None
        if owner != user.key:
            raise ArchiveError(f"this export belongs to {named(owner)}, not to you ({user.key}): only your own data "
                               "can be imported")
        report = ImportReport()
        messages = _Messages(self.store.storage, user, dm_channel, self.known, self.limits, report)
        # Checking every entry (the poisoning guard's patterns on each) takes seconds for a large archive: off
        # the event loop, so the bot goes on answering meanwhile.
        plans = await asyncio.to_thread(self._plan, data, messages, report)
        try:
            for plan in plans:
                await self._persona(user, plan, report)
            await messages.write()
        except Exception as exc:
            # A forget-me while this ran deleted what came in so far: nothing may be written for them after it
            # (every write names their row, which is gone: a foreign key fails).
            if is_missing_reference(exc) or getattr(await self.store.storage.get_user(user.key), "id", None) != user.id:
                raise ArchiveError("you asked to be forgotten while the import ran: nothing of it was kept (send "
                                   "it again to bring it back)") from None
            raise
        return report

    def _plan(self, data: Mapping[str, Any], messages: _Messages, report: ImportReport) -> list[_PersonaPlan]:
        """One plan per persona, however often the archive lists it (each entry had one import's share of
        items: five entries of one persona brought five shares)."""
        plans: dict[str, _PersonaPlan] = {}
        for persona in _list(data.get("personas")):
            if (plan := self._plan_persona(persona, report)) is None:
                continue
            if (first := plans.get(plan.name)) is None:
                plans[plan.name] = plan
            else:  # (a file listed again: the later entry's, as a later version would be)
                first.files.update(plan.files)
                for filename, contents in plan.versions.items():
                    first.versions.setdefault(filename, set()).update(contents)
                first.items += plan.items
                first.corrections += plan.corrections
        messages.plan(_list(data.get("messages")), paused_since(data))
        return list(plans.values())

    def _plan_persona(self, persona: Any, report: ImportReport) -> _PersonaPlan | None:
        name = self.known.get(str(persona.get("persona", "")).casefold()) if isinstance(persona, dict) else None
        if name is None:
            report.left_out.append(f"persona {_text(persona.get('persona'), 60)!r} does not exist here"
                                   if isinstance(persona, dict) else "a damaged persona entry")
            return None
        plan = _PersonaPlan(name)
        for version in _list(persona.get("file_versions")):
            if isinstance(version, dict) and version.get("file") in FILENAMES:
                if not isinstance(version.get("content"), str):  # (a number or an object is no file's text)
                    report.left_out.append(f"a version of {name}'s {version['file']} that is not text")
                    continue
                content = storable(version["content"])
                plan.files[str(version["file"])] = content
                plan.versions.setdefault(str(version["file"]), set()).add(content)
        for filename, content in list(plan.files.items()):
            # (an edit saves up to the limit and the line end it adds: without that one, as it was counted)
            if not content.strip() or len(content.removesuffix("\n")) > self.files.file_max_chars:
                report.left_out.append(f"{name}'s {filename} (empty or too long)")
                del plan.files[filename]
        for item in _list(persona.get("memory_items")):
            fields = item_fields(item, self.limits.item_chars) if isinstance(item, dict) else None
            if fields is None:
                report.left_out.append("an unusable memory item")
            elif not check_memory_text(fields["content"]).ok:
                report.left_out.append("an item that reads like instructions to the bot")
            else:
                plan.items.append((item["id"] if _is_id(item.get("id")) else None, fields))
                if _is_id(item.get("id")) and _is_id(item.get("superseded_by")) and item["superseded_by"] != item["id"]:
                    plan.corrections.append((item["id"], item["superseded_by"]))
        return plan

    async def _persona(self, user: User, plan: _PersonaPlan, report: ImportReport) -> None:
        # By the user's row as the import began, never made again: a forget-me meanwhile stops the import here.
        pair = await self.store.count_messages(user.id, plan.name, 0)
        for filename, content in plan.files.items():
            before = await self.store.current(pair.id, filename)
            try:
                written = await self.files.write(pair, filename, content, "user", REASON)
            except FileError as exc:  # e.g. the guard refused it: the rest still comes in
                report.left_out.append(f"{plan.name}'s {filename} ({exc})")
                continue
            if written is None:
                report.skipped += 1
                continue
            report.files += 1
            # Written here after the export was made (by the user or the persona; not a template): an older
            # archive brought back is said to have replaced it, and how to get it back.
            if before is not None and before.author != "system" and before.content not in plan.versions.get(
                    filename, ()):
                report.replaced.append((plan.name, filename, before.version))
        await self._items(pair.id, plan, report)

    async def _items(self, pair_id: int, plan: _PersonaPlan, report: ImportReport) -> None:
        repo = self.store.storage.export
        new_ids: dict[int, int] = {}
        room = self.limits.pair_items - await repo.active_items(pair_id)
        added = full = later = 0
        for archive_id, fields in plan.items:
            if added >= self.limits.items:  # one import's share: the same archive sent again brings the next
                later += 1
                continue
            if (here := await repo.item_like(pair_id, fields["content"], fields["created_at"])) is not None:
                report.skipped += 1  # here already (an import run before): its corrections still link to it
                new_id = here
            elif room <= 0:
                full += 1
                continue
            else:
                new_id = await repo.import_item(pair_id, fields)
                added += 1
                room -= 1
            if archive_id is not None:
                new_ids[archive_id] = new_id
        report.items += added
        if later:
            report.left_out.append(f"{plural(later, 'memory item')} of {plan.name}'s for later: one import brings "
                                   f"{self.limits.items:,} new ones (send the same archive again for the rest)")
        if full:
            report.left_out.append(f"{plural(full, 'memory item')}: your memory with {plan.name} holds "
                                   f"{self.limits.pair_items:,} already (forget some to make room)")
        for old, new in plan.corrections:  # corrections between imported items keep their link
            if old in new_ids and new in new_ids:
                await repo.link_correction(pair_id, new_ids[old], new_ids[new])


EARLIER = "#imported"  # the companion channel of imported messages older than a channel's own (see write)
# Its name: not the DM's, which names the person ("DM with Ann") and which a forget-me landing before its first
# message (so before the person was its speaker) would not find to rename.
EARLIER_NAME = "imported direct messages"


class _Messages:
    """The archive's direct messages, taken into the user's direct-message channel here."""

    NOTES = {"paused": "{n} said during a !memory pause (incognito: never kept)",
             "group": "{n} from group channels (their history is everyone's)",
             "elsewhere": "{n} from direct messages: send the import in a direct message with me to bring them back",
             "persona": "{n} with personas this bot does not have",
             "time": "{n} without a usable time",
             "long": "{n} longer than this bot takes",
             "guard": "{n} of the bot's that read like instructions to it"}

    def __init__(self, storage: Storage, user: User, channel: Channel | None, personas: Mapping[str, str],
                 limits: ImportLimits, report: ImportReport) -> None:
        self.storage, self.user, self.channel, self.personas = storage, user, channel, personas
        self.limits, self.report = limits, report
        self.left_out: Counter[str] = Counter()
        self.rows: list[tuple[str, Role, str, str, float]] = []  # persona, role, author, text, time

    def plan(self, messages: list[Any], paused: Mapping[str, float]) -> None:
        """Check the archive's messages; ``paused``: when each pause running at the export began, by persona."""
        latest = time.time() + 60  # a message from the future would stay last in the window for as long
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or not isinstance(
                    m.get("text"), str):
                continue
            text = storable(m["text"]).strip()
            if text:
                reason = self._refused(m, text, latest, paused)
                if reason:
                    self.left_out[reason] += 1
                else:
                    persona = self.personas[str(m.get("persona") or "").casefold()]
                    self.rows.append((persona, m["role"], _text(m.get("author_name"), MAX_NAME_CHARS), text,
                                      _time(m.get("created_at"), latest=latest) or 0.0))
        for reason, count in self.left_out.items():
            self.report.left_out.append(self.NOTES[reason].format(n=plural(count, "message")))

    def _refused(self, m: Mapping[str, Any], text: str, latest: float, paused: Mapping[str, float]) -> str | None:
        """Why a message cannot come in (a key of ``NOTES``), or None."""
        limit = self.limits.message_chars if m["role"] == "user" else self.limits.reply_chars
        # An export made during `!memory pause` holds the stretch, which the resume deletes: brought back, it
        # would be kept for good (searched, summarised, read by cortex updates). Asked first: no other way of
        # sending the import brings these back.
        if during_pause(paused, m):
            return "paused"
        if not m.get("is_dm"):
            return "group"
        if self.channel is None:
            return "elsewhere"
        if str(m.get("persona") or "").casefold() not in self.personas:
            return "persona"
        if _time(m.get("created_at"), latest=latest) is None:
            return "time"
        if len(text) > limit:
            return "long"
        # The bot's own turns go into every later prompt as its words: an edited archive must not put
        # instructions there (the user's own turns are theirs to say, as in the chat).
        if m["role"] == "assistant" and not check_memory_text(text).ok:
            return "guard"
        return None

    async def write(self) -> None:
        if self.channel is None:
            return
        # The history window reads a channel by id, newest last: messages older than what the channel holds
        # would come after it and read as the latest exchange. Those go into a companion channel instead,
        # where recall finds them and no window shows them.
        newest = await self.storage.recent_messages(self.channel.id, 1)
        since = newest[0].created_at.timestamp() if newest else float("-inf")
        earlier = await self.storage.get_channel(f"{self.channel.key}{EARLIER}")  # an earlier import's
        for n, (persona, role, author, text, created) in enumerate(self.rows):
            if self.report.messages >= self.limits.messages:  # one import's share; the same archive again: the rest
                self.report.left_out.append(
                    f"{plural(len(self.rows) - n, 'message')} for later: one import brings {self.limits.messages:,} "
                    "new ones (send the same archive again for the rest)")
                break
            if earlier is None and created < since:
                earlier = await self.storage.upsert_channel(f"{self.channel.key}{EARLIER}", EARLIER_NAME, is_dm=True)
            target = earlier if created < since and earlier is not None else self.channel
            if any([await self.storage.export.has_message(c.id, role, text, created)
                    for c in (self.channel, earlier) if c is not None]):
                self.report.skipped += 1
                continue
            # Its token count as the chat stores it: counted as 0, a message took no room in the history
            # window, and any number of them went into every prompt.
            await self.storage.add_message(target.id, self.user.id, persona, role, author, text,
                                           self.limits.tokens(text), datetime.fromtimestamp(created, tz=UTC))
            self.report.messages += 1
