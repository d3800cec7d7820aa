"""Per-user rate limits counted in the database, for the processes of a fleet sharing one PostgreSQL (SQLite has
one process per file: ``bot.ratelimit`` counts in memory there).

A subject's sends of the last minute are one row (an array of times, by the server's clock), checked and counted
in one statement: the upsert's row lock makes two processes counting the same user at once take turns, so
neither lets a send past the limit. A subject is a digest of the user's key (no user id in the table); rows idle
for a minute are deleted by the upkeep (:meth:`RateLimitRepository.prune`).
"""

from __future__ import annotations

import hashlib

from bot.storage.engine import Database

WINDOW_SECONDS = 60.0
# The sends within the window (one stamped further ahead than the window, by a clock that was wrong, is past).
_KEPT = "ARRAY(SELECT t FROM unnest(rate_limits.sends) AS t WHERE t > ? AND t < ?)"
COUNT_SQL = (
    "INSERT INTO rate_limits (subject, sends, updated_at) VALUES (?, ARRAY[CAST(? AS DOUBLE PRECISION)], ?)"
    f" ON CONFLICT (subject) DO UPDATE SET sends = CASE WHEN cardinality({_KEPT}) < ?"
    f" THEN {_KEPT} || excluded.sends ELSE {_KEPT} END, updated_at = excluded.updated_at RETURNING sends"
)


def subject(kind: str, key: str) -> str:
    """The row of ``key``'s sends of one kind ("chat", "commands")."""
    return f"{kind}:{hashlib.sha256(key.encode()).hexdigest()[:32]}"


class RateLimitRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def count(self, kind: str, key: str, per_minute: int) -> float:
        """Count a send of ``key`` when it sent fewer than ``per_minute`` of ``kind`` in the last minute: 0; else
        the seconds until it may (nothing counted)."""
        now = await self.db.now()
        window = (now - WINDOW_SECONDS, now + WINDOW_SECONDS)
        row = await self.db.write_one(COUNT_SQL, (subject(kind, key), now, now, *window, per_minute, *window, *window))
        sends = [float(t) for t in row[0]] if row is not None else []
        if sends and sends[-1] == now and len(sends) <= per_minute:
            return 0.0
        return min(max(WINDOW_SECONDS - (now - min(sends, default=now)), 0.001), WINDOW_SECONDS)

    async def prune(self) -> int:
        """Delete the rows of subjects that sent nothing for a minute; how many."""
        cutoff = await self.db.now() - WINDOW_SECONDS
        return len(await self.db.write("DELETE FROM rate_limits WHERE updated_at < ? RETURNING subject", (cutoff,)))
