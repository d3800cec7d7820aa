"""The memory repository: items per pair, full-text and vector candidates, the embedding backlog, pruning.

Ranking (weights, recency, normalisation) is not here: ``cortex.memory.store`` does it in plain
Python over the candidates this repository finds. Engines differ in three places, each a fork here:

* **Full text.** SQLite: FTS5 tables with bm25 (porter stemming). PostgreSQL: ``tsvector`` columns
  (the persona language's configuration) with GIN indexes, ranked by ``ts_rank`` per word weighted by
  the word's rarity (an idf, given by the caller), which is what bm25 does.
* **Vectors.** SQLite: float32 blobs the caller loads into memory and scans with numpy
  (``load_vectors``). PostgreSQL: pgvector columns with an HNSW index per dimension (cosine),
  searched in the database (``vector_top``) with iterative scans, so a per-pair filter never returns
  fewer hits than exist; no process keeps vectors in memory.
* **Upserts** of message vectors.

A candidate row carries the columns of ``ITEM_COLUMNS`` (items) or ``MESSAGE_HIT_COLUMNS`` (messages)
plus ``rank`` (lower is better, like bm25).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from bot.storage.engine import Database, Row, Tx, is_conflict, serialise
from bot.storage.incognito import not_incognito
from bot.storage.spread import SAMPLE as SPREAD_SAMPLE
from bot.storage.spread import TTL as SPREAD_TTL
from bot.storage.spread import Spreads
from bot.storage.textsearch import MARK_CLOSE, MARK_OPEN, fts5_match, marked_ranks, tsquery

log = logging.getLogger(__name__)

# Every column but the embedding (1.5 KB per row that search never reads).
ITEM_COLUMNS = (
    "id, pair_id, category, key, content, importance, pinned, expires_at, supersedes, superseded_by, tags, source,"
    " source_ref, metadata, created_at, updated_at, access_count, last_accessed, archived_at, archive_reason, scope"
)
ITEM_COLUMNS_M = ", ".join(f"m.{c.strip()}" for c in ITEM_COLUMNS.split(","))
MESSAGE_HIT_COLUMNS = "m.id, m.text, m.created_at, m.author_name, m.role, c.name AS channel, m.channel_id"
NEIGHBOUR_SPAN = 5000  # ids a neighbour lookup walks back or forth at most (other people's messages in a busy group)


def _array(vector: Any) -> npt.NDArray[np.float32]:
    """A pgvector column's value as numpy (pgvector 0.4 decodes to numpy, later versions to ``Vector``)."""
    return np.asarray(vector.to_numpy() if hasattr(vector, "to_numpy") else vector, dtype=np.float32)


def _estimated_count(source: str, word: int, estimate: bool) -> str:
    """PostgreSQL, in :meth:`MemoryRepository.fts_term_counts`: the rows of ``source`` matching the tsquery
    word ``$word`` (at most ``$3``): with ``estimate``, from the ``st`` row (``pg_stats``) when it lists the
    word's lexeme among the most common; else counted."""
    count = f"(SELECT count(*) FROM (SELECT 1 FROM {source} WHERE ts @@ to_tsquery(cfg.c, ${word}) LIMIT $3) AS t)"
    if not estimate:
        return count
    lexeme = f"trim(both '''' from CAST(to_tsquery(cfg.c, ${word}) AS TEXT))"
    estimated = f"(SELECT round(st.freqs[array_position(st.elems, {lexeme})] * st.n) FROM st)"
    return f"least(coalesce({estimated}, {count}), $3)"

def _marked(table: str, columns: int) -> str:
    """The ``columns`` of an FTS5 row as one text, the matched words between :data:`MARK_OPEN` and
    ``MARK_CLOSE`` (FTS5's ``highlight()``), as bm25 reads every column."""
    marks = f"char({ord(MARK_OPEN)}), char({ord(MARK_CLOSE)})"
    return " || ' ' || ".join(f"coalesce(highlight({table}, {c}, {marks}), '')" for c in range(columns))


VISIBLE = (
    "m.pair_id = ? AND m.archived_at IS NULL AND m.superseded_by IS NULL AND (m.expires_at IS NULL OR m.expires_at > ?)"
)
SHARED = "scope = 'shared'"  # items a group channel may see (the scope column holds only 'private' or 'shared')
STATS_MIN_ROWS = 10_000  # PostgreSQL: from this many rows, common words are not counted (fts_term_counts)
TYPICAL_SAMPLE = 2000  # vectors a PostgreSQL query's typical similarity is estimated from
TYPICAL_MIN = 30  # below this many vectors, the lowest similarity is the typical level (as in the numpy scan)
TS_CONFIG_TTL = 60.0  # seconds a pair's or persona's text-search configuration is trusted
# PostgreSQL's HNSW indexes: over half-precision copies of the vectors (half the memory and reads of full
# precision; the rows' cosines stay exact), with a graph built for recall: at a million vectors of near-duplicates
# ef_construction 128 found 0.75 of the exact top-10 at ef_search 100, 256 found 0.88 and 512 0.94 (0.96 at 150).
HNSW_BUILD = "m = 32, ef_construction = 512"
VECTOR_TABLES = (("message_vectors", "vector"), ("memory_items", "embedding"))  # (table, vector column)
HALF_CHECK_SECONDS = 10.0  # how often a process looks whether a table's half-precision index is ready yet
OLD_INDEX_GRACE_SECONDS = 3 * HALF_CHECK_SECONDS  # then the full-precision one of an older version goes
# A graph walk misses more of the exact neighbours the bigger the graph: searches of an index of LARGE_INDEX
# vectors or more look at LARGE_EF_SEARCH candidates instead of EF_SEARCH (the pool's hnsw.ef_search) unless the
# URL sets it (measured recall@10: 0.99 at 100k vectors with 100; 0.94 at 1M with 100, 0.96 with 150).
EF_SEARCH = 100
LARGE_INDEX = 300_000
LARGE_EF_SEARCH = 150
SPARSE_BACKLOG = 2000  # below this many items to embed, they are found by the backlog's index and sorted
INDEX_SIZE_SECONDS = 60.0  # how often a process reads an index's size (PostgreSQL's estimate: pg_class)
# PostgreSQL, a query of function words only ("The Who", "who are you"): the newest rows of the pair (or of the
# user's messages with the persona) searched by their words as written (see _pg_stop_words_sql). Their words are
# read from the text on each search, 10-15 µs a row (measured: 1,000 rows of 100 characters, 10-16 ms): 500 keep
# such a search to a few milliseconds at any size. A GIN index of every row's words as written would reach older
# rows, but made each insert ten times dearer (50k rows: 0.1 s without one, 1.0 s with), for a rare search.
STOP_WORDS_ROWS = 500

FtsTable = Literal["memory_fts", "messages_fts"]
FTS_SOURCE: dict[str, str] = {"memory_fts": "memory_items", "messages_fts": "messages"}  # PostgreSQL's tables


@dataclass(frozen=True, slots=True)
class ItemScope:
    pair_id: int
    shared_only: bool = False  # a group channel's search: the pair's shared items only


@dataclass(frozen=True, slots=True)
class MessageScope:
    user_id: int
    persona: str


VectorScope = ItemScope | MessageScope


class _StaleCorrection(Exception):
    """Raised inside :meth:`MemoryRepository.add_item`'s transaction to roll back a correction of an item
    that is no longer active."""


class SameWords(Exception):
    """:meth:`MemoryRepository.add_item` with ``once``: an item in use already says these words (its row)."""

    def __init__(self, row: Row) -> None:
        super().__init__(f"item #{row['id']} says the same")
        self.row = row


ACTIVE_WITH_TEXT = ("SELECT * FROM memory_items WHERE pair_id = ? AND content = ? AND scope = ? AND archived_at IS NULL"
                    " AND superseded_by IS NULL AND (expires_at IS NULL OR expires_at > ?)")


