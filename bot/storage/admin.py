"""What the web page's admin routes read and change beyond the other repositories: token spending per
day and purpose, the users with counts (never text), and requeueing a failed job.

Portable SQL only (``?`` placeholders, no date functions): a day is a UTC time range the caller gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bot.storage.engine import Database, serialise


def enqueue_lock(kind: str, key: str) -> str:
    """The lock (``serialise``) that puts jobs of one kind and key in the queue one at a time on PostgreSQL, where
    each statement sees the rows committed when it began: enqueues and re-queues take it alike."""
    return f"enqueue:{kind}:{key}"


@dataclass(frozen=True, slots=True)
class Usage:
    """LLM calls of one day (index into the ranges given) and purpose."""

    day: int
    purpose: str
    input_tokens: int
    output_tokens: int
    calls: int


@dataclass(frozen=True, slots=True)
class UserCounts:
    key: str
    name: str
    messages: int  # the user's own messages (not the replies to them)
    items: int  # active memory items over all their pairs
    pairs: int
    last_seen: float  # their newest message, else when the user row last changed


class AdminRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def llm_usage(self, day_starts: Sequence[float], end: float) -> list[Usage]:
        """Tokens and calls per day and purpose; ``day_starts`` newest first, the newest day ending at ``end``.
        Calls before the oldest start are not counted."""
        if not day_starts:
            return []
        bucket = " ".join(f"WHEN created_at >= ? THEN {i}" for i in range(len(day_starts)))
        rows = await self.db.fetch_all(
            "SELECT day, purpose, coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0), count(*)"
            f" FROM (SELECT CASE {bucket} END AS day, purpose, input_tokens, output_tokens FROM llm_calls"
            "   WHERE created_at >= ? AND created_at < ?) AS c GROUP BY day, purpose",
            (*day_starts, min(day_starts), end))
        return [Usage(int(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows if r[0] is not None]

    async def users(self, limit: int = 500) -> list[UserCounts]:
        """Every user with counts of what is stored about them, the most recently seen first."""
        rows = await self.db.fetch_all(
            "SELECT u.key, u.display_name,"
            " (SELECT count(*) FROM messages m WHERE m.user_id = u.id AND m.role = 'user'),"
            " (SELECT count(*) FROM memory_items i JOIN cortex_pairs p ON p.id = i.pair_id"
            "   WHERE p.user_id = u.id AND i.archived_at IS NULL AND i.superseded_by IS NULL),"
            " (SELECT count(*) FROM cortex_pairs p WHERE p.user_id = u.id),"
            " coalesce((SELECT max(m.created_at) FROM messages m WHERE m.user_id = u.id), u.updated_at) AS seen"
            " FROM users u ORDER BY seen DESC, u.id LIMIT ?", (limit,))
        return [UserCounts(str(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4]), float(r[5])) for r in rows]

    async def count_users(self) -> int:
        row = await self.db.fetch_one("SELECT count(*) FROM users")
        return int(row[0]) if row else 0

    async def requeue_failed_job(self, job_id: int) -> bool:
        """Queue a failed job again with a fresh set of attempts (its last error stays visible); False when
        it is not failed, or a job of the same kind and key is queued already."""
        now = await self.db.now()
        sql = ("UPDATE jobs SET status = 'queued', attempts = 0, run_after = ?, locked_by = '', lease_until = 0,"
               " updated_at = ? WHERE id = ? AND status = 'failed' AND NOT EXISTS (SELECT 1 FROM jobs AS q"
               " WHERE q.kind = jobs.kind AND q.key = jobs.key AND q.status = 'queued') RETURNING id")
        if self.db.dialect != "postgres":
            return bool(await self.db.write(sql, (now, now, job_id)))
        async with self.db.transaction() as tx:
            job = await tx.fetch_one("SELECT kind, key FROM jobs WHERE id = ?", (job_id,))
            if job is None:
                return False
            await serialise(self.db, tx, enqueue_lock(str(job[0]), str(job[1])))
            return await tx.fetch_one(sql, (now, now, job_id)) is not None
