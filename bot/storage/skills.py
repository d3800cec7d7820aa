"""The skill audit: one row per skill execution (who, where, which skill, sanitised arguments, outcome,
duration), for ``!skills stats``, ``!cortex stats`` and the per-user daily call limits."""

from __future__ import annotations

from dataclasses import dataclass

from bot.storage.engine import Database, serialise
from bot.storage.forgotten import USED_SINCE, subject


@dataclass(frozen=True, slots=True)
class SkillExecution:
    skill: str  # SkillInfo.key: the offered name, or server/tool for an MCP tool (its name may change)
    persona: str
    user_key: str
    channel_key: str
    server_key: str
    arguments: str  # JSON, secrets replaced
    ok: bool
    error: str
    duration_ms: int
    triggered_by: str  # "model" or "admin"
    created_at: float


@dataclass(frozen=True, slots=True)
class SkillStats:
    skill: str
    calls: int
    failures: int
    average_ms: float
    last_at: float
    last_error: str


class SkillAuditRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    def _insert(self, row: SkillExecution) -> tuple[str, tuple[object, ...]]:
        """The row's INSERT (RETURNING its id), only while its user exists: a reply still running while they asked
        to be forgotten must not write their words back. PostgreSQL: the user's row is read locked, so a
        forget-me in progress (which locks it first) is waited for."""
        lock = " FOR SHARE" if self.db.dialect == "postgres" else ""
        return (
            "INSERT INTO skill_executions (skill, persona, user_key, channel_key, server_key, arguments, ok,"
            " error, duration_ms, triggered_by, created_at) SELECT CAST(? AS TEXT), CAST(? AS TEXT),"
            " CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS INTEGER),"
            " CAST(? AS TEXT), CAST(? AS INTEGER), CAST(? AS TEXT), CAST(? AS DOUBLE PRECISION)"
            f" WHERE EXISTS (SELECT 1 FROM users WHERE key = ?{lock}) RETURNING id",
            (row.skill, row.persona, row.user_key, row.channel_key, row.server_key, row.arguments, int(row.ok),
             row.error, row.duration_ms, row.triggered_by, row.created_at, row.user_key))

    async def record(self, row: SkillExecution) -> None:
        """Audit one call (unless its user is gone, see :meth:`_insert`)."""
        sql, params = self._insert(row)
        async with self.db.transaction() as tx:
            await tx.fetch_one(sql, params)

    async def reserve(self, row: SkillExecution, since: float, limit: int) -> int | None:
        """Count a call against its user's daily limit before it runs: ``row`` (the call as not finished) is
        written only while the user made fewer than ``limit`` calls of the skill since ``since``. Its id for
        :meth:`finish`; 0 when the user is gone (nothing written); None at the limit. Concurrent calls (two
        replies, two processes) are counted one after the other: SQLite's write lock, on PostgreSQL an
        advisory lock on the user and skill."""
        async with self.db.transaction() as tx:
            await serialise(self.db, tx, f"skill-limit:{row.user_key}:{row.skill}")
            made = await tx.fetch_one(  # (a forget-me does not start the count afresh: bot.storage.forgotten)
                f"SELECT COUNT(*) + {USED_SINCE} FROM skill_executions WHERE user_key = ? AND skill = ?"
                " AND created_at >= ?", (subject("skill", row.user_key, row.skill), since, row.user_key, row.skill,
                                         since))
            if made is not None and int(made[0]) >= limit:
                return None
            inserted = await tx.fetch_one(*self._insert(row))
        return int(inserted[0]) if inserted else 0

    async def finish(self, execution_id: int, arguments: str, ok: bool, error: str, duration_ms: int) -> None:
        """Complete a reserved call's row (gone when its user was forgotten meanwhile: then nothing is written)."""
        await self.db.write(
            "UPDATE skill_executions SET arguments = ?, ok = ?, error = ?, duration_ms = ? WHERE id = ?",
            (arguments, int(ok), error, duration_ms, execution_id))

    async def stats(self, since: float, persona: str | None = None) -> list[SkillStats]:
        """Per skill since ``since`` (optionally for one persona): calls, failures, mean duration, last error."""
        where = "created_at >= ?"
        params: tuple[object, ...] = (since,)
        if persona is not None:
            where, params = where + " AND persona = ?", (*params, persona)
        rows = await self.db.fetch_all(
            "SELECT skill, COUNT(*), SUM(1 - ok), AVG(duration_ms), MAX(created_at)"
            f" FROM skill_executions WHERE {where} GROUP BY skill ORDER BY COUNT(*) DESC, skill", params)
        errors = await self.db.fetch_all(
            "SELECT skill, error FROM skill_executions"
            f" WHERE {where} AND ok = 0 ORDER BY created_at DESC, id DESC", params)
        last_error: dict[str, str] = {}
        for skill, error in errors:
            last_error.setdefault(str(skill), str(error))
        return [SkillStats(str(r[0]), int(r[1]), int(r[2] or 0), float(r[3] or 0), float(r[4]),
                           last_error.get(str(r[0]), "")) for r in rows]

    async def recent(self, user_key: str, limit: int = 100) -> list[SkillExecution]:
        rows = await self.db.fetch_all(
            "SELECT skill, persona, user_key, channel_key, server_key, arguments, ok, error, duration_ms,"
            " triggered_by, created_at FROM skill_executions WHERE user_key = ? ORDER BY id DESC LIMIT ?",
            (user_key, limit))
        return [SkillExecution(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]), bool(r[6]),
                               str(r[7]), int(r[8]), str(r[9]), float(r[10])) for r in rows]
