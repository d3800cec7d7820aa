"""The cortex repository: pairs and their tier cycle, versioned files, update runs, settings.

Lives in the same database as the core (tables from migration 2), written once for both engines.
Every accepted file write is a new row in ``cortex_versions``; nothing is ever updated in place, so
a process killed at any moment leaves each file at a whole version.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

from bot import metrics
from bot.storage.base import StoredMessage, User
from bot.storage.engine import Database, StaleReference, Tx, is_conflict, serialise, stale_if_missing
from bot.storage.forgotten import USED_SINCE, subject
from bot.storage.incognito import not_incognito
from bot.storage.rows import MESSAGE_COLUMN_COUNT, MESSAGE_COLUMNS, message_from_row

FILENAMES: tuple[str, ...] = ("memory.md", "soul.md", "relationship.md")
_FILES = " UNION ALL ".join(f"SELECT '{name}'" + (" AS filename" if not n else "") for n, name in enumerate(FILENAMES))
PROMPT_CACHE_SECONDS = 5.0
FORGOTTEN_SINCE = "(SELECT coalesce(sum(tokens), 0) FROM forgotten_spending WHERE started_at >= ?)"
Author = Literal["model", "user", "system"]
RunStatus = Literal["running", "success", "failed", "skipped"]
INTERRUPTED = "interrupted: the process running it stopped"


def _dt(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, tz=UTC)


@dataclass(frozen=True, slots=True)
class Pair:
    id: int
    user_id: int
    persona: str
    cycle: int
    cycle_count: int
    fired_tiers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FileVersion:
    id: int
    pair_id: int
    filename: str
    version: int
    content: str
    author: Author
    reason: str
    tier: str
    run_id: int | None
    created_at: datetime
    size: int | None = None  # characters, when the content was left out (``versions_listed``)

    @property
    def chars(self) -> int:
        return len(self.content) if self.size is None else self.size


@dataclass(frozen=True, slots=True)
class CortexRun:
    id: int
    pair_id: int
    job_id: int | None
    tier: str
    status: RunStatus
    reason: str
    rounds: int
    files_read: list[str]
    files_written: list[str]
    input_tokens: int
    output_tokens: int
    duration_ms: int
    error: str
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class RunStats:
    by_status: dict[str, int]
    input_tokens: int
    output_tokens: int
    average_duration_ms: float
    last_errors: list[CortexRun]


@dataclass(frozen=True, slots=True)
class ForgetReport:
    messages: int
    summaries: int
    pairs: int
    versions: int
    runs: int
    items: int = 0


class CortexRepository:
    # The newest versions kept of each file of a pair. Every save is a new version (a whole file), so without
    # a bound a user saving at the command rate limit, or a runaway update, would grow the database without
    # end; a thousand is years of ordinary updates and edits.
    KEEP_VERSIONS = 1000

    def __init__(self, db: Database) -> None:
        self.db = db
        # Current files per (user id, persona) for reply prompts; cleared by every write here and
        # re-read after PROMPT_CACHE_SECONDS for other processes' writes.
        self._prompt_files: dict[tuple[int, str], tuple[float, dict[str, str]]] = db.caches.named(
            "cortex.prompt_files"
        )
        self._pair_keys: dict[int, tuple[int, str]] = db.caches.named("cortex.pair_keys")
        self._prompt_versions: dict[tuple[int, str], dict[str, int]] = db.caches.named("cortex.prompt_versions")
        # How many times this process's writes cleared the cache: a read that a write overtook is not cached.
        self._prompt_clears: dict[str, int] = db.caches.named("cortex.prompt_clears")

    # -- pairs -----------------------------------------------------------------------------------

    @staticmethod
    def _pair(row: Any) -> Pair:
        return Pair(
            int(row["id"]), int(row["user_id"]), str(row["persona"]), int(row["cycle"]),
            int(row["cycle_count"]), tuple(json.loads(row["fired_tiers"])),
        )

    async def ensure_pair(self, user_id: int, persona: str) -> Pair:
        row = await self.db.write_one(
            "INSERT INTO cortex_pairs (user_id, persona, created_at) VALUES (?, ?, ?)"
            " ON CONFLICT (user_id, persona) DO UPDATE SET persona = excluded.persona RETURNING *",
            (user_id, persona, time.time()),
        )
        assert row is not None
        return self._pair(row)

    async def get_pair(self, user_id: int, persona: str) -> Pair | None:
        row = await self.db.fetch_one(
            "SELECT * FROM cortex_pairs WHERE user_id = ? AND persona = ?", (user_id, persona)
        )
        return None if row is None else self._pair(row)

    async def pair_by_id(self, pair_id: int) -> Pair | None:
        row = await self.db.fetch_one("SELECT * FROM cortex_pairs WHERE id = ?", (pair_id,))
        return None if row is None else self._pair(row)

    async def count_messages(self, user_id: int, persona: str, added: int) -> Pair:
        """Add ``added`` messages to the pair's cycle counter (creating the pair), atomically;
        :class:`StaleReference` when the user is gone (forgotten meanwhile: no pair is made for nobody)."""
        with stale_if_missing(f"user {user_id} no longer exists"):
            row = await self.db.write_one(
                "INSERT INTO cortex_pairs (user_id, persona, cycle_count, created_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (user_id, persona) DO UPDATE SET"
                " cycle_count = cortex_pairs.cycle_count + excluded.cycle_count"
                " RETURNING *",
                (user_id, persona, added, time.time()),
            )
        assert row is not None
        return self._pair(row)

    async def replace_cycle(self, seen: Pair, new: Pair) -> bool:
        """Store ``new`` cycle state only if the row still is ``seen`` (compare and set)."""
        return bool(await self.db.write(
            "UPDATE cortex_pairs SET cycle = ?, cycle_count = ?, fired_tiers = ?"
            " WHERE id = ? AND cycle = ? AND cycle_count = ? AND fired_tiers = ? RETURNING id",
            (
                new.cycle, new.cycle_count, json.dumps(sorted(new.fired_tiers)),
                seen.id, seen.cycle, seen.cycle_count, json.dumps(sorted(seen.fired_tiers)),
            ),
        ))

    async def user_of(self, pair: Pair) -> User:
        row = await self.db.fetch_one("SELECT id, key, display_name FROM users WHERE id = ?", (pair.user_id,))
        if row is None:  # (forgotten since the pair was read)
            raise StaleReference(f"user {pair.user_id} no longer exists")
        return User(int(row[0]), str(row[1]), str(row[2]))

    async def pair_messages(self, user_id: int, persona: str, limit: int, before_id: int | None = None
                            ) -> list[tuple[StoredMessage, str]]:
        """The pair's own exchanges in every channel (never other users' messages), newest first,
        each with its channel's name."""
        rows = await self.db.fetch_all(
            f"SELECT {', '.join('m.' + c.strip() for c in MESSAGE_COLUMNS.split(','))}, c.name"
            " FROM messages AS m JOIN channels AS c ON c.id = m.channel_id"
            " WHERE m.user_id = ? AND m.persona = ? AND m.id < ?"
            f" AND {not_incognito('m')} ORDER BY m.id DESC LIMIT ?",
            (user_id, persona, before_id if before_id is not None else 2**62, limit),
        )
        return [(message_from_row(row), str(row[MESSAGE_COLUMN_COUNT])) for row in rows]

    # -- files -----------------------------------------------------------------------------------

    @staticmethod
    def _version(row: Any) -> FileVersion:
        return FileVersion(
            int(row["id"]), int(row["pair_id"]), str(row["filename"]), int(row["version"]), str(row["content"]),
            row["author"], str(row["reason"]), str(row["tier"]),
            None if row["run_id"] is None else int(row["run_id"]), _dt(float(row["created_at"])) or datetime.now(UTC),
        )

    async def current(self, pair_id: int, filename: str) -> FileVersion | None:
        row = await self.db.fetch_one(
            "SELECT * FROM cortex_versions WHERE pair_id = ? AND filename = ? ORDER BY version DESC LIMIT 1",
            (pair_id, filename),
        )
        return None if row is None else self._version(row)

    async def current_all(self, pair_id: int) -> dict[str, FileVersion]:
        rows = await self.db.fetch_all(
            "SELECT v.* FROM cortex_versions AS v WHERE v.pair_id = ? AND v.version = ("
            " SELECT max(version) FROM cortex_versions WHERE pair_id = v.pair_id AND filename = v.filename)",
            (pair_id,),
        )
        return {str(r["filename"]): self._version(r) for r in rows}

    async def add_version(
        self, pair_id: int, filename: str, content: str, author: Author, reason: str = "", tier: str = "",
        run_id: int | None = None,
    ) -> FileVersion:
        if filename not in FILENAMES:
            raise ValueError(f"not a cortex file: {filename!r}")
        # One statement: the next version number and the insert are atomic together.
        row = await self.db.write_one(
            "INSERT INTO cortex_versions (pair_id, filename, version, content, author, reason, tier, run_id,"
            " created_at) SELECT CAST(? AS BIGINT), CAST(? AS TEXT), coalesce(max(version), 0) + 1, CAST(? AS TEXT),"
            " CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS BIGINT), CAST(? AS DOUBLE PRECISION)"
            " FROM cortex_versions"
            " WHERE pair_id = ? AND filename = ? RETURNING *",
            (pair_id, filename, content, author, reason, tier, run_id, time.time(), pair_id, filename),
        )
        assert row is not None
        self._files_changed(pair_id)
        saved = self._version(row)
        await self._trim_versions(saved)
        return saved

    async def add_version_based_on(
        self, based_on: int, pair_id: int, filename: str, content: str, author: Author, reason: str = "",
        tier: str = "", run_id: int | None = None,
    ) -> FileVersion | None:
        """A new version only while ``based_on`` is still the newest (one statement, so two saves based on
        the same version cannot both land, in any process); None when the file changed meanwhile."""
        if filename not in FILENAMES:
            raise ValueError(f"not a cortex file: {filename!r}")
        try:
            row = await self.db.write_one(
                "INSERT INTO cortex_versions (pair_id, filename, version, content, author, reason, tier, run_id,"
                " created_at) SELECT CAST(? AS BIGINT), CAST(? AS TEXT), coalesce(max(version), 0) + 1,"
                " CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS BIGINT),"
                " CAST(? AS DOUBLE PRECISION) FROM cortex_versions WHERE pair_id = ? AND filename = ?"
                " HAVING coalesce(max(version), 0) = ? RETURNING *",
                (pair_id, filename, content, author, reason, tier, run_id, time.time(), pair_id, filename, based_on),
            )
        except Exception as exc:
            if is_conflict(exc):  # another writer took the same next version a moment earlier
                return None
            raise
        if row is None:
            return None
        self._files_changed(pair_id)
        saved = self._version(row)
        await self._trim_versions(saved)
        return saved

    async def _trim_versions(self, newest: FileVersion) -> None:
        """Delete the versions of the file older than the newest :attr:`KEEP_VERSIONS` (one statement, and
        none at all while a file has fewer). All of them, not one: a process stopped between a save and its
        trim leaves the excess to the next save."""
        if newest.version > self.KEEP_VERSIONS:
            await self.db.write(
                "DELETE FROM cortex_versions WHERE pair_id = ? AND filename = ? AND version <= ?",
                (newest.pair_id, newest.filename, newest.version - self.KEEP_VERSIONS),
            )

    async def version_range(self, pair_id: int, filename: str) -> tuple[int, int] | None:
        """The oldest and the newest version kept of a file; None when it has none."""
        row = await self.db.fetch_one(
            "SELECT min(version), max(version) FROM cortex_versions WHERE pair_id = ? AND filename = ?",
            (pair_id, filename),
        )
        return None if row is None or row[0] is None else (int(row[0]), int(row[1]))

    async def add_first_version(self, pair_id: int, filename: str, content: str, author: Author, reason: str = ""
                                ) -> FileVersion | None:
        """Version 1 of a file that has no version yet; None (nothing stored) when it has one, made meanwhile
        by anyone (the same one-statement check as :meth:`add_version_based_on`)."""
        return await self.add_version_based_on(0, pair_id, filename, content, author, reason)

    async def files_for_prompt(self, user_id: int, persona: str) -> dict[str, str]:
        """Current content of the pair's files (empty when the pair has none yet), cached briefly."""
        key = (user_id, persona)
        cached = self._prompt_files.get(key)
        if cached is not None and time.monotonic() - cached[0] < PROMPT_CACHE_SECONDS:
            return cached[1]
        clears = self._prompt_clears.get("n", 0)
        # Each file's newest version by the (pair, file, version) index: joined to all of the pair's versions,
        # the query read every one of them, at each reply past the cache (8-16 ms at 1,500 versions).
        rows = await self.db.fetch_all(
            f"SELECT v.filename, v.content, p.id, v.version FROM cortex_pairs AS p CROSS JOIN ({_FILES}) AS f"
            " JOIN cortex_versions AS v ON v.pair_id = p.id AND v.filename = f.filename AND v.version = (SELECT"
            " max(version) FROM cortex_versions WHERE pair_id = p.id AND filename = f.filename)"
            " WHERE p.user_id = ? AND p.persona = ?",
            (user_id, persona),
        )
        files = {str(r[0]): str(r[1]) for r in rows}
        if self._prompt_clears.get("n", 0) == clears:  # else a write landed meanwhile: the read may predate it
            self._prompt_files[key] = (time.monotonic(), files)
        self._prompt_versions[key] = {str(r[0]): int(r[3]) for r in rows}
        if rows:
            self._pair_keys[int(rows[0][2])] = key
        return files

    def prompt_versions(self, user_id: int, persona: str) -> dict[str, int]:
        """The versions of the files :meth:`files_for_prompt` gave last for this pair (for "why")."""
        return self._prompt_versions.get((user_id, persona), {})

    def _files_changed(self, pair_id: int | None = None) -> None:
        """Drop the prompt cache's entry of ``pair_id`` (all entries without one), and count the clearing so
        that a read it overtook is not cached (:meth:`files_for_prompt`)."""
        self._prompt_clears["n"] = self._prompt_clears.get("n", 0) + 1
        key = self._pair_keys.get(pair_id) if pair_id is not None else None
        if key is not None:
            self._prompt_files.pop(key, None)
        else:  # a pair not seen by a prompt yet (e.g. its first files): its cache entry is unknown
            self._prompt_files.clear()

    async def versions(self, pair_id: int, filename: str) -> list[FileVersion]:
        rows = await self.db.fetch_all(
            "SELECT * FROM cortex_versions WHERE pair_id = ? AND filename = ? ORDER BY version", (pair_id, filename)
        )
        return [self._version(r) for r in rows]

    async def versions_listed(self, pair_id: int, filename: str, newest: int) -> tuple[list[FileVersion], int]:
        """The ``newest`` versions of a file, newest first, without their content (``size`` instead), and how
        many there are: a history view or chart, whatever a file's number of versions."""
        rows = await self.db.fetch_all(
            "SELECT id, pair_id, filename, version, '' AS content, author, reason, tier, run_id, created_at,"
            " length(content) AS size FROM cortex_versions WHERE pair_id = ? AND filename = ?"
            " ORDER BY version DESC LIMIT ?", (pair_id, filename, newest))
        total = await self.db.fetch_one(
            "SELECT count(*) FROM cortex_versions WHERE pair_id = ? AND filename = ?", (pair_id, filename))
        return [replace(self._version(r), size=int(r["size"])) for r in rows], int(total[0]) if total else 0

    async def all_versions(self, pair_id: int) -> list[FileVersion]:
        rows = await self.db.fetch_all(
            "SELECT * FROM cortex_versions WHERE pair_id = ? ORDER BY filename, version", (pair_id,)
        )
        return [self._version(r) for r in rows]

    async def versions_of_runs(self, pair_id: int, run_ids: Sequence[int]) -> list[FileVersion]:
        """The versions the update runs ``run_ids`` of the pair saved, oldest first."""
        if not run_ids:
            return []
        marks = ", ".join("?" for _ in run_ids)
        rows = await self.db.fetch_all(
            f"SELECT * FROM cortex_versions WHERE pair_id = ? AND run_id IN ({marks}) ORDER BY id",
            (pair_id, *run_ids),
        )
        return [self._version(r) for r in rows]

    async def version(self, pair_id: int, filename: str, number: int) -> FileVersion | None:
        row = await self.db.fetch_one(
            "SELECT * FROM cortex_versions WHERE pair_id = ? AND filename = ? AND version = ?",
            (pair_id, filename, number),
        )
        return None if row is None else self._version(row)

    # -- runs (audit) ----------------------------------------------------------------------------

    @staticmethod
    def _run(row: Any) -> CortexRun:
        return CortexRun(
            id=int(row["id"]),
            pair_id=int(row["pair_id"]),
            job_id=None if row["job_id"] is None else int(row["job_id"]),
            tier=str(row["tier"]),
            status=row["status"],
            reason=str(row["reason"]),
            rounds=int(row["rounds"]),
            files_read=json.loads(row["files_read"]),
            files_written=json.loads(row["files_written"]),
            input_tokens=int(row["input_tokens"]),
            output_tokens=int(row["output_tokens"]),
            duration_ms=int(row["duration_ms"]),
            error=str(row["error"]),
            started_at=_dt(float(row["started_at"])) or datetime.now(UTC),
            finished_at=_dt(None if row["finished_at"] is None else float(row["finished_at"])),
        )

    async def start_run(self, pair_id: int, job_id: int | None, tier: str) -> int:
        await self.close_interrupted(pair_id, own_job=job_id)
        row = await self.db.write_one(
            "INSERT INTO cortex_runs (pair_id, job_id, tier, status, started_at) VALUES (?, ?, ?, 'running', ?)"
            " RETURNING id",
            (pair_id, job_id, tier, time.time()),
        )
        assert row is not None
        return int(row[0])

    async def close_interrupted(self, pair_id: int, own_job: int | None = None) -> list[int]:
        """Mark failed the pair's runs still marked running whose process stopped: those whose job no worker holds
        under a live lease (the rule that fences the jobs themselves; a run of another process's live job goes
        on), and those of ``own_job``, the job now running, left by its earlier attempts. The answer a run had
        reserved is taken back out of its tokens (its input stays counted: the request may have reached the
        server, which bills it, as a round that timed out counts it), and the files it saved are listed as
        written. The ids of the runs closed."""
        # Look first (no write lock taken) since there rarely is one.
        stale = await self.db.fetch_all(
            "SELECT r.id FROM cortex_runs AS r WHERE r.pair_id = ? AND r.status = 'running' AND (r.job_id IS NULL"
            " OR r.job_id = ? OR NOT EXISTS (SELECT 1 FROM jobs AS j WHERE j.id = r.job_id AND j.status = 'running'"
            " AND j.lease_until >= ?))",
            (pair_id, -1 if own_job is None else own_job, await self.db.now()))
        closed = []
        for (run_id,) in stale:
            saved = await self.db.fetch_all(
                "SELECT DISTINCT filename FROM cortex_versions WHERE pair_id = ? AND run_id = ?", (pair_id, run_id))
            if await self.db.write(  # (once: another process may be closing it too)
                    "UPDATE cortex_runs SET status = 'failed', reason = ?, error = ?, files_written = ?,"
                    " output_tokens = output_tokens - reserved_output, reserved_output = 0, finished_at = ?"
                    " WHERE id = ? AND status = 'running' RETURNING id",
                    (INTERRUPTED, INTERRUPTED, json.dumps(sorted(str(r[0]) for r in saved)), time.time(), run_id)):
                metrics.observe_cortex_update("failed")
                closed.append(int(run_id))
        return closed

    async def finish_run(
        self,
        run_id: int,
        status: RunStatus,
        *,
        reason: str = "",
        rounds: int = 0,
        files_read: Sequence[str] = (),
        files_written: Sequence[str] = (),
        input_tokens: int = 0,
        output_tokens: int = 0,
        duration_ms: int = 0,
        error: str = "",
    ) -> None:
        metrics.observe_cortex_update(status)
        await self.db.write(
            "UPDATE cortex_runs SET status = ?, reason = ?, rounds = ?, files_read = ?, files_written = ?,"
            " input_tokens = ?, output_tokens = ?, reserved_output = 0, duration_ms = ?, error = ?, finished_at = ?"
            " WHERE id = ?",
            (
                status, reason, rounds, json.dumps(sorted(set(files_read))), json.dumps(sorted(set(files_written))),
                input_tokens, output_tokens, duration_ms, error, time.time(), run_id,
            ),
        )

    async def record_progress(self, run_id: int, rounds: int, input_tokens: int, output_tokens: int) -> None:
        """A running update's rounds and tokens so far (budgets count them at once, in every process)."""
        await self.db.write(
            "UPDATE cortex_runs SET rounds = ?, input_tokens = ?, output_tokens = ?, reserved_output = 0 WHERE id = ?",
            (rounds, input_tokens, output_tokens, run_id),
        )

    async def reserve(self, run_id: int, pair_id: int, since: float, spent: tuple[int, int, int], *, cost: int,
                      pair_budget: int, bot_budget: int, answer: int = 0) -> Literal["pair", "bot"] | None:
        """Which daily budget (the pair's or the bot's tokens since ``since``; 0: none) ``cost`` more tokens
        would exceed; else record ``spent`` (rounds, input and output tokens, the ``cost`` counted in them) as
        the run's progress, and ``answer``, the output tokens of it not spent yet, apart too (a run whose process
        stopped before the round's answer came gives them back: :meth:`close_interrupted`). Checked and written
        in one statement, which every process's reservations run in turn (SQLite's write lock; an advisory lock
        on PostgreSQL, whose statements see the rows committed when they began): two processes checking at once
        would each see the other's round as not spent."""
        total = "(SELECT coalesce(sum(input_tokens + output_tokens), 0) FROM cortex_runs WHERE started_at >= ?"
        sql = (f"UPDATE cortex_runs SET rounds = ?, input_tokens = ?, output_tokens = ?, reserved_output = ?"
               f" WHERE id = ? AND {total} AND pair_id = ?) + {USED_SINCE} + ? <= ?"
               f" AND {total}) + {FORGOTTEN_SINCE} + ? <= ? RETURNING id")
        unlimited = 2**62
        params = (*spent, answer, run_id, since, pair_id, await self._forgotten_subject(pair_id), since, cost,
                  pair_budget or unlimited, since, since, cost, bot_budget or unlimited)
        if self.db.dialect == "postgres":
            async with self.db.transaction() as tx:
                await serialise(self.db, tx, "cortex-budget")
                done = await tx.fetch_one(sql, params)
        else:  # one statement holds the file's write lock from its reads to its write
            done = await self.db.write_one(sql, params)
        if done is not None:
            return None
        over_pair = pair_budget and await self.tokens_since(since, pair_id) + cost > pair_budget
        return "pair" if over_pair else "bot"

    async def record_skip(self, pair_id: int, job_id: int | None, tier: str, reason: str) -> int:
        now = time.time()
        row = await self.db.write_one(
            "INSERT INTO cortex_runs (pair_id, job_id, tier, status, reason, started_at, finished_at)"
            " VALUES (?, ?, ?, 'skipped', ?, ?, ?) RETURNING id",
            (pair_id, job_id, tier, reason, now, now),
        )
        assert row is not None
        return int(row[0])

    async def skipped_tiers(self, pair_id: int, job_id: int) -> list[str]:
        """The tiers of ``pair_id`` skipped because update job ``job_id`` was queued or running (by job, not by time:
        the processes of a fleet do not share one clock)."""
        rows = await self.db.fetch_all(
            "SELECT tier FROM cortex_runs WHERE pair_id = ? AND status = 'skipped' AND job_id = ? ORDER BY id",
            (pair_id, job_id))
        return [str(r[0]) for r in rows]

    async def job_runs(self, pair_id: int, job_id: int) -> list[int]:
        """The ids of the pair's update runs that ``job_id`` started (its attempts so far), oldest first."""
        rows = await self.db.fetch_all(
            "SELECT id FROM cortex_runs WHERE pair_id = ? AND job_id = ? AND status <> 'skipped' ORDER BY id",
            (pair_id, job_id))  # (a tier skipped because this job was under way names it too: not an attempt)
        return [int(r[0]) for r in rows]

    async def last_update_started(self, pair_id: int, exclude_job: int | None = None) -> float | None:
        """When the pair's last real (not skipped) update started: the cooldown counts from there.
        Runs of ``exclude_job`` do not count (a job resumed after a crash must not block itself)."""
        row = await self.db.fetch_one(
            "SELECT max(started_at) FROM cortex_runs WHERE pair_id = ? AND status != 'skipped'"
            " AND (job_id IS NULL OR job_id != ?)",
            (pair_id, -1 if exclude_job is None else exclude_job),
        )
        return None if row is None or row[0] is None else float(row[0])

    async def _forgotten_subject(self, pair_id: int) -> str:
        """Under which subject ``forgotten_usage`` keeps the pair's user's tokens with its persona from before a
        forget-me (bot.storage.forgotten); an empty one (matching nothing) for a pair that is gone."""
        row = await self.db.fetch_one("SELECT u.key, p.persona FROM cortex_pairs AS p JOIN users AS u"
                                      " ON u.id = p.user_id WHERE p.id = ?", (pair_id,))
        return "" if row is None else subject("pair", str(row[0]), str(row[1]))

    async def tokens_since(self, since: float, pair_id: int | None = None) -> int:
        """The tokens cortex updates took since ``since``: the pair's, or the bot's (with those of forgotten users)."""
        if pair_id is not None:  # (with what the user spent with the persona before a forget-me)
            row = await self.db.fetch_one(
                f"SELECT coalesce(sum(input_tokens + output_tokens), 0) + {USED_SINCE} FROM cortex_runs"
                " WHERE started_at >= ? AND pair_id = ?",
                (await self._forgotten_subject(pair_id), since, since, pair_id))
        else:
            row = await self.db.fetch_one("SELECT coalesce(sum(input_tokens + output_tokens), 0) + "
                                          f"{FORGOTTEN_SINCE} FROM cortex_runs WHERE started_at >= ?", (since, since))
        return int(row[0]) if row else 0

    async def runs(self, pair_id: int | None = None, limit: int = 20) -> list[CortexRun]:
        if pair_id is None:
            rows = await self.db.fetch_all("SELECT * FROM cortex_runs ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = await self.db.fetch_all(
                "SELECT * FROM cortex_runs WHERE pair_id = ? ORDER BY id DESC LIMIT ?", (pair_id, limit)
            )
        return [self._run(r) for r in rows]

    async def run_stats(self, since: float = 0.0) -> RunStats:
        rows = await self.db.fetch_all(
            "SELECT status, count(*) FROM cortex_runs WHERE started_at >= ? GROUP BY status", (since,)
        )
        totals = await self.db.fetch_one(
            "SELECT coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0),"
            " coalesce(avg(CASE WHEN status IN ('success', 'failed') THEN duration_ms END), 0)"
            " FROM cortex_runs WHERE started_at >= ?",
            (since,),
        )
        errors = await self.db.fetch_all(
            "SELECT * FROM cortex_runs WHERE status = 'failed' AND started_at >= ? ORDER BY id DESC LIMIT 5",
            (since,),
        )
        assert totals is not None
        return RunStats(
            by_status={str(r[0]): int(r[1]) for r in rows},
            input_tokens=int(totals[0]),
            output_tokens=int(totals[1]),
            average_duration_ms=float(totals[2]),
            last_errors=[self._run(r) for r in errors],
        )

    # -- settings --------------------------------------------------------------------------------

    async def settings(self, scope: str) -> dict[str, Any]:
        rows = await self.db.fetch_all("SELECT key, value FROM cortex_settings WHERE scope = ?", (scope,))
        return {str(r[0]): json.loads(r[1]) for r in rows}

    async def persona_overrides(self) -> dict[str, dict[str, Any]]:
        """Every persona-wide override (scope ``persona:…``), by scope."""
        rows = await self.db.fetch_all(
            "SELECT scope, key, value FROM cortex_settings WHERE scope LIKE 'persona:%' ORDER BY scope, key")
        found: dict[str, dict[str, Any]] = {}
        for row in rows:
            found.setdefault(str(row[0]), {})[str(row[1])] = json.loads(row[2])
        return found

    async def overrides_of(self, key: str) -> list[tuple[str, Any]]:
        """Every override of ``key`` (persona-wide and per server), as (scope, value), by scope."""
        rows = await self.db.fetch_all(
            "SELECT scope, value FROM cortex_settings WHERE key = ? ORDER BY scope", (key,))
        return [(str(r[0]), json.loads(r[1])) for r in rows]

    async def set_setting(self, scope: str, key: str, value: Any, updated_by: str) -> None:
        await self.db.write(
            "INSERT INTO cortex_settings (scope, key, value, updated_by, updated_at) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (scope, key) DO UPDATE SET value = excluded.value, updated_by = excluded.updated_by,"
            " updated_at = excluded.updated_at",
            (scope, key, json.dumps(value), updated_by, time.time()),
        )

    async def clear_setting(self, scope: str, key: str) -> bool:
        return bool(await self.db.write(
            "DELETE FROM cortex_settings WHERE scope = ? AND key = ? RETURNING key", (scope, key)
        ))

    # -- forget me (inside the core's one transaction, see Storage.forget_user) -----------------------

    async def delete_pairs(self, tx: Tx, pair_ids: list[int]) -> dict[str, int]:
        """Delete the pairs with their file versions, runs, memory items and unfinished jobs (what their runs
        spent is noted first, by ``bot.storage.forgotten.keep_usage``)."""
        marks = ",".join("?" for _ in pair_ids) or "NULL"
        versions = await tx.fetch_all(f"DELETE FROM cortex_versions WHERE pair_id IN ({marks}) RETURNING id", pair_ids)
        runs = await tx.fetch_all(f"DELETE FROM cortex_runs WHERE pair_id IN ({marks}) RETURNING id", pair_ids)
        await tx.execute(
            f"UPDATE memory_items SET supersedes = NULL, superseded_by = NULL WHERE pair_id IN ({marks})", pair_ids)
        items = await tx.fetch_all(f"DELETE FROM memory_items WHERE pair_id IN ({marks}) RETURNING id", pair_ids)
        for pair_id in pair_ids:
            # (every finished one too: a row kept for days names the pair; a running one ends on its own)
            await tx.execute("DELETE FROM jobs WHERE key = ? AND status <> 'running'", (f"pair:{pair_id}",))
        await tx.execute(f"DELETE FROM cortex_pairs WHERE id IN ({marks})", pair_ids)
        self._files_changed()
        return {"versions": len(versions), "runs": len(runs), "items": len(items)}