class MemoryRepository:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._vector_indexes: set[int] = set()  # dimensions whose HNSW index exists (PostgreSQL)
        # (pair id or persona) -> (text-search configuration, when looked up)
        self._ts_configs: dict[int | str, tuple[str, float]] = {}
        # PostgreSQL: large vector scopes' typical levels, shared with the sibling handles (background jobs)
        self._spreads: Spreads = db.caches.named("memory").setdefault("spreads", Spreads())
        # PostgreSQL: per (table, dimensions), how its searches go (see _index_plan), shared with the sibling
        # handles: the backfill that builds an index tells the reply path
        self._index_plans: dict[tuple[str, int], _IndexPlan] = db.caches.named("memory").setdefault("plans", {})

    @property
    def vectors_in_database(self) -> bool:
        """Whether vector search runs in the database (PostgreSQL) rather than over loaded matrices."""
        return self.db.dialect == "postgres"

    @property
    def needs_term_weights(self) -> bool:
        """Whether full-text ranking needs the caller's per-word rarity weights (bm25 has its own)."""
        return self.db.dialect == "postgres"

    # -- items -----------------------------------------------------------------------------------

    async def add_item(self, pair_id: int, fields: Mapping[str, Any], supersedes: int | None, now: float, *,
                       once: bool = False) -> Row | None:
        """Insert an item (and mark the one it corrects) in one transaction; returns its row. None, with
        nothing stored, when the item to correct is no longer active (corrected or archived meanwhile): the
        check is the corrected item's UPDATE itself, inside the transaction, so of concurrent corrections of
        one item exactly one lands, in any process and on either engine. With ``once``, :class:`SameWords`
        when another item of the pair in use says the same in the same scope: the check and the insert hold
        the pair's lock together (SQLite's write lock; on PostgreSQL an advisory one), in any process."""
        values = {**fields, "pair_id": pair_id, "supersedes": supersedes, "created_at": now, "updated_at": now}
        columns = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        try:
            async with self.db.transaction() as tx:
                if once:
                    await self._no_twin(tx, pair_id, fields, supersedes, now)
                row = await tx.fetch_one(
                    f"INSERT INTO memory_items ({columns}) VALUES ({marks}) RETURNING {ITEM_COLUMNS}",
                    tuple(values.values()),
                )
                assert row is not None
                if supersedes is not None and await tx.fetch_one(
                    "UPDATE memory_items SET superseded_by = ?, updated_at = ? WHERE id = ? AND pair_id = ?"
                    " AND superseded_by IS NULL AND archived_at IS NULL RETURNING id",
                    (int(row["id"]), now, supersedes, pair_id),
                ) is None:
                    raise _StaleCorrection  # rolls the new item back
        except _StaleCorrection:
            return None
        return row

    async def _no_twin(self, tx: Tx, pair_id: int, fields: Mapping[str, Any], other_than: int | None, now: float
                       ) -> None:
        """:class:`SameWords` when an item of the pair in use, not ``other_than``, says ``fields``' content in its
        scope; the pair's lock is held to the transaction's end (checks and writes of its items take turns)."""
        await serialise(self.db, tx, f"memory.words:{pair_id}")
        twin = await tx.fetch_one(f"{ACTIVE_WITH_TEXT} AND id <> ? ORDER BY id LIMIT 1",
                                  (pair_id, fields["content"], fields["scope"], now, other_than or 0))
        if twin is not None:
            raise SameWords(twin)

    async def item(self, pair_id: int, item_id: int) -> Row | None:
        return await self.db.fetch_one(
            f"SELECT {ITEM_COLUMNS} FROM memory_items WHERE id = ? AND pair_id = ?", (item_id, pair_id)
        )

    async def active_with_text(self, pair_id: int, content: str, scope: str, now: float) -> Row | None:
        """An item of the pair in use (not archived, corrected or expired at ``now``) in ``scope`` that says
        exactly ``content``; None when there is none."""
        return await self.db.fetch_one(f"{ACTIVE_WITH_TEXT} ORDER BY id LIMIT 1", (pair_id, content, scope, now))

    async def has_at_least(self, pair_id: int, count: int) -> bool:
        """Whether the pair has ``count`` items not archived, or more (counted no further than that)."""
        row = await self.db.fetch_one(
            "SELECT count(*) FROM (SELECT 1 FROM memory_items WHERE pair_id = ? AND archived_at IS NULL LIMIT ?) AS t",
            (pair_id, count))
        return row is not None and int(row[0]) >= count

    async def count_access(self, item_ids: Sequence[int], now: float) -> None:
        marks = ",".join("?" for _ in item_ids)
        await self.db.write(
            f"UPDATE memory_items SET access_count = access_count + 1, last_accessed = ? WHERE id IN ({marks})",
            (now, *item_ids),
        )

    async def set_pinned(self, pair_id: int, item_id: int, pinned: bool, now: float) -> None:
        await self.db.write(
            "UPDATE memory_items SET pinned = ?, updated_at = ? WHERE id = ? AND pair_id = ?",
            (int(pinned), now, item_id, pair_id),
        )

    async def set_scope(self, pair_id: int, item_id: int, scope: str, now: float) -> None:
        await self.db.write("UPDATE memory_items SET scope = ?, updated_at = ? WHERE id = ? AND pair_id = ?",
                            (scope, now, item_id, pair_id))

    async def archive(self, pair_id: int, item_id: int, reason: str, now: float) -> bool:
        """Archive an active item (neither archived nor corrected), and the wordings it replaced; False when it
        no longer is one (checked in the UPDATE itself, so a forget racing a correction or another forget
        changes nothing)."""
        async with self.db.transaction() as tx:
            done = await tx.fetch_all(
                "UPDATE memory_items SET archived_at = ?, archive_reason = ? WHERE id = ? AND pair_id = ?"
                " AND archived_at IS NULL AND superseded_by IS NULL RETURNING id",
                (now, reason, item_id, pair_id),
            )
            await archive_older(tx, [int(r[0]) for r in done], now)
        return bool(done)

    async def count_changes(self, pair_id: int, source_refs: Sequence[str], reason_prefixes: Sequence[str]
                            ) -> tuple[int, int]:
        """How many of the pair's items came from any of ``source_refs``, and how many were archived with
        a reason starting with any of ``reason_prefixes`` (plain text, no wildcards)."""
        if not source_refs and not reason_prefixes:
            return 0, 0
        refs = ", ".join("?" * len(source_refs)) or "NULL"
        prefixes = " OR ".join("substr(archive_reason, 1, ?) = ?" for _ in reason_prefixes) or "FALSE"
        row = await self.db.fetch_one(
            f"SELECT (SELECT count(*) FROM memory_items WHERE pair_id = ? AND source_ref IN ({refs})),"
            f" (SELECT count(*) FROM memory_items WHERE pair_id = ? AND archived_at IS NOT NULL AND ({prefixes}))",
            (pair_id, *source_refs, pair_id, *(v for p in reason_prefixes for v in (len(p), p))))
        return (int(row[0]), int(row[1])) if row else (0, 0)

    async def archive_from(self, pair_id: int | None, source_ref: str, reason: str, now: float, *,
                           user_id: int | None = None) -> list[int]:
        """Archive the pair's (None: every pair's, or only ``user_id``'s pairs) visible items that came from
        ``source_ref`` (a message), and the visible corrections of those (the persona's later wording of what was
        remembered from it, which "Forget this" left in place); their ids."""
        pair, params = ("pair_id = ? AND ", (pair_id,)) if pair_id is not None else (
            ("pair_id IN (SELECT id FROM cortex_pairs WHERE user_id = ?) AND ", (user_id,)) if user_id is not None
            else ("", ()))
        async with self.db.transaction() as tx:
            rows = await tx.fetch_all(
                "WITH RECURSIVE chain (id) AS ("
                f" SELECT id FROM memory_items WHERE {pair}source_ref = ?"
                " UNION SELECT m.superseded_by FROM memory_items AS m JOIN chain ON m.id = chain.id"
                " WHERE m.superseded_by IS NOT NULL)"
                " UPDATE memory_items SET archived_at = ?, archive_reason = ? WHERE id IN (SELECT id FROM chain)"
                " AND archived_at IS NULL AND superseded_by IS NULL RETURNING id", (*params, source_ref, now, reason))
            archived = sorted(int(r[0]) for r in rows)
            await archive_older(tx, archived, now)
        return archived

    async def restore(self, pair_id: int, item_id: int, now: float, twin_of: Mapping[str, Any]) -> None:
        """Bring an archived (or expired) item back; :class:`SameWords` when another item in use says what it
        says (``twin_of``: its content and scope), checked with the change as :meth:`add_item` checks."""
        async with self.db.transaction() as tx:
            await self._no_twin(tx, pair_id, twin_of, item_id, now)
            # A restored item that had expired no longer expires: the user wants it back.
            await tx.execute(
                "UPDATE memory_items SET archived_at = NULL, archive_reason = '', updated_at = ?,"
                " expires_at = CASE WHEN expires_at <= ? THEN NULL ELSE expires_at END WHERE id = ? AND pair_id = ?",
                (now, now, item_id, pair_id),
            )

    async def list_items(
        self, pair_id: int, *, category: str | None, archived: bool, limit: int, offset: int, now: float,
    ) -> tuple[list[Row], int]:
        # Archived: forgotten or pruned, and expired ones the daily prune has not archived yet (both restorable).
        # (a corrected item is its correction's past, not an archived item of its own: restoring it is refused)
        where = ["pair_id = ?", "superseded_by IS NULL AND (archived_at IS NOT NULL OR expires_at <= ?)" if archived
                 else "archived_at IS NULL AND superseded_by IS NULL AND (expires_at IS NULL OR expires_at > ?)"]
        params: list[Any] = [pair_id, now]
        if category:
            where.append("category = ?")
            params.append(category)
        clause = " AND ".join(where)
        total = await self.db.fetch_one(f"SELECT count(*) FROM memory_items WHERE {clause}", params)
        rows = await self.db.fetch_all(
            f"SELECT {ITEM_COLUMNS} FROM memory_items WHERE {clause} ORDER BY pinned DESC, id DESC LIMIT ? OFFSET ?",
            (*params, limit, offset),
        )
        return rows, int(total[0]) if total else 0

    async def user_item(self, user_id: int, item_id: int) -> Row | None:
        """The item (``ITEM_COLUMNS`` and its pair's ``persona``) when it belongs to one of the user's pairs."""
        return await self.db.fetch_one(
            f"SELECT {ITEM_COLUMNS_M}, p.persona FROM memory_items AS m JOIN cortex_pairs AS p ON p.id = m.pair_id"
            " WHERE m.id = ? AND p.user_id = ?", (item_id, user_id))

    async def user_items(
        self, user_id: int, filters: ItemFilters, *, limit: int, offset: int, now: float,
    ) -> tuple[list[Row], int]:
        """A page of the user's items over all their pairs (or one persona's) with their pair's ``persona``,
        and how many match. Active items (visible) pinned first, then newest; the others (archived,
        corrected or expired) most recently archived or changed first."""
        clause, params = filters.where(user_id, now, self.db.dialect)
        source = "memory_items AS m JOIN cortex_pairs AS p ON p.id = m.pair_id"
        order = "m.pinned DESC" if filters.active else "coalesce(m.archived_at, m.updated_at) DESC"
        total = await self.db.fetch_one(f"SELECT count(*) FROM {source} WHERE {clause}", params)
        rows = await self.db.fetch_all(
            f"SELECT {ITEM_COLUMNS_M}, p.persona FROM {source} WHERE {clause} ORDER BY {order}, m.id DESC"
            " LIMIT ? OFFSET ?",
            (*params, limit, offset))
        return rows, int(total[0]) if total else 0

    async def pair_with_items(self, user_id: int, persona: str) -> tuple[int | None, bool]:
        """The pair's id and whether it has live items: one query, which stops at the first item (a count
        read every item's index entry, at every reply: thousands for a pair an import filled)."""
        row = await self.db.fetch_one(
            "SELECT p.id, EXISTS (SELECT 1 FROM memory_items WHERE pair_id = p.id AND archived_at IS NULL)"
            " FROM cortex_pairs AS p WHERE p.user_id = ? AND p.persona = ?",
            (user_id, persona),
        )
        return (None, False) if row is None else (int(row[0]), bool(row[1]))

    async def pinned(self, pair_id: int, now: float, limit: int | None = None, *, shared_only: bool = False
                     ) -> list[Row]:
        """The pair's visible pinned items (only the shared ones, for a group channel), the most important
        first (at most ``limit``)."""
        shared = f" AND m.{SHARED}" if shared_only else ""
        return await self.db.fetch_all(
            f"SELECT {ITEM_COLUMNS_M} FROM memory_items AS m WHERE {VISIBLE} AND m.pinned = 1{shared}"
            " ORDER BY m.importance DESC, m.id" + (" LIMIT ?" if limit is not None else ""),
            (pair_id, now, *(() if limit is None else (limit,))),
        )

    async def shared_item_ids(self, pair_id: int, now: float) -> list[int]:
        """The ids of the pair's visible shared items (what a group channel's search may find)."""
        rows = await self.db.fetch_all(f"SELECT m.id FROM memory_items AS m WHERE {VISIBLE} AND m.{SHARED}",
                                       (pair_id, now))
        return [int(r[0]) for r in rows]

    async def visible_items(self, pair_id: int, ids: Sequence[int], now: float, *, shared_only: bool = False
                            ) -> list[Row]:
        marks = ",".join("?" for _ in ids)
        shared = f" AND m.{SHARED}" if shared_only else ""
        return await self.db.fetch_all(
            f"SELECT {ITEM_COLUMNS_M} FROM memory_items AS m WHERE m.id IN ({marks}) AND {VISIBLE}{shared}",
            (*ids, pair_id, now),
        )

    async def pair_messages(self, user_id: int, persona: str, ids: Sequence[int]) -> list[Row]:
        """Messages by id, only those of this user-persona pair (never another user's), none of an incognito
        stretch (as no word search finds them: a vector found by meaning, or a cached one, leads to nothing)."""
        marks = ",".join("?" for _ in ids)
        return await self.db.fetch_all(
            f"SELECT {MESSAGE_HIT_COLUMNS} FROM messages AS m JOIN channels AS c ON c.id = m.channel_id"
            f" WHERE m.id IN ({marks}) AND m.user_id = ? AND m.persona = ? AND {not_incognito('m')}",
            (*ids, user_id, persona),
        )

    async def message_neighbours(self, user_id: int, persona: str, ids: Sequence[int], per_side: int
                                 ) -> list[tuple[int, int, int]]:
        """For each message of ``ids`` (this user-persona pair's only), the pair's ``per_side`` messages just
        before and just after it in its channel, as (message id, neighbour id, distance 1..per_side).
        Each lookup walks the channel's index from the message, at most ``NEIGHBOUR_SPAN`` ids."""
        if not ids or per_side < 1:
            return []
        same = "n.channel_id = m.channel_id AND n.user_id = m.user_id AND n.persona = m.persona"
        columns = [
            f"(SELECT n.id FROM messages AS n WHERE {same} AND n.id {op} m.id AND n.id {bound}"
            f" ORDER BY n.id {order} LIMIT 1 OFFSET {k})"
            for op, bound, order in (("<", f"> m.id - {NEIGHBOUR_SPAN}", "DESC"),
                                     (">", f"< m.id + {NEIGHBOUR_SPAN}", "ASC"))
            for k in range(per_side)
        ]
        marks = ",".join("?" for _ in ids)
        rows = await self.db.fetch_all(
            f"SELECT m.id, {', '.join(columns)} FROM messages AS m WHERE m.id IN ({marks}) AND m.user_id = ?"
            " AND m.persona = ?", (*ids, user_id, persona))
        found = []
        for row in rows:
            for n, neighbour in enumerate(list(row)[1:]):
                if neighbour is not None:
                    found.append((int(row[0]), int(neighbour), n % per_side + 1))
        return found

    # -- full text -------------------------------------------------------------------------------

    async def fts_size(self, table: FtsTable) -> int:
        """A cheap upper bound of the rows a full-text table covers."""
        if self.db.dialect == "sqlite":
            sql = f"SELECT coalesce(max(rowid), 0) FROM {table}"
        else:  # the tsvector lives on the source table itself
            sql = f"SELECT coalesce(max(id), 0) FROM {FTS_SOURCE[table]}"
        row = await self.db.fetch_one(sql)
        return int(row[0]) if row else 0

    async def fts_term_counts(
        self, table: FtsTable, terms: Sequence[str], cap: int, *, persona: str | None = None, pair_id: int = 0,
        rows: int | None = None,
    ) -> list[int]:
        """How many rows match each term (counting stops at ``cap``; PostgreSQL reads words the way the
        language configuration of ``persona``, or of the pair's persona, does).

        PostgreSQL: a word among the column's most common ones (``pg_stats``, kept by ANALYZE) is not
        counted: its share of the rows there, times the rows, is close enough for a rarity weight, and
        counting it would visit a table page per match (a millisecond per few hundred rows). Below
        ``STATS_MIN_ROWS`` rows, or for a word not among those, the matches are counted; ``rows``, the
        table's size when the caller knows it, saves a small table planning the statistics' query."""
        if self.db.dialect == "sqlite":
            sql = "SELECT " + ", ".join(
                f"(SELECT count(*) FROM (SELECT 1 FROM {table} WHERE {table} MATCH ? LIMIT {cap}))" for _ in terms)
            row = await self.db.fetch_one(sql, [fts5_match([t]) for t in terms])
            return [int(c) for c in row] if row else [0] * len(terms)
        source, estimate = FTS_SOURCE[table], rows is None or rows >= STATS_MIN_ROWS
        stats = ("st AS (SELECT CAST(CAST(s.most_common_elems AS TEXT) AS TEXT[]) AS elems,"
                 " s.most_common_elem_freqs AS freqs, c.reltuples * (1 - s.null_frac) AS n FROM pg_stats AS s"
                 f" JOIN pg_class AS c ON c.oid = to_regclass('{source}') WHERE s.schemaname = current_schema()"
                 f" AND s.tablename = '{source}' AND s.attname = 'ts' AND NOT s.inherited"
                 f" AND c.reltuples >= {STATS_MIN_ROWS}), ")
        columns = ", ".join(_estimated_count(source, n + 4, estimate) for n in range(len(terms)))
        row = await self.db.fetch_one(
            f"WITH {stats if estimate else ''}cfg AS (SELECT cortex_ts_config(coalesce(CAST($1 AS TEXT),"
            f" (SELECT persona FROM cortex_pairs WHERE id = $2))) AS c) SELECT {columns} FROM cfg",
            [persona, pair_id, cap, *(tsquery([t]) for t in terms)])
        return [int(c) for c in row] if row else [0] * len(terms)

    async def ts_config(self, *, pair_id: int = 0, persona: str | None = None) -> str:
        """The text-search configuration of ``persona`` (or of the pair's persona): its language's ("english",
        "german"), ``simple`` when none fits or the persona is gone. Cached for ``TS_CONFIG_TTL``: handed to
        PostgreSQL's queries as a constant, it lets the planner fold ``to_tsquery`` and estimate how many rows a
        query matches from the column's statistics; the memory search drops its language's function words."""
        key: int | str = pair_id if persona is None else persona
        cached = self._ts_configs.get(key)
        if cached is not None and time.monotonic() - cached[1] <= TS_CONFIG_TTL:
            return cached[0]
        name = "(SELECT persona FROM cortex_pairs WHERE id = ?)" if persona is None else "?"
        sql = (f"SELECT CAST(cortex_ts_config({name}) AS TEXT)" if self.db.dialect == "postgres" else
               f"SELECT coalesce((SELECT ts_config FROM personas WHERE name = {name}), 'simple')")  # (NOCASE)
        row = await self.db.fetch_one(sql, (pair_id if persona is None else persona,))
        config = str(row[0]) if row else "simple"
        if len(self._ts_configs) > 10_000:
            self._ts_configs.clear()
        self._ts_configs[key] = (config, time.monotonic())
        return config

    @staticmethod
    def _pg_rank(count: int, first: int, vector: str = "m.ts", config: str = "$5") -> str:
        """``-(Σ weight × ts_rank(vector, word))`` over ``count`` query words: their tsquery texts are numbered
        from ``$first``, their weights follow them, in the configuration ``config``. Each tsquery is an
        uncorrelated scalar subquery, so PostgreSQL computes it once per query, not once per row, whatever the
        plan. The weights are parameters: as literals, every query would be a new statement for asyncpg's
        cache, and pay a round trip to prepare it."""
        parts = [f"${first + count + n}::float8 * ts_rank({vector}, (SELECT to_tsquery({config}, ${first + n})), 1)"
                 for n in range(count)]
        return "-(" + " + ".join(parts) + ")"

    @staticmethod
    def _pg_text_sql(columns: str, source: str, where: str, count: int, newest: bool, *, walk: bool = False) -> str:
        """The full-text candidate query of PostgreSQL: ``$3`` the OR-ed tsquery text, ``$4`` the limit,
        ``$5`` the text-search configuration, ``$6…`` the ``count`` words of the rank, then their weights
        (see :meth:`_pg_params`).

        Best first: every match is ranked (the caller keeps only rare words, so they are few); the
        tsquery is a scalar subquery, computed once. Newest first (every word is common, thousands of
        rows match): the newest matches are found first and only they are ranked. There the tsquery is
        ``to_tsquery($5, $3)`` itself, which the planner folds into a constant and estimates from the
        column's statistics: for common words it walks the primary key backwards and stops at the limit
        (a few hundred rows) instead of fetching every match from the GIN bitmap and sorting them. With
        ``walk`` the match is ``IS TRUE``, which no index answers: a statement's generic plan (its sixth run
        on) cannot see the words, and it combined the GIN bitmap with ``where``'s index instead of walking,
        then fetched and sorted every match."""
        rank = MemoryRepository._pg_rank(count, 6)
        # (walking, the tsquery is a scalar subquery, computed once: by a generic plan, to_tsquery($5, $3) would
        # be parsed again for every row walked)
        match = "(m.ts @@ (SELECT to_tsquery($5, $3))) IS TRUE" if walk else "m.ts @@ to_tsquery($5, $3)"
        if not newest:
            return (f"SELECT {columns}, {rank} AS rank FROM {source}"
                    f" WHERE m.ts @@ (SELECT to_tsquery($5, $3)) AND {where} ORDER BY rank LIMIT $4")
        return (f"SELECT {columns}, {rank} AS rank FROM (SELECT m.* FROM {source}"
                f" WHERE {match} AND {where} ORDER BY m.id DESC LIMIT $4) AS m"
                " ORDER BY m.id DESC")

    @staticmethod
    def _pg_stop_words_sql(columns: str, source: str, where: str, count: int, words: str) -> str:
        """:meth:`_pg_text_sql`'s rows for when the configuration ``$5`` drops every query word (all stop words:
        "The Who", "who are you"), which made its tsquery empty and found nothing, where SQLite's FTS5 keeps
        every word and finds them: the newest ``STOP_WORDS_ROWS`` rows of ``where``, their ``words`` (an
        expression of ``m``'s columns) read by the ``simple`` configuration (no stop words, no stemming), best
        first. The condition on ``$5``'s tsquery holds no column, so it is checked once, before any row is
        read: a query the configuration keeps words of reads none (see :meth:`_pg_text_or_stop_words`)."""
        rank = MemoryRepository._pg_rank(count, 6, "s.v", "'simple'")
        # (each row's words are read once, by the plain parser: cortex_tsvector's look for the parts of addresses
        # and paths, which hold no function words, tripled the cost)
        newest = f"SELECT m.* FROM {source} WHERE {where} ORDER BY m.id DESC LIMIT {STOP_WORDS_ROWS}"
        return (f"SELECT {columns}, {rank} AS rank FROM ({newest}) AS m"
                f" CROSS JOIN LATERAL (SELECT to_tsvector('simple', {words}) AS v) AS s"
                " WHERE numnode((SELECT to_tsquery($5, $3))) = 0 AND s.v @@ (SELECT to_tsquery('simple', $3))"
                " ORDER BY rank LIMIT $4")

    @staticmethod
    def _pg_text_or_stop_words(columns: str, source: str, where: str, count: int, newest: bool, words: str
                               ) -> str:
        """:meth:`_pg_text_sql`'s query and, for when its tsquery is empty, :meth:`_pg_stop_words_sql`'s, in one
        statement (one round trip: a search that matches nothing, as every one of a new user's does, would pay
        a second). At most one of the two finds rows: the first finds none when the tsquery is empty, the second
        reads none when it is not. Each is planned as before, on its own."""
        return (f"SELECT * FROM (({MemoryRepository._pg_text_sql(columns, source, where, count, newest, walk=newest)})"
                f" UNION ALL ({MemoryRepository._pg_stop_words_sql(columns, source, where, count, words)})) AS m"
                " ORDER BY " + ("m.id DESC" if newest else "m.rank"))

    @staticmethod
    def _pg_params(terms: Mapping[str, float], limit: int, config: str) -> tuple[Any, ...]:
        """``$3``… of :meth:`_pg_text_sql`: the OR-ed tsquery, the limit, the configuration, the words and
        their weights."""
        return (tsquery(list(terms)), limit, config, *(tsquery([t]) for t in terms), *map(float, terms.values()))

    async def item_text_candidates(
        self, pair_id: int, terms: Mapping[str, float], *, newest: bool, now: float, limit: int,
        shared_only: bool = False,
    ) -> list[Row]:
        """Visible items (``shared_only``: only shared ones) matching any of ``terms`` (FTS5-quoted words
        with their weights), best first (or newest first when ``newest``), each with ``rank``."""
        shared = f" AND m.{SHARED}" if shared_only else ""
        if self.db.dialect == "sqlite":
            # Which matches are visible comes from an index (a few pages for hundreds of matches); only the
            # rows kept are read from the table, whose rows are large (their vectors).
            inner = ("SELECT memory_fts.rowid AS id, {} FROM memory_fts"
                     " JOIN memory_items AS m INDEXED BY memory_items_visible ON m.id = memory_fts.rowid"
                     f" WHERE memory_fts MATCH ? AND {VISIBLE}{shared} ORDER BY {{}} LIMIT ?")
            outer = (f"SELECT {ITEM_COLUMNS_M}, t.{{}} FROM ({{}}) AS t"
                     " JOIN memory_items AS m ON m.id = t.id ORDER BY {}")
            params = (fts5_match(terms), pair_id, now, limit)
            if newest:
                marked = inner.format(f"{_marked('memory_fts', 3)} AS marked", "memory_fts.rowid DESC")
                return await self._newest_sqlite(outer.format("marked", marked, "t.id DESC"), params)
            ranked = inner.format("bm25(memory_fts) AS rank", "rank")
            return await self.db.fetch_all(outer.format("rank", ranked, "t.rank"), params)
        config = await self.ts_config(pair_id=pair_id)
        # Newest first, by walking back through the pair's live items (memory_items_live): a generic plan took
        # the words' index instead, then fetched and sorted every match (25-67 ms for a pair of 100k items).
        where = ("m.pair_id = $1 AND m.archived_at IS NULL AND m.superseded_by IS NULL"
                 f" AND (m.expires_at IS NULL OR m.expires_at > $2){shared}")
        params = (pair_id, now, *self._pg_params(terms, limit, config))
        words = "m.content || ' ' || m.key || ' ' || m.tags"
        return await self.db.fetch_all(self._pg_text_or_stop_words(
            ITEM_COLUMNS_M, "memory_items AS m", where, len(terms), newest, words), params)

    async def message_text_candidates(
        self, user_id: int, persona: str, terms: Mapping[str, float], *, newest: bool, limit: int,
        exclude: Collection[int] = (),
    ) -> list[Row]:
        """The pair's messages matching any of ``terms``, best first (or newest), each with ``rank``; none of
        ``exclude`` (the reply's own history window: left out here, so the limit counts only what is kept
        and no excluded row is marked or ranked for nothing)."""
        left_out = json.dumps(sorted(exclude))
        paused = not_incognito("m")  # what is said in an incognito stretch is found by no search (it goes at its end)
        if self.db.dialect == "sqlite":
            skip = " AND m.id NOT IN (SELECT value FROM json_each(?))" if exclude else ""
            sql = (" FROM messages_fts JOIN messages AS m ON m.id = messages_fts.rowid"
                   " JOIN channels AS c ON c.id = m.channel_id"
                   f" WHERE messages_fts MATCH ? AND m.user_id = ? AND m.persona = ?{skip} AND {paused}"
                   " ORDER BY {} LIMIT ?")
            params = (fts5_match(terms), user_id, persona, *((left_out,) if exclude else ()), limit)
            if newest:
                return await self._newest_sqlite(
                    f"SELECT {MESSAGE_HIT_COLUMNS}, {_marked('messages_fts', 2)} AS marked"  # author, text
                    + sql.format("messages_fts.rowid DESC"), params)
            return await self.db.fetch_all(
                f"SELECT {MESSAGE_HIT_COLUMNS}, bm25(messages_fts) AS rank" + sql.format("bm25(messages_fts)"), params)
        config = await self.ts_config(persona=persona)
        last = 6 + 2 * len(terms)  # after the words of the rank and their weights
        skip = f" AND m.id NOT IN (SELECT CAST(value AS BIGINT) FROM jsonb_array_elements_text(${last}::jsonb))"
        # The messages' own columns only: the channel of the few rows returned is joined afterwards. Newest
        # first, a generic plan has one way to go (see _pg_text_sql): the walk back through the user's messages
        # (0.45 ms by a generic plan, where it took 157 ms for a user of 100k messages, most of them matching).
        where = f"m.user_id = $1 AND m.persona = $2{skip} AND {paused}"
        params = (user_id, persona, *self._pg_params(terms, limit, config), left_out)
        return await self.db.fetch_all(_with_channel(self._pg_text_or_stop_words(
            "m.*", "messages AS m", where, len(terms), newest, "m.author_name || ' ' || m.text"), newest), params)

    async def _newest_sqlite(self, sql: str, params: Sequence[Any]) -> list[Row]:
        """SQLite: the newest matches with a ``rank`` from the words FTS5 marked in each (its ``bm25()``
        would first count every row each word matches: as costly as ranking them all, see
        :func:`marked_ranks`)."""
        rows = await self.db.fetch_all(sql, params)
        ranks = marked_ranks([str(r["marked"] or "") for r in rows])
        return [{**{k: r[k] for k in r.keys() if k != "marked"}, "rank": rank}
                for r, rank in zip(rows, ranks, strict=True)]

    # -- vectors ---------------------------------------------------------------------------------

    @staticmethod
    def _vector_where(scope: VectorScope) -> tuple[str, str, str, tuple[Any, ...]]:
        """(id column, vector column, FROM … WHERE … (the model is the last parameter), parameters)."""
        if isinstance(scope, ItemScope):
            shared = f" AND {SHARED}" if scope.shared_only else ""
            return ("id", "embedding", "FROM memory_items WHERE pair_id = ? AND embedding IS NOT NULL"
                    f" AND archived_at IS NULL{shared} AND embedding_model = ?", (scope.pair_id,))
        return ("message_id", "vector", "FROM message_vectors WHERE user_id = ? AND persona = ? AND model = ?",
                (scope.user_id, scope.persona))

    async def count_vectors(self, scope: VectorScope, model: str) -> int:
        _id, _vector, where, params = self._vector_where(scope)
        row = await self.db.fetch_one(f"SELECT count(*) {where}", (*params, model))
        return int(row[0]) if row else 0

    async def has_vectors(self, scope: VectorScope, model: str) -> bool:
        """Whether the scope has a vector of ``model``. PostgreSQL: the model is written into the statement,
        not bound. A prepared statement runs by a generic plan from its sixth run on, which takes a bound
        model for one that every row has when the column holds one value: it then read the whole table for
        its LIMIT 1 at every reply (57 ms at 100k items that no embedder of this model had embedded yet, as
        after an import or a change of embedder). With the value in the text, the column's statistics say
        how rare it is, and the (pair, model) index answers at once."""
        _id, _vector, where, params = self._vector_where(scope)
        assert where.endswith(" = ?"), where  # the model's condition comes last
        named, model_params = self._model_in(model)
        return await self.db.fetch_one(f"SELECT 1 {where.removesuffix('?')}{named} LIMIT 1",
                                       (*params, *model_params)) is not None

    def _model_in(self, model: str) -> tuple[str, tuple[str, ...]]:
        """How a statement that filters by ``model`` names it, and its parameters: written into the text on
        PostgreSQL. Bound, the generic plan of a prepared statement's sixth run on takes it for a model that
        every row has when the column holds one value, and reads the whole table: at every reply for
        :meth:`has_vectors`' LIMIT 1 (57 ms at 100k items), at each backfill batch for the embedding backlog
        once there is work after idle runs (88 ms for 100k items, 2.8 s for 100k messages; a walk of the
        primary key takes 0.03 and 0.5 ms). SQLite binds it."""
        return (_literal(model), ()) if self.db.dialect == "postgres" else ("?", (model,))

    async def load_vectors(self, scope: VectorScope, model: str, after: int, limit: int) -> list[tuple[int, bytes]]:
        """A page of the scope's float32 vectors as (id, raw bytes), by id (SQLite)."""
        id_column, vector_column, where, params = self._vector_where(scope)
        rows = await self.db.fetch_all(
            f"SELECT {id_column}, {vector_column} {where} AND {id_column} > ? ORDER BY {id_column} LIMIT ?",
            (*params, model, after, limit),
        )
        return [(int(r[0]), bytes(r[1])) for r in rows]

    async def vector_top(
        self, scope: VectorScope, model: str, query: npt.NDArray[np.float32], k: int
    ) -> dict[int, float]:
        """PostgreSQL: the ``k`` nearest ids with how far their cosine similarity rises above the query's
        typical similarity in the scope (mean + 2σ over up to ``TYPICAL_SAMPLE`` of its vectors; the
        lowest below ``TYPICAL_MIN``), the same measure as the numpy scan of the SQLite engine."""
        scores, _rows = await self._vector_knn(scope, model, query, k, "", ())
        return scores

    async def vector_top_centred(
        self, scope: VectorScope, model: str, query: npt.NDArray[np.float32], k: int,
        direction: npt.NDArray[np.float32], offset: npt.NDArray[np.float32],
    ) -> tuple[dict[int, float], dict[int, float]]:
        """PostgreSQL: :meth:`vector_top`, and each id's centred cosine (``knn_centred``, see
        :meth:`_centred_column`), by the same statement."""
        centred, params = self._centred_column(scope, query, direction, offset)
        scores, rows = await self._vector_knn(scope, model, query, k, centred, params)
        return scores, {int(r["knn_id"]): float(r["knn_centred"]) for r in rows if int(r["knn_id"]) in scores}

    async def vector_top_items(
        self, pair_id: int, model: str, query: npt.NDArray[np.float32], k: int, now: float,
        centring: tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None = None, *, shared_only: bool = False,
    ) -> tuple[dict[int, float], list[Row]]:
        """PostgreSQL: :meth:`vector_top` of the pair's items, with the rows (``ITEM_COLUMNS``, and with
        ``centring`` (direction, offset) each one's centred cosine as ``knn_centred`` for the caller's
        relevance floor) of those of them that are visible, read by the same statement (a search saves a
        round trip)."""
        scope = ItemScope(pair_id, shared_only)
        centred, params = self._centred_column(scope, query, *centring) if centring is not None else ("", ())
        visible = ", (m.superseded_by IS NULL AND (m.expires_at IS NULL OR m.expires_at > ?)) AS visible"
        scores, rows = await self._vector_knn(scope, model, query, k, f", {ITEM_COLUMNS_M}{visible}{centred}",
                                              (now, *params))
        return scores, [r for r in rows if r["visible"] and int(r["knn_id"]) in scores]

    def _centred_column(self, scope: VectorScope, query: npt.NDArray[np.float32], direction: npt.NDArray[np.float32],
                        offset: npt.NDArray[np.float32]) -> tuple[str, tuple[Any, ...]]:
        """The column ``knn_centred`` of a k-NN row (:meth:`_vector_knn`) and its parameters: the cosine of
        its vector to ``direction`` once ``offset`` is taken out (the centred cosine of the relevance
        floor, ``CentredFloor``), ((v - o)·d) / |v - o| = (v·d - o·d) / |v - o|, so no vector is sent back."""
        dims = int(query.shape[0])
        typed = f"m.{self._vector_where(scope)[1]}::vector({dims})"
        column = (f", (-({typed} <#> ?::vector({dims})) - ?) / GREATEST({typed} <-> ?::vector({dims}), 1e-6)"
                  " AS knn_centred")
        return column, (direction, float(offset @ direction), offset)

    async def _vector_knn(
        self, scope: VectorScope, model: str, query: npt.NDArray[np.float32], k: int, columns: str,
        column_params: tuple[Any, ...],
    ) -> tuple[dict[int, float], list[Row]]:
        """The k-NN ids with their excess similarity (see :meth:`vector_top`), and the k-NN rows (the id,
        the similarity, then ``columns`` over the scope's table as ``m``)."""
        dims = int(query.shape[0])
        id_column, vector_column, where, params = self._vector_where(scope)
        typed = f"{vector_column}::vector({dims})"
        plan = await self._index_plan(_vector_table(scope), dims)
        order = (f"{vector_column}::halfvec({dims}) <=> CAST(?::vector({dims}) AS halfvec({dims}))" if plan.half
                 else f"{typed} <=> ?::vector({dims})")
        scoped = f"{where} AND vector_dims({vector_column}) = {dims}"
        # The typical level is measured over all of the scope's vectors (as the numpy scan measures it),
        # even when only shared items are wanted.
        _, _, everything, _ = self._vector_where(ItemScope(scope.pair_id) if isinstance(scope, ItemScope) else scope)
        sampled = f"{everything} AND vector_dims({vector_column}) = {dims}"
        knn = self._knn_rows(
            f"SELECT {id_column} AS knn_id, 1 - ({typed} <=> ?::vector({dims})) AS knn_similarity{columns}"
            f" {scoped.replace(' WHERE ', ' AS m WHERE ', 1)} ORDER BY {order} LIMIT ?",
            (query, *column_params, *params, model, query, k), plan.ef_search)
        key = (sampled, *params, model)
        spread = self._spreads.get(key)
        measure = partial(self._spreads.measure, key, dims,
                          partial(self._spread_sample, vector_column, sampled, (*params, model)))
        if spread is not None:  # a large scope: its typical level comes from its spread (see bot.storage.spread)
            if time.monotonic() - spread.measured > SPREAD_TTL:
                measure()
            rows = await knn
            floor = spread.level(query)
            return {int(r[0]): float(r[1]) - floor for r in rows}, rows
        # Two statements on two pooled connections, at the same time: the k-NN walk of the HNSW graph
        # and the sample's similarities cost about the same; in one statement they ran one after the other.
        # The sample's similarity is the inner product, as the numpy scan's (every embedder's vectors have
        # unit length, so it is their cosine): half the work of pgvector's cosine distance, which also
        # measures both lengths.
        rows, stats = await asyncio.gather(knn, self.db.fetch_one(
            f"SELECT count(*), avg(s), stddev_pop(s), min(s) FROM (SELECT -({typed} <#> ?::vector({dims})) AS s"
            f" {sampled} LIMIT {TYPICAL_SAMPLE}) AS sample", (query, *params, model)))
        if not rows or stats is None:
            return {}, []
        count, mean, sd, low = int(stats[0]), float(stats[1] or 0), float(stats[2] or 0), float(stats[3] or 0)
        if count >= TYPICAL_SAMPLE:  # the next searches of this scope need no sample
            measure()
        floor = mean + 2.0 * sd if count >= TYPICAL_MIN else (low if count > 1 else 0.0)
        return {int(r[0]): float(r[1]) - floor for r in rows}, rows

    async def _spread_sample(self, vector_column: str, sampled: str, params: tuple[Any, ...]
                             ) -> npt.NDArray[np.float32]:
        """PostgreSQL: ``SPREAD_SAMPLE`` of the scope's vectors, drawn at random (the row addresses are
        sorted, not the vectors, which would not fit in the sort's memory)."""
        rows = await self.db.fetch_all(
            f"SELECT {vector_column} {sampled} AND ctid = ANY(ARRAY(SELECT ctid {sampled}"
            f" ORDER BY random() LIMIT {SPREAD_SAMPLE}))", (*params, *params))
        sample = np.empty((len(rows), len(_array(rows[0][0])) if rows else 0), dtype=np.float32)
        for n, row in enumerate(rows):
            sample[n] = _array(row[0])
        return sample

    def forget_spreads(self) -> None:
        """Drop the process's spreads of vector scopes (a forget-me: they derive from the user's vectors)."""
        self._spreads.clear()

    async def spreads_settled(self) -> None:
        """Wait for the spreads being measured (tests)."""
        await self._spreads.settled()

    async def close(self) -> None:
        await self._spreads.close()

    async def _index_plan(self, table: str, dims: int) -> _IndexPlan:
        """How searches of ``table``'s vectors of ``dims`` go: by its half-precision HNSW index once that is
        valid (until then, in a database of an older cortex-bot and while the backfill builds the new index, by
        the full-precision one such a database has), and how many candidates they look at (None: as the URL
        sets ``hnsw.ef_search``). Looked up at most every ``HALF_CHECK_SECONDS`` until the index is
        ready, then every ``INDEX_SIZE_SECONDS`` (its size)."""
        key, now = (table, dims), time.monotonic()
        plan = self._index_plans.get(key)
        if plan is not None and now - plan.checked < (INDEX_SIZE_SECONDS if plan.half else HALF_CHECK_SECONDS):
            return plan
        row = await self.db.fetch_one(
            "SELECT i.indisvalid, c.reltuples FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid"
            " WHERE i.indexrelid = to_regclass(?)", (_index_name(table, dims),))
        half = row is not None and bool(row[0])
        large = half and row is not None and float(row[1]) >= LARGE_INDEX
        ef_search = None if "hnsw.ef_search" in self.db.url_settings else LARGE_EF_SEARCH if large else EF_SEARCH
        self._index_plans[key] = plan = _IndexPlan(half, ef_search, now)
        return plan

    async def _knn_rows(self, sql: str, params: Sequence[Any], ef_search: int | None) -> list[Row]:
        """The k-NN statement's rows, on a connection set to look at ``ef_search`` candidates (None: the URL's
        setting): the connection keeps it, so only a change costs a statement (a transaction with SET LOCAL
        around each search cost three round trips, 0.6 ms)."""
        settings = {} if ef_search is None else {"hnsw.ef_search": str(ef_search)}
        return await self.db.fetch_all_set(sql, params, settings)

    async def ensure_vector_index(self, dims: int) -> None:
        """PostgreSQL: the HNSW (cosine) indexes for vectors of ``dims`` dimensions, made once by the
        background backfill, never in a reply. Over a big table (a bot copied from SQLite) the build takes
        minutes (two at 100k vectors on two cores, over twenty at a million, given the memory), so it runs
        CONCURRENTLY (writes to the table go on; searches scan exactly until it is done, or go by the index an
        older version built) and without the pool's statement timeout, which used to cancel it after five
        minutes, every time the backfill tried again. A build
        another process runs is left to it; one left invalid by a process that died is dropped and started
        again."""
        if self.db.dialect != "postgres" or dims in self._vector_indexes:
            return
        ready = [await self._build_vector_index(table, column, dims)
                 for table, column in VECTOR_TABLES]
        if all(ready):
            self._vector_indexes.add(dims)
            for table, _column in VECTOR_TABLES:
                self._index_plans.pop((table, dims), None)  # the next search looks again
            await self._prewarm(dims)
            await self._drop_full_indexes(dims)

    async def _prewarm(self, dims: int) -> None:
        """Load the HNSW indexes into PostgreSQL's buffers, once a process finds them ready (built now, or at
        its start), when the ``pg_prewarm`` extension is installed and an index fits in half of the buffers.
        Right after a build or a server restart, a search of a large index otherwise reads its pages from
        disk: at 1M items, the first 300 searches had a p95 of 19–20 ms, against 8–10 ms once warm. Loading
        one of 1.3 GB takes seconds; a failure only costs the warm start."""
        try:
            if await self.db.fetch_one("SELECT 1 FROM pg_extension WHERE extname = 'pg_prewarm'") is None:
                return
            for table, _column in VECTOR_TABLES:
                name = _index_name(table, dims)
                row = await self.db.fetch_one("SELECT pg_relation_size(to_regclass(?)),"
                                              " pg_size_bytes(current_setting('shared_buffers'))", (name,))
                if row is None or row[0] is None or int(row[0]) > int(row[1]) // 2:
                    continue
                loaded = await self.db.fetch_one("SELECT pg_prewarm(to_regclass(?))", (name,))
                log.info("loaded the vector index %s into PostgreSQL's buffers (%d blocks, pg_prewarm)", name,
                         int(loaded[0]) if loaded else 0)
        except Exception as exc:  # (a missing privilege, a pool closing): searches read from disk until warm
            log.warning("could not load the vector indexes into PostgreSQL's buffers (pg_prewarm): %s", exc)

    async def _drop_full_indexes(self, dims: int) -> None:
        """Drop the full-precision HNSW indexes an older cortex-bot built, once the half-precision ones are
        ready: after ``OLD_INDEX_GRACE_SECONDS``, by when every process has looked and searches by the new ones
        (one that still searched by the old expression would scan exactly)."""
        old = []
        for name in (_index_name(table, dims, half=False) for table, _column in VECTOR_TABLES):
            row = await self.db.fetch_one("SELECT to_regclass(?) IS NOT NULL", (name,))
            if row is not None and row[0]:
                old.append(name)
        if not old:
            return
        log.info("the half-precision vector indexes are ready; the full-precision ones (%s) go in %g s",
                 ", ".join(old), OLD_INDEX_GRACE_SECONDS)
        await asyncio.sleep(OLD_INDEX_GRACE_SECONDS)
        for name in old:
            await self.db.maintain(f"DROP INDEX CONCURRENTLY IF EXISTS {name}", lock=name,
                                   when="SELECT to_regclass(?) IS NOT NULL", params=(name,))

    async def _build_vector_index(self, table: str, column: str, dims: int) -> bool:
        """Whether ``table``'s HNSW index for ``dims`` is valid once this returns (False: another process is
        building it). Each step holds a lock of the index's name, and checks under it that it is still due."""
        name = _index_name(table, dims)
        valid = "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(?)"
        row = await self.db.fetch_one(valid, (name,))
        if row is not None and row[0]:
            return True
        if row is not None:  # invalid: being built (its builder holds the lock), or left by a build that died
            abandoned = "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(?)"
            if not await self.db.maintain(f"DROP INDEX CONCURRENTLY IF EXISTS {name}", lock=name, when=abandoned,
                                          params=(name,)):
                return False
            log.warning("dropped the vector index %s, which a build that stopped half-way left unfinished", name)
        log.info("building the vector index %s unless another process is (over a big table this takes minutes; "
                 "searches scan meanwhile)", name)
        try:
            await self.db.maintain(
                f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} USING hnsw"
                f" (({column}::halfvec({dims})) halfvec_cosine_ops) WITH ({HNSW_BUILD})"
                f" WHERE vector_dims({column}) = {dims}", lock=name, when="SELECT to_regclass(?) IS NULL",
                params=(name,))
        except Exception as exc:  # a process of an older cortex-bot started it at the same moment
            if not is_conflict(exc) and "already exists" not in str(exc):
                raise
        row = await self.db.fetch_one(valid, (name,))
        return row is not None and bool(row[0])

    def _vector_param(self, vector: npt.NDArray[np.float32]) -> Any:
        return vector if self.db.dialect == "postgres" else vector.astype(np.float32).tobytes()

    # -- embedding backlog -----------------------------------------------------------------------

    async def items_to_embed(self, model: str, limit: int) -> list[Row]:
        """Up to ``limit`` live items without a vector of ``model``, newest first. Found by the backlog's index
        (migration 22), one range of it on each side of the model's name, and sorted when they are few, as
        between two runs; when there are many (a new model), by walking the items newest first, which meets
        one at nearly every step, where sorting them all for each batch would cost 0.27 s at 100k."""
        named, params = self._model_in(model)
        columns, live = "id, pair_id, key, content", "FROM memory_items WHERE archived_at IS NULL"
        ranges = (f"SELECT {columns} {live} AND embedding_model < {named}"
                  f" UNION ALL SELECT {columns} {live} AND embedding_model > {named}")
        # (Each side counted in the index's order: otherwise PostgreSQL reads the rows when most of them count.)
        side = (f"(SELECT count(*) FROM (SELECT 1 {live} AND embedding_model {{}} {named} ORDER BY embedding_model"
                f" LIMIT {SPARSE_BACKLOG}) AS side)")
        pending = await self.db.fetch_one(f"SELECT {side.format('<')} + {side.format('>')}", (*params, *params))
        count = int(pending[0]) if pending is not None else 0
        if not count:
            return []
        if count < SPARSE_BACKLOG:  # (+id: sorted, not walked in the primary key's order past every item)
            return await self.db.fetch_all(f"SELECT * FROM ({ranges}) AS p ORDER BY +id DESC LIMIT ?",
                                           (*params, *params, limit))
        return await self.db.fetch_all(f"SELECT {columns} {live} AND embedding_model != {named} ORDER BY id DESC"
                                       " LIMIT ?", (*params, limit))

    async def store_item_vectors(self, model: str, rows: Sequence[tuple[int, npt.NDArray[np.float32]]]) -> None:
        async with self.db.transaction() as tx:
            await tx.executemany(
                "UPDATE memory_items SET embedding = ?, embedding_model = ? WHERE id = ?",
                [(self._vector_param(vector), model, item_id) for item_id, vector in rows],
            )

    async def newest_message_id(self) -> int:
        row = await self.db.fetch_one("SELECT coalesce(max(id), 0) FROM messages")
        return int(row[0]) if row is not None else 0

    async def messages_to_embed(self, model: str, below: int, limit: int, *, above: int = 0) -> list[Row]:
        """Messages of users (newest first, ids below ``below`` and above ``above``) without a vector of
        ``model``, each with the channel's message before it (``before_author``, ``before_text``) unless that one
        was said in an incognito stretch (it is deleted at the stretch's end: it must not live on in another's
        vector), and the id of the message before it whatever it is (``before_id``, 0 for none: see
        store_message_vectors)."""
        named, params = self._model_in(model)
        return await self.db.fetch_all(
            "SELECT m.id, m.user_id, m.persona, m.author_name, m.text, p.author_name AS before_author,"
            " p.text AS before_text, coalesce((SELECT max(id) FROM messages WHERE channel_id = m.channel_id"
            " AND id < m.id), 0) AS before_id FROM messages AS m LEFT JOIN message_vectors AS v ON v.message_id = m.id"
            " LEFT JOIN messages AS p ON p.id = (SELECT max(id) FROM messages"
            f" WHERE channel_id = m.channel_id AND id < m.id) AND {not_incognito('p')}"
            f" WHERE m.user_id IS NOT NULL AND (v.model IS NULL OR v.model != {named}) AND m.id < ? AND m.id > ?"
            f" AND {not_incognito('m')}"
            " ORDER BY m.id DESC LIMIT ?",
            (*params, below, above, limit),
        )

    async def store_message_vectors(
        self, model: str, rows: Sequence[tuple[int, int, str, npt.NDArray[np.float32]]], *,
        before: Sequence[int] | None = None,
    ) -> list[int]:
        """Store (message id, user id, persona, vector) rows, only while the message still exists with the
        same owner (forget-me may have run meanwhile); the ids stored. With ``before`` (per row, the id of the
        message before it when it was read, 0 for none: its context), only while that is still the one before
        it: a message deleted meanwhile (forget-me, the end of an incognito stretch, a withdrawal) must not
        live on in its neighbour's vector, which the deletion dropped before this one was stored."""
        stored: list[int] = []
        async with self.db.transaction() as tx:
            if before is not None and self.db.dialect == "postgres":
                # A deletion that already took these rows makes this wait for its end (and the check below then
                # sees them gone); one that comes later waits for this commit, and then drops the vectors of
                # the messages after those it deleted (``delete_messages``), this one's too.
                context = sorted({b for b in before if b})
                if context:
                    await tx.fetch_all(f"SELECT id FROM messages WHERE id IN ({', '.join('?' for _ in context)})"
                                       " FOR SHARE", context)
            for n, (message_id, user_id, persona, vector) in enumerate(rows):
                check, params = ("", ()) if before is None else (
                    " AND coalesce((SELECT max(p.id) FROM messages AS p WHERE p.channel_id = messages.channel_id"
                    " AND p.id < messages.id), 0) = ?", (before[n],))
                row = await tx.fetch_one(
                    "INSERT INTO message_vectors (message_id, user_id, persona, model, vector)"
                    " SELECT id, user_id, persona, CAST(? AS TEXT), ? FROM messages WHERE id = ? AND user_id = ?"
                    f" AND persona = ?{check} ON CONFLICT (message_id) DO UPDATE SET model = excluded.model,"
                    " vector = excluded.vector RETURNING message_id",
                    (model, self._vector_param(vector), message_id, user_id, persona, *params))
                if row is not None:
                    stored.append(int(row[0]))
        return stored

    async def embedding_counts(self, model: str, message_model: str, messages: bool) -> tuple[int, int, int, int]:
        """(items, items embedded, user messages, messages embedded)."""
        items = await self.db.fetch_one(
            "SELECT count(*), coalesce(sum(CASE WHEN embedding_model = ? THEN 1 ELSE 0 END), 0) FROM memory_items"
            " WHERE archived_at IS NULL",
            (model,),
        )
        total = embedded = 0
        if messages:
            row = await self.db.fetch_one(
                "SELECT (SELECT count(*) FROM messages WHERE user_id IS NOT NULL),"
                " (SELECT count(*) FROM message_vectors WHERE model = ?)", (message_model,))
            total, embedded = (int(row[0]), int(row[1])) if row else (0, 0)
        return (int(items[0]), int(items[1]), total, embedded) if items else (0, 0, total, embedded)

    # -- pruning ---------------------------------------------------------------------------------

    async def prune_items(
        self, now: float, reasons: PruneReasons, *, unused_before: float, rarely_before: float, min_access: int
    ) -> list[tuple[str, str, int]]:
        """Archive, in one transaction, unpinned items changed last before ``unused_before`` and never
        accessed, or before ``rarely_before`` and accessed fewer than ``min_access`` times, and expired
        items; returns (reason, category, pair id) per archived item."""
        rules: list[tuple[str, str, tuple[Any, ...]]] = [
            (reasons.expired, "expires_at IS NOT NULL AND expires_at <= ?", (now,)),
            (reasons.unused, "pinned = 0 AND access_count = 0 AND updated_at < ?", (unused_before,)),
            (reasons.rarely, "pinned = 0 AND access_count < ? AND updated_at < ?", (min_access, rarely_before)),
        ]
        archived: list[tuple[str, str, int]] = []
        async with self.db.transaction() as tx:
            for reason, where, params in rules:
                rows = await tx.fetch_all(
                    # (not a corrected item: hidden already, it was counted and listed as pruned beside its correction;
                    # it goes with its correction, uncounted)
                    "UPDATE memory_items SET archived_at = ?, archive_reason = ? WHERE archived_at IS NULL"
                    f" AND superseded_by IS NULL AND {where} RETURNING category, pair_id, id",
                    (now, f"pruned: {reason}", *params),
                )
                archived += [(reason, str(r[0]), int(r[1])) for r in rows]
                await archive_older(tx, [int(r[2]) for r in rows], now)
        return archived


