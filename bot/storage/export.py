"""Everything the bot holds about one user, read for ``!memory export`` (and written back by import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bot.storage.engine import Database, Row
from bot.storage.memory import ITEM_COLUMNS

# What an import may set of an item (ids and links are this database's own; links are made afterwards).
IMPORTED_ITEM_COLUMNS = (
    "category", "key", "content", "importance", "pinned", "expires_at", "tags", "source", "source_ref", "metadata",
    "created_at", "updated_at", "access_count", "last_accessed", "archived_at", "archive_reason", "scope",
)


def import_claim_key(user_key: str) -> str:
    """The setting that says an import of the user's is running (see ``ExportRepository.claim_import``)."""
    return f"import.running:{user_key}"


def plain(row: Row) -> dict[str, Any]:
    return {key: row[key] for key in row.keys()}


class ExportRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def pairs(self, user_id: int) -> list[dict[str, Any]]:
        rows = await self.db.fetch_all("SELECT id, persona, created_at FROM cortex_pairs WHERE user_id = ? ORDER BY id",
                                       (user_id,))
        return [plain(r) for r in rows]

    async def personas_talked_to(self, user_id: int) -> set[str]:
        """The personas the user has something with: a message, a memory item or a file version beyond the
        templates (a pair alone is made by merely looking at its files)."""
        rows = await self.db.fetch_all(
            "SELECT p.persona FROM cortex_pairs AS p WHERE p.user_id = ? AND ("
            " EXISTS (SELECT 1 FROM messages AS m WHERE m.user_id = p.user_id AND m.persona = p.persona)"
            " OR EXISTS (SELECT 1 FROM memory_items AS i WHERE i.pair_id = p.id)"
            " OR EXISTS (SELECT 1 FROM cortex_versions AS v WHERE v.pair_id = p.id AND v.author <> 'system'))",
            (user_id,))
        return {str(r[0]) for r in rows}

    async def items(self, pair_id: int) -> list[dict[str, Any]]:
        """Every item of the pair: active, archived, superseded and expired, with all their metadata."""
        rows = await self.db.fetch_all(f"SELECT {ITEM_COLUMNS} FROM memory_items WHERE pair_id = ? ORDER BY id",
                                       (pair_id,))
        return [plain(r) for r in rows]

    async def messages(self, user_id: int) -> list[dict[str, Any]]:
        """The user's messages and the replies to them (``reply_to``: the id of the message a reply answers), oldest
        first, with where they were said."""
        rows = await self.db.fetch_all(
            "SELECT m.id, c.key AS channel, c.name AS channel_name, c.is_dm, m.persona, m.role, m.author_name,"
            " m.text, m.created_at, m.reply_to FROM messages AS m JOIN channels AS c ON c.id = m.channel_id"
            " WHERE m.user_id = ? ORDER BY m.id", (user_id,))
        return [plain(r) for r in rows]

    async def dm_summaries(self, user_id: int) -> list[dict[str, Any]]:
        """The rolling summaries of the direct-message channels the user wrote in: every version, the
        rejected drafts too (their ``status`` and ``reason`` say so)."""
        rows = await self.db.fetch_all(
            "SELECT c.key AS channel, s.version, s.text, s.status, s.reason, s.created_at FROM summaries AS s"
            " JOIN channels AS c ON c.id = s.channel_id"
            " WHERE c.is_dm = 1"
            " AND s.channel_id IN (SELECT channel_id FROM messages WHERE user_id = ?"
            " UNION SELECT channel_id FROM channel_speakers WHERE user_id = ?)"
            " ORDER BY c.key, s.version", (user_id, user_id))
        return [plain(r) for r in rows]

    # -- import ------------------------------------------------------------------------------------

    async def claim_import(self, user_key: str, token: str, now: float, stale_before: float) -> bool:
        """Mark an import of the user's as running, for every process sharing the database (two at once
        would each find nothing there yet and write everything twice); False while another runs. A mark
        older than ``stale_before`` is one whose process died: taken over."""
        row = await self.db.write_one(
            "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE SET"
            " value = excluded.value, updated_at = excluded.updated_at WHERE settings.updated_at < ? RETURNING key",
            (import_claim_key(user_key), token, now, stale_before))
        return row is not None

    async def renew_import(self, user_key: str, token: str, now: float) -> bool:
        """Keep a running import's mark fresh (its process is alive); False when the mark is no longer ours."""
        row = await self.db.write_one("UPDATE settings SET updated_at = ? WHERE key = ? AND value = ? RETURNING key",
                                      (now, import_claim_key(user_key), token))
        return row is not None

    async def import_marked_at(self, user_key: str) -> float | None:
        """When the mark of the user's running import was last renewed (None: no import runs)."""
        row = await self.db.fetch_one("SELECT updated_at FROM settings WHERE key = ?", (import_claim_key(user_key),))
        return float(row[0]) if row else None

    async def release_import(self, user_key: str, token: str) -> None:
        await self.db.write("DELETE FROM settings WHERE key = ? AND value = ?", (import_claim_key(user_key), token))

    async def item_like(self, pair_id: int, content: str, created_at: float) -> int | None:
        """The id of the pair's item with this text and time (an import's item already here), or None (found
        through the pair's items by time: an import of thousands asks once per item)."""
        row = await self.db.fetch_one(
            "SELECT id FROM memory_items WHERE pair_id = ? AND created_at > ? AND created_at < ? AND content = ?"
            " ORDER BY id LIMIT 1", (pair_id, created_at - 0.001, created_at + 0.001, content))
        return None if row is None else int(row[0])

    async def active_items(self, pair_id: int) -> int:
        """The pair's items not archived (what an import may add to, up to a limit)."""
        row = await self.db.fetch_one(
            "SELECT count(*) FROM memory_items WHERE pair_id = ? AND archived_at IS NULL", (pair_id,))
        return int(row[0]) if row else 0

    async def import_item(self, pair_id: int, fields: Mapping[str, Any]) -> int:
        """Insert an item as exported (its own times and state); returns its new id."""
        columns = [c for c in IMPORTED_ITEM_COLUMNS if c in fields]
        row = await self.db.write_one(
            f"INSERT INTO memory_items (pair_id, {', '.join(columns)}) VALUES (?, {', '.join('?' for _ in columns)})"
            " RETURNING id", (pair_id, *(fields[c] for c in columns)))
        assert row is not None
        return int(row[0])

    async def link_correction(self, pair_id: int, old_id: int, new_id: int) -> None:
        """Mark ``new_id`` as the correction of ``old_id``, unless ``old_id`` has a correction already (one
        its user made since an earlier import of it stays the one that counts). A link that would close a
        loop (``new_id`` already corrected by ``old_id``, directly or down a chain) is not made: every item
        of a loop would be hidden as superseded, for good."""
        if old_id == new_id:
            return
        async with self.db.transaction() as tx:
            loop = await tx.fetch_one(
                "WITH RECURSIVE chain (id) AS (SELECT superseded_by FROM memory_items WHERE id = ? AND pair_id = ?"
                " UNION SELECT m.superseded_by FROM memory_items AS m JOIN chain ON m.id = chain.id"
                " WHERE m.superseded_by IS NOT NULL) SELECT 1 FROM chain WHERE id = ?", (new_id, pair_id, old_id))
            if loop is not None:
                return
            linked = await tx.fetch_one(
                "UPDATE memory_items SET superseded_by = ? WHERE id = ? AND pair_id = ?"
                " AND (superseded_by IS NULL OR superseded_by = ?) RETURNING id", (new_id, old_id, pair_id, new_id))
            if linked is not None:
                await tx.execute("UPDATE memory_items SET supersedes = ? WHERE id = ? AND pair_id = ?",
                                 (old_id, new_id, pair_id))

    async def has_message(self, channel_id: int, role: str, text: str, created_at: float) -> bool:
        row = await self.db.fetch_one(  # (found by time within the channel: an import asks once per message)
            "SELECT 1 FROM messages WHERE channel_id = ? AND created_at > ? AND created_at < ? AND role = ?"
            " AND text = ?", (channel_id, created_at - 0.001, created_at + 0.001, role, text))
        return row is not None
