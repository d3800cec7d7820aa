"""``!memory export``: one zip with everything the bot holds about the caller, for every persona.

JSON for machines (``data.json``, the format ``!memory import`` reads back) and Markdown for people,
with a README inside that says what each file is.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from bot.commands.files import MAX_ATTACHMENT_BYTES
from bot.storage.base import User
from bot.storage.core import user_persona_key
from bot.text import plural, shown
from cortex.store import CortexStore

T = TypeVar("T")

FORMAT = "cortex-bot-export"
FORMAT_VERSION = 1
README = """# Your data from cortex-bot

Everything this bot stored about you when the export was made ({when} UTC), for every persona you
talked to.

- `data.json` — all of it in one file, for programs (and for `!memory import`, which reads it back into
  this or another bot: only into the account that exported it, skipping what is already there).
- `messages.md` — your messages and the bot's replies to you, oldest first, with where they were said. Those
  marked 🕶️ were said during a `!memory pause` still running: `!memory resume` deletes them from the bot, and
  `!memory import` leaves them out (they are yours to read here, never to come back as memory).
- `<persona>/memory.md`, `soul.md`, `relationship.md` — the persona's three files about you, as they are now.
- `<persona>/versions/<file>/v0001.md …` — every earlier version of those files (who changed them, when
  and why is in `data.json`).
- `<persona>/memory-items.md` — your memory items: active, archived (forgotten or pruned), corrected
  (superseded) and expired ones, with category, importance, scope and dates.
- `summaries.md` — the rolling summaries of your direct-message conversations (drafts the bot rejected
  too, marked).
- In `data.json` only: `skill_calls`, the tools the personas used while answering you (arguments as
  recorded, secrets replaced); `dm_persona`, the persona you picked for direct messages; `paused`, the
  `!memory pause` stretches running.

Times are UTC. Ids are this bot's own numbers (`#12`), as the chat commands show them.
"""


def _time(value: Any) -> str:
    return datetime.fromtimestamp(float(value), tz=UTC).strftime("%Y-%m-%d %H:%M") if value is not None else ""


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_ " else "_" for ch in name).strip() or "persona"


def _unique(folder: str, taken: set[str]) -> str:
    """``folder``, numbered when another persona's name made the same one ("Cora?" and "Cora!" are both
    ``Cora_``; "cora" too, where files are named without regard to case)."""
    name, n = folder, 1
    while name.casefold() in taken:
        n += 1
        name = f"{folder}-{n}"
    taken.add(name.casefold())
    return name


async def persona_data(store: CortexStore, pair_id: int, persona: str) -> dict[str, Any]:
    """One persona's part of a user's export. A failed update run says why in ``reason``, in words; its
    ``error`` (an exception's text: a path, a query, what the model's server said) is the log's reader's, as on
    the page's activity view, where only the bot's admins see it."""
    versions = await store.all_versions(pair_id)
    runs = await store.runs(pair_id, limit=100_000)
    return {
        "persona": persona,
        "file_versions": [{"file": v.filename, "version": v.version, "content": v.content, "author": v.author,
                           "reason": v.reason, "tier": v.tier, "created_at": v.created_at.isoformat()}
                          for v in versions],
        "memory_items": await store.storage.export.items(pair_id),
        "update_runs": [{"tier": r.tier, "status": r.status, "reason": r.reason, "rounds": r.rounds,
                         "files_read": r.files_read, "files_written": r.files_written,
                         "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                         "started_at": r.started_at.isoformat()} for r in runs],
    }


async def export_data(store: CortexStore, user: User) -> dict[str, Any]:
    repo = store.storage.export
    personas = [await persona_data(store, int(p["id"]), str(p["persona"])) for p in await repo.pairs(user.id)]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "exported_at": datetime.now(UTC).isoformat(),
        "user": {"key": user.key, "name": user.display_name},
        "personas": personas,
        "messages": await repo.messages(user.id),
        "dm_summaries": await repo.dm_summaries(user.id),
        "dm_persona": await store.storage.get_setting(user_persona_key(user.key)),  # their pick, if any
        "paused": [{"persona": persona, "since": datetime.fromtimestamp(since, UTC).isoformat()}
                   for persona, since in await store.storage.incognito.stretches(user.id)],
        "skill_calls": [{"skill": c.skill, "persona": c.persona, "channel": c.channel_key, "arguments": c.arguments,
                         "ok": c.ok, "error": c.error, "duration_ms": c.duration_ms,
                         "at": datetime.fromtimestamp(c.created_at, UTC).isoformat()}
                        for c in await store.storage.skills.recent(user.key, limit=100_000)],
    }


def paused_since(data: Mapping[str, Any]) -> dict[str, float]:
    """When each ``!memory pause`` running as the archive was made began (its ``paused``), by persona (casefolded):
    that persona's messages from then on are the stretch's, which ``!memory resume`` deletes. An entry that
    cannot be read counts for nothing (only an archive edited by hand has one, and its editor could as well
    have taken the entry out)."""
    since: dict[str, float] = {}
    entries = data.get("paused")
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict) or not isinstance(entry.get("persona"), str) \
                or not isinstance(entry.get("since"), str):
            continue
        try:
            began = datetime.fromisoformat(entry["since"])
        except ValueError:
            continue
        # The export wrote the start to the microsecond, rounded: a message stamped at the start itself is in.
        at = began.replace(tzinfo=began.tzinfo or UTC).timestamp() - 1e-6
        persona = entry["persona"].casefold()
        since[persona] = min(at, since.get(persona, at))
    return since


def during_pause(paused: Mapping[str, float], message: Mapping[str, Any]) -> bool:
    """Whether an exported message was said in one of the archive's running pauses (``paused_since``)."""
    since, created = paused.get(str(message.get("persona") or "").casefold()), message.get("created_at")
    return since is not None and isinstance(created, int | float) and not isinstance(created, bool) and created >= since


