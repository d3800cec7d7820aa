"""Incognito stretches (``!memory pause`` … ``!memory resume``): per user and persona, the messages
since the start are answered with but kept out of summaries, cortex updates and embeddings
(:data:`NOT_INCOGNITO` in those queries), and deleted — with all that points at them — when it ends.
The retention of ``[memory] keep_messages_days`` deletes old messages the same way."""

from __future__ import annotations

import time

from bot.storage.engine import Database

# "This message (alias m) is not inside an incognito stretch of its user and persona."
NOT_INCOGNITO = ("NOT EXISTS (SELECT 1 FROM incognito AS i WHERE i.user_id = {m}.user_id AND i.persona = {m}.persona"
                 " AND {m}.created_at >= i.started_at)")
DEPENDENT = ("reply_sources", "platform_messages", "message_vectors")


def not_incognito(alias: str) -> str:
    return NOT_INCOGNITO.format(m=alias)


class IncognitoRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def start(self, user_id: int, persona: str) -> float:
        """Begin a stretch (or keep the running one); its start time."""
        await self.db.write("INSERT INTO incognito (user_id, persona, started_at) VALUES (?, ?, ?)"
                            " ON CONFLICT DO NOTHING", (user_id, persona, time.time()))
        started = await self.since(user_id, persona)
        assert started is not None
        return started

    async def since(self, user_id: int, persona: str) -> float | None:
        row = await self.db.fetch_one("SELECT started_at FROM incognito WHERE user_id = ? AND persona = ?",
                                      (user_id, persona))
        return None if row is None else float(row[0])

    async def end(self, user_id: int, persona: str) -> int | None:
        """End the stretch: its messages (the user's and the replies) go, in one transaction; how many
        (None when there was no stretch)."""
        async with self.db.transaction() as tx:
            row = await tx.fetch_one("SELECT started_at FROM incognito WHERE user_id = ? AND persona = ?",
                                     (user_id, persona))
            if row is None:
                return None
            stretch = "SELECT id FROM messages WHERE user_id = ? AND persona = ? AND created_at >= ?"
            params = (user_id, persona, float(row[0]))
            for table in DEPENDENT:
                await tx.execute(f"DELETE FROM {table} WHERE message_id IN ({stretch})", params)
            channels = [int(r[0]) for r in await tx.fetch_all(
                "SELECT DISTINCT channel_id FROM messages WHERE user_id = ? AND persona = ? AND created_at >= ?",
                params)]
            deleted = await tx.fetch_all(f"DELETE FROM messages WHERE id IN ({stretch}) RETURNING id", params)
            marks = ",".join("?" for _ in channels) or "NULL"
            await tx.execute("UPDATE channels SET message_count = (SELECT count(*) FROM messages"
                             f" WHERE channel_id = channels.id) WHERE id IN ({marks})", channels)
            await tx.execute("DELETE FROM incognito WHERE user_id = ? AND persona = ?", (user_id, persona))
        return len(deleted)

    async def delete_messages_before(self, before: float) -> int:
        """Retention: every message older than ``before`` goes (with what points at it); how many."""
        async with self.db.transaction() as tx:
            old = "SELECT id FROM messages WHERE created_at < ?"
            for table in (*DEPENDENT, "reply_stats"):
                await tx.execute(f"DELETE FROM {table} WHERE message_id IN ({old})", (before,))
            channels = [int(r[0]) for r in await tx.fetch_all(
                "SELECT DISTINCT channel_id FROM messages WHERE created_at < ?", (before,))]
            deleted = await tx.fetch_all("DELETE FROM messages WHERE created_at < ? RETURNING id", (before,))
            marks = ",".join("?" for _ in channels) or "NULL"
            await tx.execute("UPDATE channels SET message_count = (SELECT count(*) FROM messages"
                             f" WHERE channel_id = channels.id) WHERE id IN ({marks})", channels)
        return len(deleted)

    async def expired(self, started_before: float) -> list[tuple[int, str]]:
        rows = await self.db.fetch_all("SELECT user_id, persona FROM incognito WHERE started_at < ?",
                                       (started_before,))
        return [(int(r[0]), str(r[1])) for r in rows]
