"""Schema migrations as code: one numbered list, each applied in one transaction, never destructive.

A migration only adds (tables, columns, indexes) or copies data; it never drops user data. Where the
engines' SQL differs a migration carries a PostgreSQL fork (``postgres=``, in ``bot.storage.pg_schema``);
versions and descriptions are shared, so ``cortexbot migrate`` reports the same thing everywhere.
"""

from __future__ import annotations

from bot.storage import pg_schema
from bot.storage.engine import Migration

# (the daily upkeep deletes the old model calls, the web page reads the last 14 days: both by their time)
LLM_CALLS_BY_TIME = "CREATE INDEX llm_calls_by_time ON llm_calls (created_at)"


def _sqlite_fork(statements: tuple[str, ...]) -> tuple[str, ...]:
    """SQLite's spelling of PostgreSQL statements that differ only in id and time column types."""
    return tuple(s.replace(f"id {pg_schema.ID}", "id INTEGER PRIMARY KEY AUTOINCREMENT")
                 .replace("DOUBLE PRECISION", "REAL").replace("BIGINT", "INTEGER") for s in statements)


# The wordings a correction replaced, left unarchived when the correction was (before archive_older): walked back
# from each archived correction by ``supersedes``, the primary key's way (a walk forward from every wording kept a
# row per pair of one chain's wordings: 36 s for a chain of 3,000 on SQLite).
_ORPHANED_WORDINGS = (
    "WITH RECURSIVE older (id) AS ("
    " SELECT supersedes FROM memory_items WHERE superseded_by IS NULL AND archived_at IS NOT NULL"
    " AND supersedes IS NOT NULL"
    " UNION SELECT m.supersedes FROM memory_items AS m JOIN older ON m.id = older.id WHERE m.supersedes IS NOT NULL)"
    " UPDATE memory_items SET archived_at = {now}, archive_reason = 'its correction was archived'"
    " WHERE id IN (SELECT id FROM older) AND archived_at IS NULL AND superseded_by IS NOT NULL")
REPLY_INDEX = "CREATE INDEX messages_by_reply_to ON messages (reply_to) WHERE reply_to IS NOT NULL"
SOURCE_INDEX = "CREATE INDEX memory_items_by_source ON memory_items (source_ref)"
# SQLite: what a full-text match needs to know of an item to keep it (see ``MemoryRepository``), in an index
# dense enough to read hundreds of matches from a few pages; the table's rows carry their vectors (1.5 kB).
VISIBLE_INDEX = ("CREATE INDEX memory_items_visible ON memory_items"
                 " (id, pair_id, archived_at, superseded_by, expires_at, scope)")