def _items_markdown(items: list[dict[str, Any]]) -> str:
    lines = ["# Memory items", ""]
    for item in items:
        state = ("archived: " + str(item["archive_reason"] or "forgotten") if item["archived_at"] is not None
                 else f"corrected by #{item['superseded_by']}" if item["superseded_by"] is not None else "active")
        lines.append(f"- #{item['id']} [{item['category']}] {item['content']}  \n  importance {item['importance']}, "
                     f"{item['scope']}, {state}, since {_time(item['created_at'])}"
                     + (" (pinned)" if item["pinned"] else ""))
    return "\n".join(lines) + "\n"


def _messages_markdown(messages: list[dict[str, Any]], paused: Mapping[str, float]) -> str:
    lines = ["# Messages", ""]
    lines += [f"- {'🕶️ ' if during_pause(paused, m) else ''}{_time(m['created_at'])} in "
              f"{m['channel_name'] or m['channel']} — **{m['author_name']}**: {m['text']}" for m in messages]
    return "\n".join(lines) + "\n"


async def zipped(data: dict[str, Any]) -> bytes:
    """:func:`build_zip` on a worker thread: serialising and compressing a long history takes seconds,
    which every reply would otherwise wait for."""
    return await asyncio.to_thread(build_zip, data)


def build_zip(data: dict[str, Any]) -> bytes:
    """The archive: ``data.json``, README, and Markdown for reading."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("README.md", README.format(when=data["exported_at"][:16].replace("T", " ")))
        archive.writestr("data.json", json.dumps(data, indent=2, ensure_ascii=False, default=str))
        archive.writestr("messages.md", _messages_markdown(data["messages"], paused_since(data)))
        archive.writestr("summaries.md", "# Summaries of your direct messages\n\n" + "\n\n".join(
            f"## {s['channel']} (version {s['version']}"
            + (f", a draft rejected: {s['reason']})" if s.get("status", "ok") != "ok" else ")") + f"\n{s['text']}"
            for s in data["dm_summaries"]) + "\n")
        folders: set[str] = set()
        for persona in data["personas"]:
            folder = _unique(_safe(persona["persona"]), folders)
            latest: dict[str, str] = {}
            for v in persona["file_versions"]:
                latest[v["file"]] = v["content"]
                archive.writestr(f"{folder}/versions/{v['file'].removesuffix('.md')}/v{v['version']:04d}.md",
                                 v["content"])
            for filename, content in sorted(latest.items()):
                archive.writestr(f"{folder}/{filename}", content)
            archive.writestr(f"{folder}/memory-items.md", _items_markdown(persona["memory_items"]))
    return buffer.getvalue()


MAX_ARCHIVE_BYTES = MAX_ATTACHMENT_BYTES  # what an adapter downloads for a command at most
MAX_DATA_BYTES = 100 * 1024 * 1024  # data.json unpacked: a zip bomb stops here
# Values in data.json (objects, lists, numbers, strings...): each costs Python memory whatever its size
# ("{}," is 3 bytes and ~100 bytes parsed, "1," 2 bytes and ~30), so 100 MB of them would take gigabytes. A
# message takes about 17 (its keys and values): three million cover about 170,000 messages.
MAX_DATA_VALUES = 3_000_000


class ExportBusy(Exception):
    """An export of this user's is being made already (a resent command would only make a second)."""


