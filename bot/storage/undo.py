"""The confirmations that offer an undo ("Remembered as #12. React ❌ to this message to undo."): which platform
message confirmed what, for whom. Kept in the database, not in the process that sent them, so that a ❌ on one
sent before a restart (or by another process) still undoes what it names.

A row names the user by their row (a forget-me deletes theirs; one written while it runs fails on the reference,
and is not kept) and what was remembered by its source (the undo archives what came from it). Rows older than
``KEPT_DAYS`` are deleted by the daily upkeep (:meth:`UndoOfferRepository.prune`): a ❌ on such an old
confirmation is told the undo has expired, and ``!memory forget`` does it then.
"""

from __future__ import annotations

import time

from bot.storage.engine import Database, is_missing_reference

KEPT_DAYS = 30


class UndoOfferRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def offer(self, key: str, user_key: str, source_ref: str) -> bool:
        """Note that the platform message ``key`` offers ``user_key`` the undo of what was remembered from
        ``source_ref``; False when the user is gone (a forget-me came first)."""
        try:
            rows = await self.db.write(
                "INSERT INTO undo_offers (key, user_id, source_ref, created_at) SELECT ?, id, ?, ? FROM users"
                " WHERE key = ? ON CONFLICT (key) DO NOTHING RETURNING key", (key, source_ref, time.time(), user_key))
        except Exception as exc:
            if not is_missing_reference(exc):
                raise
            return False  # (PostgreSQL: the user's row went in a forget-me that ended as this was written)
        return bool(rows)

    async def find(self, key: str) -> tuple[str, str] | None:
        """Whose undo the platform message ``key`` offers, and of what: (user key, source), or None when it
        offers none (or no longer does)."""
        row = await self.db.fetch_one(
            "SELECT u.key, o.source_ref FROM undo_offers AS o JOIN users AS u ON u.id = o.user_id WHERE o.key = ?",
            (key,))
        return None if row is None else (str(row[0]), str(row[1]))

    async def prune(self, kept_days: float = KEPT_DAYS) -> int:
        """Delete the offers older than ``kept_days``; how many went."""
        cutoff = time.time() - kept_days * 86_400
        return len(await self.db.write("DELETE FROM undo_offers WHERE created_at < ? RETURNING key", (cutoff,)))
