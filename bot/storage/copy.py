"""Copy one bot's database into another (SQLite → PostgreSQL and back): ``cortexbot copy-data``.

Every table goes over in foreign-key order, page by page along its primary key (keyset pagination, so
a page costs the same at the start and the end of a big table), ids kept as they are so every reference
stays valid. Each page is inserted in one transaction, a row the target holds already brought up to date
where it differs (``ON CONFLICT … DO UPDATE``): a copy that was interrupted is resumed by running it again, a
second run copies nothing twice, and a copy back after the bot ran on the other side brings its changes too
(items archived or pinned, jobs done, settings). Rows are copied up to the largest ids the copy found as it
began: what a bot running on the source adds meanwhile (``--while-running``) waits for the next copy. Rows
deleted on the source since an earlier copy (a forget-me, expired messages, an ended incognito stretch) are
deleted from the target first, children before parents, where their origin is certain: the rows of the tables
keyed by one id (a target a bot ran on or wrote into since is refused before anything changes: a bot's start
marks it used, and its ids grew past the mark), the rows pointing at them, and what a forget-me deletes by the key
of a user the source no longer has (web sessions, a persona pick); other rows keyed otherwise (settings, web
sessions) stay, and a target an older copy-data made (no mark) is not touched. The deleted words are then
scrubbed from a SQLite target's files.

What differs between the engines is handled here:

* **Columns**: only the columns both databases have; PostgreSQL's ``tsvector`` columns are left out (its
  triggers fill them from the persona's language, which is why personas go before messages).
* **Vectors**: SQLite float32 blobs become pgvector ``vector`` values and back (numpy float32).
* **Counters and triggers**: SQLite's message trigger bumps ``channels.message_count`` (and its
  ``updated_at``) for every copied message, so after the messages each channel gets the source's values
  again; each table's next id on the target (SQLite's ``sqlite_sequence``, PostgreSQL's identity
  sequences) is past the largest copied id and no lower than the source's, so the id of a row deleted
  there (a forgotten user) is never handed out again.
* **A target that went apart**: a user, persona, channel or pair not inserted must be there already as
  the same row (its id and its unique name); otherwise the copy stops with one line instead of keeping
  the target's row and pointing what follows at it.
* **Self references**: ``memory_items.supersedes``/``superseded_by`` may point at a later row, so items
  are inserted without them and the links are set once every item is there.

A database's bot is named by the settings row ``bot.instance_id`` (a uuid4, made in the source when it
has none). The copy refuses a target whose id differs, a target without an id that already holds rows
(a bot started on it, say), and a copy of a database onto itself. At the end every table's rows are counted on both
sides; a difference is reported, never hidden.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from bot.storage.core import Storage, forget_keyed, note_scrub_pending
from bot.storage.engine import Database, Row, StorageError, is_conflict
from bot.storage.unavailable import read_only

__all__ = ["INSTANCE_KEY", "TABLES", "CopyReport", "TableCount", "copy_data", "ensure_instance_id", "note_use",
           "unfinished_copy"]

INSTANCE_KEY = "bot.instance_id"
# (settings) The largest id of each table a copy from or into this database accounted for (the source's, as the
# copy began): rows past them in a target were added there since (a bot ran on it), and a further copy into it
# would mix the source's rows with them under the same ids. Never copied itself: each database keeps its own.
LAST_COPY_KEY = "copy.largest_ids"
# (settings) A copy into this database began and has not ended (killed, failed): its data is part of the source's.
UNFINISHED_KEY = "copy.unfinished"
# (settings) A bot ran on this database (or a command changed its data) since a copy from or into it last accounted
# for it: what it changed there (a forget-me, items archived or pinned, settings) adds no id past the mark, and a
# copy into it would undo it. Written at each start (``note_use``), taken away by a copy from or into it.
USED_KEY = "copy.used"
NOT_COPIED: dict[str, str] = {"settings": f"key NOT IN ('{LAST_COPY_KEY}', '{UNFINISHED_KEY}', '{USED_KEY}')"}  # (SQL)
# Foreign-key order (``processes`` and ``schema_version`` stay behind: they describe the database, not the bot).
TABLES: tuple[str, ...] = (
    "users", "personas", "versioned_texts", "lore_entries", "channels", "messages", "channel_speakers", "summaries",
    "jobs",
    "llm_calls", "reply_stats", "settings",
    "cortex_pairs", "cortex_versions", "cortex_runs", "cortex_settings", "memory_items", "message_vectors",
    "reply_sources", "platform_messages", "incognito", "incognito_ended", "undo_offers",
    "skill_executions", "web_links", "web_sessions", "forgotten_spending",
    "forgotten_usage",
    "periodic_runs", "instance_locks",
)
# What names a row apart from its id (a unique column): a row the target holds under the same id must
# agree on it, or the two databases went apart (a user forgotten and back under a new id, say).
NATURAL_KEYS: dict[str, tuple[str, ...]] = {
    "users": ("key",), "personas": ("name",), "channels": ("key",), "cortex_pairs": ("user_id", "persona"),
}
# Tables keyed otherwise than by one id, and the column pointing at a table that is (a row past that table's
# mark points at a row the copy leaves for the next one: see ``_copy_table``; a row pointing at one the source
# deleted goes with it: see ``_remove_deleted``).
BOUNDED_BY: dict[str, tuple[str, str]] = {
    "reply_sources": ("message_id", "messages"), "platform_messages": ("message_id", "messages"),
    "incognito": ("user_id", "users"), "undo_offers": ("user_id", "users"),
}
# Rows the bot never changes once written: one the target holds is left as it is. SQLite's text index keeps a
# message's words through its insert and delete only, so a message rewritten in place (its NUL, which PostgreSQL
# cannot hold, gone after a copy there and back) kept the old words in the index after its deletion.
UNCHANGING = frozenset({"messages"})
# Columns that may point at rows copied later: inserted empty, set after the whole table.
DEFERRED: dict[str, tuple[str, ...]] = {"memory_items": ("supersedes", "superseded_by")}
ENGINE_ONLY_TYPES = frozenset({"tsvector"})  # filled by the engine itself
INTEGER_TYPES = frozenset({"integer", "int", "bigint", "int4", "int8"})  # (SQLite's declared, PostgreSQL's names)
MAX_PARAMETERS = 30_000  # per statement (PostgreSQL allows 32767, SQLite 32766)

# What to do when a row of the source cannot be read or written (a hand-edited or damaged database).
FIX_SOURCE = ("correct or delete that row in the source, then run the copy again: it goes on where it stopped "
              "(--batch 1 names the single row)")
Progress = Callable[[str, int, int], None]  # (table, rows done, rows in the source)


@dataclass(frozen=True, slots=True)
class TableCount:
    table: str
    source_rows: int
    target_rows: int
    copied: int  # rows this run inserted
    removed: int = 0  # rows this run deleted from the target: deleted at the source since an earlier copy

    @property
    def matches(self) -> bool:
        return self.source_rows == self.target_rows


@dataclass(frozen=True, slots=True)
class CopyReport:
    source: str
    target: str
    instance_id: str
    tables: tuple[TableCount, ...]
    seconds: float = 0.0

    @property
    def mismatches(self) -> list[TableCount]:
        return [t for t in self.tables if not t.matches]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def copied(self) -> int:
        return sum(t.copied for t in self.tables)

    @property
    def removed(self) -> int:
        return sum(t.removed for t in self.tables)


@dataclass(frozen=True, slots=True)
class _Shape:
    """One table as one engine has it: column types (SQLite's declared type or PostgreSQL's type name,
    lower case), primary key, identity column."""

    types: dict[str, str]
    key: tuple[str, ...]
    identity: str | None = None


@dataclass(slots=True)
class _Plan:
    table: str
    columns: tuple[str, ...]
    key: tuple[str, ...]
    convert: dict[int, Callable[[Any], Any]] = field(default_factory=dict)  # column position -> converter
    deferred: tuple[str, ...] = ()


# -- the copy ------------------------------------------------------------------------------------


async def copy_data(source: Storage, target: Storage, *, progress: Progress | None = None,
                    batch: int = 1000, source_running: bool = False) -> CopyReport:
    """Copy every table of ``source`` into ``target`` (migrated first); see the module's docstring.
    ``source_running``: a bot runs on the source meanwhile (``--while-running``): it stays marked as used."""
    if batch < 1:
        raise StorageError("the batch size must be at least 1")
    started = time.monotonic()
    instance, source_read_only = await _check_ends(source, target)
    await target.set_setting(UNFINISHED_KEY, json.dumps({"from": source.db.url, "at": time.time()}))
    # Both ends marked before a row goes over: the target may hold rows up to the source's ids (so a resumed copy
    # passes), and the source's rows up to here are the target's too (so a copy back, once a bot ran on the target,
    # passes while this one did not move on meanwhile; and is refused when it did).
    reached = await _largest_ids(source.db)
    accounted = None if source_read_only else await _accounted(source.db, target.db)
    await _mark_both(source, target, reached, source_running, mark_source=not source_read_only)
    removed = await _remove_deleted(source.db, target.db, batch, progress, accounted)
    if any(removed.values()):
        await target.scrub()  # (the deleted words out of a SQLite target's files, as a forget-me does)
    copied: dict[str, int] = {}
    for table in TABLES:  # (rows up to the ids marked: what a running bot adds meanwhile is for the next copy)
        column, parent = BOUNDED_BY.get(table, ("", table))
        bound = None if parent not in reached else (column, reached[parent])
        copied[table] = await _copy_table(source.db, target.db, table, batch, progress, bound)
        if table == "messages":
            await _restore_channel_counters(source.db, target.db, batch)
    await _move_sequences(target.db, await _next_ids(source.db))
    await target.db.write("DELETE FROM settings WHERE key = ?", (UNFINISHED_KEY,))  # (a bot may start on it now)
    counts = [TableCount(t, await _count(source.db, t), await _count(target.db, t), copied[t], removed[t])
              for t in TABLES]
    return CopyReport(source.db.url, target.db.url, instance, tuple(counts), time.monotonic() - started)


async def _check_ends(source: Storage, target: Storage) -> tuple[str, bool]:
    """Refuse what must not be copied, before a row goes over (see the module's docstring); the target migrated and
    claimed. Returns the bot's id and whether the source is read-only."""
    if await _identity(source.db) == await _identity(target.db):
        raise StorageError(f"{target.db.url} is the configured database itself: name another database to copy into")
    pending = await source.pending_migrations()
    if pending:
        raise StorageError(f"the source database {source.db.url} lacks migration(s) {', '.join(map(str, pending))}: "
                           "run cortexbot migrate (or start the bot once), then copy")
    instance = await ensure_instance_id(source)
    if await target.applied_migrations():  # refuse another bot's database before touching its schema
        await _check_target(target.db, instance)
    await target.migrate(elsewhere="name another database with --to")
    if (unfinished := await unfinished_copy(source)) is not None:
        raise StorageError(f"the source database is not whole: {unfinished}")
    await _claim_target(source.db, target.db, instance)
    await _check_unused(target.db)
    return instance, await _source_read_only(source.db, target.db)


async def _source_read_only(source: Database, target: Database) -> bool:
    """Whether the source is a read-only PostgreSQL (a hot standby, ``default_transaction_read_only``). It cannot
    be marked, so a copy from it goes into a fresh database (or finishes one it began) only: into a copy an earlier
    run finished, it could not tell which of the target's rows its primary deleted since (a forget-me)."""
    if source.dialect != "postgres":
        return False
    row = await source.fetch_one("SELECT current_setting('transaction_read_only')")
    if row is None or row[0] != "on":
        return False
    if await _mark(target) is not None and await target.fetch_one(
            "SELECT 1 FROM settings WHERE key = ?", (UNFINISHED_KEY,)) is None:
        raise StorageError(
            f"{source.url} is read-only (a hot standby?): a copy from it cannot be marked there, so it cannot tell "
            f"what was deleted since the earlier copy into {target.url}: copy from the writable primary, or into a "
            "fresh database")
    return True


async def unfinished_copy(storage: Storage) -> str | None:
    """Why ``storage`` must not be used yet (a copy-data into it began and did not end: the source's data is
    only partly there, and a bot run on it would make a copy that finishes it impossible), or None."""
    value = await storage.get_setting(UNFINISHED_KEY)
    if value is None:
        return None
    try:
        began = json.loads(value)
        source, at = str(began["from"]), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(began["at"])))
    except (ValueError, TypeError, KeyError):
        source, at = "another database", "an unknown time"
    return (f"{storage.db.url} is an unfinished copy of {source} (copy-data began at {at} and did not end): run "
            f"cortexbot copy-data --to {storage.db.url} again with the source's config to finish it, or point "
            "[storage] url back at the source")


