"""The core repository: users, channels, messages, summaries, jobs, audit rows, settings; and the
:class:`Storage` handle that carries the other repositories (cortex, memory, fleet) of one database.

Written once for every engine (see ``bot.storage.engine``); forks on ``db.dialect`` are marked.

The reply path keeps database round trips few: identical user/channel upserts are answered from
memory (ids are never reused while cached: a delete drops the entries), the newest summary of a
channel is cached (invalidated by this process's writes, re-read after ``SUMMARY_CACHE_SECONDS`` for
other processes' writes), and audit rows (LLM calls, reply stats) are buffered and written in batches
(at most ``AUDIT_FLUSH_SECONDS`` late; flushed before they are read and on close). A crash can lose
that last second of audit rows, never a message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from bot import metrics
from bot.storage.admin import AdminRepository, enqueue_lock
from bot.storage.base import (
    Channel,
    Job,
    JobStatus,
    LLMCallRecord,
    MessageRole,
    ReplyMetrics,
    ReplyStats,
    StoredMessage,
    Summary,
    SummarySources,
    SummaryStatus,
    User,
)
from bot.storage.cortex import CortexRepository, ForgetReport
from bot.storage.engine import (
    Database,
    Migration,
    Row,
    StorageError,
    Tx,
    is_conflict,
    is_missing_reference,
    multi_row,
    power_chunks,
    serialise,
    stale_if_missing,
)
from bot.storage.export import ExportRepository, import_claim_key
from bot.storage.fleet import FleetRepository
from bot.storage.forgotten import keep_usage
from bot.storage.forgotten import prune as prune_forgotten
from bot.storage.incognito import IN_RUNNING, IncognitoRepository, believable, not_incognito, visible_to
from bot.storage.memory import MemoryRepository, archive_older
from bot.storage.migrations import MIGRATIONS
from bot.storage.personas import LoreRepository, PersonaRepository
from bot.storage.places import PlaceRepository
from bot.storage.ratelimits import RateLimitRepository
from bot.storage.rows import MESSAGE_COLUMNS, message_from_row
from bot.storage.rows import dt as _dt
from bot.storage.rows import ts as _ts
from bot.storage.skills import SkillAuditRepository
from bot.storage.sources import SourceRepository
from bot.storage.textsearch import restem, text_search_config
from bot.storage.unavailable import unavailable
from bot.storage.undo import UndoOfferRepository
from bot.storage.web import HealthRepository, WebLoginRepository

log = logging.getLogger(__name__)
FORGOTTEN_AUTHOR = "a forgotten user"  # who wrote a shared text, once its author asked to be forgotten
FORGOTTEN_DM = "a direct message"  # a DM channel's name once its person asked to be forgotten


def user_persona_key(user_key: str) -> str:
    """The setting holding the persona someone picked for their direct messages."""
    return f"persona.dm.{user_key}"


def channel_persona_key(channel_key: str) -> str:
    """The setting holding the persona admins picked for a channel."""
    return f"persona.channel.{channel_key}"


FORGET_ATTEMPTS = 3  # a forget-me that met a row written meanwhile runs again, this many times in all

AUDIT_FLUSH_ROWS = 64  # buffered audit rows written in one go ...
AUDIT_FLUSH_SECONDS = 1.0  # ... or after this long
AUDIT_ROWS_PER_STATEMENT = 64  # rows of one table per INSERT at most (9 parameters each: far below any cap)
SUMMARY_CACHE_SECONDS = 5.0  # how stale another process's new summary may look here
PRUNE_BATCH = 5000  # old job (or model call) rows deleted per statement
LATE_ASKED = 500  # a window's newest messages whose answers stored after a later message are looked for

# Errors of an audit write that no retry mends: a reference gone meanwhile, a value no column holds (sqlite3
# raises OverflowError for an integer over 64 bits, asyncpg a DataError for one over the column's type;
# sqlite3 a ProgrammingError for a value of a type it has no column for, and a UnicodeEncodeError for a string
# with a lone surrogate).
NEVER_FITS = frozenset({"IntegrityError", "ForeignKeyViolationError", "OverflowError", "DataError", "ProgrammingError",
                        "UnicodeError"})


def _never_fits(exc: BaseException) -> bool:
    """Whether a row failed for good (retrying cannot help), by the engines' error class names."""
    return bool({c.__name__ for c in type(exc).__mro__} & NEVER_FITS)


def _retrieved(future: asyncio.Future[None]) -> None:
    """Mark a finished flush's error as seen (its caller re-raises it; a cancelled caller no longer can)."""
    if not future.cancelled():
        future.exception()

