"""Do cortex updates slow replies down? Reply overhead with 0 and with 50 updates in flight.

The provider answers chat replies instantly (we time the core, not the model) and answers cortex
update calls after a latency (default 1 s per call; real ones take 1-10 s), running the real tool loop: read memory.md,
rewrite it, stop, so every update does real reads, checked writes, new versions and audit rows.
The reply path is timed alone and while 50 pairs are updated continuously (each as soon as its
previous update finishes), alternating the two phases many times in one process, in ABBA
order (alone, loaded, loaded, alone, ...), so that drift of the machine and the growing history hit
both alike. Prints p50/p99 of both and their ratio; the target is ≤ 1.1,
in five runs in a row (``--runs 5``: each a whole measurement in a fresh bot, each printed).

The updates' LLM latency runs on a clock that stands still while the load is paused (:class:`LoadClock`):
pausing parks every update in its LLM call (or before its next update) and resuming lets each go on
with the latency it had left, so the phases can alternate every few dozen replies without a drain or
a ramp in between. The reply path's cost drifts by a factor of two and more over a run (the history and
the full-text index grow, SQLite's files change), far more than the effect measured: with phases of
200 replies, an A/A run strayed up to 9 % at p50 and 15 % at p99 by that drift alone.

    python bench/nonblocking.py [--replies 2000] [--rounds 100] [--updates 50] [--latency-ms 1000] [--runs 5]
        [--no-load] [--load-process]

``--no-load`` times both phases without updates (an A/A run): the ratios it prints are the noise floor of
the measurement on this machine. ``--load-process`` runs the updates in a second process on the same
database (as a worker process of its own would), paused and resumed over a pipe: the measure of how much of
the effect is the updates' work sharing the reply path's process and event loop.
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


class LoadClock:
    """The updates' time: it passes only while the load runs. A paused update's LLM call neither returns
    nor ages; on resuming, each goes on with the latency it had left (timers, not a task per call: only the
    updates waiting to start wake at once). ``parked`` counts the updates waiting here (until their time is
    up, not until they run again) or for their next start."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.running = asyncio.Event()
        self.parked = 0
        self.all_parked = asyncio.Event()
        if not total:
            self.all_parked.set()
        self._stood = 0.0  # real seconds the clock stood still
        self._stopped_at: float | None = 0.0
        self._timers: dict[asyncio.Future[None], tuple[float, asyncio.TimerHandle | None]] = {}

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def now(self) -> float:
        at = self._loop.time() if self._stopped_at is None else self._stopped_at
        return at - self._stood

    def _arm(self, future: asyncio.Future[None], due: float) -> asyncio.TimerHandle:
        return self._loop.call_at(due + self._stood, self._wake, future)

    def _wake(self, future: asyncio.Future[None]) -> None:
        """Its time is up: from now on the update runs (a pause must wait for it), though its task has not yet."""
        if not future.done():
            self.park(-1)
            future.set_result(None)

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = self._loop.create_future()
        due = self.now() + seconds
        self._timers[future] = (due, None if self._stopped_at is not None else self._arm(future, due))
        self.park(+1)
        try:
            await future
        finally:
            _, timer = self._timers.pop(future)
            if not future.done() or future.cancelled():  # (cancelled while waiting: never woken)
                if timer is not None:
                    timer.cancel()
                self.park(-1)

    def park(self, step: int) -> None:
        self.parked += step
        if self.parked == self.total:
            self.all_parked.set()
        else:
            self.all_parked.clear()

    def stop(self) -> None:
        if self._stopped_at is None:
            self._stopped_at = self._loop.time()
            self.running.clear()
            for future, (due, timer) in self._timers.items():
                if timer is not None:
                    timer.cancel()
                self._timers[future] = (due, None)

    def start(self) -> None:
        if self._stopped_at is not None:
            self._stood += self._loop.time() - self._stopped_at
            self._stopped_at = None
            for future, (due, _) in self._timers.items():
                self._timers[future] = (due, self._arm(future, due))
            self.running.set()


