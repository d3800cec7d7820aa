"""What the embedding backfill pays to find its work when there is none, and when there is a little or a lot.

The backfill runs every ``[memory] backfill_seconds`` (a minute) in every bot, and each run first asks the
store for the items and the messages that lack a vector of the current model. Usually there are none, or
the few said since the last run. This fills a database of ``--size`` memory items and as many messages
(half of them users', each with a 384-dimension vector of the model) and times, per engine:

* ``items idle``: :meth:`MemoryRepository.items_to_embed` with every item embedded, against the baseline,
  the statement it ran until now (``... embedding_model != ? ORDER BY id DESC LIMIT ?``), in turn;
* ``items, 10 new``: ten of the newest items without a vector (what a minute of chat leaves);
* ``items, a third old``: a third of them with another model's vector (a new embedder: each batch);
* ``messages idle``: :meth:`MemoryRepository.messages_to_embed` with every message embedded, with the index
  of migration 22 (``message_vectors (message_id, model)``) and, as the baseline, without it.

Each figure is the median of ``--repeat`` calls, the two ways of a pair alternating (ABBA); the ratio is
baseline / now. The machine's load average is printed before and after.

    python bench/backlog.py [--storage sqlite postgres] [--size 100000] [--repeat 9]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bot.storage import Storage, open_storage  # noqa: E402

MODEL = "bench-model"
DIMS = 384
STEP = 5000
# The statement items_to_embed ran until migration 22 (the baseline): it walks the items newest first and,
# with nothing to embed, reads every one of them.
FORMER_ITEMS = ("SELECT id, pair_id, key, content FROM memory_items WHERE archived_at IS NULL"
                " AND embedding_model != {model} ORDER BY id DESC LIMIT ?")


async def fill(storage: Storage, size: int) -> None:
    """``size`` items of one pair, all embedded, and ``size`` messages in 100 channels (every other one a
    user's, embedded). Setup only: rows go in by plain statements, many at a time."""
    db = storage.db
    await db.write("INSERT INTO users (key, display_name, created_at, updated_at) VALUES ('bench:1', 'Ann', 0, 0)")
    user = int((await db.fetch_one("SELECT id FROM users"))[0])  # type: ignore[index]
    await db.write("INSERT INTO cortex_pairs (user_id, persona, cycle_count, created_at) VALUES (?, 'Cora', 0, 0)",
                   (user,))
    pair = int((await db.fetch_one("SELECT id FROM cortex_pairs"))[0])  # type: ignore[index]
    for c in range(100):
        await db.write("INSERT INTO channels (key, name, is_dm, created_at, updated_at) VALUES (?, ?, 0, 0, 0)",
                       (f"bench:{c}", f"c{c}"))
    channels = [int(r[0]) for r in await db.fetch_all("SELECT id FROM channels ORDER BY id")]
    unit = np.ones(DIMS, dtype=np.float32) / np.sqrt(DIMS)
    vector: Any = unit if db.dialect == "postgres" else unit.tobytes()
    for start in range(0, size, STEP):
        span = range(start, min(start + STEP, size))
        async with db.transaction() as tx:
            await tx.executemany(
                "INSERT INTO memory_items (pair_id, category, content, embedding, embedding_model, created_at,"
                " updated_at) VALUES (?, 'fact', ?, ?, ?, ?, ?)",
                [(pair, f"Ann said thing {i} about her garden", vector, MODEL, float(i), float(i)) for i in span])
            await tx.executemany(
                "INSERT INTO messages (channel_id, user_id, persona, role, author_name, text, token_count, seq,"
                " created_at) VALUES (?, ?, 'Cora', ?, 'Ann', ?, 5, ?, ?)",
                [(channels[i % 100], user if i % 2 == 0 else None, "user" if i % 2 == 0 else "assistant",
                  f"message {i} about gardens", i, float(i)) for i in span])
        async with db.transaction() as tx:
            rows = await tx.fetch_all("SELECT m.id FROM messages AS m LEFT JOIN message_vectors AS v"
                                      " ON v.message_id = m.id WHERE m.user_id IS NOT NULL AND v.message_id IS NULL")
            await tx.executemany("INSERT INTO message_vectors (message_id, user_id, persona, model, vector)"
                                 " VALUES (?, ?, 'Cora', ?, ?)", [(int(r[0]), user, MODEL, vector) for r in rows])
    await db.write("ANALYZE")


async def median_ms(call: Callable[[], Awaitable[Any]], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        await call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def pair_of(now: Callable[[], Awaitable[Any]], before: Callable[[], Awaitable[Any]],
                  repeat: int) -> tuple[float, float]:
    """Medians of ``now`` and ``before``, in ABBA order."""
    a1 = await median_ms(now, repeat)
    b1 = await median_ms(before, repeat)
    b2 = await median_ms(before, repeat)
    a2 = await median_ms(now, repeat)
    return (a1 + a2) / 2, (b1 + b2) / 2


def line(engine: str, what: str, now: float, before: float) -> str:
    return f"{engine:<9} {what:<22} now {now:8.2f} ms   before {before:8.2f} ms   ×{before / now:7.1f} faster"


async def measure(engine: str, storage: Storage, size: int, repeat: int) -> list[str]:
    repo, db = storage.memory, storage.db
    model = f"'{MODEL}'" if db.dialect == "postgres" else "?"
    former_params: tuple[Any, ...] = () if db.dialect == "postgres" else (MODEL,)

    async def former(limit: int = 64) -> list[Any]:
        return await db.fetch_all(FORMER_ITEMS.format(model=model), (*former_params, limit))

    out = []
    now, before = await pair_of(lambda: repo.items_to_embed(MODEL, 64), former, repeat)
    out.append(line(engine, "items idle", now, before))
    await db.write("UPDATE memory_items SET embedding_model = '' WHERE id > ?", (size - 10,))
    assert len(await repo.items_to_embed(MODEL, 64)) == len(await former()) == 10
    now, before = await pair_of(lambda: repo.items_to_embed(MODEL, 64), former, repeat)
    out.append(line(engine, "items, 10 new", now, before))
    await db.write("UPDATE memory_items SET embedding_model = 'old' WHERE id % 3 = 0")
    await db.write("ANALYZE")
    now, before = await pair_of(lambda: repo.items_to_embed(MODEL, 64), former, repeat)
    out.append(line(engine, "items, a third old", now, before))
    now = await median_ms(lambda: repo.messages_to_embed(MODEL, 2**62, 256), repeat)
    await db.write("DROP INDEX message_vectors_by_message_model") if db.dialect == "sqlite" else None
    before = await median_ms(lambda: repo.messages_to_embed(MODEL, 2**62, 256), repeat)
    out.append(line(engine, "messages idle", now, before) + ("" if db.dialect == "sqlite" else "  (no such index)"))
    return out


async def run_engine(engine: str, size: int, repeat: int) -> list[str]:
    if engine == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            return await _run(engine, f"sqlite:///{tmp}/bench.db", size, repeat)
    from tests.postgres import PostgresServer

    server = PostgresServer()
    server.start()
    try:
        return await _run(engine, server.create_database("backlog"), size, repeat)
    finally:
        server.stop()


async def _run(engine: str, url: str, size: int, repeat: int) -> list[str]:
    storage = await open_storage(url)
    try:
        await storage.migrate()
        await fill(storage, size)
        return await measure(engine, storage, size, repeat)
    finally:
        await storage.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--size", type=int, default=100_000, help="memory items, and as many messages (100000)")
    parser.add_argument("--repeat", type=int, default=9, help="calls per median (9)")
    args = parser.parse_args()
    print(f"{args.size:,} items and {args.size:,} messages, {DIMS}-dimension vectors; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    for engine in args.storage:
        for text in await run_engine(engine, args.size, args.repeat):
            print(text, flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
