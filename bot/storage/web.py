"""Web page logins: single-use links a ``!dashboard`` command hands out, and the sessions they open.

Only SHA-256 hashes of the link tokens and session ids are stored: whoever reads the database (or a
backup of it) cannot open a session with what they find there. Consuming a link is one statement,
so two requests racing with the same link open at most one session.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from bot.storage.engine import Database

TOKEN_BYTES = 32


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class WebSession:
    user_key: str
    user_name: str
    csrf: str
    created_at: float
    expires_at: float


class WebLoginRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create_link(self, user_key: str, user_name: str, valid_seconds: float) -> str:
        """A new login token for ``user_key`` (returned once, stored as its hash)."""
        # Hex, not base64url: a link shown as Markdown (Matrix) read "_" and "__" in the token as emphasis.
        token, now = secrets.token_hex(TOKEN_BYTES), await self.db.now()
        await self.db.write(
            "INSERT INTO web_links (token_hash, user_key, user_name, created_at, expires_at) VALUES (?, ?, ?, ?, ?)",
            (token_hash(token), user_key, user_name, now, now + valid_seconds))
        await self.db.write("DELETE FROM web_links WHERE expires_at < ?", (now - 86_400,))
        return token

    async def link_valid(self, token: str) -> bool:
        row = await self.db.fetch_one(
            "SELECT 1 FROM web_links WHERE token_hash = ? AND used_at IS NULL AND expires_at > ?",
            (token_hash(token), await self.db.now()))
        return row is not None

    async def consume_link(self, token: str, session_seconds: float) -> tuple[str, WebSession] | None:
        """Use a link once: a new session (its id and row), or None when the link is unknown, used or expired."""
        now = await self.db.now()
        session_id, csrf = secrets.token_urlsafe(TOKEN_BYTES), secrets.token_urlsafe(TOKEN_BYTES)
        # One transaction: a forget-me cannot fall between the link's use and the session it opens.
        async with self.db.transaction() as tx:
            row = await tx.fetch_one(
                "UPDATE web_links SET used_at = ? WHERE token_hash = ? AND used_at IS NULL AND expires_at > ?"
                " RETURNING user_key, user_name", (now, token_hash(token), now))
            if row is None:
                return None
            session = WebSession(str(row[0]), str(row[1]), csrf, now, now + session_seconds)
            await tx.execute(
                "INSERT INTO web_sessions (id_hash, user_key, user_name, csrf, created_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (token_hash(session_id), session.user_key, session.user_name, csrf, now, session.expires_at))
        await self.db.write("DELETE FROM web_sessions WHERE expires_at < ?", (now,))
        return session_id, session

    async def session(self, session_id: str) -> WebSession | None:
        row = await self.db.fetch_one(
            "SELECT user_key, user_name, csrf, created_at, expires_at FROM web_sessions"
            " WHERE id_hash = ? AND expires_at > ?", (token_hash(session_id), await self.db.now()))
        if row is None:
            return None
        return WebSession(str(row[0]), str(row[1]), str(row[2]), float(row[3]), float(row[4]))

    async def session_user(self, session_id: str) -> tuple[int, str, str] | None:
        """The session's user row (id, key, display name), made from the name the session was opened with
        when there is none: in one statement, and only while the session exists, so a request that raced
        a forget-me (which ends the user's sessions in its transaction) cannot bring the row back. None
        when the session has ended. A row that exists keeps its name (one changed in chat since), unless it
        has none."""
        now = await self.db.now()
        # PostgreSQL: the session row is locked while it is read, so a forget-me deleting it meanwhile is
        # waited for (and then nothing is made) or waits (and then sees the row made here and deletes it).
        lock = " FOR SHARE" if self.db.dialect == "postgres" else ""
        row = await self.db.write_one(
            "INSERT INTO users (key, display_name, created_at, updated_at)"
            " SELECT user_key, coalesce(nullif(user_name, ''), user_key), ?, ? FROM web_sessions"
            f" WHERE id_hash = ? AND expires_at > ?{lock}"
            # (a bare row a forget-me during a pause kept has no name: the session's fills it, or the page's new
            # files would read "My memories of " and "What  told me")
            " ON CONFLICT (key) DO UPDATE SET display_name = CASE WHEN users.display_name = ''"
            " THEN excluded.display_name ELSE users.display_name END RETURNING id, key, display_name",
            (now, now, token_hash(session_id), now))
        return None if row is None else (int(row[0]), str(row[1]), str(row[2]))

    async def end_session(self, session_id: str) -> None:
        await self.db.write("DELETE FROM web_sessions WHERE id_hash = ?", (token_hash(session_id),))

    async def session_users(self) -> list[str]:
        """The users with a session or an unused link (ended ones included until their rows are pruned)."""
        rows = await self.db.fetch_all("SELECT user_key FROM web_sessions UNION SELECT user_key FROM web_links"
                                       " WHERE used_at IS NULL")
        return [str(row[0]) for row in rows]

    async def end_sessions(self, user_key: str) -> int:
        """Log ``user_key`` out everywhere: end all their sessions and void their unused links (a link that
        leaked must not open a new one); how many sessions ended. Links before sessions, as in a forget-me: on
        PostgreSQL a login using a link holds its row until it has made its session, which the sessions'
        delete then sees."""
        async with self.db.transaction() as tx:
            await tx.execute("DELETE FROM web_links WHERE user_key = ? AND used_at IS NULL", (user_key,))
            ended = await tx.fetch_all("DELETE FROM web_sessions WHERE user_key = ? RETURNING id_hash", (user_key,))
        return len(ended)


@dataclass(frozen=True, slots=True)
class QueueState:
    by_status: dict[str, int]
    oldest_queued_at: float | None  # created_at of the oldest queued job


class HealthRepository:
    """What ``/healthz`` and the ``/metrics`` gauges read: cheap aggregate queries, no user data."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def ping(self) -> None:
        await self.db.fetch_one("SELECT 1")

    async def job_counts(self) -> dict[str, int]:
        """How many jobs are in each status, read at one moment."""
        rows = await self.db.fetch_all("SELECT status, COUNT(*) FROM jobs GROUP BY status")
        return {str(r[0]): int(r[1]) for r in rows}

    async def queue(self) -> QueueState:
        counts = await self.job_counts()
        oldest = await self.db.fetch_one("SELECT MIN(created_at) FROM jobs WHERE status = 'queued'")
        at = oldest[0] if oldest is not None else None
        return QueueState(counts, None if at is None else float(at))

    async def item_states(self) -> dict[str, int]:
        row = await self.db.fetch_one(
            "SELECT SUM(CASE WHEN archived_at IS NULL AND superseded_by IS NULL THEN 1 ELSE 0 END),"
            " SUM(CASE WHEN archived_at IS NOT NULL THEN 1 ELSE 0 END), COUNT(*) FROM memory_items")
        active, archived, total = (int(v or 0) for v in (row or (0, 0, 0)))
        return {"active": active, "archived": archived, "superseded": total - active - archived}