class BenchProvider:
    """Instant replies; cortex calls take ``latency`` seconds and walk read → write → stop."""

    name = "bench"

    def __init__(self, latency: float, clock: LoadClock) -> None:
        self.latency = latency
        self.clock = clock
        self.update_calls = 0

    async def complete(self, request: LLMRequest) -> Completion:
        if not any(tool.name == "write_file" for tool in request.tools):  # a chat reply (skills may be offered)
            return Completion(text=REPLY, usage=Usage(0, 20))
        self.update_calls += 1
        await self.clock.sleep(self.latency * random.uniform(0.5, 1.5))
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
    """Every user's pair updated back to back while ``clock`` runs; paused, each waits in the clock."""

    def __init__(self, app: App, users: list[str], clock: LoadClock) -> None:
        self.app = app
        self.users = users
        self.clock = clock
        self.stopping = False
        self.finished = 0
        self.failed: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def _loop(self, user: str) -> None:
        account = await self.app.storage.get_user(f"console:{user}")
        assert account is not None
        pair = await self.app.cortex.store.count_messages(account.id, "Cora", 0)
        settings = (await self.app.cortex.resolver.effective("Cora")).settings
        while True:
            while not self.clock.running.is_set():  # (checked again once woken: a pause may have come first)
                self.clock.park(+1)
                try:
                    await self.clock.running.wait()
                finally:
                    self.clock.park(-1)
            if self.stopping:
                return
            try:
                await self.app.cortex.updater.run(pair, "manual", settings)
            except Exception as exc:  # counted and shown; a task that died would hang the next pause
                self.failed.append(f"{type(exc).__name__}: {exc}")
            else:
                self.finished += 1

    async def start(self) -> None:
        """Start every user's updates, paused (as :meth:`pause` leaves them)."""
        self.tasks = [asyncio.create_task(self._loop(user)) for user in self.users]
        await self.pause()

    async def pause(self) -> None:
        """Stop the clock and wait until every update sits in an LLM call or before its next start."""
        self.clock.stop()
        await self.clock.all_parked.wait()

    async def resume(self) -> None:
        self.clock.start()

    async def stop(self) -> None:
        """Let every update run to its end, and start none after it; ``finished`` counts those before."""
        finished = self.finished
        self.stopping = True
        self.clock.start()
        await asyncio.gather(*self.tasks)
        self.finished = finished


class RemoteLoad:
    """The same load in a process of its own on the same database (``--load-process``): the updates' work
    away from the reply path's event loop and its process. Driven over the child's stdin and stdout."""

    def __init__(self, database: Path, args: argparse.Namespace) -> None:
        self.database = database
        self.args = args
        self.finished = 0
        self.calls = 0
        self.failed: list[str] = []

    async def start(self) -> None:
        self.child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--serve-load", str(self.database), "--updates", str(self.args.updates),
            "--latency-ms", str(self.args.latency_ms), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        await self._said("ready")

    async def _said(self, expected: str) -> str:
        assert self.child.stdout is not None
        line = (await self.child.stdout.readline()).decode().strip()
        if not line.startswith(expected):
            raise RuntimeError(f"the load process said {line!r}, not {expected!r}")
        return line

    async def _ask(self, command: str, answer: str) -> str:
        assert self.child.stdin is not None
        self.child.stdin.write(f"{command}\n".encode())
        await self.child.stdin.drain()
        return await self._said(answer)

    async def pause(self) -> None:
        await self._ask("pause", "parked")

    async def resume(self) -> None:
        await self._ask("start", "started")

    async def stop(self) -> None:
        _, finished, calls, failed, *first = (await self._ask("stop", "done")).split(" ", 4)  # (as UpdateLoad's)
        self.finished, self.calls = int(finished), int(calls)
        self.failed = first * int(failed)
        await self.child.wait()


async def serve_load(args: argparse.Namespace) -> None:
    """The child of :class:`RemoteLoad`: the updates of every bench user's pair, paused and resumed on its
    parent's word (stdin: pause, start, stop; stdout: parked, started, done FINISHED CALLS FAILED FIRST)."""
    clock = LoadClock(args.updates)
    provider = BenchProvider(args.latency_ms / 1000, clock)
    app = await bench_app(Path(args.serve_load), provider)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        load = UpdateLoad(app, [f"user{i}" for i in range(args.updates)], clock)
        await load.start()
        print("ready", flush=True)
        while command := (await reader.readline()).decode().strip():
            if command == "pause":
                await load.pause()
                print("parked", flush=True)
            elif command == "start":
                await load.resume()
                print("started", flush=True)
            elif command == "stop":
                await load.stop()
                first = load.failed[0].replace("\n", " ") if load.failed else ""
                print(f"done {load.finished} {provider.update_calls} {len(load.failed)} {first}", flush=True)
                return
    finally:
        await app.stop()


