"""Incognito stretches (``!memory pause`` … ``!memory resume``): per user and persona, the messages
since the start are answered with but kept out of summaries, cortex updates, embeddings and the search of
past messages
(:data:`NOT_INCOGNITO` in those queries), and deleted — with all that points at them — when it ends
(``Storage.end_incognito``)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from bot.storage.engine import Database

CLOCK_SLACK_SECONDS = 600.0  # a platform's time further off the bot's clock than this is not believed


def believable(sent_at: datetime | None) -> datetime | None:
    """The platform's time of a message or a command, unless it is further off the bot's clock than
    ``CLOCK_SLACK_SECONDS`` (then None: the bot's clock). Messages and a stretch's start are compared, so both
    go by this one rule."""
    if sent_at is None or abs((sent_at - datetime.now(UTC)).total_seconds()) > CLOCK_SLACK_SECONDS:
        return None
    return sent_at

# How long an ended stretch is remembered: a message sent in it may reach the bot (and be stored) after the
# stretch's end, when it was in flight as `!memory resume` was handled (Matrix handles each event as a task).
# Its time is the platform's, believed within CLOCK_SLACK_SECONDS: no later one can fall inside.
ENDED_KEPT_SECONDS = CLOCK_SLACK_SECONDS + 60.0

# "This message (alias m) is inside a running incognito stretch of its user and persona."
IN_RUNNING = ("EXISTS (SELECT 1 FROM incognito AS i WHERE i.user_id = {m}.user_id AND i.persona = {m}.persona"
              " AND {m}.created_at >= i.started_at)")
# "… inside one that has ended" (a message stored after the end of the stretch it was sent in: it is about to go).
IN_ENDED = ("EXISTS (SELECT 1 FROM incognito_ended AS e JOIN users AS eu ON eu.key = e.user_key"
            " WHERE eu.id = {m}.user_id AND e.persona = {m}.persona AND {m}.created_at >= e.started_at"
            " AND {m}.created_at < e.ended_at)")


def not_incognito(alias: str) -> str:
    """SQL: the message ``alias`` is in no incognito stretch, running or ended."""
    return f"NOT {IN_RUNNING.format(m=alias)} AND NOT {IN_ENDED.format(m=alias)}"


def visible_to(alias: str) -> str:
    """SQL: the message ``alias`` may enter a prompt for the viewer given by the next two parameters (user id,
    persona): outside every stretch, or in the viewer's own running stretch with that persona (never in an
    ended one: a reply to anyone is kept)."""
    return (f"NOT {IN_ENDED.format(m=alias)} AND (NOT {IN_RUNNING.format(m=alias)}"
            f" OR ({alias}.user_id = ? AND {alias}.persona = ?))")


class IncognitoRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def start(self, user_id: int, persona: str, at: datetime | None = None) -> float:
        """Begin a stretch (or keep the running one) at ``at``: when the platform says the pause was sent, the
        clock its messages are stored by (the bot's own clock read when it got to the pause let a message sent
        just after it, but handled first or stamped earlier, fall outside the stretch); its start time."""
        believed = believable(at)
        start = believed.timestamp() if believed is not None else time.time()
        await self.db.write("INSERT INTO incognito (user_id, persona, started_at) VALUES (?, ?, ?)"
                            " ON CONFLICT DO NOTHING", (user_id, persona, start))
        started = await self.since(user_id, persona)
        assert started is not None
        return started

    async def since(self, user_id: int, persona: str) -> float | None:
        row = await self.db.fetch_one("SELECT started_at FROM incognito WHERE user_id = ? AND persona = ?",
                                      (user_id, persona))
        return None if row is None else float(row[0])

    async def at(self, user_id: int, user_key: str, persona: str, sent: float) -> tuple[float | None, bool]:
        """The start of the user's running stretch with the persona (None: not paused), and whether a message
        sent at ``sent`` lies in a stretch that has ended (it was stored after the end: it goes, unremembered)."""
        row = await self.db.fetch_one(
            "SELECT (SELECT started_at FROM incognito WHERE user_id = ? AND persona = ?),"
            " EXISTS (SELECT 1 FROM incognito_ended WHERE user_key = ? AND persona = ? AND started_at <= ?"
            " AND ended_at > ?)", (user_id, persona, user_key, persona, sent, sent))
        assert row is not None
        return (None if row[0] is None else float(row[0])), bool(row[1])

    async def active(self, user_id: int, persona: str) -> bool:
        """Whether the user is incognito with the persona (a pause is running)."""
        return await self.since(user_id, persona) is not None

    async def stretches(self, user_id: int) -> list[tuple[str, float]]:
        """(persona, since when) of every pause the user has running."""
        rows = await self.db.fetch_all(
            "SELECT persona, started_at FROM incognito WHERE user_id = ? ORDER BY persona", (user_id,))
        return [(str(r[0]), float(r[1])) for r in rows]

    async def personas(self, user_id: int) -> list[str]:
        """The personas the user is incognito with."""
        rows = await self.db.fetch_all("SELECT persona FROM incognito WHERE user_id = ? ORDER BY persona", (user_id,))
        return [str(r[0]) for r in rows]

    async def expired(self, started_before: float) -> list[tuple[int, str]]:
        rows = await self.db.fetch_all("SELECT user_id, persona FROM incognito WHERE started_at < ?",
                                       (started_before,))
        return [(int(r[0]), str(r[1])) for r in rows]
