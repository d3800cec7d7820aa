"""The fleet repository: what several bot processes sharing one database agree on through it.

* **Periodic runs**: a process runs a periodic job only after claiming the period in one statement
  (an upsert that succeeds only when the last run started long enough ago), so upkeep runs once per
  period across the fleet, whoever's timer fires first.
* **Instance locks**: a named lock with an owner and an expiry, renewed while held (a Matrix account
  served by one process only); a lock whose holder died expires.
* **Processes**: each process writes a heartbeat row (host, pid, shards, …); ``cortexbot status``
  lists those seen recently, with the queue's depth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bot.storage.engine import Database

LIVE_SECONDS = 45.0  # a process whose heartbeat is older than this is taken for dead
DEAD_KEPT_SECONDS = 86_400.0  # and its row is deleted this much later
# A stamp further ahead of this clock than this was written by a clock that was wrong (it has been set back
# since, or another machine's is far off): it does not hold up a periodic run or a lock until then.
CLOCK_AHEAD_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    id: str
    host: str
    pid: int
    info: dict[str, Any]
    started_at: float
    last_seen: float


@dataclass(frozen=True, slots=True)
class QueueStats:
    queued: int
    running: int
    failed: int
    oldest_queued_at: float | None
    failed_recently: int = 0  # failed since the ``since`` asked for (``queue_stats``)
    lapsed: int = 0  # marked running, their lease run out: a process that stopped mid-job (taken over later)
    newest_failure: NewestFailure | None = None


@dataclass(frozen=True, slots=True)
class NewestFailure:
    id: int
    kind: str
    key: str
    error: str
    failed_at: float


class FleetRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def claim_period(self, name: str, period_seconds: float, owner: str, *, now: float | None = None) -> bool:
        """Whether this process should run ``name`` now: true for exactly one claimant per period.

        A run counts as due a little early (5 % of the period, at most 5 s), so timers of different
        processes that drift by a moment never skip a period; a last start far in the future
        (:data:`CLOCK_AHEAD_SECONDS`) counts as long ago."""
        now = await self.db.now() if now is None else now
        slack = min(period_seconds * 0.05, 5.0)
        row = await self.db.write_one(
            "INSERT INTO periodic_runs (name, last_started, owner) VALUES (?, ?, ?)"
            " ON CONFLICT (name) DO UPDATE SET last_started = excluded.last_started, owner = excluded.owner"
            " WHERE periodic_runs.last_started <= ? OR periodic_runs.last_started > ? RETURNING name",
            (name, now, owner, now - period_seconds + slack, now + period_seconds + CLOCK_AHEAD_SECONDS),
        )
        return row is not None

    async def acquire_lock(self, name: str, owner: str, ttl_seconds: float) -> str | None:
        """Take or renew the lock ``name`` for ``owner``; returns None when taken, else the holder. An
        expiry far in the future (:data:`CLOCK_AHEAD_SECONDS`) counts as past."""
        now = await self.db.now()
        row = await self.db.write_one(
            "INSERT INTO instance_locks (name, owner, expires_at) VALUES (?, ?, ?)"
            " ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at"
            " WHERE instance_locks.owner = excluded.owner OR instance_locks.expires_at < ?"
            " OR instance_locks.expires_at > ? RETURNING owner",
            (name, owner, now + ttl_seconds, now, now + ttl_seconds + CLOCK_AHEAD_SECONDS),
        )
        if row is not None:
            return None
        holder = await self.db.fetch_one("SELECT owner FROM instance_locks WHERE name = ?", (name,))
        return str(holder[0]) if holder else "another process"

    async def release_lock(self, name: str, owner: str) -> None:
        await self.db.write("DELETE FROM instance_locks WHERE name = ? AND owner = ?", (name, owner))

    async def release_locks(self, owner: str) -> None:
        """Every lock ``owner`` holds (a clean stop)."""
        await self.db.write("DELETE FROM instance_locks WHERE owner = ?", (owner,))

    async def heartbeat(self, process_id: str, host: str, pid: int, info: dict[str, Any], started_at: float) -> None:
        await self.db.write(
            "INSERT INTO processes (id, host, pid, info, started_at, last_seen) VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET info = excluded.info, last_seen = excluded.last_seen",
            (process_id, host, pid, json.dumps(info), started_at, await self.db.now()),
        )

    async def leave(self, process_id: str) -> None:
        await self.db.write("DELETE FROM processes WHERE id = ?", (process_id,))

    async def live_processes(self, *, within: float = LIVE_SECONDS) -> list[ProcessInfo]:
        """Processes seen within ``within`` seconds. Only reads: a read-only database (a hot standby) and a role
        that may only read answer `cortexbot status` and a copy from them (``prune_processes`` removes old rows)."""
        cutoff = await self.db.now() - within
        rows = await self.db.fetch_all(
            "SELECT id, host, pid, info, started_at, last_seen FROM processes WHERE last_seen >= ? ORDER BY started_at",
            (cutoff,),
        )
        return [ProcessInfo(str(r[0]), str(r[1]), int(r[2]), json.loads(r[3]), float(r[4]), float(r[5])) for r in rows]

    async def prune_processes(self) -> int:
        """Delete the rows of processes not seen for a day (stopped without a word: killed, crashed); how many."""
        return len(await self.db.write("DELETE FROM processes WHERE last_seen < ? RETURNING id",
                                       (await self.db.now() - LIVE_SECONDS - DEAD_KEPT_SECONDS,)))

    async def queue_stats(self, since: float = 0.0) -> QueueStats:
        """The queue's counts; jobs failed since ``since`` and the newest failure; running jobs whose lease
        ran out."""
        now = await self.db.now()
        row = await self.db.fetch_one(
            "SELECT sum(CASE WHEN status = 'queued' THEN 1 ELSE 0 END),"
            " sum(CASE WHEN status = 'running' THEN 1 ELSE 0 END),"
            " sum(CASE WHEN status = 'failed' THEN 1 ELSE 0 END),"
            " min(CASE WHEN status = 'queued' THEN created_at END),"
            " sum(CASE WHEN status = 'failed' AND updated_at >= ? THEN 1 ELSE 0 END),"
            " sum(CASE WHEN status = 'running' AND lease_until < ? THEN 1 ELSE 0 END) FROM jobs"
            " WHERE status IN ('queued', 'running', 'failed')", (since, now)
        )
        if row is None:
            return QueueStats(0, 0, 0, None)
        newest = await self.db.fetch_one(
            "SELECT id, kind, key, last_error, updated_at FROM jobs WHERE status = 'failed'"
            " ORDER BY updated_at DESC, id DESC LIMIT 1")
        failure = None if newest is None else NewestFailure(
            int(newest[0]), str(newest[1]), str(newest[2]), str(newest[3]), float(newest[4]))
        return QueueStats(int(row[0] or 0), int(row[1] or 0), int(row[2] or 0),
                          None if row[3] is None else float(row[3]), int(row[4] or 0), int(row[5] or 0), failure)