async def bench_app(database: Path, provider: BenchProvider) -> App:
    """A started bot on the bench's SQLite file: no cooldown or budget holds an update back, and no workers
    of its own (the bench runs the updates)."""
    config = parse_config({
        "storage": {"url": f"sqlite:///{database}"},
        "cortex": {"context_limit": 100_000, "cooldown_seconds": 0, "daily_token_budget": 0,
                   "bot_daily_token_budget": 0},
    })
    app = App(config, llm=provider)
    await app.start(workers=False)
    return app


async def measure(args: argparse.Namespace) -> tuple[list[float], list[float], int, int]:
    """One run in a fresh bot: reply timings alone and loaded, updates finished, update calls."""
    clock = LoadClock(args.updates)
    provider = BenchProvider(args.latency_ms / 1000, clock)
    per_round = max(args.replies // args.rounds, 1)
    alone: list[float] = []
    loaded: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        app = await bench_app(Path(tmp) / "bench.db", provider)
        try:
            users = [f"user{i}" for i in range(args.updates)]
            for user in users:  # each pair needs some conversation to update from
                for i in range(3):
                    msg = IncomingMessage("console", f"dm-{user}", user, user, f"hello {i}, I grow tomatoes")
                    await app.core.reply(msg).text()
            await time_replies(app, 50)  # warm-up
            remote = RemoteLoad(Path(tmp) / "bench.db", args) if args.load_process else None
            load: UpdateLoad | RemoteLoad = UpdateLoad(app, users, clock) if remote is None else remote
            await load.start()
            if not args.no_load:  # every pair mid-update, their calls spread over the latency
                await load.resume()
                await asyncio.sleep(args.latency_ms / 1000 * 1.5)
            # Alternate the phases so that drift hits both alike, in ABBA order (alone, loaded, loaded,
            # alone, ...): the history grows with every reply and the machine's speed drifts, and with
            # "alone" always first each round's loaded phase would always meet the longer history.
            for number in range(args.rounds):
                for phase in ("alone", "loaded") if number % 2 == 0 else ("loaded", "alone"):
                    if phase == "alone" or args.no_load:  # the A/A check: "loaded" timed exactly as "alone"
                        await load.pause()
                        (alone if phase == "alone" else loaded).extend(await time_replies(app, per_round))
                    else:
                        await load.resume()
                        loaded += await time_replies(app, per_round)
            await load.stop()
            if load.failed:  # (their share of the load is missing from the loaded phase: said, not hidden)
                print(f"  {len(load.failed)} updates failed, the first with {load.failed[0]}")
        finally:
            await app.stop()
    return alone, loaded, load.finished, provider.update_calls if remote is None else remote.calls


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replies", type=int, default=2000, help="timed replies per phase (default 2000)")
    parser.add_argument("--rounds", type=int, default=100,
                        help="alternations of the two phases (default 100: 20 replies a phase)")
    parser.add_argument("--updates", type=int, default=50, help="updates in flight at once (default 50)")
    parser.add_argument("--latency-ms", type=float, default=1000.0,
                        help="LLM latency per update call (default 1000; real ones take 1-10 s)")
    parser.add_argument("--runs", type=int, default=1,
                        help="whole measurements one after the other, each in a fresh bot (the goal: 5 in a row)")
    parser.add_argument("--no-load", action="store_true",
                        help="time the second phase without updates too (an A/A run: how far the ratios stray "
                             "from 1.0 by noise alone)")
    parser.add_argument("--load-process", action="store_true",
                        help="run the updates in a second process on the same database, as a worker process would")
    parser.add_argument("--serve-load", metavar="DATABASE", help=argparse.SUPPRESS)  # that process
    args = parser.parse_args()
    if args.serve_load:
        await serve_load(args)
        return
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
