"""What the memory search's query embedding costs a reply, and what taking it off the critical path saves.

A real bot (SQLite, the default offline embedder multilingual-e5-small, an instant in-process model
from ``bench/core_overhead.py``) answers a DM user who has ``--items`` memory items and ``--history``
past messages, all really embedded during setup. Each reply is timed from ``ConversationCore.reply``
to its end (the model answers at once, so this is the core's own cost, memory search included).
Every reply asks a different question (no query vector can come from the cache).

Three ways are measured in the same process, interleaved reply by reply so that load changes on the
machine hit all three alike:

* ``before``: the query embedded on one thread, only when the search asks for it (the previous way);
* ``threads``: on the query embedder's threads (two on a machine with two cores), still on demand;
* ``early``: as the bot runs now: two threads, started the moment the message arrives
  (``ReplyPreparer``), while the message is stored and the prompt is built.

Printed: p50/p95/p99 per way and the ratios against ``before``; the machine's load average before
and after. ``--json`` prints one JSON object last.

    python bench/reply_path.py [--replies 150] [--items 300] [--history 400] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.core_overhead import InstantProvider  # noqa: E402
from bot.app import App  # noqa: E402
from bot.config import parse_config  # noqa: E402
from bot.ports import IncomingMessage  # noqa: E402
from cortex.memory.embedders import E5SmallEmbedder  # noqa: E402

WAYS = ("before", "threads", "early")
WARMUP = 10
PEOPLE = ["Mia", "Jonas", "Lena", "Tom", "Aylin", "Sam", "Noor", "Felix"]
PLACES = ["Lyon", "Hamburg", "Porto", "Kyoto", "Graz", "Oslo", "Leeds", "Bari"]
THINGS = ["tomatoes", "the violin", "bouldering", "sourdough", "chess", "watercolours", "running", "pottery"]


def fact(n: int) -> str:
    return (f"{PEOPLE[n % 8]} moved to {PLACES[(n // 8) % 8]} in {2010 + n % 13} and took up "
            f"{THINGS[(n // 64) % 8]} there (note {n}).")


def question(n: int) -> str:
    return (f"Do you remember when {PEOPLE[n % 8]} went to {PLACES[(n * 3) % 8]} and what they started "
            f"doing there, was it {THINGS[(n * 5) % 8]}? I mean the time around {1990 + n}.")


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def setup(app: App, items: int, history: int) -> None:
    """Ann's items and DM history, all embedded (setup, not timed)."""
    user = await app.storage.upsert_user("console:ann", "Ann")
    channel = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
    pair = (await app.cortex.store.count_messages(user.id, "Cora", 0)).id
    for n in range(items):
        await app.cortex.memory.remember(pair, fact(n))
    for n in range(history):
        role: Literal["user", "assistant"] = "user" if n % 2 == 0 else "assistant"
        author = "Ann" if role == "user" else "Cora"
        text = fact(n + items) if role == "user" else "How lovely, tell me more about it."
        await app.storage.add_message(channel.id, user.id, "Cora", role, author, text, 20)
    embeddings = app.cortex.embeddings
    assert embeddings is not None
    while (await embeddings.backfill(max_seconds=600)).more:
        pass


async def one_reply(app: App, way: str, n: int, one_thread: E5SmallEmbedder, threads: Any) -> float:
    embeddings = app.cortex.embeddings
    assert embeddings is not None
    embeddings.query_embedder = one_thread if way == "before" else threads
    app.core.preparers = [app.cortex.knowledge] if way == "early" else []
    message = IncomingMessage("console", "dm-ann", "ann", "Ann", question(n), is_dm=True)
    started = time.perf_counter()
    await app.core.reply(message).text()
    return (time.perf_counter() - started) * 1000


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        config = parse_config({"storage": {"url": f"sqlite:///{Path(folder) / 'bench.db'}"},
                               "memory": {"query_timeout_seconds": 30}})
        app = App(config, llm=InstantProvider())
        await app.start(workers=False)
        try:
            started = time.perf_counter()
            await setup(app, args.items, args.history)
            print(f"setup: {args.items} items and {args.history} messages stored and embedded in "
                  f"{time.perf_counter() - started:.0f} s")
            embeddings = app.cortex.embeddings
            assert embeddings is not None
            threads = embeddings.query_embedder
            one_thread = E5SmallEmbedder(threads=1)
            one_thread.embed_query(["warm-up"])
            timings: dict[str, list[float]] = {way: [] for way in WAYS}
            load_before = os.getloadavg()
            for n in range(WARMUP + args.replies):
                for k, way in enumerate(WAYS):
                    elapsed = await one_reply(app, way, n * len(WAYS) + k, one_thread, threads)
                    if n >= WARMUP:
                        timings[way].append(elapsed)
            load_after = os.getloadavg()
        finally:
            await app.stop()
    return {"timings": timings, "load_before": load_before, "load_after": load_after,
            "query_threads": getattr(threads, "threads", None)}


def report(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    timings: dict[str, list[float]] = measured["timings"]
    print(f"load average before {measured['load_before'][0]:.2f}, after {measured['load_after'][0]:.2f}; "
          f"{args.replies} replies per way after {WARMUP} warm-up rounds; query threads "
          f"{measured['query_threads']}")
    figures: dict[str, dict[str, float]] = {}
    for way in WAYS:
        values = timings[way]
        figures[way] = {q: percentile(values, float(q[1:])) for q in ("p50", "p95", "p99")}
        f = figures[way]
        print(f"{way:<8} reply p50 {f['p50']:6.2f} ms   p95 {f['p95']:6.2f} ms   p99 {f['p99']:6.2f} ms")
    base = figures["before"]
    ratios = {way: {q: figures[way][q] / base[q] for q in base} for way in WAYS[1:]}
    for way, r in ratios.items():
        print(f"ratio {way}/before: p50 ×{r['p50']:.2f}   p95 ×{r['p95']:.2f}   p99 ×{r['p99']:.2f}")
    return {"figures": figures, "ratios": ratios, "load_before": measured["load_before"],
            "load_after": measured["load_after"], "replies": args.replies}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replies", type=int, default=150, help="timed replies per way (default 150)")
    parser.add_argument("--items", type=int, default=300, help="Ann's memory items (default 300)")
    parser.add_argument("--history", type=int, default=400, help="past messages in her DM (default 400)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.replies < 10:
        parser.error("--replies must be at least 10")
    summary = report(args, await measure(args))
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