@dataclass
class Exports:
    """Archives, made one at a time in the process: one holds all of a user's rows in memory while it is made
    (about a gigabyte for a user of 160,000 imported messages; five sent at once reached 3 GB), and one at
    a time for each user (one more while theirs is being made is refused, not queued)."""

    store: CortexStore
    _making: set[str] = field(default_factory=set)
    _one: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))

    async def archive(self, user: User) -> tuple[dict[str, Any], bytes]:
        """Everything about ``user`` (:func:`export_data`) and its zip (:func:`zipped`)."""
        if user.key in self._making:
            raise ExportBusy("an export of yours is being made already; wait for its answer")
        self._making.add(user.key)
        try:
            async with self._one:
                everything = await export_data(self.store, user)
                return everything, await zipped(everything)
        finally:
            self._making.discard(user.key)


def export_filename(user: User, now: datetime | None = None) -> str:
    """The archive's file name: ASCII only (every platform and browser keeps it as it is), the display
    name cut to 40 characters, and the time in UTC."""
    safe = "".join(ch if ch.isascii() and ch.isalnum() else "-" for ch in user.display_name[:40]).strip("-")
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    return f"cortex-export-{safe or 'user'}-{stamp}.zip"


class ArchiveError(Exception):
    """One line for the user: why the archive cannot be imported; nothing was changed."""


def named(value: object) -> str:
    """A value of an archive named in an :class:`ArchiveError`: on one line and cut (an edited archive's text may
    be megabytes long), a list or an object only by its kind."""
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "a list"
    return shown(value if isinstance(value, str) else repr(value))


@dataclass
class ImportReport:
    items: int = 0
    files: int = 0
    messages: int = 0
    skipped: int = 0  # already here
    left_out: list[str] = field(default_factory=list)  # what could not come in, and why
    # (persona, file, version) of files changed here after the export was made, that the archive's replaced
    replaced: list[tuple[str, str, int]] = field(default_factory=list)

    def line(self, prefix: str = "!") -> str:
        text = (f"Imported {plural(self.items, 'memory item')}, {plural(self.files, 'file')} and "
                f"{plural(self.messages, 'message')}; {self.skipped:,} were here already.")
        if self.replaced:
            text += " Replaced what changed here after the export was made: " + "; ".join(
                f"{persona}'s {filename} (version {version} is kept: {prefix}memory revert {filename} {version} "
                f"with {persona} brings it back)" for persona, filename, version in self.replaced) + "."
        reasons = Counter(self.left_out)  # in order of first appearance, each once with its count
        named = [reason if count == 1 else f"{reason} (×{count:,})" for reason, count in reasons.items()]
        more = f"; and {plural(len(named) - 8, 'other reason')}" if len(named) > 8 else ""
        return text + (" Left out: " + "; ".join(named[:8]) + more + "." if named else "")


# The zip's list of its files (its central directory), which zipfile reads whole into objects before anything
# else: an export's is a few kilobytes per thousand file versions, but a 50 MB zip of a million empty entries
# took 18 s and half a gigabyte.
MAX_DIRECTORY_BYTES = 8 * 1024 * 1024
_END, _END64, _LOCATOR64 = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"


