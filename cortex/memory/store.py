"""The structured memory store: discrete items per user-persona pair, and hybrid search over them and
over the pair's past messages.

An item is never overwritten: a correction is a new item that ``supersedes`` the old one (the old one
stays, marked ``superseded_by``, hidden from search); forgetting archives (``archived_at``), never
deletes, and a user can restore. Expired items (``expires_at`` in the past) are hidden.

Search scores every candidate with a weighted sum of signals normalised to [0, 1]: vector similarity,
full text (FTS5 bm25, porter stemming), importance, recency (exponential decay with a half-life) and
access frequency. Candidates are the top ``candidates`` by full text and the top ``candidates`` by
vector, merged. The pair's past messages join the same ranking (full text and recency; they carry
no importance), so facts no update extracted can still be found; each hit says where it came from.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from bot.storage.sqlite import SQLiteStorage

if TYPE_CHECKING:
    from cortex.memory.embedding import EmbeddingService

CATEGORIES: tuple[str, ...] = (
    "fact", "preference", "decision", "user_info", "project_context", "learned_behavior", "correction",
    "temporal", "event",
)
Source = Literal["user", "model", "system"]
_WORD = re.compile(r"\w+", re.UNICODE)
COMMON_MATCHES = 2000  # a query word found in more rows than this is too common to rank by (see _bounded)


# Function words of the two languages the personas mostly speak. Matching them ranks nothing and makes
# bm25 score every message that contains "the": they are left out of queries (not of the index).
STOPWORDS = frozenset("""
a about after again all also am an and any are as at be been before being but by can could did do does
doing down during each few for from had has have having he her here hers him his how i if in into is it
its just me more most my no nor not now of off on once only or other our out over own same she should
so some such than that the their them then there these they this those through to too under until up
very was we were what when where which while who whom why will with would you your yours
aber alle also am an auch auf aus bei bin bis bist da damit dann das dass dem den der des die dies doch
du durch ein eine einem einen einer er es für hat hatte ich ihr im in ist ja kann mein mit nach nicht
noch nun nur ob oder sich sie sind so um und uns von vor war was wenn wer wie wir wird wo zu zum zur
""".split())


def fts_query(text: str) -> str:
    """User text as a safe FTS5 query: every word quoted, OR-ed (raw ``foo-bar`` would make MATCH raise).

    Function words are dropped unless nothing else is left."""
    words = [w for w in _WORD.findall(text.lower()) if len(w) > 1]
    content = [w for w in words if w not in STOPWORDS] or words
    return " OR ".join(f'"{w}"' for w in dict.fromkeys(content[:32]))


@dataclass(frozen=True, slots=True)
class Weights:
    vector: float = 0.50
    text: float = 0.20
    importance: float = 0.15
    recency: float = 0.10
    access: float = 0.05


@dataclass(frozen=True, slots=True)
class MemoryItem:
    id: int
    pair_id: int
    category: str
    key: str
    content: str
    importance: int
    pinned: bool
    expires_at: datetime | None
    supersedes: int | None
    superseded_by: int | None
    tags: list[str]
    source: str
    source_ref: str
    created_at: datetime
    updated_at: datetime
    access_count: int
    last_accessed: datetime | None
    archived_at: datetime | None
    archive_reason: str

    @property
    def visible(self) -> bool:
        now = datetime.now(UTC)
        return self.archived_at is None and self.superseded_by is None and (
            self.expires_at is None or self.expires_at > now)


@dataclass(frozen=True, slots=True)
class Hit:
    kind: Literal["item", "message"]
    id: int
    text: str
    score: float
    created_at: datetime
    source: str  # "memory item #12 (fact)" or "message #345 in <channel>"
    signals: dict[str, float] = field(default_factory=dict)
    item: MemoryItem | None = None


def _dt(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, tz=UTC)


class MemoryError(ValueError):
    """A memory operation a user asked for cannot be done; the message says why."""


class MemoryStore:
    def __init__(
        self,
        storage: SQLiteStorage,
        *,
        weights: Weights = Weights(),
        half_life_days: float = 30.0,
        candidates: int = 50,
        clock: Callable[[], float] = time.time,
        embeddings: EmbeddingService | None = None,
    ) -> None:
        self.storage = storage
        self.embeddings = embeddings
        self._table_sizes: dict[str, tuple[int, float]] = {}
        self.weights = weights
        self.half_life_days = half_life_days
        self.candidates = candidates
        self.clock = clock

    @staticmethod
    def _item(row: Any) -> MemoryItem:
        return MemoryItem(
            id=int(row["id"]), pair_id=int(row["pair_id"]), category=str(row["category"]), key=str(row["key"]),
            content=str(row["content"]), importance=int(row["importance"]), pinned=bool(row["pinned"]),
            expires_at=_dt(row["expires_at"]), supersedes=row["supersedes"], superseded_by=row["superseded_by"],
            tags=json.loads(row["tags"]), source=str(row["source"]), source_ref=str(row["source_ref"]),
            created_at=_dt(row["created_at"]) or datetime.now(UTC),
            updated_at=_dt(row["updated_at"]) or datetime.now(UTC),
            access_count=int(row["access_count"]), last_accessed=_dt(row["last_accessed"]),
            archived_at=_dt(row["archived_at"]), archive_reason=str(row["archive_reason"]),
        )

    # -- writing ---------------------------------------------------------------------------------

    async def remember(
        self, pair_id: int, content: str, *, category: str = "fact", key: str = "", importance: int = 5,
        pinned: bool = False, expires_at: float | None = None, tags: Sequence[str] = (), source: Source = "user",
        source_ref: str = "", supersedes: int | None = None,
    ) -> MemoryItem:
        content = content.strip()
        if not content:
            raise MemoryError("there is nothing to remember: the text is empty")
        if category not in CATEGORIES:
            raise MemoryError(f"unknown category {category!r}; categories: {', '.join(CATEGORIES)}")
        if not 1 <= importance <= 10:
            raise MemoryError("importance is a number from 1 to 10")
        if supersedes is not None:
            old = await self.get(pair_id, supersedes, count_access=False)
            if old.superseded_by is not None:
                raise MemoryError(f"item #{supersedes} was already corrected by #{old.superseded_by}")
        now = self.clock()
        async with self.storage.transaction() as db:
            rows = await db.execute_fetchall(
                "INSERT INTO memory_items (pair_id, category, key, content, importance, pinned, expires_at, supersedes,"
                " tags, source, source_ref, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " RETURNING *",
                (pair_id, category, key, content, importance, int(pinned), expires_at, supersedes,
                 json.dumps(list(tags)), source, source_ref, now, now),
            )
            item = self._item(next(iter(rows)))
            if supersedes is not None:
                await db.execute(
                    "UPDATE memory_items SET superseded_by = ?, updated_at = ? WHERE id = ? AND pair_id = ?",
                    (item.id, now, supersedes, pair_id),
                )
        return item

    async def get(self, pair_id: int, item_id: int, *, count_access: bool = True) -> MemoryItem:
        """One item of this pair (fetching it singly counts as an access)."""
        row = await self.storage.fetch_one(
            "SELECT * FROM memory_items WHERE id = ? AND pair_id = ?", (item_id, pair_id)
        )
        if row is None:
            raise MemoryError(f"you have no memory item #{item_id}")
        if count_access:
            await self.count_access([item_id])
        return self._item(row)

    async def count_access(self, item_ids: Sequence[int]) -> None:
        if not item_ids:
            return
        marks = ",".join("?" for _ in item_ids)
        await self.storage.write(
            f"UPDATE memory_items SET access_count = access_count + 1, last_accessed = ? WHERE id IN ({marks})",
            (self.clock(), *item_ids),
        )

    async def set_pinned(self, pair_id: int, item_id: int, pinned: bool) -> MemoryItem:
        await self.get(pair_id, item_id, count_access=False)
        await self.storage.write(
            "UPDATE memory_items SET pinned = ?, updated_at = ? WHERE id = ? AND pair_id = ?",
            (int(pinned), self.clock(), item_id, pair_id),
        )
        return await self.get(pair_id, item_id, count_access=False)

    async def archive(self, pair_id: int, item_id: int, reason: str) -> MemoryItem:
        item = await self.get(pair_id, item_id, count_access=False)
        if item.archived_at is not None:
            raise MemoryError(f"item #{item_id} is already archived")
        await self.storage.write(
            "UPDATE memory_items SET archived_at = ?, archive_reason = ? WHERE id = ? AND pair_id = ?",
            (self.clock(), reason, item_id, pair_id),
        )
        return await self.get(pair_id, item_id, count_access=False)

    async def restore(self, pair_id: int, item_id: int) -> MemoryItem:
        item = await self.get(pair_id, item_id, count_access=False)
        if item.archived_at is None:
            raise MemoryError(f"item #{item_id} is not archived")
        await self.storage.write(
            # A restored item that had expired no longer expires: the user wants it back.
            "UPDATE memory_items SET archived_at = NULL, archive_reason = '', updated_at = ?,"
            " expires_at = CASE WHEN expires_at <= ? THEN NULL ELSE expires_at END WHERE id = ? AND pair_id = ?",
            (self.clock(), self.clock(), item_id, pair_id),
        )
        if self.embeddings is not None:
            self.embeddings.index.invalidate(("items", pair_id))
        return await self.get(pair_id, item_id, count_access=False)

    # -- reading ---------------------------------------------------------------------------------

    async def list_items(
        self, pair_id: int, *, category: str | None = None, archived: bool = False, limit: int = 20, offset: int = 0,
    ) -> tuple[list[MemoryItem], int]:
        """A page of the pair's items (newest first) and how many there are; list views count no access."""
        where = ["pair_id = ?", "archived_at IS NOT NULL" if archived else "archived_at IS NULL"]
        params: list[Any] = [pair_id]
        if not archived:
            where += ["superseded_by IS NULL", "(expires_at IS NULL OR expires_at > ?)"]
            params.append(self.clock())
        if category:
            where.append("category = ?")
            params.append(category)
        clause = " AND ".join(where)
        total = await self.storage.fetch_one(f"SELECT count(*) FROM memory_items WHERE {clause}", params)
        rows = await self.storage.fetch_all(
            f"SELECT * FROM memory_items WHERE {clause} ORDER BY pinned DESC, id DESC LIMIT ? OFFSET ?",
            (*params, limit, offset),
        )
        return [self._item(r) for r in rows], int(total[0]) if total else 0

    async def pair_with_items(self, user_id: int, persona: str) -> tuple[int | None, int]:
        """The pair's id and how many live items it has, in one query (the reply path asks this first)."""
        row = await self.storage.fetch_one(
            "SELECT p.id, (SELECT count(*) FROM memory_items WHERE pair_id = p.id AND archived_at IS NULL)"
            " FROM cortex_pairs AS p WHERE p.user_id = ? AND p.persona = ?",
            (user_id, persona),
        )
        return (None, 0) if row is None else (int(row[0]), int(row[1]))

    async def pinned(self, pair_id: int) -> list[MemoryItem]:
        rows = await self.storage.fetch_all(
            "SELECT * FROM memory_items WHERE pair_id = ? AND pinned = 1 AND archived_at IS NULL"
            " AND superseded_by IS NULL AND (expires_at IS NULL OR expires_at > ?) ORDER BY importance DESC, id",
            (pair_id, self.clock()),
        )
        return [self._item(r) for r in rows]

    # -- search ----------------------------------------------------------------------------------

    async def search(
        self, pair_id: int, query: str, *, user_id: int | None = None, persona: str | None = None, limit: int = 10,
        query_vector: npt.NDArray[np.float32] | None = None, include_messages: bool = True,
        exclude_messages: Collection[int] = (), use_vectors: bool = True,
    ) -> list[Hit]:
        """Hybrid search over the pair's visible items (and its past messages when ``user_id``/``persona``).

        The query is embedded here when an embedding service is attached (``use_vectors``) unless
        ``query_vector`` is given; without a vector the search runs on full text and the other signals.
        """
        now = self.clock()
        match = fts_query(query)
        index = self.embeddings.index if self.embeddings is not None else None
        if query_vector is None and use_vectors and self.embeddings is not None and index is not None:
            # Embedding the query costs ~16 ms of CPU: only when there is something to compare it with.
            messages = include_messages and user_id is not None and persona is not None
            if len((await index.items(pair_id)).ids) or (
                    messages and len((await index.messages(user_id or 0, persona or "")).ids)):
                query_vector = await self.embeddings.embed_query(query)
        text_scores: dict[int, float] = {}
        if match:
            item_match, order = await self._bounded("memory_fts", match)
            rows = await self.storage.fetch_all(
                "SELECT m.id, bm25(memory_fts) FROM memory_fts JOIN memory_items AS m ON m.id = memory_fts.rowid"
                " WHERE memory_fts MATCH ? AND m.pair_id = ? AND m.archived_at IS NULL AND m.superseded_by IS NULL"
                f" AND (m.expires_at IS NULL OR m.expires_at > ?) ORDER BY {order} LIMIT ?",
                (item_match, pair_id, now, self.candidates),
            )
            text_scores = {int(r[0]): -float(r[1]) for r in rows}
        vector_scores: dict[int, float] = {}
        if query_vector is not None and index is not None:
            # Hidden items may sit in the matrix: take a few more than needed, the fetch below filters.
            vector_scores = (await index.items(pair_id)).top(query_vector, self.candidates * 2)
        candidate_ids = sorted(set(text_scores) | set(vector_scores))
        items: list[MemoryItem] = []
        if candidate_ids:
            marks = ",".join("?" for _ in candidate_ids)
            rows = await self.storage.fetch_all(
                f"SELECT * FROM memory_items WHERE id IN ({marks}) AND pair_id = ? AND archived_at IS NULL"
                " AND superseded_by IS NULL AND (expires_at IS NULL OR expires_at > ?)",
                (*candidate_ids, pair_id, now),
            )
            items = [self._item(r) for r in rows]
        most_accessed = max((i.access_count for i in items), default=0)
        hits = [self._score_item(i, text_scores, vector_scores, now, most_accessed) for i in items]
        if include_messages and user_id is not None and persona is not None:
            hits += await self._message_hits(
                user_id, persona, match, query_vector if index is not None else None, now, set(exclude_messages)
            )
        return self._rank(hits, limit)

    async def _bounded(self, table: str, match: str) -> tuple[str, str]:
        """The MATCH expression and ORDER BY that keep a full-text query's cost bounded.

        bm25 ranking scores every row that matches, so one word found in half of 100k messages costs
        ~50 ms. Words matching more than ``COMMON_MATCHES`` rows say little (their idf is low): they are
        left out. When every word is that common, the newest matches are ranked instead of all of them.
        Small tables skip the check (its extra query costs more than it saves).
        """
        size, checked = self._table_sizes.get(table, (0, 0.0))
        if time.monotonic() - checked > 60:
            row = await self.storage.fetch_one(f"SELECT coalesce(max(rowid), 0) FROM {table}")
            size = int(row[0]) if row else 0
            self._table_sizes[table] = (size, time.monotonic())
        by_rank = f"bm25({table})"
        if size <= COMMON_MATCHES:
            return match, by_rank
        terms = match.split(" OR ")
        counts = await self.storage.fetch_one(
            "SELECT " + ", ".join(
                f"(SELECT count(*) FROM (SELECT 1 FROM {table} WHERE {table} MATCH ? LIMIT {COMMON_MATCHES + 1}))"
                for _ in terms),
            terms,
        )
        rare = [t for t, n in zip(terms, counts or (), strict=False) if int(n) <= COMMON_MATCHES]
        if rare:
            return " OR ".join(rare), by_rank
        return match, f"{table}.rowid DESC"

    def _rank(self, hits: list[Hit], limit: int) -> list[Hit]:
        """One ranking: text and vector scores are normalised over all hits, so items and messages compete
        fairly (text by the best bm25, vectors min-max over the candidates)."""
        top_text = max((h.signals.get("text_raw", 0.0) for h in hits), default=0.0)
        sims = [h.signals["vector_raw"] for h in hits if "vector_raw" in h.signals]
        low, high = (min(sims), max(sims)) if sims else (0.0, 0.0)
        ranked = []
        for hit in hits:
            signals = dict(hit.signals)
            signals["text"] = signals.get("text_raw", 0.0) / top_text if top_text > 0 else 0.0
            if "vector_raw" in signals:
                raw = signals["vector_raw"]
                signals["vector"] = (raw - low) / (high - low) if high - low > 1e-6 else max(raw, 0.0)
            score = (self.weights.vector * signals.get("vector", 0.0) + self.weights.text * signals["text"]
                     + self.weights.importance * signals.get("importance", 0.0)
                     + self.weights.recency * signals.get("recency", 0.0)
                     + self.weights.access * signals.get("access", 0.0))
            ranked.append(Hit(hit.kind, hit.id, hit.text, score, hit.created_at, hit.source, signals, hit.item))
        ranked.sort(key=lambda h: h.score, reverse=True)
        return ranked[:limit]

    def _recency(self, created: datetime, now: float) -> float:
        age_days = max(now - created.timestamp(), 0.0) / 86_400
        return math.exp(-math.log(2) * age_days / self.half_life_days)

    def _score_item(
        self, item: MemoryItem, text_scores: dict[int, float], vector_scores: dict[int, float], now: float,
        most_accessed: int,
    ) -> Hit:
        signals = {
            "text_raw": max(text_scores.get(item.id, 0.0), 0.0),
            "importance": (item.importance - 1) / 9,
            "recency": self._recency(item.created_at, now),
            "access": math.log1p(item.access_count) / math.log1p(most_accessed) if most_accessed else 0.0,
        }
        if item.id in vector_scores:
            signals["vector_raw"] = vector_scores[item.id]
        return Hit("item", item.id, item.content, 0.0, item.created_at, f"memory item #{item.id} ({item.category})",
                   signals, item)

    async def _message_hits(
        self, user_id: int, persona: str, match: str, query_vector: npt.NDArray[np.float32] | None, now: float,
        exclude: set[int],
    ) -> list[Hit]:
        text_scores: dict[int, float] = {}
        if match:
            message_match, order = await self._bounded("messages_fts", match)
            rows = await self.storage.fetch_all(
                "SELECT m.id, bm25(messages_fts) FROM messages_fts JOIN messages AS m ON m.id = messages_fts.rowid"
                f" WHERE messages_fts MATCH ? AND m.user_id = ? AND m.persona = ? ORDER BY {order} LIMIT ?",
                (message_match, user_id, persona, self.candidates + len(exclude)),
            )
            text_scores = {int(r[0]): max(-float(r[1]), 0.0) for r in rows if int(r[0]) not in exclude}
        vector_scores: dict[int, float] = {}
        if query_vector is not None and self.embeddings is not None:
            block = await self.embeddings.index.messages(user_id, persona)
            vector_scores = {i: v for i, v in block.top(query_vector, self.candidates + len(exclude)).items()
                             if i not in exclude}
        ids = sorted(set(text_scores) | set(vector_scores))
        if not ids:
            return []
        marks = ",".join("?" for _ in ids)
        rows = await self.storage.fetch_all(
            "SELECT m.id, m.text, m.created_at, m.author_name, c.name FROM messages AS m"
            f" JOIN channels AS c ON c.id = m.channel_id WHERE m.id IN ({marks})",
            ids,
        )
        hits = []
        for row in rows:
            message_id = int(row[0])
            created = _dt(float(row[2])) or datetime.now(UTC)
            signals = {"text_raw": text_scores.get(message_id, 0.0), "recency": self._recency(created, now)}
            if message_id in vector_scores:
                signals["vector_raw"] = vector_scores[message_id]
            hits.append(Hit("message", message_id, f"{row[3]}: {row[1]}", 0.0, created,
                            f"message #{message_id} in {row[4]}", signals))
        return hits
