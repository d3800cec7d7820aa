"""What shaped each reply: the ids of the memory items, lore entries, recalled messages, cortex file
versions and summary version that went into its prompt (ids only, never their text), for ``!memory why``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bot.storage.engine import Database, multi_row, power_chunks

ROWS_PER_STATEMENT = 256  # rows inserted by one statement at most (4 parameters each, far below any engine's cap)
SOURCE_SQL = "INSERT INTO reply_sources (message_id, kind, ref, detail) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"


@dataclass(frozen=True, slots=True)
class ReplySource:
    kind: str  # "item", "lore", "message", "file", "summary"
    ref: int  # the item's, entry's or message's id; a file's or summary's version
    detail: str = ""  # the file's name


class SourceRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def record(self, message_id: int, sources: Sequence[ReplySource]) -> None:
        rows = [(message_id, s.kind, s.ref, s.detail) for s in dict.fromkeys(sources)]
        if not rows:
            return
        if len(rows) <= ROWS_PER_STATEMENT:
            # A reply's usual few dozen in one statement, one round trip; padded with copies of its last row
            # (which the key makes no-ops) to a power of two, so few statement texts exist.
            padded = rows + rows[-1:] * ((1 << (len(rows) - 1).bit_length()) - len(rows))
            await self.db.write(*multi_row(SOURCE_SQL, padded))
            return
        async with self.db.transaction() as tx:
            for chunk in power_chunks(rows, ROWS_PER_STATEMENT):
                await tx.execute(*multi_row(SOURCE_SQL, chunk))

    async def of(self, message_id: int) -> list[ReplySource]:
        rows = await self.db.fetch_all(
            "SELECT kind, ref, detail FROM reply_sources WHERE message_id = ? ORDER BY kind, ref", (message_id,))
        return [ReplySource(str(r[0]), int(r[1]), str(r[2])) for r in rows]

    async def link(self, keys: Sequence[str], message_id: int) -> None:
        """Remember which platform messages (``discord-message:123``) show the stored reply."""
        async with self.db.transaction() as tx:
            await tx.executemany("INSERT INTO platform_messages (key, message_id) VALUES (?, ?) ON CONFLICT DO NOTHING",
                                 [(key, message_id) for key in dict.fromkeys(keys)])

    async def reply_shown_as(self, key: str, user_id: int) -> tuple[int, float, str] | None:
        """The stored reply to ``user_id`` that the platform message ``key`` shows: its id, time and persona."""
        row = await self.db.fetch_one(
            "SELECT m.id, m.created_at, m.persona FROM platform_messages AS p JOIN messages AS m ON m.id = p.message_id"
            " WHERE p.key = ? AND m.user_id = ? AND m.role = 'assistant'", (key, user_id))
        return None if row is None else (int(row[0]), float(row[1]), str(row[2]))

    async def last_reply(self, user_id: int, channel_key: str) -> tuple[int, float, str] | None:
        """The newest reply to ``user_id`` in the channel: its id, time and persona (the channel is looked up first, so
        that every plan walks back through the (channel, user) index: a join let PostgreSQL's generic plan
        combine two indexes of all the user's messages and sort them)."""
        row = await self.db.fetch_one(
            "SELECT m.id, m.created_at, m.persona FROM messages AS m"
            " WHERE m.channel_id = (SELECT id FROM channels WHERE key = ?)"
            " AND m.user_id = ? AND m.role = 'assistant' ORDER BY m.id DESC LIMIT 1",
            (channel_key, user_id))
        return None if row is None else (int(row[0]), float(row[1]), str(row[2]))
