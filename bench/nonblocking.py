"""Do cortex updates slow replies down? Reply overhead with 0 and with 50 updates in flight.

The provider answers chat replies instantly (we time the core, not the model) and answers cortex
update calls after a latency (default 1 s per call; real ones take 1-10 s), running the real tool loop: read memory.md,
rewrite it, stop, so every update does real reads, checked writes, new versions and audit rows.
The reply path is timed alone and while 50 pairs are updated continuously (each as soon as its
previous update finishes), alternating the two phases over several rounds in one process, in ABBA
order (alone, loaded, loaded, alone, ...), so that drift of the machine and the growing history hit
both alike. Prints p50/p99 of both and their ratio; the target is ≤ 1.1,
in five runs in a row (``--runs 5``: each a whole measurement in a fresh bot, each printed).

    python bench/nonblocking.py [--replies 2000] [--rounds 10] [--updates 50] [--latency-ms 1000] [--runs 5]
        [--no-load]

``--no-load`` times both phases without updates (an A/A run): the ratios it prints are the noise floor of
the measurement on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bot.app import App  # noqa: E402
from bot.config import parse_config  # noqa: E402
from bot.llm.base import (  # noqa: E402
    Completion,
    LLMRequest,
    StreamEnd,
    StreamEvent,
    TextDelta,
    ToolCall,
    Usage,
)
from bot.ports import IncomingMessage  # noqa: E402

TARGET = 1.1
REPLY = "That sounds lovely. Tell me more about the tomatoes — did the late frost hurt them?"


class BenchProvider:
    """Instant replies; cortex calls take ``latency`` seconds and walk read → write → stop."""

    name = "bench"

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.update_calls = 0

    async def complete(self, request: LLMRequest) -> Completion:
        if not any(tool.name == "write_file" for tool in request.tools):  # a chat reply (skills may be offered)
            return Completion(text=REPLY, usage=Usage(0, 20))
        self.update_calls += 1
        await asyncio.sleep(self.latency * random.uniform(0.5, 1.5))
        last = request.messages[-1]
        if last.role == "user":
            call = ToolCall("r", "read_file", {"filename": "memory.md"})
            return Completion(text="", tool_calls=(call,), usage=Usage(900, 20), stop_reason="tool_use")
        if last.tool_call_id == "r":
            content = f"# My memories\n\n- update {self.update_calls}: the tomatoes survived the frost.\n"
            call = ToolCall("w", "write_file", {"filename": "memory.md", "content": content})
            return Completion(text="", tool_calls=(call,), usage=Usage(1000, 60), stop_reason="tool_use")
        return Completion(text="", usage=Usage(1100, 5))

    async def stream(self, request: LLMRequest) -> AsyncIterator[StreamEvent]:
        completion = await self.complete(request)
        yield TextDelta(completion.text)
        yield StreamEnd(completion)

    async def list_models(self) -> list[str]:
        return ["bench"]

    async def aclose(self) -> None:
        return None


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def time_replies(app: App, count: int) -> list[float]:
    timings = []
    for i in range(count):
        message = IncomingMessage("console", "bench", "bench", "Bench", f"message {i} about the garden", is_dm=True)
        started = time.perf_counter()
        await app.core.reply(message).text()
        timings.append((time.perf_counter() - started) * 1000)
    return timings


class UpdateLoad:
    """``count`` pairs updated back to back while ``running`` is set; ``idle`` once none is in flight."""

    def __init__(self, app: App, users: list[str]) -> None:
        self.app = app
        self.users = users
        self.running = asyncio.Event()
        self.stopping = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.finished = 0
        self.tasks: list[asyncio.Task[None]] = []

    async def _loop(self, user: str) -> None:
        account = await self.app.storage.get_user(f"console:{user}")
        assert account is not None
        pair = await self.app.cortex.store.count_messages(account.id, "Cora", 0)
        settings = (await self.app.cortex.resolver.effective("Cora")).settings
        while True:
            await self.running.wait()
            if self.stopping:
                return
            self.in_flight += 1
            self.idle.clear()
            try:
                await self.app.cortex.updater.run(pair, "manual", settings)
            finally:
                self.in_flight -= 1
                if not self.in_flight:
                    self.idle.set()
            self.finished += 1

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._loop(user)) for user in self.users]

    async def pause(self) -> None:
        self.running.clear()
        await self.idle.wait()

    async def stop(self) -> None:
        self.stopping = True
        self.running.set()
        await asyncio.gather(*self.tasks)


async def measure(args: argparse.Namespace) -> tuple[list[float], list[float], int, int]:
    """One run in a fresh bot: reply timings alone and loaded, updates finished, update calls."""
    provider = BenchProvider(args.latency_ms / 1000)
    per_round = max(args.replies // args.rounds, 1)
    alone: list[float] = []
    loaded: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = parse_config({
            "storage": {"url": f"sqlite:///{Path(tmp) / 'bench.db'}"},
            "cortex": {"context_limit": 100_000, "cooldown_seconds": 0, "daily_token_budget": 0,
                       "bot_daily_token_budget": 0},
        })
        app = App(config, llm=provider)
        await app.start(workers=False)
        try:
            users = [f"user{i}" for i in range(args.updates)]
            for user in users:  # each pair needs some conversation to update from
                for i in range(3):
                    msg = IncomingMessage("console", f"dm-{user}", user, user, f"hello {i}, I grow tomatoes")
                    await app.core.reply(msg).text()
            await time_replies(app, 50)  # warm-up
            load = UpdateLoad(app, users)
            load.start()
            # Alternate the phases so that drift hits both alike, in ABBA order (alone, loaded, loaded,
            # alone, ...): the history grows with every reply and the machine's speed drifts, and with
            # "alone" always first each round's loaded phase would always meet the longer history.
            for number in range(args.rounds):
                for phase in ("alone", "loaded") if number % 2 == 0 else ("loaded", "alone"):
                    if phase == "alone":
                        await load.pause()
                        alone += await time_replies(app, per_round)
                    elif args.no_load:  # the A/A check: "loaded" timed exactly as "alone"
                        await load.pause()
                        loaded += await time_replies(app, per_round)
                    else:
                        if not load.running.is_set():
                            load.running.set()
                            await asyncio.sleep(args.latency_ms / 1000 * 1.5)  # every pair mid-update
                        loaded += await time_replies(app, per_round)
            finished = load.finished
            await load.stop()
        finally:
            await app.stop()
    return alone, loaded, finished, provider.update_calls


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replies", type=int, default=2000, help="timed replies per phase (default 2000)")
    parser.add_argument("--rounds", type=int, default=10, help="alternations of the two phases (default 10)")
    parser.add_argument("--updates", type=int, default=50, help="updates in flight at once (default 50)")
    parser.add_argument("--latency-ms", type=float, default=1000.0,
                        help="LLM latency per update call (default 1000; real ones take 1-10 s)")
    parser.add_argument("--runs", type=int, default=1,
                        help="whole measurements one after the other, each in a fresh bot (the goal: 5 in a row)")
    parser.add_argument("--no-load", action="store_true",
                        help="time the second phase without updates too (an A/A run: how far the ratios stray "
                             "from 1.0 by noise alone)")
    args = parser.parse_args()
    print(f"LLM latency per update call: {args.latency_ms:.0f} ms; {args.rounds} alternating rounds per run; "
          f"load average before: {os.getloadavg()[0]:.2f}"
          + ("; A/A run: the second phase has no updates either" if args.no_load else ""))
    within = 0
    for run in range(1, args.runs + 1):
        alone, loaded, finished, calls = await measure(args)
        a50, a99 = percentile(alone, 50), percentile(alone, 99)
        l50, l99 = percentile(loaded, 50), percentile(loaded, 99)
        ok = l50 / a50 <= TARGET and l99 / a99 <= TARGET
        within += ok
        second = "again alone (A/A)" if args.no_load else f"with {args.updates} updates in flight"
        print(f"run {run}: replies alone p50 {a50:6.2f} ms p99 {a99:6.2f} ms ({len(alone)}); {second} "
              f"p50 {l50:6.2f} ms p99 {l99:6.2f} ms ({finished} updates, {calls} calls); "
              f"ratio p50 ×{l50 / a50:.2f} p99 ×{l99 / a99:.2f} {'PASS' if ok else 'MISS'}")
    print(f"runs with both ratios ≤ {TARGET}: {within} of {args.runs}; load average after: {os.getloadavg()[0]:.2f}")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    asyncio.run(main())