def _directory_bytes(blob: bytes) -> int:
    """The size of the zip's central directory as its end record gives it (also a ZIP64 one), which is what
    zipfile reads; 0 when there is no end record (zipfile then refuses the file itself). Found as zipfile finds
    it: the last 22 bytes when they are one without a comment (its own fields may hold the marker's bytes, which
    a search from the end would take for the record), else the last marker before a comment of at most 64 KB."""
    tail = len(blob) - 22
    at = tail if tail >= 0 and blob[tail:tail + 4] == _END and blob[-2:] == b"\0\0" else (
        blob.rfind(_END, max(0, len(blob) - (1 << 16) - 22)))  # (zipfile's own start: a 64 KB comment's room)
    if at < 0:
        return 0
    size = int.from_bytes(blob[at + 12:at + 16], "little")
    if at >= 20 and blob[at - 20:at - 16] == _LOCATOR64:
        # The ZIP64 record: where the locator says, or (as Python 3.11's zipfile reads it, whatever the locator
        # says) right before the locator. Each one there counts: a forged offset must not hide the one zipfile reads.
        for start in (int.from_bytes(blob[at - 12:at - 4], "little"), at - 20 - 56):
            if 0 <= start and blob[start:start + 4] == _END64:
                size = max(size, int.from_bytes(blob[start + 40:start + 48], "little"))
    return size


def read_number(kind: Callable[[str], T]) -> Callable[[str], T | None]:
    """A JSON number as an export writes them (at most 40 characters: ids, times, scores); a longer one is read
    as null, never converted (23,000 numbers of 4,200 digits took 3.6 s), and leaves its entry out; so does one
    too large for a float (``1e999`` is infinity, which JSON cannot hold: stored, no other reader took it)."""
    def parse(text: str) -> T | None:
        if len(text) > 40:
            return None
        number = kind(text)
        return None if isinstance(number, float) and not math.isfinite(number) else number
    return parse


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def loads_archive_json(text: str | bytes) -> Any:
    """JSON of an archive (its ``data.json``, an item's tags or metadata written as JSON text), read with
    the number rules of :func:`read_number`. (``NaN`` and ``Infinity``, which Python reads and JSON has not,
    stay floats: as a time they make their entry unusable, and metadata holding one is not stored.)"""
    return json.loads(text, parse_int=read_number(int), parse_float=read_number(float), object_pairs_hook=_object)


# The parse runs on a worker thread, but the JSON decoder, written in C, holds Python's lock until it is done:
# 70 MB of numbers held the event loop 2.5 s. The hooks above are Python, and Python lets the lock go to the
# event loop every few milliseconds (the decoder calls them for every number and object).
def read_archive(blob: bytes) -> dict[str, Any]:
    """``data.json`` of an export zip, checked for size and format (CPU-bound for a large one: callers
    run it on a worker thread)."""
    if len(blob) > MAX_ARCHIVE_BYTES:
        raise ArchiveError(f"the archive is {len(blob) / 1e6:.1f} MB; at most {MAX_ARCHIVE_BYTES // 1024 // 1024} MB")
    if _directory_bytes(blob) > MAX_DIRECTORY_BYTES:
        raise ArchiveError("its list of files is far longer than an export's (not a cortex-bot export?)")
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            info = archive.getinfo("data.json")
            if info.file_size > MAX_DATA_BYTES:
                raise ArchiveError("its data.json is too large")
            raw = archive.read(info)  # zipfile reads no more than the size checked above (else: BadZipFile)
            # Every value is an object, an array, or follows a comma or a colon: counting those bounds what
            # the parse would build (a list of 24 million numbers is 94 KB zipped). Inside strings they count
            # too: an upper bound.
            values = raw.count(b"{") + raw.count(b"[") + raw.count(b",") + raw.count(b":")
            if values > MAX_DATA_VALUES:
                raise ArchiveError(f"its data.json holds more than {MAX_DATA_VALUES:,} values, more than this bot "
                                   "imports at once")
            data = loads_archive_json(raw)
    except ArchiveError:
        raise
    except (zipfile.BadZipFile, KeyError):
        raise ArchiveError("not a cortex-bot export (a zip with data.json, as !memory export makes)") from None
    except (ValueError, RecursionError, OSError, EOFError, zlib.error) as exc:
        raise ArchiveError(f"its data.json is damaged ({type(exc).__name__})") from None
    except (RuntimeError, NotImplementedError) as exc:  # an encrypted entry; a compression zipfile cannot read
        raise ArchiveError(f"its data.json cannot be read: {str(exc)[:100] or type(exc).__name__} (send the zip "
                           "as !memory export made it)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ArchiveError("not a cortex-bot export (data.json has another format)")
    if data.get("format_version") != FORMAT_VERSION:
        raise ArchiveError(f"export format {named(data.get('format_version'))} is not one this bot reads "
                           f"({FORMAT_VERSION})")
    return data