async def archive_older(tx: Tx, heads: Sequence[int], now: float) -> None:
    """Archive the wordings that the items ``heads`` (archived a moment ago) replaced: hidden already, they count
    against the pair's item limit until archived, and nothing else archives them (restoring one is refused). Walked
    back by ``supersedes``, the primary key's way."""
    for start in range(0, len(heads), 500):
        chunk = heads[start:start + 500]
        await tx.execute(
            "WITH RECURSIVE older (id) AS ("
            f" SELECT supersedes FROM memory_items WHERE id IN ({','.join('?' for _ in chunk)})"
            " AND supersedes IS NOT NULL"
            " UNION SELECT m.supersedes FROM memory_items AS m JOIN older ON m.id = older.id"
            " WHERE m.supersedes IS NOT NULL)"
            " UPDATE memory_items SET archived_at = ?, archive_reason = ? WHERE id IN (SELECT id FROM older)"
            " AND archived_at IS NULL AND superseded_by IS NOT NULL", (*chunk, now, "its correction was archived"))


@dataclass(frozen=True, slots=True)
class ItemFilters:
    """Which of a user's items to list: active (visible) ones or the others, and optional conditions."""

    active: bool = True
    persona: str | None = None
    category: str | None = None
    pinned: bool | None = None
    scope: str | None = None
    words: tuple[str, ...] = ()  # each must occur in the content (case-insensitive)

    def where(self, user_id: int, now: float, dialect: str = "sqlite") -> tuple[str, list[Any]]:
        visible = "m.archived_at IS NULL AND m.superseded_by IS NULL AND (m.expires_at IS NULL OR m.expires_at > ?)"
        where = ["p.user_id = ?", visible if self.active else f"NOT ({visible})"]
        params: list[Any] = [user_id, now]
        for column, value in (("p.persona", self.persona), ("m.category", self.category), ("m.scope", self.scope),
                              ("m.pinned", None if self.pinned is None else int(self.pinned))):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        # Any script's capitals: SQLite's lower() folds ASCII only (the engine registers cortex_fold, Python's
        # casefold); PostgreSQL's lower() folds by the database's locale.
        fold, folded = ("cortex_fold", str.casefold) if dialect == "sqlite" else ("lower", str.lower)
        for word in self.words:
            where.append(f"{fold}(m.content) LIKE ? ESCAPE '\\'")
            params.append("%" + folded(word).replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%")
        return " AND ".join(where), params


@dataclass(frozen=True, slots=True)
class PruneReasons:
    expired: str
    unused: str
    rarely: str


def item_fields(**fields: Any) -> dict[str, Any]:
    """Item columns as stored (lists and mappings as JSON, flags as 0/1)."""
    out = dict(fields)
    for name in ("tags", "metadata"):
        if name in out and not isinstance(out[name], str):
            out[name] = json.dumps(out[name])
    if "pinned" in out:
        out["pinned"] = int(bool(out["pinned"]))
    return out


@dataclass(frozen=True, slots=True)
class _IndexPlan:
    half: bool  # search by the half-precision index
    ef_search: int | None  # candidates to look at (None: as the URL sets)
    checked: float  # time.monotonic()


def _with_channel(sql: str, newest: bool) -> str:
    """PostgreSQL: a message query's rows (``sql``) as hits, with their channel's name (joined only to the few
    rows kept), newest first or best first."""
    return (f"SELECT {MESSAGE_HIT_COLUMNS}, m.rank FROM ({sql}) AS m JOIN channels AS c ON c.id = m.channel_id"
            " ORDER BY " + ("m.id DESC" if newest else "m.rank"))


def _literal(text: str) -> str:
    """``text`` as an SQL string literal (quotes doubled; PostgreSQL's standard strings keep backslashes)."""
    return "'" + text.replace("'", "''") + "'"


def _vector_table(scope: VectorScope) -> str:
    return "memory_items" if isinstance(scope, ItemScope) else "message_vectors"


def _index_name(table: str, dims: int, *, half: bool = True) -> str:
    """The name of ``table``'s HNSW index of ``dims``-dimensional vectors: over half-precision copies, or the
    full-precision one of cortex-bot before 2026-11 (dropped once the new one is ready)."""
    return f"{table}_hnsw{'h' if half else ''}_{dims}"
