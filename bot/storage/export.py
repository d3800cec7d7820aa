"""Everything the bot holds about one user, read for ``!memory export`` (and written back by import)."""

from __future__ import annotations

from typing import Any

from bot.storage.engine import Database, Row
from bot.storage.memory import ITEM_COLUMNS


def plain(row: Row) -> dict[str, Any]:
    return {key: row[key] for key in row.keys()}


class ExportRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def pairs(self, user_id: int) -> list[dict[str, Any]]:
        rows = await self.db.fetch_all("SELECT id, persona, created_at FROM cortex_pairs WHERE user_id = ? ORDER BY id",
                                       (user_id,))
        return [plain(r) for r in rows]

    async def items(self, pair_id: int) -> list[dict[str, Any]]:
        """Every item of the pair: active, archived, superseded and expired, with all their metadata."""
        rows = await self.db.fetch_all(f"SELECT {ITEM_COLUMNS} FROM memory_items WHERE pair_id = ? ORDER BY id",
                                       (pair_id,))
        return [plain(r) for r in rows]

    async def messages(self, user_id: int) -> list[dict[str, Any]]:
        """The user's messages and the replies to them, oldest first, with where they were said."""
        rows = await self.db.fetch_all(
            "SELECT m.id, c.key AS channel, c.name AS channel_name, c.is_dm, m.persona, m.role, m.author_name,"
            " m.text, m.created_at FROM messages AS m JOIN channels AS c ON c.id = m.channel_id"
            " WHERE m.user_id = ? ORDER BY m.id", (user_id,))
        return [plain(r) for r in rows]

    async def dm_summaries(self, user_id: int) -> list[dict[str, Any]]:
        """The rolling summaries (accepted versions) of the direct-message channels the user wrote in."""
        rows = await self.db.fetch_all(
            "SELECT c.key AS channel, s.version, s.text, s.created_at FROM summaries AS s"
            " JOIN channels AS c ON c.id = s.channel_id"
            " WHERE c.is_dm = 1 AND s.status = 'ok'"
            " AND s.channel_id IN (SELECT DISTINCT channel_id FROM messages WHERE user_id = ?)"
            " ORDER BY c.key, s.version", (user_id,))
        return [plain(r) for r in rows]