async def note_use(storage: Storage, by: str) -> None:
    """Mark the database as used by ``by`` (a bot process starting on it, a command changing its data): a copy
    into it is refused from now on, until a copy from it (``USED_KEY``). The first use since a copy is kept."""
    await storage.db.write(
        "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?) ON CONFLICT (key) DO NOTHING",
        (USED_KEY, json.dumps({"by": by, "at": time.time()}), time.time()),
    )


async def ensure_instance_id(storage: Storage) -> str:
    """The database's bot id (``bot.instance_id``), made now (a uuid4) when it has none (read first: a read-only
    database that has one is copied from)."""
    if (value := await storage.get_setting(INSTANCE_KEY)) is not None:
        return value
    try:
        await storage.db.write(
            "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?) ON CONFLICT (key) DO NOTHING",
            (INSTANCE_KEY, str(uuid.uuid4()), time.time()),
        )
    except Exception as exc:
        if not read_only(exc):
            raise
        raise StorageError(f"{storage.db.url} is read-only (a hot standby?) and does not name its bot yet "
                           f"({INSTANCE_KEY}): copy from the writable primary once, then its standbys name it too"
                           ) from None
    value = await storage.get_setting(INSTANCE_KEY)
    assert value is not None
    return value


async def _claim_target(source: Database, target: Database, instance: str) -> None:
    """Refuse another bot's database; else mark the target as this bot's before any row goes in (so an
    interrupted copy, which leaves data there, is still recognised as ours)."""
    if await _check_target(target, instance):
        return
    mine = await source.fetch_one("SELECT key, value, updated_at FROM settings WHERE key = ?", (INSTANCE_KEY,))
    assert mine is not None
    await target.write("INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                       tuple(mine))


async def _check_target(target: Database, instance: str) -> bool:
    """Whether the target is already this bot's; a clear error when it is another's."""
    row = await target.fetch_one("SELECT value FROM settings WHERE key = ?", (INSTANCE_KEY,))
    if row is not None and str(row[0]) != instance:
        raise StorageError(
            f"{target.url} holds another bot's data (bot.instance_id {row[0]}, this bot's is {instance}): "
            "copy into an empty database, or drop and recreate that one if its data is no longer wanted")
    if row is None:
        # Any row: a bot started there once holds no users yet, but its personas, souls and settings would stay
        # in place of this one's under the same ids.
        held = [f"{n} {table}" for table in TABLES if (n := await _count(target, table))]
        if held:
            raise StorageError(
                f"{target.url} already holds data ({', '.join(held[:6])}{', …' if len(held) > 6 else ''}) of a bot "
                "with no bot.instance_id (was the bot started on it before the copy?): copy into an empty database, "
                "or drop and recreate that one if its data is no longer wanted")
    return row is not None


async def _largest_ids(db: Database) -> dict[str, int]:
    """Each table's largest id (of the tables keyed by one whole number)."""
    found: dict[str, int] = {}
    for table in TABLES:
        key = (await _shape(db, table)).key
        if len(key) == 1:
            row = await db.fetch_one(f"SELECT max({_quote(key[0])}) FROM {_quote(table)}")
            if row is not None and isinstance(row[0], int) and not isinstance(row[0], bool):
                found[table] = row[0]
    return found


async def _mark(db: Database) -> dict[str, int] | None:
    """The database's mark (LAST_COPY_KEY): each table's largest id a copy from or into it accounted for."""
    row = await db.fetch_one("SELECT value FROM settings WHERE key = ?", (LAST_COPY_KEY,))
    if row is None:
        return None
    try:
        return {str(k): int(v) for k, v in json.loads(str(row[0])).items()}
    except (ValueError, TypeError, AttributeError):
        return {}


async def _raise_mark(db: Database, reached: dict[str, int]) -> None:
    mark = await _mark(db) or {}
    merged = {table: max(mark.get(table, 0), reached.get(table, 0)) for table in {*mark, *reached}}
    await db.write("INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE SET"
                   " value = excluded.value, updated_at = excluded.updated_at",
                   (LAST_COPY_KEY, json.dumps(merged, sort_keys=True), time.time()))


async def _mark_both(source: Storage, target: Storage, reached: dict[str, int], source_running: bool, *,
                     mark_source: bool) -> None:
    """Both ends account for the source's rows up to ``reached`` (see ``_raise_mark``); neither counts as used since
    (``USED_KEY``), but a source a bot goes on running on. A read-only source is left as it is."""
    await _raise_mark(target.db, reached)
    await target.db.write("DELETE FROM settings WHERE key = ?", (USED_KEY,))
    if not mark_source:
        return
    await _raise_mark(source.db, reached)
    if source_running:
        await note_use(source, "a bot running on it while copy-data copied from it")
    else:
        await source.db.write("DELETE FROM settings WHERE key = ?", (USED_KEY,))


async def _check_unused(target: Database) -> None:
    """Refuse a target a bot used since a copy from or into it: one started there (``USED_KEY``: what it changed
    would be undone), or rows past the ids that copy accounted for (written otherwise). Their ids are this
    database's next ones too, so what this database added since would be left out as "there already", and rows
    pointing at them (a reply's sources) would be pinned onto the target's rows."""
    await _check_not_run_on(target)
    left = await _mark(target)
    if left is None:
        return
    grown = [f"{table} up to #{n:,} (the copy left #{left.get(table, 0):,})"
             for table, n in (await _largest_ids(target)).items() if n > left.get(table, 0)]
    if grown:
        raise StorageError(
            f"{target.url} was used after the earlier copy ({'; '.join(grown[:4])}"
            f"{'; …' if len(grown) > 4 else ''}): a bot ran on it, and its rows and this database's went apart "
            "under the same ids. Copy into an empty database, or drop and recreate that one if what was added "
            "there is not wanted")


async def _check_not_run_on(target: Database) -> None:
    """Refuse a target a bot ran on (or a command changed) since the last copy from or into it (``USED_KEY``)."""
    row = await target.fetch_one("SELECT value FROM settings WHERE key = ?", (USED_KEY,))
    if row is None:
        return
    try:
        used = json.loads(str(row[0]))
        who = f"{used['by']} at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(float(used['at'])))}"
    except (ValueError, TypeError, KeyError):
        who = "a bot process"
    raise StorageError(
        f"{target.url} was used by a bot after the last copy from or into it ({who}): what changed there since (a "
        "forget-me, items archived or pinned, settings) would be undone or mixed with this database's rows. Copy "
        "into a fresh database (or drop and recreate that one); to keep what changed there, copy it back here "
        "first (copy-data with its config)")


async def _copy_table(source: Database, target: Database, table: str, batch: int, progress: Progress | None,
                      bound: tuple[str, int] | None = None) -> int:
    """Copy one table page by page, its rows up to ``bound`` (a column, "" for the key, and the largest id when
    the copy began: a bot running on the source meanwhile, ``--while-running``, adds rows that point at rows of
    tables copied already, and that the mark does not account for); returns the rows inserted or brought up to
    date."""
    plan = _plan(table, await _shape(source, table), await _shape(target, table))
    select = _select_sql(plan, batch, bound)
    total = await _count(source, table)
    done = copied = 0
    if progress is not None:
        progress(table, 0, total)
    last: tuple[Any, ...] | None = None
    while True:
        try:
            rows = await source.fetch_all(select[last is not None], () if last is None else last)
        except StorageError:
            raise
        except Exception as exc:  # (a hand-edited source: text that is not UTF-8, say)
            after = "" if last is None else f" after {', '.join(plan.key)} {', '.join(map(str, last))}"
            raise StorageError(f"reading {table}{after} from {source.url} failed: {type(exc).__name__}: {exc}; "
                               f"{FIX_SOURCE}") from exc
        if not rows:
            break
        inserted = await _insert(target, plan, rows)
        if inserted < len(rows):
            await _check_same_rows(target, plan, rows)
        copied += inserted
        done += len(rows)
        last = tuple(rows[-1][plan.columns.index(k)] for k in plan.key)
        if progress is not None:
            progress(table, done, max(total, done))
        if len(rows) < batch:
            break
    if plan.deferred:
        await _copy_deferred(source, target, plan, batch, bound[1] if bound is not None and not bound[0] else None)
    return copied


async def _accounted(source: Database, target: Database) -> dict[str, int] | None:
    """The ids up to which the target's rows are provably the source's (both marked by an earlier copy between
    them: the source's mark), or None (a first copy, or a target an older copy-data made). A target marked past
    the source is refused: it holds rows this database never had (it was copied from a newer state of this
    database, which was then restored from a backup, say), and the ids this one hands out next are theirs."""
    source_mark, target_mark = await _mark(source), await _mark(target)
    if source_mark is None or target_mark is None:
        return None
    ahead = [f"{table} up to #{n:,} (this database: #{source_mark.get(table, 0):,})"
             for table, n in target_mark.items() if n > source_mark.get(table, 0)]
    if ahead:
        raise StorageError(
            f"{target.url} holds rows this database never had ({'; '.join(ahead[:4])}{'; …' if len(ahead) > 4 else ''}"
            "): it was copied from a newer state of this bot's database (was this one restored from a backup?). "
            "Copy into an empty database, or copy that one back here first")
    return source_mark


async def _remove_deleted(source: Database, target: Database, batch: int, progress: Progress | None,
                          accounted: dict[str, int] | None) -> dict[str, int]:
    """Delete from the target what the source deleted since an earlier copy (a forget-me, expired messages, an
    ended incognito stretch): the rows of the tables keyed by one id that the source no longer has, the rows of
    ``BOUNDED_BY`` pointing at them, and what a forget-me deletes by the key of a user among them
    (``_forget_gone_users``). Only rows whose origin is certain go: a target a bot wrote into since is refused
    before this (its ids grew past the mark), other rows of a table keyed otherwise (settings, sessions) are left
    as they are, only ids up to what the source had when a copy between them last ran (``accounted``) are
    looked at, and a target that was not marked before this copy (empty, or made by an older copy-data) is not
    touched at all. Children go before parents, in one transaction per table. Returns the rows deleted per
    table."""
    removed = dict.fromkeys(TABLES, 0)
    if accounted is None:
        return removed
    gone: dict[str, tuple[str, list[int]]] = {}  # table -> (its key, the ids the source lacks)
    for table in TABLES:  # (parents first: a row the source deletes meanwhile leaves no child pointing at a gone one)
        shape = await _shape(target, table)
        if len(shape.key) == 1 and shape.types[shape.key[0]] in INTEGER_TYPES:
            key = shape.key[0]
            gone[table] = (key, await _gone_ids(source, target, table, key, batch, accounted.get(table, 0)))
    for table, n in (await _forget_gone_users(target, gone.get("users", ("", []))[1])).items():
        removed[table] += n
    for table in reversed(TABLES):
        if table in BOUNDED_BY:
            column, parent = BOUNDED_BY[table]
            removed[table] += await _delete_where(target, table, column, gone.get(parent, ("", []))[1])
        elif table in gone:
            removed[table] += await _delete_where(target, table, *gone[table])
        if removed[table] and progress is not None:
            progress(f"{table} (deleted at the source)", removed[table], removed[table])
    return removed


async def _forget_gone_users(target: Database, user_ids: list[int]) -> dict[str, int]:
    """Do on the target, for the users the source no longer has (``user_ids``), what a forget-me does by their key
    rather than their row (``forget_keyed``: their web links and sessions, persona pick and import claim, skill
    runs), in one transaction before their rows go; the rows deleted per table. Those rows are keyed otherwise than
    by an id, so the comparison of ids never found them, and a forget-me at the source was partly undone here.
    A forget-me during a pause keeps a bare user row under a new id: the old id is gone all the same, and what the
    source holds by that key now is copied after. Run again after an interruption: the users are still there."""
    deleted: dict[str, int] = {}
    keys = sorted({str(r[1]) for r in await _rows_with_ids(target, "users", ("id", "key"), user_ids)})
    if not keys:
        return deleted
    async with target.transaction() as tx:
        for key in keys:
            for table, n in (await forget_keyed(tx, key)).items():
                deleted[table] = deleted.get(table, 0) + n
        if any(deleted.values()):  # (a name on a session: scrubbed right after the pass)
            await note_scrub_pending(tx)
    return deleted


async def _gone_ids(source: Database, target: Database, table: str, key: str, batch: int, upto: int) -> list[int]:
    """The target's ids of ``table`` up to ``upto`` the source lacks, page by page (each page's ids looked up in
    the source)."""
    gone: list[int] = []
    last: int | None = None
    while True:
        after = f" AND {_quote(key)} > ?" if last is not None else ""
        held = [r[0] for r in await target.fetch_all(
            f"SELECT {_quote(key)} FROM {_quote(table)} WHERE {_quote(key)} <= {int(upto)}{after}"
            f" ORDER BY {_quote(key)} LIMIT {batch}", () if last is None else (last,))]
        if not held:
            return gone
        kept = {r[0] for r in await _rows_with_ids(source, table, (key,), held)}
        gone.extend(i for i in held if i not in kept)
        last = held[-1]
        if len(held) < batch:
            return gone


async def _rows_with_ids(db: Database, table: str, columns: Sequence[str], ids: Sequence[Any]) -> list[Row]:
    """The ``columns`` of the rows of ``table`` whose first column (its key) is one of ``ids``, in statements
    within the engines' parameter limits."""
    rows: list[Row] = []
    for start in range(0, len(ids), MAX_PARAMETERS):
        chunk = list(ids[start:start + MAX_PARAMETERS])
        rows += await db.fetch_all(
            f"SELECT {', '.join(_quote(c) for c in columns)} FROM {_quote(table)}"
            f" WHERE {_quote(columns[0])} IN ({', '.join('?' for _ in chunk)})", chunk)
    return rows


async def _delete_where(target: Database, table: str, column: str, ids: list[int]) -> int:
    """Delete the rows whose ``column`` is one of ``ids``, in one transaction (references to them from rows of
    the same table, an item's correction links, cleared first: the source cleared or deleted them too)."""
    if not ids:
        return 0
    deleted = 0
    try:
        async with target.transaction() as tx:
            for start in range(0, len(ids), MAX_PARAMETERS):
                chunk = ids[start:start + MAX_PARAMETERS]
                marks = ", ".join("?" for _ in chunk)
                for linked in DEFERRED.get(table, ()):
                    await tx.execute(f"UPDATE {_quote(table)} SET {_quote(linked)} = NULL"
                                     f" WHERE {_quote(linked)} IN ({marks})", chunk)
                deleted += len(await tx.fetch_all(
                    f"DELETE FROM {_quote(table)} WHERE {_quote(column)} IN ({marks}) RETURNING 1", chunk))
            if deleted:  # (scrubbed right after the pass; the note is for a copy stopped before that)
                await note_scrub_pending(tx)
    except StorageError:
        raise
    except Exception as exc:  # (a row pointing at one deleted: the source changed meanwhile, --while-running)
        raise StorageError(f"deleting from {table} in {target.url} what the source no longer has failed: "
                           f"{type(exc).__name__}: {exc}; the source changed while it was copied (was the bot "
                           "running?): run copy-data again") from exc
    return deleted


def _on_conflict(plan: _Plan, dialect: str) -> str:
    """A row the target holds already under its key takes the source's values where they differ (an item
    archived, pinned or made private since, a job done, a setting changed: kept as they were, a copy back lost
    them); its unique name must agree (else the rows went apart: see ``_check_same_rows``); self references
    are set after the table (``_copy_deferred``)."""
    natural = [c for c in NATURAL_KEYS.get(plan.table, ()) if c in plan.columns]
    changing = [c for c in plan.columns if c not in plan.key and c not in plan.deferred and c not in natural]
    if not changing or plan.table in UNCHANGING:
        return " ON CONFLICT DO NOTHING"
    table = _quote(plan.table)
    differs, same = (" IS DISTINCT FROM ", " IS NOT DISTINCT FROM ") if dialect == "postgres" else (" IS NOT ", " IS ")
    sets = ", ".join(f"{_quote(c)} = excluded.{_quote(c)}" for c in changing)
    changed = " OR ".join(f"{table}.{_quote(c)}{differs}excluded.{_quote(c)}" for c in changing)
    agree = "".join(f" AND {table}.{_quote(c)}{same}excluded.{_quote(c)}" for c in natural)
    return f" ON CONFLICT ({', '.join(_quote(k) for k in plan.key)}) DO UPDATE SET {sets} WHERE ({changed}){agree}"


async def _insert(target: Database, plan: _Plan, rows: Sequence[Row]) -> int:
    """Insert (or bring up to date: see ``_on_conflict``) one page in one transaction (statements of up to
    ``MAX_PARAMETERS``); returns the rows inserted or changed."""
    try:
        values = [_target_values(plan, row) for row in rows]  # (a vector of a broken length fails here)
        try:
            return await _write_page(target, plan, values, _on_conflict(plan, target.dialect))
        except Exception as exc:
            if not is_conflict(exc):
                raise
        # Another row of the target holds a unique name of this page's (the two went apart): the page goes in as
        # far as it can, as it is (for the tables rows point at, the caller's check then says so in one line;
        # elsewhere the counts at the end tell).
        return await _write_page(target, plan, values, " ON CONFLICT DO NOTHING")
    except StorageError:
        raise
    except Exception as exc:
        first, last = (tuple(row[plan.columns.index(k)] for k in plan.key) for row in (rows[0], rows[-1]))
        where = f"{', '.join(plan.key)} {', '.join(map(str, first))} to {', '.join(map(str, last))}"
        raise StorageError(f"copying {plan.table} ({where}) into {target.url} failed: {type(exc).__name__}: {exc}; "
                           f"{FIX_SOURCE}") from exc


async def _write_page(target: Database, plan: _Plan, values: list[list[Any]], on_conflict: str) -> int:
    """One page in one transaction, in statements of up to ``MAX_PARAMETERS``: the rows written."""
    per_statement = max(1, MAX_PARAMETERS // len(plan.columns))
    names = ", ".join(_quote(c) for c in plan.columns)
    marks = "(" + ", ".join("?" for _ in plan.columns) + ")"
    written = 0
    async with target.transaction() as tx:
        for start in range(0, len(values), per_statement):
            chunk = values[start:start + per_statement]
            written += len(await tx.fetch_all(
                f"INSERT INTO {_quote(plan.table)} ({names}) VALUES {', '.join(marks for _ in chunk)}"
                f"{on_conflict} RETURNING 1", [value for row in chunk for value in row]))
    return written


def _target_values(plan: _Plan, row: Row) -> list[Any]:
    values = list(row)
    for position, convert in plan.convert.items():
        if values[position] is not None:
            values[position] = convert(values[position])
    for name in plan.deferred:
        values[plan.columns.index(name)] = None
    return values


async def _copy_deferred(source: Database, target: Database, plan: _Plan, batch: int, mark: int | None) -> None:
    """Set the self references left out at insert to the source's (a correction made since included), for
    the rows up to ``mark`` (the largest id when the copy began); a reference to a row past it (a correction
    the running bot made meanwhile, not copied) stays empty, for the next copy to set."""
    columns = plan.deferred
    sets = ", ".join(f"{_quote(c)} = ?" for c in columns)
    wanted = " OR ".join(f"{_quote(c)} IS NOT NULL" for c in columns)
    key = plan.key[0]
    upto = "" if mark is None else f" AND {_quote(key)} <= {int(mark)}"
    last: Any = None
    while True:
        after = "" if last is None else f" AND {_quote(key)} > ?"
        rows = await source.fetch_all(
            f"SELECT {_quote(key)}, {', '.join(_quote(c) for c in columns)} FROM {_quote(plan.table)}"
            f" WHERE ({wanted}){upto}{after} ORDER BY {_quote(key)} LIMIT {batch}", () if last is None else (last,))
        if not rows:
            return
        values = [(*(None if mark is not None and v is not None and v > mark else v for v in row[1:]), row[0])
                  for row in rows]
        try:
            async with target.transaction() as tx:
                await tx.executemany(f"UPDATE {_quote(plan.table)} SET {sets} WHERE {_quote(key)} = ?", values)
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"linking {plan.table}'s {', '.join(columns)} in {target.url} failed: "
                               f"{type(exc).__name__}: {exc}; {FIX_SOURCE}") from exc
        last = rows[-1][0]


async def _restore_channel_counters(source: Database, target: Database, batch: int) -> None:
    """Give every channel the source's message counter and ``updated_at`` (SQLite's message trigger
    bumped both while the messages went in)."""
    last = 0
    while True:
        rows = await source.fetch_all(
            f"SELECT id, message_count, updated_at FROM channels WHERE id > ? ORDER BY id LIMIT {batch}", (last,))
        if not rows:
            return
        async with target.transaction() as tx:
            await tx.executemany("UPDATE channels SET message_count = ?, updated_at = ? WHERE id = ?",
                                 [(row[1], row[2], row[0]) for row in rows])
        last = int(rows[-1][0])


async def _check_same_rows(target: Database, plan: _Plan, rows: Sequence[Row]) -> None:
    """For the tables other rows point at by id (users, personas, channels, pairs): rows of a page that were
    not inserted must be in the target already as the same rows, under their id and with their unique name.
    Otherwise ``ON CONFLICT DO NOTHING`` kept the target's row of that name (a forgotten user, back under a
    new id here) and the rows copied after would fail on it, or point at it. Elsewhere a row left out
    (an old summary version, say) only shows in the counts at the end."""
    natural = tuple(c for c in NATURAL_KEYS.get(plan.table, ()) if c in plan.columns)
    if not natural or len(plan.key) != 1:
        return
    wanted = plan.key + natural
    positions = [plan.columns.index(c) for c in wanted]
    ids = [row[positions[0]] for row in rows]
    found = {r[0]: tuple(r) for r in await _rows_with_ids(target, plan.table, wanted, ids)}
    for row in rows:
        there = found.get(row[positions[0]])
        if there is None or there != tuple(row[p] for p in positions):
            raise StorageError(
                f"{target.url} has gone apart from this database: {plan.table} {row[positions[0]]} "
                + ("is held there by another row with the same " + ", ".join(natural) if there is None else
                   "is another row there") + " (this database changed since the earlier copy: someone was "
                "forgotten and came back, or the target was used). Copy into an empty database.")


async def _next_ids(db: Database) -> dict[str, int]:
    """The id each table would hand out next: never one a deleted row had (SQLite's sqlite_sequence,
    PostgreSQL's identity sequences), so a copy keeps that promise too."""
    if db.dialect == "sqlite":
        return {str(r[0]): int(r[1]) + 1 for r in await db.fetch_all(
            "SELECT name, max(seq) FROM sqlite_sequence GROUP BY name")}  # one row per name since migration 15
    found: dict[str, int] = {}
    for table in TABLES:
        identity = (await _shape(db, table)).identity
        if identity is not None and (next_id := await _pg_next_id(db, table, identity)) is not None:
            found[table] = next_id
    return found


async def _pg_next_id(db: Database, table: str, identity: str) -> int | None:
    """The id a PostgreSQL table's identity sequence hands out next, read from the sequence itself: one a copy set
    (``setval(…, false)``) has no "last value" yet for ``pg_sequence_last_value``, and the ids of rows deleted
    since were handed out again."""
    named = await db.fetch_one("SELECT pg_get_serial_sequence(?, ?)", (table, identity))
    if named is None or named[0] is None:
        return None
    row = await db.fetch_one(f"SELECT last_value, is_called FROM {named[0]}")  # (a name PostgreSQL quoted)
    return None if row is None else int(row[0]) + (1 if row[1] else 0)


async def _move_sequences(target: Database, source_next: dict[str, int]) -> None:
    """Every table's next id on the target: after its largest id (or new rows would collide) and no lower
    than the source's next (or the ids of rows deleted there would be handed out again)."""
    for table in TABLES:
        if target.dialect == "sqlite":
            if table not in source_next:
                continue
            row = await target.fetch_one("SELECT max(seq) FROM sqlite_sequence WHERE name = ?", (table,))
            wanted = source_next[table] - 1
            if row is None or row[0] is None:
                await target.write("INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", (table, wanted))
            elif int(row[0]) < wanted:
                await target.write("UPDATE sqlite_sequence SET seq = ? WHERE name = ?", (wanted, table))
            continue
        identity = (await _shape(target, table)).identity
        if identity is not None:  # (never lower than its own next: ids of rows deleted there stay unused too)
            wanted = max(source_next.get(table, 1), await _pg_next_id(target, table, identity) or 1)
            await target.write(
                f"SELECT setval(pg_get_serial_sequence(?, ?), greatest(coalesce(max({_quote(identity)}), 0) + 1,"
                f" CAST(? AS BIGINT)), false) FROM {_quote(table)}", (table, identity, wanted))


async def _count(db: Database, table: str) -> int:
    left_out = NOT_COPIED.get(table)
    row = await db.fetch_one(f"SELECT count(*) FROM {_quote(table)}" + (f" WHERE {left_out}" if left_out else ""))
    return int(row[0]) if row else 0


# -- planning ------------------------------------------------------------------------------------


def _plan(table: str, source: _Shape, target: _Shape) -> _Plan:
    """The columns both sides have (engine-only ones left out), converters for vectors, the key to page by."""
    if not source.types or not target.types:
        where = "source" if not source.types else "target"
        raise StorageError(f"the {where} database has no table {table}: is it a cortex-bot database?")
    columns = tuple(c for c, kind in source.types.items()
                    if c in target.types and kind not in ENGINE_ONLY_TYPES and target.types[c] not in ENGINE_ONLY_TYPES)
    key = source.key or target.key
    if not key or any(k not in columns for k in key):
        raise StorageError(f"the table {table} has no primary key both databases share: cannot copy it")
    convert: dict[int, Callable[[Any], Any]] = {}
    for position, name in enumerate(columns):
        into_vector, from_vector = target.types[name] == "vector", source.types[name] == "vector"
        if into_vector and not from_vector:
            convert[position] = _blob_to_vector
        elif from_vector and not into_vector:
            convert[position] = _vector_to_blob
    deferred = tuple(c for c in DEFERRED.get(table, ()) if c in columns)
    return _Plan(table, columns, key, convert, deferred)


def _select_sql(plan: _Plan, batch: int, bound: tuple[str, int] | None = None) -> tuple[str, str]:
    """(first page, next page after the key ``?``…) along the primary key (rows up to ``bound``: see
    ``_copy_table``)."""
    names = ", ".join(_quote(c) for c in plan.columns)
    order = ", ".join(_quote(k) for k in plan.key)
    if len(plan.key) == 1:
        after = f"{order} > ?"
    else:
        after = f"({order}) > ({', '.join('?' for _ in plan.key)})"
    base = f"SELECT {names} FROM {_quote(plan.table)}"
    column = (bound[0] or (plan.key[0] if len(plan.key) == 1 else "")) if bound is not None else ""
    limit = f"{_quote(column)} <= {int(bound[1])}" if bound is not None and column in plan.columns else None
    conditions = [c for c in (NOT_COPIED.get(plan.table), limit) if c]
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    return (f"{base}{where} ORDER BY {order} LIMIT {batch}",
            f"{base}{where}{' AND' if where else ' WHERE'} {after} ORDER BY {order} LIMIT {batch}")


async def _shape(db: Database, table: str) -> _Shape:
    if db.dialect == "sqlite":
        rows = await db.fetch_all(f"PRAGMA table_info({_quote(table)})")
        key = tuple(str(r["name"]) for r in sorted((r for r in rows if r["pk"]), key=lambda r: int(r["pk"])))
        return _Shape({str(r["name"]): str(r["type"]).lower() for r in rows}, key)
    rows = await db.fetch_all(
        "SELECT column_name, udt_name, is_identity FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND table_name = ? ORDER BY ordinal_position", (table,))
    keys = await db.fetch_all(
        "SELECT k.column_name FROM information_schema.table_constraints AS c"
        " JOIN information_schema.key_column_usage AS k ON k.constraint_name = c.constraint_name"
        " AND k.constraint_schema = c.constraint_schema AND k.table_name = c.table_name"
        " WHERE c.table_schema = current_schema() AND c.table_name = ? AND c.constraint_type = 'PRIMARY KEY'"
        " ORDER BY k.ordinal_position", (table,))
    identity = next((str(r[0]) for r in rows if r[2] == "YES"), None)
    return _Shape({str(r[0]): str(r[1]).lower() for r in rows}, tuple(str(r[0]) for r in keys), identity)


def _blob_to_vector(value: Any) -> Any:
    return np.frombuffer(bytes(value), dtype=np.float32)


def _vector_to_blob(value: Any) -> bytes:
    array = value.to_numpy() if hasattr(value, "to_numpy") else np.asarray(value)
    return bytes(np.asarray(array, dtype=np.float32).tobytes())


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# -- which database is which -----------------------------------------------------------------------


async def _identity(db: Database) -> tuple[str, ...]:
    """What tells two handles on one database apart from handles on two: the file (device and inode) for
    SQLite, the server's system identifier and the database's name for PostgreSQL (the URL's host, port and
    name when the server won't say)."""
    if db.dialect == "sqlite":
        from bot.storage.sqlite import sqlite_path

        path = sqlite_path(db.url)
        try:
            stat = os.stat(path)
        except OSError:
            return ("sqlite", str(path.resolve()))
        return ("sqlite", str(stat.st_dev), str(stat.st_ino))
    try:
        row = await db.fetch_one("SELECT system_identifier::text, current_database() FROM pg_control_system()")
    except Exception:
        row = None
    if row is not None:
        return ("postgres", str(row[0]), str(row[1]))
    parts = urlsplit(db.url)
    return ("postgres", (parts.hostname or "").lower(), str(parts.port or 5432), parts.path.lstrip("/"))