# The query's ``pinned = 1`` matches the index's condition, so only pinned items are in it (a handful a pair).
PINNED_INDEX = "CREATE INDEX memory_items_pinned ON memory_items (pair_id, importance DESC, id) WHERE pinned = 1"
# The items without a vector of the current model (MemoryRepository.items_to_embed): a handful between two runs.
BACKLOG_INDEX = "CREATE INDEX memory_items_backlog ON memory_items (embedding_model, id) WHERE archived_at IS NULL"

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "users, personas, channels, messages, summaries, jobs, llm calls, reply stats, settings",
        (
            """CREATE TABLE users (
                id INTEGER PRIMARY KEY,
                key TEXT NOT NULL UNIQUE,
                display_name TEXT NOT NULL,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL)""",
            """CREATE TABLE personas (
                id INTEGER PRIMARY KEY,
                name TEXT NOT NULL UNIQUE COLLATE NOCASE,
                created_at REAL NOT NULL)""",
            """CREATE TABLE channels (
                id INTEGER PRIMARY KEY,
                key TEXT NOT NULL UNIQUE,
                name TEXT NOT NULL,
                is_dm INTEGER NOT NULL DEFAULT 0,
                message_count INTEGER NOT NULL DEFAULT 0,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL)""",
            """CREATE TABLE messages (
                id INTEGER PRIMARY KEY,
                channel_id INTEGER NOT NULL REFERENCES channels(id),
                user_id INTEGER REFERENCES users(id),
                persona TEXT NOT NULL,
                role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
                author_name TEXT NOT NULL,
                text TEXT NOT NULL,
                token_count INTEGER NOT NULL,
                seq INTEGER NOT NULL,
                created_at REAL NOT NULL)""",
            "CREATE INDEX messages_by_channel ON messages (channel_id, id)",
            "CREATE INDEX messages_by_user ON messages (user_id, id)",
            # Keeps channels.message_count exact inside the very statement that inserts a message.
            """CREATE TRIGGER messages_count_channel AFTER INSERT ON messages BEGIN
                UPDATE channels SET message_count = message_count + 1, updated_at = NEW.created_at
                WHERE id = NEW.channel_id;
            END""",
            """CREATE TABLE summaries (
                id INTEGER PRIMARY KEY,
                channel_id INTEGER NOT NULL REFERENCES channels(id),
                version INTEGER NOT NULL,
                text TEXT NOT NULL,
                covers_from_id INTEGER NOT NULL,
                covers_to_id INTEGER NOT NULL,
                covers_to_seq INTEGER NOT NULL,
                token_count INTEGER NOT NULL,
                model TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('ok', 'rejected')),
                reason TEXT NOT NULL DEFAULT '',
                created_at REAL NOT NULL,
                UNIQUE (channel_id, version))""",
            "CREATE INDEX summaries_good ON summaries (channel_id, status, version)",
            """CREATE TABLE jobs (
                id INTEGER PRIMARY KEY,
                kind TEXT NOT NULL,
                key TEXT NOT NULL,
                payload TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'done', 'failed')),
                attempts INTEGER NOT NULL DEFAULT 0,
                max_attempts INTEGER NOT NULL,
                run_after REAL NOT NULL,
                last_error TEXT NOT NULL DEFAULT '',
                locked_by TEXT NOT NULL DEFAULT '',
                lease_until REAL NOT NULL DEFAULT 0,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL)""",
            "CREATE INDEX jobs_runnable ON jobs (status, run_after, id)",
            "CREATE INDEX jobs_by_key ON jobs (key, status)",
            """CREATE TABLE llm_calls (
                id INTEGER PRIMARY KEY,
                purpose TEXT NOT NULL,
                model TEXT NOT NULL,
                input_tokens INTEGER NOT NULL,
                output_tokens INTEGER NOT NULL,
                estimated_input_tokens INTEGER NOT NULL DEFAULT 0,
                duration_ms INTEGER NOT NULL,
                error TEXT NOT NULL DEFAULT '',
                created_at REAL NOT NULL)""",
            """CREATE TABLE reply_stats (
                id INTEGER PRIMARY KEY,
                channel_id INTEGER NOT NULL REFERENCES channels(id),
                message_id INTEGER NOT NULL REFERENCES messages(id),
                history_tokens INTEGER NOT NULL,
                history_budget INTEGER NOT NULL,
                window_messages INTEGER NOT NULL,
                trimmed_messages INTEGER NOT NULL,
                summary_used INTEGER NOT NULL,
                prompt_tokens INTEGER NOT NULL,
                created_at REAL NOT NULL)""",
            "CREATE INDEX reply_stats_by_channel ON reply_stats (channel_id)",
            """CREATE TABLE settings (
                key TEXT PRIMARY KEY,
                value TEXT NOT NULL,
                updated_at REAL NOT NULL)""",
        ),
        postgres=pg_schema.V1,
    ),
    Migration(
        2,
        "cortex: user-persona pairs with tier cycles, versioned cortex files, update runs, settings",
        (
            """CREATE TABLE cortex_pairs (
                id INTEGER PRIMARY KEY,
                user_id INTEGER NOT NULL REFERENCES users(id),
                persona TEXT NOT NULL,
                cycle INTEGER NOT NULL DEFAULT 1,
                cycle_count INTEGER NOT NULL DEFAULT 0,
                fired_tiers TEXT NOT NULL DEFAULT '[]',
                created_at REAL NOT NULL,
                UNIQUE (user_id, persona))""",
            """CREATE TABLE cortex_versions (
                id INTEGER PRIMARY KEY,
                pair_id INTEGER NOT NULL REFERENCES cortex_pairs(id),
                filename TEXT NOT NULL CHECK (filename IN ('memory.md', 'soul.md', 'relationship.md')),
                version INTEGER NOT NULL,
                content TEXT NOT NULL,
                author TEXT NOT NULL CHECK (author IN ('model', 'user', 'system')),
                reason TEXT NOT NULL DEFAULT '',
                tier TEXT NOT NULL DEFAULT '',
                run_id INTEGER,
                created_at REAL NOT NULL,
                UNIQUE (pair_id, filename, version))""",
            """CREATE TABLE cortex_runs (
                id INTEGER PRIMARY KEY,
                pair_id INTEGER NOT NULL REFERENCES cortex_pairs(id),
                job_id INTEGER,
                tier TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('running', 'success', 'failed', 'skipped')),
                reason TEXT NOT NULL DEFAULT '',
                rounds INTEGER NOT NULL DEFAULT 0,
                files_read TEXT NOT NULL DEFAULT '[]',
                files_written TEXT NOT NULL DEFAULT '[]',
                input_tokens INTEGER NOT NULL DEFAULT 0,
                output_tokens INTEGER NOT NULL DEFAULT 0,
                duration_ms INTEGER NOT NULL DEFAULT 0,
                error TEXT NOT NULL DEFAULT '',
                started_at REAL NOT NULL,
                finished_at REAL)""",
            "CREATE INDEX cortex_runs_by_pair ON cortex_runs (pair_id, started_at)",
            "CREATE INDEX cortex_runs_by_time ON cortex_runs (started_at)",
            """CREATE TABLE cortex_settings (
                scope TEXT NOT NULL,
                key TEXT NOT NULL,
                value TEXT NOT NULL,
                updated_by TEXT NOT NULL DEFAULT '',
                updated_at REAL NOT NULL,
                PRIMARY KEY (scope, key))""",
        ),
        postgres=pg_schema.V2,
    ),
    Migration(
        3,
        "memory store: items per pair with full-text search; full-text search over messages",
        (
            """CREATE TABLE memory_items (
                id INTEGER PRIMARY KEY,
                pair_id INTEGER NOT NULL REFERENCES cortex_pairs(id),
                category TEXT NOT NULL CHECK (category IN ('fact', 'preference', 'decision', 'user_info',
                    'project_context', 'learned_behavior', 'correction', 'temporal', 'event')),
                key TEXT NOT NULL DEFAULT '',
                content TEXT NOT NULL,
                importance INTEGER NOT NULL DEFAULT 5 CHECK (importance BETWEEN 1 AND 10),
                pinned INTEGER NOT NULL DEFAULT 0,
                expires_at REAL,
                supersedes INTEGER REFERENCES memory_items(id),
                superseded_by INTEGER REFERENCES memory_items(id),
                tags TEXT NOT NULL DEFAULT '[]',
                source TEXT NOT NULL DEFAULT 'user',
                source_ref TEXT NOT NULL DEFAULT '',
                metadata TEXT NOT NULL DEFAULT '{}',
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL,
                access_count INTEGER NOT NULL DEFAULT 0,
                last_accessed REAL,
                archived_at REAL,
                archive_reason TEXT NOT NULL DEFAULT '',
                embedding BLOB,
                embedding_model TEXT NOT NULL DEFAULT '')""",
            "CREATE INDEX memory_items_by_pair ON memory_items (pair_id, archived_at)",
            """CREATE VIRTUAL TABLE memory_fts USING fts5(
                content, key, tags, content='memory_items', content_rowid='id', tokenize='porter unicode61')""",
            """CREATE TRIGGER memory_fts_insert AFTER INSERT ON memory_items BEGIN
                INSERT INTO memory_fts (rowid, content, key, tags) VALUES (NEW.id, NEW.content, NEW.key, NEW.tags);
            END""",
            """CREATE TRIGGER memory_fts_delete AFTER DELETE ON memory_items BEGIN
                INSERT INTO memory_fts (memory_fts, rowid, content, key, tags)
                VALUES ('delete', OLD.id, OLD.content, OLD.key, OLD.tags);
            END""",
            """CREATE TRIGGER memory_fts_update AFTER UPDATE OF content, key, tags ON memory_items BEGIN
                INSERT INTO memory_fts (memory_fts, rowid, content, key, tags)
                VALUES ('delete', OLD.id, OLD.content, OLD.key, OLD.tags);
                INSERT INTO memory_fts (rowid, content, key, tags) VALUES (NEW.id, NEW.content, NEW.key, NEW.tags);
            END""",
            """CREATE VIRTUAL TABLE messages_fts USING fts5(
                text, content='messages', content_rowid='id', tokenize='porter unicode61')""",
            "INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')",
            """CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
                INSERT INTO messages_fts (rowid, text) VALUES (NEW.id, NEW.text);
            END""",
            """CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
                INSERT INTO messages_fts (messages_fts, rowid, text) VALUES ('delete', OLD.id, OLD.text);
            END""",
        ),
        postgres=pg_schema.V3,
    ),
    Migration(
        4,
        "memory store: message embeddings for recall by vector; the author's name in message full text",
        (
            # The text index sees what the embedder sees ("author: text"), so "what did Ann say about…"
            # finds Ann's messages by name too.
            "DROP TRIGGER messages_fts_insert",
            "DROP TRIGGER messages_fts_delete",
            "DROP TABLE messages_fts",
            """CREATE VIRTUAL TABLE messages_fts USING fts5(
                author_name, text, content='messages', content_rowid='id', tokenize='porter unicode61')""",
            "INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')",
            """CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
                INSERT INTO messages_fts (rowid, author_name, text) VALUES (NEW.id, NEW.author_name, NEW.text);
            END""",
            """CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
                INSERT INTO messages_fts (messages_fts, rowid, author_name, text)
                VALUES ('delete', OLD.id, OLD.author_name, OLD.text);
            END""",
            # One row per embedded message of a user-persona pair; ``model`` names the embedder, so a
            # change of embedder shows which vectors are stale. Rows go with their message.
            """CREATE TABLE message_vectors (
                message_id INTEGER PRIMARY KEY REFERENCES messages(id),
                user_id INTEGER NOT NULL,
                persona TEXT NOT NULL,
                model TEXT NOT NULL,
                vector BLOB NOT NULL)""",
            "CREATE INDEX message_vectors_by_pair ON message_vectors (user_id, persona, model)",
            """CREATE TRIGGER message_vectors_delete AFTER DELETE ON messages BEGIN
                DELETE FROM message_vectors WHERE message_id = OLD.id;
            END""",
            "CREATE INDEX memory_items_by_pair_model ON memory_items (pair_id, embedding_model)",
        ),
        postgres=pg_schema.V4,
    ),
    Migration(
        5,
        "scale-out: one running job per key, fleet-wide periodic runs, instance locks, live processes",
        (
            # A crash could in theory have left two running jobs of one key: requeue all but the oldest.
            "UPDATE jobs SET status = 'queued', locked_by = '', lease_until = 0 WHERE status = 'running'"
            " AND id NOT IN (SELECT min(id) FROM jobs WHERE status = 'running' GROUP BY key)",
            *pg_schema.V5,
            "ALTER TABLE personas ADD COLUMN ts_config TEXT NOT NULL DEFAULT 'simple'",
        ),
        postgres=(
            "UPDATE jobs SET status = 'queued', locked_by = '', lease_until = 0 WHERE status = 'running'"
            " AND id NOT IN (SELECT min(id) FROM jobs WHERE status = 'running' GROUP BY key)",
            *pg_schema.V5,
        ),
    ),
    Migration(
        6,
        "ids are never reused, not even after the newest rows are deleted",
        (),
        postgres=(),  # identity columns never hand out an id twice
        sqlite_autoincrement=("users", "personas", "channels", "messages", "summaries", "jobs", "llm_calls",
                              "reply_stats", "cortex_pairs", "cortex_versions", "cortex_runs", "memory_items"),
    ),
    Migration(
        7,
        "personas as data: language and settings per persona, versioned soul sections, guidelines and rules",
        _sqlite_fork(pg_schema.V7),
        postgres=pg_schema.V7,
    ),
    Migration(
        8,
        "lore: knowledge entries a persona shares with everyone, entering the prompt by keyword or search",
        _sqlite_fork(pg_schema.V8),
        postgres=pg_schema.V8,
    ),
    Migration(9, "a privacy scope per memory item (private or shared)", pg_schema.V9),
    Migration(10, "what shaped each reply: the ids of the memory, lore and messages in its prompt",
              _sqlite_fork(pg_schema.V10), postgres=pg_schema.V10),
    Migration(11, "which platform message shows which stored reply", _sqlite_fork(pg_schema.V11),
              postgres=pg_schema.V11),
    Migration(12, "incognito stretches per user and persona", _sqlite_fork(pg_schema.V12), postgres=pg_schema.V12),
    Migration(13, "an audit row for every skill execution", _sqlite_fork(pg_schema.V13), postgres=pg_schema.V13),
    Migration(14, "web page logins: single-use links and sessions (hashes only)", _sqlite_fork(pg_schema.V14),
              postgres=pg_schema.V14),
    Migration(
        15,
        "one id counter per table (migration 6 left two rows per rebuilt table in SQLite's sqlite_sequence);"
        " memory items found by the message they came from (a deleted message archives them)",
        (  # SQLite reads and advances the first row of a name: it keeps the larger value, the other goes
            "UPDATE sqlite_sequence SET seq = (SELECT max(s.seq) FROM sqlite_sequence AS s"
            " WHERE s.name = sqlite_sequence.name)",
            "DELETE FROM sqlite_sequence WHERE rowid NOT IN (SELECT min(rowid) FROM sqlite_sequence GROUP BY name)",
            SOURCE_INDEX,
        ),
        postgres=(SOURCE_INDEX,),  # identity columns keep their own sequences
    ),
    Migration(
        16,
        "SQLite: which items a full-text match may return, read from an index instead of the rows",
        (VISIBLE_INDEX,),
        postgres=(),  # the text query filters on the table's own columns there (and its rows are read anyway)
    ),
    Migration(
        17,
        "memory items found by their time within a pair (an import checks each of its items against them)",
        ("CREATE INDEX memory_items_by_pair_time ON memory_items (pair_id, created_at)",),
    ),
    Migration(
        18,
        "messages found by their time within a channel (an import checks each of its messages against them)",
        ("CREATE INDEX messages_by_channel_time ON messages (channel_id, created_at)",),
    ),
    Migration(
        19,
        "messages of channels that lost messages are embedded again: each was embedded with the one before it,"
        " and one deleted before this release (a forget-me, an incognito stretch, retention) may live on in it",
        # A channel's seq runs 1, 2, 3 … in id order until a message in it is deleted (it is recounted then).
        ("DELETE FROM message_vectors WHERE message_id IN (SELECT id FROM messages WHERE channel_id IN ("
         "SELECT channel_id FROM (SELECT channel_id, seq, ROW_NUMBER() OVER (PARTITION BY channel_id ORDER BY id)"
         " AS n FROM messages) AS numbered WHERE seq <> n))",),
    ),
    Migration(
        20,
        "a pair's pinned items read from an index of their own: every reply reads them, and the pair's index"
        " made it go through all of the pair's items (60 ms a reply at 100k items)",
        (PINNED_INDEX,),
    ),
    Migration(
        21,
        "the newest jobs of a key, runs of a pair and replies to a user in a channel read from indexes in their"
        " order: a statement's generic plan on PostgreSQL (its sixth run on) walked every job, every run or all"
        " of the user's messages instead (7.6, 1.6 and 42 ms at 40k jobs, 20k runs and 100k messages)",
        ("CREATE INDEX jobs_by_key_id ON jobs (key, id)",
         "CREATE INDEX cortex_runs_by_pair_id ON cortex_runs (pair_id, id)",
         "CREATE INDEX messages_by_channel_user ON messages (channel_id, user_id, id)"),
    ),
    Migration(
        22,
        "the embedding backlog read from indexes: with nothing to embed, each backfill run (every minute) read"
        " every memory item, and on SQLite every message's vector, to find none (0.15 and 0.11 s at 100k);"
        " PostgreSQL: a pair's newest matching items found by walking back through its live ones",
        (BACKLOG_INDEX, "CREATE INDEX message_vectors_by_message_model ON message_vectors (message_id, model)"),
        # PostgreSQL's anti-join of the messages' backlog does not read the vectors (35-50 ms at 100k). Its
        # search of a pair's newest items walks its live ones (SQLite's goes by memory_items_visible).
        postgres=(BACKLOG_INDEX, "CREATE INDEX memory_items_live ON memory_items (pair_id, id)"
                                 " WHERE archived_at IS NULL AND superseded_by IS NULL"),
    ),
    Migration(23, "ended incognito stretches, kept a while: a message sent in one and stored after its end goes too",
              _sqlite_fork(pg_schema.V23), postgres=pg_schema.V23),
    Migration(24, "the tokens of forgotten users' cortex updates, without names: the bot's daily budget counts them",
              _sqlite_fork(pg_schema.V24), postgres=pg_schema.V24),
    Migration(25, "which message each reply answers: a message deleted on its platform takes its reply along",
              ("ALTER TABLE messages ADD COLUMN reply_to INTEGER", REPLY_INDEX),
              postgres=("ALTER TABLE messages ADD COLUMN reply_to BIGINT", REPLY_INDEX)),
    Migration(26, "forgotten users' use of the per-user daily limits, under a digest of their key: forget-me in a"
                  " loop no longer lifts a skill's daily calls or a pair's cortex budget",
              _sqlite_fork(pg_schema.V26), postgres=pg_schema.V26),
    Migration(27, "who wrote in a channel after their messages there are gone: forget-me still finds its summaries",
              _sqlite_fork(pg_schema.V27), postgres=pg_schema.V27),
    Migration(28, "PostgreSQL: the words inside e-mail addresses, host names, paths and versions are searchable",
              (), postgres=pg_schema.V28),
    Migration(29, "PostgreSQL: and those inside brackets or quotes (<https://…>, a name <mail@…>)",
              (), postgres=pg_schema.V29),
    Migration(30, "wordings whose correction was archived are archived too: they counted against the item limit",
              (_ORPHANED_WORDINGS.format(now="(julianday('now') - 2440587.5) * 86400.0"),),
              postgres=(_ORPHANED_WORDINGS.format(now="extract(epoch FROM clock_timestamp())"),)),
    Migration(31, "the answer an update round reserved, kept apart: a process killed during the round no longer"
                  " leaves it counted against the daily budgets",
              ("ALTER TABLE cortex_runs ADD COLUMN reserved_output INTEGER NOT NULL DEFAULT 0",),
              postgres=("ALTER TABLE cortex_runs ADD COLUMN reserved_output BIGINT NOT NULL DEFAULT 0",)),
    Migration(32, "PostgreSQL: each user's rate limits counted across the processes sharing the database",
              (), postgres=pg_schema.V32),
    Migration(33, "which confirmation offers the undo of what was remembered, for whom: a ❌ on one sent before a"
                  " restart undid nothing", _sqlite_fork(pg_schema.V33), postgres=pg_schema.V33),
    Migration(34, "the model calls by their time: the daily upkeep's deletion of old ones and the page's last 14 days"
                  " read the whole table", (LLM_CALLS_BY_TIME,), postgres=(LLM_CALLS_BY_TIME,)),
)