LLM_CALL_SQL = (
    "INSERT INTO llm_calls (purpose, model, input_tokens, output_tokens, estimated_input_tokens,"
    " duration_ms, error, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
REPLY_STATS_SQL = (
    "INSERT INTO reply_stats (channel_id, message_id, history_tokens, history_budget, window_messages,"
    " trimmed_messages, summary_used, prompt_tokens, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
JOB_DONE = "locked_by = '', lease_until = 0"
MESSAGE_DEPENDENTS = ("reply_stats", "message_vectors", "reply_sources", "platform_messages")
SCRUB_PENDING = "storage.scrub-pending"  # deleted words may still sit in the database's files (see Storage.scrub)
SCRUB_SPACING = 60.0  # seconds between two scrubs that :meth:`Storage.scrub_soon` asks for


async def forget_keyed(tx: Tx, user_key: str) -> dict[str, int]:
    """What a forget-me deletes by the user's key rather than their row; the rows deleted per table. Links before
    sessions: on PostgreSQL a login using a link holds its row until it has made its session, so the sessions'
    delete after it sees that session. Texts an admin wrote for everyone (guidelines, rules, soul sections, lore,
    cortex settings) stay, no longer naming them. copy-data runs it on a target for the users the source no
    longer has (``bot.storage.copy``), so it adds no rows (the forget-me's ``keep_usage`` would add them under ids
    the source hands out too): the forget-me notes their usage before it."""
    deleted = dict.fromkeys(("skill_executions", "web_links", "web_sessions", "settings"), 0)
    for table in ("skill_executions", "web_links", "web_sessions"):
        deleted[table] = len(await tx.fetch_all(f"DELETE FROM {table} WHERE user_key = ? RETURNING 1", (user_key,)))
    deleted["settings"] = len(await tx.fetch_all("DELETE FROM settings WHERE key IN (?, ?) RETURNING 1",
                                                 (user_persona_key(user_key), import_claim_key(user_key))))
    for table, column in (("versioned_texts", "author"), ("lore_entries", "created_by"),
                          ("cortex_settings", "updated_by")):
        await tx.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = ?", (FORGOTTEN_AUTHOR, user_key))
    suffix = f" by {user_key}"  # a card import's reason names its importer: "imported from cora.png by discord:1"
    await tx.execute("UPDATE versioned_texts SET reason = substr(reason, 1, length(reason) - ?) || ?"
                     " WHERE length(reason) >= ? AND substr(reason, length(reason) - ? + 1) = ?",
                     (len(suffix), f" by {FORGOTTEN_AUTHOR}", len(suffix), len(suffix), suffix))
    return deleted


def _attempt_fence(attempt: int | None) -> tuple[str, tuple[int, ...]]:
    """The condition (and its parameter) that a job is still in its claim ``attempt`` (None: any)."""
    return ("", ()) if attempt is None else (" AND attempts = ?", (attempt,))


async def note_scrub_pending(tx: Tx) -> None:
    """Note, in the transaction that deletes someone's words, that the files still hold them until a scrub:
    a process stopped before its scrub leaves the note for the next start or the hourly check."""
    await tx.execute("INSERT INTO settings (key, value, updated_at) VALUES (?, '1', ?)"
                     " ON CONFLICT (key) DO UPDATE SET updated_at = excluded.updated_at", (SCRUB_PENDING, time.time()))


# "This memory item was remembered from one of the messages ``{where}`` selects" (by its platform key).
ITEM_FROM_MESSAGES = ("source_ref IN (SELECT p.key FROM platform_messages AS p"
                      " WHERE p.message_id IN (SELECT id FROM messages WHERE {where}))")


async def delete_items_from(tx: Tx, where: str, params: Sequence[Any]) -> int:
    """Delete the memory items remembered from the messages ``where`` selects (named by their platform keys),
    before those go: an incognito stretch's, whose words may not outlive it in an item. A correction they made
    is undone (the corrected item shows again); how many went."""
    ids = [int(r[0]) for r in await tx.fetch_all(
        f"SELECT id FROM memory_items WHERE {ITEM_FROM_MESSAGES.format(where=where)}", params)]
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        marks = ",".join("?" for _ in chunk)
        for column in ("supersedes", "superseded_by"):
            await tx.execute(f"UPDATE memory_items SET {column} = NULL WHERE {column} IN ({marks})", chunk)
        await tx.execute(f"DELETE FROM memory_items WHERE id IN ({marks})", chunk)
    return len(ids)


async def delete_stretch(tx: Tx, where: str, params: Sequence[Any]) -> list[int]:
    """Delete an incognito stretch's messages (``where``) with the items remembered from them; the messages'
    ids."""
    await delete_items_from(tx, where, params)
    deleted, _ = await delete_messages(tx, where, params)
    return deleted


async def delete_messages(tx: Tx, where: str, params: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Delete the messages ``where`` selects, first everything that points at them, and recount their
    channels (forget-me, the end of an incognito stretch, retention); (message ids, channel ids)."""
    channels = [int(r[0]) for r in await tx.fetch_all(f"SELECT DISTINCT channel_id FROM messages WHERE {where}",
                                                      params)]
    # The channel's summaries (and a direct message's name) outlive the messages: who wrote them is kept.
    await tx.execute("INSERT INTO channel_speakers (channel_id, user_id) SELECT DISTINCT channel_id, user_id"
                     f" FROM messages WHERE ({where}) AND user_id IS NOT NULL"
                     " ON CONFLICT (channel_id, user_id) DO NOTHING", params)
    # The message after each one in its channel was embedded with it as its context: its vector goes too, and
    # the backfill embeds it again with what is left before it (a forgotten user's words stay in nobody's).
    # Dropped once the messages are gone: a backfill storing such a vector meanwhile (PostgreSQL) holds the
    # message it was made with (``MemoryRepository.store_message_vectors``), so that delete waits for it.
    after = await _messages_after(tx, where, params)
    for table in MESSAGE_DEPENDENTS:
        await tx.execute(f"DELETE FROM {table} WHERE message_id IN (SELECT id FROM messages WHERE {where})", params)
    deleted = [int(r[0]) for r in await tx.fetch_all(f"DELETE FROM messages WHERE {where} RETURNING id", params)]
    await _delete_vectors(tx, after)
    marks = ",".join("?" for _ in channels) or "NULL"
    await tx.execute("UPDATE channels SET message_count = (SELECT count(*) FROM messages"
                     f" WHERE channel_id = channels.id) WHERE id IN ({marks})", channels)
    if deleted:
        await note_scrub_pending(tx)
    return deleted, channels
async def _messages_after(tx: Tx, where: str, params: Sequence[Any]) -> list[int]:
    """The message after each one ``where`` selects, in its channel (embedded with it as its context)."""
    return [int(r[0]) for r in await tx.fetch_all(
        "SELECT DISTINCT (SELECT min(n.id) FROM messages AS n WHERE n.channel_id = messages.channel_id"
        f" AND n.id > messages.id) FROM messages WHERE {where}", params) if r[0] is not None]


async def _delete_vectors(tx: Tx, message_ids: Sequence[int]) -> None:
    for start in range(0, len(message_ids), 500):
        chunk = message_ids[start:start + 500]
        await tx.execute(f"DELETE FROM message_vectors WHERE message_id IN ({','.join('?' for _ in chunk)})", chunk)


def _job_payload(job_id: int, text: Any) -> dict[str, Any]:
    """A job's payload; one that is not a JSON object (a hand-edited row, a copy from elsewhere) is read as empty,
    so its handler fails the job at once instead of every claim of it failing before it runs."""
    try:
        payload = json.loads(text)
    except (TypeError, ValueError):
        payload = None
    if not isinstance(payload, dict):
        log.warning("job %d has a payload that is not a JSON object; its handler gets an empty one", job_id)
        return {}
    return payload


ELSEWHERE = "point [storage] at another database"  # what to do instead of upgrading (the configured database)
SQLITE_TEXT_INDEXES = ("memory_fts", "messages_fts")  # merged after forget-me (SQLite's FTS5 tables)


class Storage:
    """One database: the core's records directly, the cortex, memory and fleet repositories as attributes."""

    def __init__(self, db: Database, *, migrations: Sequence[Migration] = MIGRATIONS) -> None:
        self.db = db
        self._migrations = tuple(sorted(migrations, key=lambda m: m.version))
        caches = db.caches
        self._users: dict[str, User] = caches.named("core.users")
        self._channels: dict[str, Channel] = caches.named("core.channels")
        self._summaries: dict[int, tuple[float, Summary | None]] = caches.named("core.summaries")
        self._audit: list[tuple[str, tuple[Any, ...]]] = []
        self._audit_timer: asyncio.Task[None] | None = None
        self._audit_lock = asyncio.Lock()  # one flush at a time: a later one waits for the rows of the one before
        self._audit_writing: asyncio.Future[None] | None = None
        self._scrubbed_at = -math.inf  # (monotonic) when this process last scrubbed
        self._scrub_timer: asyncio.Task[None] | None = None
        self.cortex = CortexRepository(db)
        self.memory = MemoryRepository(db)
        self.fleet = FleetRepository(db)
        self.personas = PersonaRepository(db)
        self.places = PlaceRepository(db)
        self.lore = LoreRepository(db)
        self.export = ExportRepository(db)
        self.sources = SourceRepository(db)
        self.incognito = IncognitoRepository(db)
        self.skills = SkillAuditRepository(db)
        self.web = WebLoginRepository(db)
        self.health = HealthRepository(db)
        self.admin = AdminRepository(db)
        self.rate_limits = RateLimitRepository(db)
        self.undo_offers = UndoOfferRepository(db)

    async def sibling(self) -> Storage:
        """A second handle on the same database sharing caches (see ``Database.sibling``)."""
        return Storage(await self.db.sibling(), migrations=self._migrations)

    async def close(self) -> None:
        if self._audit_timer is not None:
            self._audit_timer.cancel()
        if self._scrub_timer is not None:  # (its note stays: the next start scrubs)
            self._scrub_timer.cancel()
        await self.memory.close()
        try:
            await self.flush_audit()
        except Exception:
            log.exception("could not write %d buffered audit rows at close", len(self._audit))
        finally:
            await self.db.close()

    # -- migrations ------------------------------------------------------------------------------

    async def applied_migrations(self) -> list[int]:
        return await self.db.applied_migrations()

    async def pending_migrations(self) -> list[int]:
        done = set(await self.applied_migrations())
        self._refuse_newer(done)
        return [m.version for m in self._migrations if m.version not in done]

    async def migrate(self, *, elsewhere: str = ELSEWHERE) -> list[int]:
        """Apply the pending migrations; a database a newer cortex-bot upgraded is refused, saying to upgrade or
        to use another database (``elsewhere``: how, for the setting that named this one)."""
        self._refuse_newer(set(await self.applied_migrations()), elsewhere)
        return await self.db.migrate(self._migrations)

    async def start_incognito(self, user_id: int, persona: str, at: datetime | None = None) -> tuple[float, int]:
        """Begin the pair's incognito stretch, or keep the running one (``IncognitoRepository.start``); its
        start, and how many of its messages had been handled already. It starts when the platform says the
        pause was sent, so messages sent after it but handled first (answered as usual) are in it: what was made
        of them goes now. Their channels' summaries from the first of them on are dropped (written again
        without them) and items remembered from them deleted."""
        running = await self.incognito.since(user_id, persona)
        if running is not None:  # (its messages were handled as the stretch's)
            return running, 0
        started = await self.incognito.start(user_id, persona, at)
        stretch = ("user_id = ? AND persona = ? AND created_at >= ?", (user_id, persona, started))
        async with self.db.transaction() as tx:
            firsts = await tx.fetch_all(  # (the person's own messages are counted, not the replies)
                "SELECT channel_id, min(id), sum(CASE WHEN role = 'user' THEN 1 ELSE 0 END) FROM messages"
                f" WHERE {stretch[0]} GROUP BY channel_id", stretch[1])
            for channel_id, first, _ in firsts:
                await tx.execute("DELETE FROM summaries WHERE channel_id = ? AND covers_to_id >= ?",
                                 (channel_id, first))
            if firsts:
                await delete_items_from(tx, *stretch)
                # and their vectors (embedded before the pause reached the bot), with those of the messages after
                # them (embedded with them as context): the backfill leaves the stretch alone from now on
                stretch_ids = [int(r[0]) for r in await tx.fetch_all(f"SELECT id FROM messages WHERE {stretch[0]}",
                                                                     stretch[1])]
                await _delete_vectors(tx, stretch_ids + await _messages_after(tx, *stretch))
        self.forget_cached(user_key="", channel_ids=[int(r[0]) for r in firsts])
        return started, sum(int(r[2]) for r in firsts)

    async def end_incognito(self, user_id: int, persona: str, at: datetime | None = None) -> int | None:
        """End the pair's incognito stretch (``at``: when the platform says the resume was sent, else now): its
        messages (the user's and the replies) go, with what points at them, in one transaction; how many (None
        when there was no stretch). The stretch is remembered as ended for ``ENDED_KEPT_SECONDS`` (a message
        sent in it and stored after this is found by its time). A user row that only carried the stretch over
        a forget-me (no name, nothing else stored) goes instead."""
        await self.flush_audit()  # buffered reply stats may point at messages deleted below
        async with self.db.transaction() as tx:
            row = await tx.fetch_one("SELECT started_at FROM incognito WHERE user_id = ? AND persona = ?",
                                     (user_id, persona))
            if row is None:
                return None
            started = float(row[0])
            deleted = await delete_stretch(tx, "user_id = ? AND persona = ? AND created_at >= ?",
                                           (user_id, persona, started))
            await tx.execute("DELETE FROM incognito WHERE user_id = ? AND persona = ?", (user_id, persona))
            believed = believable(at)
            ended = max(started, believed.timestamp() if believed is not None else time.time())
            await tx.execute("INSERT INTO incognito_ended (user_key, persona, started_at, ended_at)"
                             " SELECT key, ?, ?, ? FROM users WHERE id = ? ON CONFLICT DO NOTHING",
                             (persona, started, ended, user_id))
            bare = await self._drop_bare_user(tx, user_id)
        if bare is not None:
            self.forget_cached(user_key=bare)
        return len(deleted)

    @staticmethod
    async def _drop_bare_user(tx: Tx, user_id: int) -> str | None:
        """Delete the user's row at the end of a stretch when nothing else of them is stored: the key-only row a
        forget-me kept for a pause (``_keep_incognito``), with the name a message of the stretch wrote into it
        since (it stayed, naming someone of whom nothing else was kept); its key, or None when it stays."""
        row = await tx.fetch_one(
            "SELECT key FROM users WHERE id = ?"
            " AND NOT EXISTS (SELECT 1 FROM messages WHERE user_id = ?)"
            " AND NOT EXISTS (SELECT 1 FROM cortex_pairs WHERE user_id = ?)"
            " AND NOT EXISTS (SELECT 1 FROM incognito WHERE user_id = ?)", (user_id,) * 4)
        if row is None:
            return None
        await tx.execute("DELETE FROM channel_speakers WHERE user_id = ?", (user_id,))  # (its stretch's)
        await tx.execute("DELETE FROM undo_offers WHERE user_id = ?", (user_id,))
        await tx.execute("DELETE FROM users WHERE id = ?", (user_id,))  # (its ended stretches stay, by key)
        return str(row[0])

    async def sweep_ended_incognito(self, before: float) -> int:
        """Forget the stretches that ended before ``before``, deleting the messages sent in them that were
        stored after their end and are still there (the reply path deletes its own; one whose process stopped
        first is left); how many such messages went."""
        await self.flush_audit()
        async with self.db.transaction() as tx:
            ended = await tx.fetch_all("DELETE FROM incognito_ended WHERE ended_at < ?"
                                       " RETURNING user_key, persona, started_at, ended_at", (before,))
            late = 0
            for user_key, persona, started, until in ended:
                deleted = await delete_stretch(
                    tx, "user_id IN (SELECT id FROM users WHERE key = ?) AND persona = ? AND created_at >= ?"
                    " AND created_at < ?", (str(user_key), str(persona), float(started), float(until)))
                late += len(deleted)
        return late

    async def withdraw_message(self, key: str, now: float, author_key: str | None = None) -> tuple[bool, int]:
        """A platform message (``matrix-message:$event``) its author or a moderator took back: the user's
        message it was (linked when it was stored) goes with what points at it, and with it the bot's reply to
        it (which often repeats it), and memory items remembered from it are archived. With ``author_key``
        (whose it was, as the platform says) only that user's message and items; without (a platform that
        vouches for its deletions, or a moderator taking back one of the bot's replies) whoever's they are; a
        reply of the bot's taken back goes alone. (Whether a message went, how many items were archived.)"""
        await self.flush_audit()  # buffered reply stats may point at it
        async with self.db.transaction() as tx:
            row = await tx.fetch_one(
                "SELECT m.id, m.user_id, u.key, m.role FROM platform_messages AS p"
                " JOIN messages AS m ON m.id = p.message_id JOIN users AS u ON u.id = m.user_id WHERE p.key = ?"
                + ("" if author_key is None else " AND m.role = 'user'"), (key,))
            if row is not None and author_key is not None and str(row[2]) != author_key:
                row = None  # someone else's message under that key: not this withdrawal's
            if row is not None and row[3] != "user":  # the bot's reply, taken back by a moderator
                await delete_messages(tx, "id = ?", (int(row[0]),))
                return True, 0
            if row is not None:
                # (with the reply to it, stored as answering it: replies in one channel may be stored out of order)
                await delete_messages(tx, "id = ? OR reply_to = ?", (int(row[0]), int(row[0])))
                user_id: int | None = int(row[1])
            else:  # not stored (a message not for the bot): the author's items remembered from it still go
                owner = await tx.fetch_one("SELECT id FROM users WHERE key = ?", (author_key,)) if author_key else None
                user_id = int(owner[0]) if owner is not None else None
        if author_key is not None and user_id is None:
            return False, 0  # nothing of theirs is stored
        archived = await self.memory.archive_from(None, key, "its message was deleted", now, user_id=user_id)
        return row is not None, len(archived)

    async def withdraw_channel(self, channel_key: str, now: float) -> tuple[int, int]:
        """A channel (a thread, a forum post) deleted on its platform, and every message in it with it: the
        stored messages go with what points at them, the channel's summaries too, and memory items remembered
        from its messages (or filed under the channel, as a typed `!memory remember` was before it was filed
        under its own message) are archived, restorable by their owners. A typed command's message is not
        stored: an item remembered with one stays (deleting that message archives it).
        (Messages deleted, items archived.)"""
        await self.flush_audit()  # buffered reply stats may point at its messages
        async with self.db.transaction() as tx:
            row = await tx.fetch_one("SELECT id FROM channels WHERE key = ?", (channel_key,))
            if row is None:
                return 0, 0
            channel_id = int(row[0])
            from_its_messages = ITEM_FROM_MESSAGES.format(where="channel_id = ?")
            archived = await tx.fetch_all(
                "UPDATE memory_items SET archived_at = ?, archive_reason = ? WHERE archived_at IS NULL"
                f" AND superseded_by IS NULL AND (source_ref = ? OR {from_its_messages}) RETURNING id",
                (now, "its channel was deleted", channel_key, channel_id))
            await archive_older(tx, [int(r[0]) for r in archived], now)
            deleted, _ = await delete_messages(tx, "channel_id = ?", (channel_id,))
            await tx.execute("DELETE FROM summaries WHERE channel_id = ?", (channel_id,))
        self.forget_cached(user_key="", channel_ids=[channel_id])
        return len(deleted), len(archived)

    async def delete_messages_before(self, before: float) -> int:
        """Retention: every message older than ``before`` goes, with what points at it; how many."""
        await self.flush_audit()
        async with self.db.transaction() as tx:
            deleted, _ = await delete_messages(tx, "created_at < ?", (before,))
        return len(deleted)

    async def delete_message(self, message_id: int) -> None:
        """One message goes, with what points at it (a reply whose incognito stretch ended while it was written)."""
        async with self.db.transaction() as tx:
            await delete_messages(tx, "id = ?", (message_id,))

    async def scrub(self) -> None:
        """After deleting someone's data: leave no trace of it in the database's files where the engine
        can (see ``Database.scrub``), and clear the note of deletions made before it began."""
        began = time.time()
        self._scrubbed_at = time.monotonic()
        if await self.db.scrub(SQLITE_TEXT_INDEXES):
            await self.db.write("DELETE FROM settings WHERE key = ? AND updated_at <= ?", (SCRUB_PENDING, began))

    async def scrub_soon(self) -> None:
        """Scrub now, or, when this process scrubbed less than :data:`SCRUB_SPACING` ago, once that has passed
        (one scrub waits for all the deletions meanwhile). A scrub merges the whole database's full-text
        indexes under the write lock (a second and more at a few hundred thousand messages): a user pausing
        and resuming in a loop had every other user's writes wait that long, each time."""
        wait = self._scrubbed_at + SCRUB_SPACING - time.monotonic()
        if wait <= 0:
            await self.scrub()
        elif self._scrub_timer is None or self._scrub_timer.done():
            self._scrub_timer = asyncio.create_task(self._scrub_after(wait), name="scrub-soon")

    async def _scrub_after(self, wait: float) -> None:
        await asyncio.sleep(wait)
        try:
            await self.scrub_if_pending()
        except Exception:  # the note stays: the hourly check or the next start scrubs
            log.exception("scrubbing the database's files after deletions failed")

    async def scrub_if_pending(self) -> bool:
        """Scrub when a deletion's note says it was not yet (a process stopped between a forget-me's commit
        and its scrub, or a message its author took back, which is not scrubbed at once); whether it did."""
        if await self.get_setting(SCRUB_PENDING) is None:
            return False
        await self.scrub()
        return True

    async def check_writable(self) -> None:
        """Write to the database without changing its data (``cortexbot doctor``)."""
        await self.db.write("CREATE TEMP TABLE IF NOT EXISTS doctor_probe (x INTEGER)")

    def _refuse_newer(self, applied: set[int], elsewhere: str = ELSEWHERE) -> None:
        known = max((m.version for m in self._migrations), default=0)
        newer = sorted(v for v in applied if v > known)
        if newer:
            raise StorageError(
                f"the database {self.db.url} was upgraded by a newer cortex-bot (schema version {newer[-1]}; this "
                f"one knows up to {known}): upgrade cortex-bot, or {elsewhere}"
            )

    # -- users, personas, channels ---------------------------------------------------------------

    async def upsert_user(self, key: str, display_name: str) -> User:
        cached = self._users.get(key)
        if cached is not None and cached.display_name == display_name:
            return cached
        now = time.time()
        row = await self.db.write_one(
            "INSERT INTO users (key, display_name, created_at, updated_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET display_name = excluded.display_name, updated_at = excluded.updated_at"
            " RETURNING id, key, display_name",
            (key, display_name, now, now),
        )
        assert row is not None
        user = User(int(row["id"]), str(row["key"]), str(row["display_name"]))
        self._users[key] = user
        return user

    async def get_user(self, key: str) -> User | None:
        row = await self.db.fetch_one("SELECT id, key, display_name FROM users WHERE key = ?", (key,))
        return None if row is None else User(int(row["id"]), str(row["key"]), str(row["display_name"]))

    async def upsert_persona(self, name: str, language: str = "") -> None:
        """Record the persona (names are unique regardless of case) with the full-text configuration of
        its language (used by PostgreSQL's full text; SQLite stems English for every persona)."""
        config = text_search_config(language)
        row = await self.db.fetch_one("SELECT ts_config FROM personas WHERE lower(name) = lower(?)", (name,))
        if row is None:
            await self.db.write(
                "INSERT INTO personas (name, created_at, ts_config) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                (name, time.time(), config),
            )
        elif str(row[0]) != config:
            async with self.db.transaction() as tx:
                await tx.execute("UPDATE personas SET ts_config = ? WHERE lower(name) = lower(?)", (config, name))
                await restem(tx, self.db.dialect, name)

    async def settings_with_prefix(self, prefix: str) -> list[tuple[str, str]]:
        rows = await self.db.fetch_all(
            "SELECT key, value FROM settings WHERE substr(key, 1, length(?)) = ? ORDER BY key", (prefix, prefix))
        return [(str(r[0]), str(r[1])) for r in rows]

    async def upsert_channel(self, key: str, name: str, is_dm: bool) -> Channel:
        cached = self._channels.get(key)
        if cached is not None and (cached.name, cached.is_dm) == (name, is_dm):
            return cached
        now = time.time()
        row = await self.db.write_one(
            "INSERT INTO channels (key, name, is_dm, created_at, updated_at) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET name = excluded.name, is_dm = excluded.is_dm,"
            " updated_at = excluded.updated_at RETURNING *",
            (key, name, int(is_dm), now, now),
        )
        assert row is not None
        channel = self._channel(row)
        self._channels[key] = channel
        return channel

    async def get_channel(self, key: str) -> Channel | None:
        row = await self.db.fetch_one("SELECT * FROM channels WHERE key = ?", (key,))
        return None if row is None else self._channel(row)

    async def count_messages(self, channel_id: int) -> int:
        row = await self.db.fetch_one("SELECT message_count FROM channels WHERE id = ?", (channel_id,))
        return int(row[0]) if row else 0

    @staticmethod
    def _channel(row: Row) -> Channel:
        return Channel(int(row["id"]), str(row["key"]), str(row["name"]), bool(row["is_dm"]))

    # -- messages --------------------------------------------------------------------------------

    async def add_message(
        self,
        channel_id: int,
        user_id: int | None,
        persona: str,
        role: MessageRole,
        author_name: str,
        text: str,
        token_count: int,
        created_at: datetime | None = None,
        reply_to: int | None = None,
        outside_stretch_from: datetime | None = None,
    ) -> StoredMessage:
        with stale_if_missing(f"user {user_id} or channel {channel_id} no longer exists"):
            return await self._add_message(channel_id, user_id, persona, role, author_name, text, token_count,
                                           _ts(created_at), reply_to, outside_stretch_from)

    async def _add_message(
        self, channel_id: int, user_id: int | None, persona: str, role: MessageRole, author_name: str, text: str,
        token_count: int, ts: float, reply_to: int | None = None, outside_stretch_from: datetime | None = None,
    ) -> StoredMessage:
        pg = self.db.dialect == "postgres"
        params: list[Any] = [channel_id, user_id, persona, role, author_name, text, token_count, ts]

        def mark(value: Any, cast: str = "") -> str:
            params.append(value)
            return f"${len(params)}{cast}" if pg else f"?{len(params)}"

        # (named only for a reply: a user's message answers nothing, and the column is younger than the table)
        column, value = (", reply_to", ", " + mark(reply_to, "::bigint")) if reply_to is not None else ("", "")
        stamp = "$8" if pg else "?8"
        if outside_stretch_from is not None:
            since = mark(outside_stretch_from.timestamp(), "::double precision")
            stamp = (f"CASE WHEN EXISTS (SELECT 1 FROM incognito WHERE user_id = {'$2::bigint' if pg else '?2'}"
                     f" AND persona = {'$3' if pg else '?3'} AND started_at > {since}) THEN {since} ELSE {stamp} END")
        if pg:
            # One statement: bumping the counter locks the channel's row, so concurrent inserts into one
            # channel (from any process) get consecutive positions.
            row = await self.db.write_one(
                "WITH c AS (UPDATE channels SET message_count = message_count + 1, updated_at = $8"
                " WHERE id = $1 RETURNING message_count)"
                " INSERT INTO messages (channel_id, user_id, persona, role, author_name, text, token_count, seq,"
                f" created_at{column}) SELECT $1, $2::bigint, $3, $4, $5, $6, $7::integer, c.message_count, {stamp}"
                f"{value} FROM c RETURNING id, seq, created_at",
                params,
            )
        else:
            # One statement: its seq is the channel's count so far + 1, and the trigger bumps the count.
            row = await self.db.write_one(
                "INSERT INTO messages (channel_id, user_id, persona, role, author_name, text, token_count, seq,"
                f" created_at{column}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7,"
                f" (SELECT message_count + 1 FROM channels WHERE id = ?1), {stamp}{value})"
                " RETURNING id, seq, created_at",
                params,
            )
        if row is None:
            raise StorageError(f"channel {channel_id} does not exist")
        return StoredMessage(
            int(row[0]), channel_id, user_id, persona, role, author_name, text, token_count, int(row[1]),
            _dt(float(row[2])), reply_to,
        )

    async def recent_messages(
        self, channel_id: int, limit: int, before_id: int | None = None, *, viewer: tuple[int, str] | None = None,
        since: float | None = None,
    ) -> list[StoredMessage]:
        where = "channel_id = ? AND id < ?"
        params: list[object] = [channel_id, before_id if before_id is not None else 2**62]
        if viewer is not None:  # a stretch is answered in its own conversation only (not for Bob in a group, ...)
            where, params = f"{where} AND {visible_to('m')}", [*params, *viewer]
        if since is not None:
            where, params = f"{where} AND created_at >= ?", [*params, since]
        rows = await self.db.fetch_all(
            f"SELECT {MESSAGE_COLUMNS} FROM messages AS m WHERE {where} ORDER BY id DESC LIMIT ?", (*params, limit))
        return [message_from_row(r) for r in rows]

    async def message_time(self, message_id: int) -> datetime | None:
        row = await self.db.fetch_one("SELECT created_at FROM messages WHERE id = ?", (message_id,))
        return None if row is None else _dt(row[0])

    async def messages_between(
        self, channel_id: int, after_id: int, before_id: int, limit: int
    ) -> list[StoredMessage]:
        rows = await self.db.fetch_all(
            f"SELECT {MESSAGE_COLUMNS} FROM messages AS m WHERE channel_id = ? AND id > ? AND id < ?"
            f" AND {not_incognito('m')} ORDER BY id LIMIT ?",
            (channel_id, after_id, before_id, limit),
        )
        return [message_from_row(r) for r in rows]

    async def answers_after(
        self, channel_id: int, message_id: int, asked: Sequence[int], viewer: tuple[int, str]
    ) -> tuple[bool, list[StoredMessage]]:
        exists = await self.db.fetch_one("SELECT 1 FROM messages WHERE id = ?", (message_id,)) is not None
        asked = sorted(set(asked))[-LATE_ASKED:]  # (the newest: an answer comes soon after its message)
        if not exists or not asked:
            return exists, []
        rows = await self.db.fetch_all(
            f"SELECT {MESSAGE_COLUMNS} FROM messages AS m WHERE channel_id = ? AND id > ? AND role = 'assistant'"
            f" AND reply_to IN ({','.join('?' * len(asked))}) AND {visible_to('m')} ORDER BY id",
            (channel_id, message_id, *asked, *viewer))
        return exists, [message_from_row(r) for r in rows]

    async def count_messages_between(self, channel_id: int, after_id: int, before_id: int) -> int:
        row = await self.db.fetch_one(
            "SELECT count(*) FROM messages WHERE channel_id = ? AND id > ? AND id < ?",
            (channel_id, after_id, before_id),
        )
        return int(row[0]) if row else 0

    # -- summaries -------------------------------------------------------------------------------

    @staticmethod
    def _summary(row: Row) -> Summary:
        return Summary(
            id=int(row["id"]),
            channel_id=int(row["channel_id"]),
            version=int(row["version"]),
            text=str(row["text"]),
            covers_from_id=int(row["covers_from_id"]),
            covers_to_id=int(row["covers_to_id"]),
            covers_to_seq=int(row["covers_to_seq"]),
            token_count=int(row["token_count"]),
            model=str(row["model"]),
            status=row["status"],
            reason=str(row["reason"]),
            created_at=_dt(float(row["created_at"])),
        )

    async def latest_summary(self, channel_id: int) -> Summary | None:
        cached = self._summaries.get(channel_id)
        if cached is not None and time.monotonic() - cached[0] < SUMMARY_CACHE_SECONDS:
            return cached[1]
        row = await self.db.fetch_one(
            "SELECT * FROM summaries WHERE channel_id = ? AND status = 'ok' ORDER BY version DESC LIMIT 1",
            (channel_id,),
        )
        summary = None if row is None else self._summary(row)
        self._summaries[channel_id] = (time.monotonic(), summary)
        return summary

    async def add_summary(
        self,
        channel_id: int,
        text: str,
        covers_from_id: int,
        covers_to_id: int,
        token_count: int,
        model: str,
        status: SummaryStatus = "ok",
        reason: str = "",
        *,
        made_from: SummarySources | None = None,
    ) -> Summary | None:
        # One statement: the next version number, the check of what it was made from and the insert are
        # atomic together (a forget-me deleting a message it folds in makes it a summary of nobody's words).
        fence, fenced = "", []
        if made_from is not None:
            ids = list(made_from.messages)
            # PostgreSQL: the rows are locked while counted, so a forget-me deleting them meanwhile is waited
            # for (and then they are gone) instead of counted from before it.
            lock = " FOR SHARE" if self.db.dialect == "postgres" else ""
            marks = ", ".join("?" * len(ids))
            # (and none of them is in an incognito stretch now: a pause that came while the summary was written
            # made them the stretch's, which no summary may keep)
            fence = (f" HAVING (SELECT count(*) FROM (SELECT 1 FROM messages WHERE id IN ({marks}){lock}) AS m) = ?"
                     f" AND NOT EXISTS (SELECT 1 FROM messages AS sm WHERE sm.id IN ({marks})"
                     f" AND {IN_RUNNING.format(m='sm')})" if ids else " HAVING TRUE")
            fenced = [*ids, len(ids), *ids] if ids else []
            # ... and the summary it continues is still there and still the newest: a late run (its worker
            # stalled while another wrote a newer one) would put an older range on top.
            newer = " AND NOT EXISTS (SELECT 1 FROM summaries WHERE channel_id = ? AND status = 'ok' AND id > ?)"
            if made_from.previous is not None:
                fence += " AND EXISTS (SELECT 1 FROM summaries WHERE id = ?)" + newer
                fenced += [made_from.previous, channel_id, made_from.previous]
            else:
                fence += newer
                fenced += [channel_id, 0]
        row = await self.db.write_one(
            "INSERT INTO summaries (channel_id, version, text, covers_from_id, covers_to_id, covers_to_seq,"
            " token_count, model, status, reason, created_at)"
            " SELECT CAST(? AS BIGINT), coalesce(max(version), 0) + 1, CAST(? AS TEXT), CAST(? AS BIGINT),"
            " CAST(? AS BIGINT), coalesce((SELECT seq FROM messages WHERE id = ?), 0), CAST(? AS INTEGER),"
            " CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS DOUBLE PRECISION) FROM summaries"
            f" WHERE channel_id = ?{fence} RETURNING *",
            (channel_id, text, covers_from_id, covers_to_id, covers_to_id, token_count, model, status, reason,
             time.time(), channel_id, *fenced),
        )
        if row is None:
            return None
        summary = self._summary(row)
        metrics.observe_summary(summary.status == "ok")
        if summary.status == "ok":
            self._summaries[channel_id] = (time.monotonic(), summary)
        return summary

    async def list_summaries(self, channel_id: int) -> list[Summary]:
        rows = await self.db.fetch_all("SELECT * FROM summaries WHERE channel_id = ? ORDER BY version", (channel_id,))
        return [self._summary(r) for r in rows]

    # -- jobs ------------------------------------------------------------------------------------

    @staticmethod
    def _job(row: Row) -> Job:
        return Job(
            id=int(row["id"]),
            kind=str(row["kind"]),
            key=str(row["key"]),
            payload=_job_payload(int(row["id"]), row["payload"]),
            status=row["status"],
            attempts=int(row["attempts"]),
            max_attempts=int(row["max_attempts"]),
            run_after=_dt(float(row["run_after"])),
            last_error=str(row["last_error"]),
            locked_by=str(row["locked_by"]),
            created_at=_dt(float(row["created_at"])),
            updated_at=_dt(float(row["updated_at"])),
        )

    async def enqueue_job(
        self,
        kind: str,
        key: str,
        payload: dict[str, Any],
        max_attempts: int,
        *,
        dedupe: bool = True,
        run_after: datetime | None = None,
    ) -> Job | None:
        now = await self.db.now()
        due = now if run_after is None else await self._on_db_clock(run_after)
        # One statement, so the duplicate check and the insert are atomic without a transaction.
        duplicate = (
            "NOT EXISTS (SELECT 1 FROM jobs WHERE kind = ? AND key = ? AND status = 'queued')" if dedupe else "1 = 1"
        )
        sql = ("INSERT INTO jobs (kind, key, payload, status, max_attempts, run_after, created_at, updated_at)"
               " SELECT CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS TEXT), 'queued', CAST(? AS INTEGER),"
               " CAST(? AS DOUBLE PRECISION), CAST(? AS DOUBLE PRECISION), CAST(? AS DOUBLE PRECISION)"
               f" WHERE {duplicate} RETURNING *")
        params = (kind, key, json.dumps(payload), max_attempts, due, now, now, *((kind, key) if dedupe else ()))
        if dedupe and self.db.dialect == "postgres":
            # Each statement there sees the rows committed when it began: two enqueues at once would each find
            # no queued job and both insert. Enqueues of one kind and key take turns (SQLite's write lock does).
            async with self.db.transaction() as tx:
                await serialise(self.db, tx, enqueue_lock(kind, key))
                row = await tx.fetch_one(sql, params)
        else:
            row = await self.db.write_one(sql, params)
        return None if row is None else self._job(row)

    async def claim_job(self, worker: str, kinds: Sequence[str], lease_seconds: float) -> Job | None:
        """Take the oldest runnable queued job whose key has no running job, in one statement.

        A partial unique index allows one running job per key: when two processes take two jobs of one
        key at the same moment (PostgreSQL), one of them fails on it and looks again."""
        if not kinds:
            return None
        marks = ",".join("?" for _ in kinds)
        skip_locked = " FOR UPDATE SKIP LOCKED" if self.db.dialect == "postgres" else ""
        runnable = (
            f"SELECT id FROM jobs AS j WHERE status = 'queued' AND run_after <= ? AND kind IN ({marks})"
            " AND NOT EXISTS (SELECT 1 FROM jobs AS r WHERE r.key = j.key AND r.status = 'running')"
            " ORDER BY run_after, id LIMIT 1"
        )
        for _attempt in range(3):
            now = await self.db.now()
            # Idle workers poll: look first without taking a write lock.
            if await self.db.fetch_one(runnable, (now, *kinds)) is None:
                return None
            try:
                row = await self.db.write_one(
                    "UPDATE jobs SET status = 'running', attempts = attempts + 1, locked_by = ?, lease_until = ?,"
                    f" updated_at = ? WHERE id = ({runnable}{skip_locked}) RETURNING *",
                    (worker, now + lease_seconds, now, now, *kinds),
                )
            except Exception as exc:
                if not is_conflict(exc):
                    raise
                continue
            return None if row is None else self._job(row)
        return None

    async def renew_lease(self, job_id: int, worker: str, lease_seconds: float, *, attempt: int | None = None) -> bool:
        """Extend the lease of a job this worker still holds (False: it was taken away); ``attempt``: only
        while that claim of it runs (the loops of one pool share a worker id)."""
        fence, fenced = _attempt_fence(attempt)
        renewed = await self.db.write(
            f"UPDATE jobs SET lease_until = ? WHERE id = ? AND status = 'running' AND locked_by = ?{fence}"
            " RETURNING id",
            (await self.db.now() + lease_seconds, job_id, worker, *fenced),
        )
        return bool(renewed)

    async def _set_job(self, job_id: int, worker: str | None, sql_set: str, params: Sequence[Any],
                       attempt: int | None = None) -> bool:
        """Change a job that ``worker`` holds under a live lease (fenced: a worker whose lease ran out,
        or whose job was handed to another, changes nothing); ``worker`` None changes it regardless.
        ``attempt`` fences off the claims of the same worker but that one (each claim counts an attempt)."""
        now = await self.db.now()
        fence = "" if worker is None else " AND status = 'running' AND locked_by = ? AND lease_until >= ?"
        by_attempt, fenced = _attempt_fence(attempt)
        changed = await self.db.write(
            f"UPDATE jobs SET {sql_set}, updated_at = ? WHERE id = ?{fence}{by_attempt} RETURNING id",
            (*params, now, job_id, *(() if worker is None else (worker, now)), *fenced),
        )
        return bool(changed)

    async def holds_job(self, job_id: int, worker: str, attempt: int) -> bool:
        """Whether ``worker`` still holds the job under a live lease, in the claim counted ``attempt`` (a handler
        asks before each result it writes: one that resumed after a stall, its job taken over meanwhile, must
        not write beside the worker that has it now)."""
        row = await self.db.fetch_one(
            "SELECT 1 FROM jobs WHERE id = ? AND status = 'running' AND locked_by = ? AND attempts = ?"
            " AND lease_until >= ?", (job_id, worker, attempt, await self.db.now()))
        return row is not None

    async def finish_job(self, job_id: int, worker: str | None = None, *, attempt: int | None = None) -> bool:
        return await self._set_job(job_id, worker, f"status = 'done', {JOB_DONE}", (), attempt)

    async def retry_job(self, job_id: int, error: str, run_after: datetime, worker: str | None = None, *,
                        attempt: int | None = None) -> bool:
        return await self._set_job(
            job_id, worker, f"status = 'queued', last_error = ?, run_after = ?, {JOB_DONE}",
            (error, await self._on_db_clock(run_after)), attempt,
        )

    async def _on_db_clock(self, moment: datetime) -> float:
        """A moment of this machine's clock (a job due in 30 s) as the database's clock gives it (jobs fall due by
        it: see :meth:`Database.now`)."""
        return _ts(moment) + await self.db.now() - time.time()

    async def fail_job(self, job_id: int, error: str, worker: str | None = None, *, attempt: int | None = None) -> bool:
        return await self._set_job(job_id, worker, f"status = 'failed', last_error = ?, {JOB_DONE}", (error,), attempt)

    async def release_job(self, job_id: int, worker: str | None = None, *, attempt: int | None = None) -> bool:
        return await self._set_job(
            job_id, worker,
            f"status = 'queued', attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END, {JOB_DONE}", (),
            attempt,
        )

    async def recover_jobs(self, is_worker_dead: Callable[[str], bool] | None = None) -> list[Job]:
        """Requeue running jobs whose lease expired (or, on a single-machine engine, whose worker
        ``is_worker_dead``); each requeue is one statement, so two processes never both take one. A job
        interrupted on its last attempt fails instead (one that kills its process would otherwise run for
        ever). The jobs as they are now (queued or failed)."""
        now = await self.db.now()
        recovered: list[Job] = []
        for row in await self.db.fetch_all("SELECT * FROM jobs WHERE status = 'running'"):
            expired = float(row["lease_until"]) < now
            if not expired and not (is_worker_dead is not None and is_worker_dead(str(row["locked_by"]))):
                continue
            taken = await self.db.write_one(
                "UPDATE jobs SET status = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'queued' END,"
                " locked_by = '', lease_until = 0, updated_at = ?, last_error = CASE WHEN attempts >= max_attempts"
                " THEN ? ELSE ? END WHERE id = ? AND status = 'running' AND locked_by = ? RETURNING *",
                (now, f"interrupted on its last attempt ({row['attempts']}): the worker running it stopped",
                 "interrupted: the worker running it stopped", row["id"], row["locked_by"]),
            )
            if taken is not None:
                recovered.append(self._job(taken))
        return recovered

    async def get_job(self, job_id: int) -> Job | None:
        row = await self.db.fetch_one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else self._job(row)

    async def active_job(self, key: str) -> Job | None:
        row = await self.db.fetch_one(
            "SELECT * FROM jobs WHERE key = ? AND status IN ('queued', 'running') ORDER BY id LIMIT 1", (key,)
        )
        return None if row is None else self._job(row)

    async def recent_jobs(self, key: str, limit: int = 5) -> list[Job]:
        """The newest jobs of one key, newest first."""
        rows = await self.db.fetch_all("SELECT * FROM jobs WHERE key = ? ORDER BY id DESC LIMIT ?", (key, limit))
        return [self._job(r) for r in rows]

    async def prune_forgotten(self) -> int:
        async with self.db.transaction() as tx:
            return await prune_forgotten(tx)

    async def delete_old_jobs(self, *, done_before: float | None, failed_before: float | None) -> int:
        """Delete the rows of jobs done before ``done_before`` and failed before ``failed_before`` (UNIX
        seconds of their last change; None: keep them); how many went."""
        deleted = 0
        for status, before in (("done", done_before), ("failed", failed_before)):
            if before is not None:
                deleted += await self._delete_in_batches("jobs", "status = ? AND updated_at < ?", (status, before))
        return deleted

    async def delete_old_llm_calls(self, before: float) -> int:
        """Delete the audit rows of model calls made before ``before`` (UNIX seconds); how many went."""
        await self.flush_audit()
        return await self._delete_in_batches("llm_calls", "created_at < ?", (before,))

    async def _delete_in_batches(self, table: str, where: str, params: tuple[Any, ...]) -> int:
        """Delete the rows of ``table`` matching ``where``, ``PRUNE_BATCH`` per statement (a busy bot's old rows are
        many, and the reply path's writes wait for none of the statements long); how many went."""
        deleted = 0
        while True:
            gone = len(await self.db.write(
                f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE {where} LIMIT {PRUNE_BATCH})"
                " RETURNING id", params))
            deleted += gone
            if gone < PRUNE_BATCH:
                return deleted

    async def list_jobs(self, status: JobStatus | None = None, limit: int = 100, *, by_change: bool = False,
                        before: int | None = None) -> list[Job]:
        """The newest jobs (of ``status``; with ``before``, those older than that job id, for the next page): by
        id, or with ``by_change`` the most recently changed first (a job tried again and failed again first)."""
        if by_change and before is not None:
            raise ValueError("pages go by id: before= does not go with by_change")
        order = "updated_at DESC, id DESC" if by_change else "id DESC"
        where = [(cond, value) for cond, value in (("status = ?", status), ("id < ?", before)) if value is not None]
        filters = f" WHERE {' AND '.join(cond for cond, _ in where)}" if where else ""
        rows = await self.db.fetch_all(f"SELECT * FROM jobs{filters} ORDER BY {order} LIMIT ?",
                                       (*(value for _, value in where), limit))
        return [self._job(r) for r in rows]

    async def job_counts(self) -> dict[str, int]:
        return await self.health.job_counts()

    async def count_jobs(self, statuses: Sequence[JobStatus], kinds: Iterable[str] | None = None, *,
                         due_by: float | None = None) -> int:
        """Jobs in ``statuses`` (of ``kinds`` only, when given; queued ones only when due by ``due_by``)."""
        marks = ",".join("?" for _ in statuses)
        kind_list = list(kinds) if kinds is not None else []
        of_kinds = f" AND kind IN ({','.join('?' for _ in kind_list)})" if kinds is not None else ""
        if kinds is not None and not kind_list:
            return 0
        due = " AND (status <> 'queued' OR run_after <= ?)" if due_by is not None else ""
        row = await self.db.fetch_one(f"SELECT count(*) FROM jobs WHERE status IN ({marks}){of_kinds}{due}",
                                      (*statuses, *kind_list, *(() if due_by is None else (due_by,))))
        return int(row[0]) if row else 0

    # -- audit and metrics -----------------------------------------------------------------------

    def _buffer_audit(self, sql: str, params: tuple[Any, ...]) -> None:
        self._audit.append((sql, params))
        if len(self._audit) >= AUDIT_FLUSH_ROWS:
            self._schedule_flush(0.0)
        else:
            self._schedule_flush(AUDIT_FLUSH_SECONDS)

    def _schedule_flush(self, delay: float) -> None:
        if self._audit_timer is not None and not self._audit_timer.done():
            if delay > 0:
                return
            self._audit_timer.cancel()
        self._audit_timer = asyncio.create_task(self._flush_after(delay), name="storage-audit-flush")

    async def _flush_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self.flush_audit()
        except Exception:
            log.exception("could not write %d buffered audit rows; will retry", len(self._audit))

    async def flush_audit(self) -> None:
        """Write buffered audit rows (LLM calls, reply stats) now, after any flush still under way: a forget-me
        flushes first and then deletes, and must find every buffered row written. The writing runs in a task
        of its own that a cancelled caller does not stop (a statement cut short on the database thread may
        have been written: it would be queued again, and counted twice)."""
        async with self._audit_lock:
            if self._audit_writing is not None and not self._audit_writing.done():
                await asyncio.wait([self._audit_writing])
            if not self._audit:
                return
            pending, self._audit = self._audit, []
            self._audit_writing = asyncio.ensure_future(self._write_audit(pending))
            self._audit_writing.add_done_callback(_retrieved)
            await asyncio.shield(self._audit_writing)

    async def _write_audit(self, pending: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Each table's rows in multi-row statements (of a few sizes), so the write lock the reply path's
        writes wait for is held one round trip at a time. A statement whose rows do not all fit (a message
        deleted meanwhile, a figure no column holds) is tried row by row and the unfit rows are dropped (retrying
        cannot help them); what any other failure leaves unwritten is queued again."""
        by_table: dict[str, list[tuple[Any, ...]]] = {}
        for sql, params in pending:
            by_table.setdefault(sql, []).append(params)
        left = [(sql, chunk) for sql, rows in by_table.items()
                for chunk in power_chunks(rows, AUDIT_ROWS_PER_STATEMENT)]
        dropped = 0
        try:
            while left:
                sql, rows = left[0]
                try:
                    await self.db.write(*multi_row(sql, rows))
                    left.pop(0)
                except Exception as exc:
                    if not _never_fits(exc):
                        raise
                    dropped += len(rows) == 1
                    left[0:1] = [(sql, [row]) for row in rows] if len(rows) > 1 else []
        except BaseException:
            self._audit[:0] = [(sql, params) for sql, rows in left for params in rows]
            raise
        finally:
            if dropped:
                log.error("dropped %d audit rows that do not fit the database (their message was deleted "
                          "meanwhile, or a figure no column holds)", dropped)

    async def record_llm_call(self, record: LLMCallRecord) -> None:
        metrics.observe_llm_call(record)  # every recorded call is counted for Prometheus too
        self._buffer_audit(
            LLM_CALL_SQL,
            (
                record.purpose,
                record.model,
                record.input_tokens,
                record.output_tokens,
                record.estimated_input_tokens,
                record.duration_ms,
                record.error,
                time.time(),
            ),
        )

    async def list_llm_calls(self, limit: int = 100) -> list[dict[str, Any]]:
        await self.flush_audit()
        rows = await self.db.fetch_all("SELECT * FROM llm_calls ORDER BY id DESC LIMIT ?", (limit,))
        return [dict(r) for r in rows]

    async def record_reply_stats(self, stats: ReplyStats) -> None:
        self._buffer_audit(
            REPLY_STATS_SQL,
            (
                stats.channel_id,
                stats.message_id,
                stats.history_tokens,
                stats.history_budget,
                stats.window_messages,
                stats.trimmed_messages,
                int(stats.summary_used),
                stats.prompt_tokens,
                time.time(),
            ),
        )

    async def reply_metrics(self, channel_id: int | None = None) -> ReplyMetrics:
        await self.flush_audit()
        where, params = ("WHERE channel_id = ?", (channel_id,)) if channel_id is not None else ("", ())
        row = await self.db.fetch_one(
            "SELECT count(*) AS n,"
            " avg(CAST(history_tokens AS DOUBLE PRECISION) / CASE WHEN history_budget > 1 THEN history_budget"
            " ELSE 1 END) AS util, avg(CASE WHEN trimmed_messages > 0 THEN 1.0 ELSE 0.0 END) AS trimmed,"
            " avg(CAST(summary_used AS DOUBLE PRECISION)) AS hit"
            f" FROM reply_stats {where}",
            params,
        )
        srow = await self.db.fetch_one(
            "SELECT sum(CASE WHEN status = 'ok' THEN 1 ELSE 0 END) AS ok,"
            f" sum(CASE WHEN status = 'rejected' THEN 1 ELSE 0 END) AS bad FROM summaries {where}", params
        )
        replies = int(row["n"]) if row else 0
        written = int(srow["ok"] or 0) if srow else 0
        rejected = int(srow["bad"] or 0) if srow else 0
        return ReplyMetrics(
            replies=replies,
            token_utilisation=float(row["util"] or 0.0) if row else 0.0,
            trim_rate=float(row["trimmed"] or 0.0) if row else 0.0,
            summary_hit_rate=float(row["hit"] or 0.0) if row else 0.0,
            summary_generation_rate=(written / replies) if replies else 0.0,
            summaries_written=written,
            summaries_rejected=rejected,
        )

    async def now(self) -> float:
        """The time (UNIX seconds) the processes sharing this database agree on (:meth:`Database.now`): for
        marks other processes compare with their own time."""
        return await self.db.now()

    def unavailable(self, exc: BaseException) -> str | None:
        """For the log: why this database could not be used for what raised ``exc`` (a lock held elsewhere, a full
        disk, no write access, a PostgreSQL server gone), naming it; None when that is not the cause."""
        cause = unavailable(exc)
        return None if cause is None else f"the database {self.db.url} cannot be used right now: {cause}"

    def forget_cached(self, *, user_key: str, channel_ids: Sequence[int] = ()) -> None:
        """Drop cached rows of a deleted user and of channels whose summaries were deleted."""
        self._users.pop(user_key, None)
        for channel_id in channel_ids:
            self._summaries.pop(channel_id, None)
        self.memory.forget_spreads()

    async def get_setting(self, key: str) -> str | None:
        row = await self.db.fetch_one("SELECT value FROM settings WHERE key = ?", (key,))
        return None if row is None else str(row["value"])

    async def set_setting(self, key: str, value: str) -> None:
        await self.db.write(
            "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
            (key, value, time.time()),
        )

    async def delete_setting_if(self, key: str, value: str) -> bool:
        """Delete ``key`` if it still holds ``value`` (not one changed meanwhile); whether it did."""
        return bool(await self.db.write("DELETE FROM settings WHERE key = ? AND value = ? RETURNING key", (key, value)))

    # -- forget me -------------------------------------------------------------------------------

    @staticmethod
    async def _forget_by_key(tx: Tx, user_key: str) -> None:
        """What is kept by the user's key rather than their row (``forget_keyed``), their use of the daily
        limits noted first."""
        await keep_usage(tx, user_key)  # (the daily limits still count what they used)
        await forget_keyed(tx, user_key)

    async def forget_user(self, user_key: str) -> ForgetReport | None:
        """Delete everything stored about one user, for every persona, in one transaction.

        Their messages and the replies to them go (with their vectors); every rolling summary of a
        channel they wrote in goes too (it may mention them; the caller has it written anew from what
        remains); their cortex files with all versions, memory items, update runs, queued cortex jobs and
        the confirmations that offered them an undo go; the user row goes last. What is kept by their key
        (web links and sessions, skill runs) goes first, before the row is looked up in the same
        transaction, so a web request cannot make the row meanwhile. Returns None when there was no user
        row. A write for the user that slipped in during the transaction (PostgreSQL) fails it on a foreign
        key: it is run again, a few times."""
        await self.flush_audit()  # buffered reply stats may point at messages deleted below
        for attempt in range(FORGET_ATTEMPTS):
            try:
                report = await self._forget_once(user_key)
                if report is None:
                    # Nothing stored, but the files may still hold their words: a forget-me whose process died
                    # after its commit never scrubbed them, and this one sent again does (the note says so).
                    await self.scrub_if_pending()
                return report
            except Exception as exc:
                if not is_missing_reference(exc) or attempt == FORGET_ATTEMPTS - 1:
                    raise
                log.info("forget-me met a row written meanwhile; running it again")
        raise AssertionError("unreachable")

    @staticmethod
    async def _keep_incognito(tx: Tx, user_key: str, stretches: list[tuple[str, float]]) -> None:
        """A forget-me during ``!memory pause`` keeps the pause: someone who asked not to be remembered and
        then had everything deleted does not expect their next message to be kept. A bare user row (key
        only, no name) carries the stretches on from their original start (so they end on time)."""
        now = time.time()
        row = await tx.fetch_one("INSERT INTO users (key, display_name, created_at, updated_at) VALUES (?, '', ?, ?)"
                                 " RETURNING id", (user_key, now, now))
        assert row is not None
        for persona, started in stretches:
            await tx.execute("INSERT INTO incognito (user_id, persona, started_at) VALUES (?, ?, ?)",
                             (int(row[0]), persona, started))

    async def _forget_once(self, user_key: str) -> ForgetReport | None:
        async with self.db.transaction() as tx:
            if self.db.dialect == "postgres":  # held to the commit: writes that check the row (FOR SHARE) wait
                await tx.execute("SELECT id FROM users WHERE key = ? FOR UPDATE", (user_key,))
            await self._forget_by_key(tx, user_key)
            row = await tx.fetch_one("SELECT id FROM users WHERE key = ?", (user_key,))
            if row is None:
                return None
            user_id = int(row[0])
            pair_ids = [int(r[0]) for r in await tx.fetch_all(
                "SELECT id FROM cortex_pairs WHERE user_id = ?", (user_id,))]
            counts = await self.cortex.delete_pairs(tx, pair_ids)
            stretches = await tx.fetch_all("DELETE FROM incognito WHERE user_id = ? RETURNING persona, started_at",
                                           (user_id,))
            messages, _ = await delete_messages(tx, "user_id = ?", (user_id,))
            # Every channel they wrote in: those of the messages just deleted (their deletion noted it) and those
            # whose messages of theirs went before (retention, deletions on the platform).
            channels = sorted(int(r[0]) for r in await tx.fetch_all(
                "DELETE FROM channel_speakers WHERE user_id = ? RETURNING channel_id", (user_id,)))
            ch_marks = ",".join("?" for _ in channels) or "NULL"
            summaries = await tx.fetch_all(f"DELETE FROM summaries WHERE channel_id IN ({ch_marks}) RETURNING id",
                                           channels)
            # A direct message's name is the platform's, often after the person ("DM with Ann").
            await tx.execute(f"UPDATE channels SET name = ? WHERE is_dm = 1 AND id IN ({ch_marks})",
                             [FORGOTTEN_DM, *channels])
            await tx.execute("DELETE FROM undo_offers WHERE user_id = ?", (user_id,))
            await tx.execute("DELETE FROM users WHERE id = ?", (user_id,))
            await note_scrub_pending(tx)  # items and files too: their words sit in the full-text indexes
            if stretches:
                await self._keep_incognito(tx, user_key, [(str(r[0]), float(r[1])) for r in stretches])
        self.forget_cached(user_key=user_key, channel_ids=channels)
        await self.scrub_soon()  # (spaced: a forget-me loop would merge the whole database's indexes each time)
        return ForgetReport(len(messages), len(summaries), len(pair_ids), counts["versions"], counts["runs"],
                            counts["items"])
