"""Scale-out on one PostgreSQL: jobs/s and replies/s with 1, 2 and 4 bot processes sharing the database.

Each process count gets a fresh database and its own set of real bot processes (subprocesses of this
script, ``--child``), each a full ``bot.app.App`` started as ``cortexbot run`` starts it (workers,
scheduler, fleet heartbeats), with the Anthropic provider pointed at the fake LLM server of
``tests/fakes/llm_server.py`` (real HTTP on 127.0.0.1, run by this script) that answers every call
after a fixed latency (``--latency-ms``, default 50) with a short text (which is also an acceptable
rolling summary). Two phases, one after the other, on the same processes:

* **jobs**: once every process is up, ``--jobs`` summary jobs (one per channel; each channel holds
  ``--history`` messages, of which those left out of the history window are folded into a summary:
  window query, evicted-message pages, one LLM call, the summary row, an audit row) are enqueued in
  one transaction; the processes' real ``WorkerPool``s (``[jobs] concurrency`` workers each,
  ``--job-concurrency``) take them with ``FOR UPDATE SKIP LOCKED``. Printed: jobs/s over all of them
  (from the enqueue to the last one done) and over the middle 80 % (10 % → 90 % done, without the
  ramp: a process's idle workers learn of jobs enqueued by another process only at their next poll,
  ``[jobs] poll_seconds`` = 1 s), and how they were spread over the processes.
* **replies**: each process runs ``--conversations`` conversations at once, each a user in a DM of
  its own (seeded with ``--conversation-history`` messages, default 200) sending its next message as
  soon as the previous reply is complete, through the real reply path (``ConversationCore.reply``
  streaming from the fake LLM; stores, window, summary, memory recall by full text, reply stats, tier
  observers; the jobs these replies cause run in the background as in a real bot). Printed: replies/s
  in a ``--duration`` s window after ``--warmup`` s, reply latency p50/p95 (including the model's
  latency), and the jobs that ran meanwhile.

Per row: the ceiling the model's latency alone allows (processes × workers or conversations ÷
latency), the speed-up against 1 process, and the CPU used in the window by the bot processes, by
PostgreSQL (its backends, from /proc; only for the temporary server) and by this script (mostly the
fake LLM server), against the machine's cores. The curve flattens where the cores are used up.

The memory embedder is off by default (``--embedder none``): the e5 embedder costs ~20 ms of CPU per
message, which on this 2-core machine would measure the embedder, not the database; ``--embedder
default`` turns it on (each process then also embeds in the background).

    python bench/scaleout.py [--storage postgres|postgresql://…] [--processes 1 2 4] [--latency-ms 50]
        [--jobs 400] [--job-concurrency 2] [--conversations 8] [--conversation-history 200] [--duration 15]
        [--warmup 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.storage_targets import Target, Targets, parse_targets  # noqa: E402
from bot.app import App  # noqa: E402
from bot.config import parse_config  # noqa: E402
from bot.ports import IncomingMessage  # noqa: E402
from bot.summary import JOB_KIND as SUMMARY_JOB  # noqa: E402
from tests.fakes.llm_server import FakeLLMServer, FakeResponse, RecordedRequest  # noqa: E402

ANSWER = "They talked about the garden, the tomatoes and the late frost; nothing else is open."
LINES = [
    "I planted three kinds of tomatoes this spring and the cherry ones are doing best.",
    "The weather was great, so we walked along the river for two hours after lunch.",
    "My sister visits next week; she wants to see the new greenhouse and the bees.",
    "Do you think the late frost will hurt the beans, or are they strong enough by now?",
]
KEY_ENV = "CORTEXBOT_SCALEOUT_KEY"
MARK = "@@"  # a child's protocol lines on stdout start with this


def child_config(args: argparse.Namespace, url: str, llm_url: str) -> dict[str, Any]:
    return {
        "storage": {"url": url, "pool_size": args.pool_size},
        "llm": {"provider": "anthropic", "base_url": llm_url, "api_key_env": KEY_ENV, "model": "fake-model-large",
                "max_retries": 0},
        "jobs": {"concurrency": args.job_concurrency},
        "memory": {"embedder": args.embedder},
        "terminal": {"enabled": False},
    }


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


# -- the child: one bot process ------------------------------------------------------------------------


def say(kind: str, **fields: Any) -> None:
    print(MARK + json.dumps({"kind": kind, **fields}), flush=True)


async def read_command() -> list[str]:
    line: str = await asyncio.to_thread(sys.stdin.readline)
    return line.split()


async def child(args: argparse.Namespace) -> None:
    config = parse_config(child_config(args, args.url, args.llm_url))
    app = App(config)
    await app.start(workers=True)  # as `cortexbot run`: workers, scheduler, heartbeats
    done: dict[str, int] = {}
    for kind, handler in list(app.workers.handlers.items()):
        async def counted(job: Any, handler: Any = handler, kind: str = kind) -> None:
            await handler(job)
            done[kind] = done.get(kind, 0) + 1
        app.workers.handlers[kind] = counted
    try:
        say("ready", pid=os.getpid())
        while True:
            command = await read_command()
            if not command or command[0] == "quit":
                break
            if command[0] == "snapshot":  # jobs phase: the orchestrator watches the database
                say("snapshot", done=dict(done), cpu=time.process_time())
            elif command[0] == "replies":
                start, stop = float(command[1]), float(command[2])
                say("replies", **await run_conversations(app, args, start, stop, done))
    finally:
        await app.stop(grace=5)


async def run_conversations(app: App, args: argparse.Namespace, start: float, stop: float, done: dict[str, int]
                            ) -> dict[str, Any]:
    """``--conversations`` users talking at once until ``stop``; counts replies completed in [start, stop]."""
    latencies: list[float] = []
    count = 0
    errors = 0
    cpu_at_start: list[float] = []
    jobs_at: list[int] = []

    async def conversation(n: int) -> None:
        nonlocal count, errors
        user = f"scale{args.index}u{n}"
        i = 0
        while time.monotonic() < stop:
            text = f"{LINES[i % len(LINES)]} ({user}, message {i})"
            i += 1
            message = IncomingMessage("console", f"dm-{user}", user, user.title(), text, is_dm=True)
            began = time.monotonic()
            try:
                await app.core.reply(message).text()
            except Exception:
                errors += 1
                await asyncio.sleep(0.05)
                continue
            ended = time.monotonic()
            if start <= ended <= stop:
                count += 1
                latencies.append((ended - began) * 1000)

    async def mark() -> None:
        await asyncio.sleep(max(start - time.monotonic(), 0))
        cpu_at_start.append(time.process_time())
        jobs_at.append(sum(done.values()))
        await asyncio.sleep(max(stop - time.monotonic(), 0))
        cpu_at_start.append(time.process_time())
        jobs_at.append(sum(done.values()))

    marker = asyncio.create_task(mark())
    await asyncio.gather(*(conversation(n) for n in range(args.conversations)))
    await marker
    return {"count": count, "errors": errors, "latencies": latencies, "cpu": cpu_at_start[1] - cpu_at_start[0],
            "jobs": jobs_at[1] - jobs_at[0]}


# -- the orchestrator ----------------------------------------------------------------------------------


class Child:
    def __init__(self, args: argparse.Namespace, index: int, url: str, llm_url: str) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", "--index", str(index), "--url", url,
                   "--llm-url", llm_url, "--job-concurrency", str(args.job_concurrency),
                   "--conversations", str(args.conversations), "--embedder", args.embedder,
                   "--pool-size", str(args.pool_size)]
        env = {**os.environ, KEY_ENV: "fake-key"}
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     stderr=subprocess.DEVNULL if not args.verbose else None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def receive(self, kind: str, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bot process {self.proc.pid} ended (exit {self.proc.poll()})")
            if line.startswith(MARK):
                message: dict[str, Any] = json.loads(line[len(MARK):])
                if message["kind"] == kind:
                    return message
        raise TimeoutError(f"bot process {self.proc.pid} sent no {kind!r} in {timeout:.0f} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def postgres_cpu(postmaster: int | None) -> float:
    """CPU seconds used so far by the PostgreSQL server's processes (the postmaster and its children)."""
    if postmaster is None:
        return float("nan")
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid, ppid = int(entry), int(fields[1])
        if pid == postmaster or ppid == postmaster:
            total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick
    return total


def own_cpu() -> float:
    return time.process_time()


def machine_cpu() -> float:
    """CPU seconds the whole machine has been busy (all cores; /proc/stat), to tell other load apart."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


async def seed(url: str, args: argparse.Namespace, processes: int) -> tuple[list[int], float]:
    """Channels with ``--history`` messages each (one per job), and the DM of every conversation the
    processes will hold with ``--conversation-history`` messages already (so a reply's cost does not
    depend on how many replies its conversation got in the window), loaded with COPY; returns the
    job channels' ids."""
    config = parse_config({"storage": {"url": url}, "memory": {"embedder": "none"}, "terminal": {"enabled": False}})
    from bench.core_overhead import InstantProvider

    app = App(config, llm=InstantProvider())
    await app.start(workers=False)
    started = time.perf_counter()
    try:
        channels = []
        rows = []
        now = time.time() - 10 * args.jobs * args.history
        counts: list[tuple[int, int]] = []
        owners = [(f"seed{n}", args.history, True) for n in range(args.jobs)]
        owners += [(f"scale{index}u{n}", args.conversation_history, False)
                   for index in range(processes) for n in range(args.conversations)]
        for name, history, job in owners:
            user = await app.storage.upsert_user(f"console:{name}", name.title())
            channel = await app.storage.upsert_channel(f"console:dm-{name}", f"dm-{name}", is_dm=True)
            if job:
                channels.append(channel.id)
            counts.append((history, channel.id))
            for i in range(history):
                role = "user" if i % 2 == 0 else "assistant"
                text = f"{LINES[i % len(LINES)]} ({name}, message {i})" if role == "user" else ANSWER
                rows.append((channel.id, user.id, "Cora", role, name.title() if role == "user" else "Cora", text,
                             app.estimator.raw_count(text), i + 1, now))
                now += 1
        db: Any = app.storage.db
        async with db.pool.acquire() as conn, conn.transaction():
            await conn.copy_records_to_table("messages", records=rows, columns=(
                "channel_id", "user_id", "persona", "role", "author_name", "text", "token_count", "seq", "created_at"))
            await conn.executemany("UPDATE channels SET message_count = $1 WHERE id = $2", counts)
        await db.pool.execute("VACUUM ANALYZE")
        return channels, time.perf_counter() - started
    finally:
        await app.stop()


async def enqueue_jobs(url: str, channels: list[int]) -> float:
    """All summary jobs in one transaction (as ``Storage.enqueue_job`` writes them); returns when committed."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        now = time.time()
        async with conn.transaction():
            await conn.executemany(
                "INSERT INTO jobs (kind, key, payload, status, max_attempts, run_after, created_at, updated_at)"
                " VALUES ($1, $2, $3, 'queued', 5, $4, $4, $4)",
                [(SUMMARY_JOB, f"channel:{c}", json.dumps({"channel_id": c, "persona": "Cora"}), now)
                 for c in channels])
        return time.monotonic()
    finally:
        await conn.close()


async def jobs_phase(url: str, children: list[Child], channels: list[int], postmaster: int | None
                     ) -> dict[str, Any]:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for child_ in children:
            child_.send("snapshot")
        before = [c.receive("snapshot") for c in children]
        cpu0 = (postgres_cpu(postmaster), own_cpu(), machine_cpu())
        started = await enqueue_jobs(url, channels)
        total = len(channels)
        marks: dict[float, float] = {}
        finished = started
        while True:
            row = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE status IN ('done', 'failed')),"
                " count(*) FILTER (WHERE status = 'failed'), count(*) FILTER (WHERE attempts > 1)"
                " FROM jobs WHERE kind = $1", SUMMARY_JOB)
            finished = time.monotonic()
            for share in (0.1, 0.9):
                if share not in marks and row[0] >= share * total:
                    marks[share] = finished
            if row[0] >= total:
                break
            if finished - started > 600:
                raise TimeoutError(f"only {row[0]} of {total} jobs done after 10 minutes")
            await asyncio.sleep(0.02)
        cpu1 = (postgres_cpu(postmaster), own_cpu(), machine_cpu())
        failed, retried = int(row[1]), int(row[2])
        for child_ in children:
            child_.send("snapshot")
        after = [c.receive("snapshot") for c in children]
        elapsed = finished - started
        middle = marks[0.9] - marks[0.1]
        per_process = [a["done"].get(SUMMARY_JOB, 0) - b["done"].get(SUMMARY_JOB, 0)
                       for a, b in zip(after, before, strict=True)]
        return {
            "jobs": total, "seconds": elapsed, "rate": total / elapsed,
            "rate_middle": (0.8 * total) / middle if middle > 0 else float("nan"),
            "failed": failed, "retried": retried, "per_process": per_process,
            "cpu_bots": sum(a["cpu"] - b["cpu"] for a, b in zip(after, before, strict=True)),
            "cpu_postgres": cpu1[0] - cpu0[0], "cpu_orchestrator": cpu1[1] - cpu0[1], "cpu_machine": cpu1[2] - cpu0[2],
        }
    finally:
        await conn.close()


async def replies_phase(args: argparse.Namespace, children: list[Child], postmaster: int | None) -> dict[str, Any]:
    start = time.monotonic() + 0.5 + args.warmup
    stop = start + args.duration
    for child_ in children:
        child_.send(f"replies {start} {stop}")
    await asyncio.sleep(max(start - time.monotonic(), 0))
    cpu0 = (postgres_cpu(postmaster), own_cpu(), machine_cpu())
    await asyncio.sleep(max(stop - time.monotonic(), 0))
    cpu1 = (postgres_cpu(postmaster), own_cpu(), machine_cpu())
    results = [await asyncio.to_thread(c.receive, "replies", args.duration + 120) for c in children]
    latencies = [v for r in results for v in r["latencies"]]
    count = sum(r["count"] for r in results)
    return {
        "replies": count, "seconds": args.duration, "rate": count / args.duration,
        "p50": percentile(latencies, 50), "p95": percentile(latencies, 95),
        "errors": sum(r["errors"] for r in results),
        "per_process": [r["count"] for r in results],
        "jobs_done": sum(r["jobs"] for r in results),
        "cpu_bots": sum(r["cpu"] for r in results),
        "cpu_postgres": cpu1[0] - cpu0[0], "cpu_orchestrator": cpu1[1] - cpu0[1], "cpu_machine": cpu1[2] - cpu0[2],
    }


def postmaster_pid(where: Targets) -> int | None:
    server = where.server
    if server is None:
        return None
    try:
        return int((server.directory / "data" / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


async def measure(args: argparse.Namespace, where: Targets, target: Target, llm_url: str, processes: int
                  ) -> dict[str, Any]:
    url = await where.url(target, f"scaleout_{processes}")
    children: list[Child] = []
    try:
        channels, seed_s = await seed(url, args, processes)
        children = [Child(args, n, url, llm_url) for n in range(processes)]
        started = time.perf_counter()
        for child_ in children:
            await asyncio.to_thread(child_.receive, "ready")
        ready_s = time.perf_counter() - started
        postmaster = None if target.spec != "postgres" else postmaster_pid(where)
        jobs = await jobs_phase(url, children, channels, postmaster)
        replies = await replies_phase(args, children, postmaster)
        print(f"{processes} process(es): seeded {len(channels)} channels in {seed_s:.1f} s, processes up in "
              f"{ready_s:.1f} s; jobs {jobs['rate']:.1f}/s, replies {replies['rate']:.1f}/s", flush=True)
        return {"processes": processes, "jobs": jobs, "replies": replies}
    finally:
        for child_ in children:
            await asyncio.to_thread(child_.close)
        await where.drop(target, url)


def cpu_columns(phase: dict[str, Any]) -> str:
    """Cores busy on average in the window: bot processes, PostgreSQL, this script, the rest of the machine."""
    seconds = phase["seconds"]
    ours = phase["cpu_bots"] + phase["cpu_postgres"] + phase["cpu_orchestrator"]
    other = max(phase["cpu_machine"] - ours, 0.0)
    return (f"{phase['cpu_bots'] / seconds:8.2f} {phase['cpu_postgres'] / seconds:5.2f} "
            f"{phase['cpu_orchestrator'] / seconds:5.2f} {other / seconds:5.2f}")


def report(args: argparse.Namespace, results: list[dict[str, Any]], cores: int) -> None:
    latency = args.latency_ms / 1000
    print()
    print(f"one PostgreSQL, fake LLM answering after {args.latency_ms:g} ms; {args.job_concurrency} job workers and "
          f"{args.conversations} conversations per process; embedder {args.embedder}; {cores} cores")
    print(f"{'procs':>5} | {'jobs/s':>7} {'middle':>7} {'ceiling':>7} {'×1':>5} | {'spread':<16} | "
          f"{'CPU bots':>8} {'pg':>5} {'llm':>5} {'other':>5} | {'fail':>4} {'retry':>5}")
    base = results[0]
    for r in results:
        j = r["jobs"]
        ceiling = r["processes"] * args.job_concurrency / latency
        busy = cpu_columns(j)
        print(f"{r['processes']:>5} | {j['rate']:7.1f} {j['rate_middle']:7.1f} {ceiling:7.0f} "
              f"{j['rate'] / base['jobs']['rate']:5.2f} | {'/'.join(map(str, j['per_process'])):<16} | {busy} | "
              f"{j['failed']:>4} {j['retried']:>5}")
    print("(jobs/s = all jobs / enqueue → last done; middle = 10 % → 90 % done; ceiling = processes × workers ÷ "
          "latency; ×1 = against 1 process; spread = jobs done per process; CPU = cores busy on average: bot "
          "processes, PostgreSQL, this script incl. the fake LLM server, and everything else on the machine)")
    print(f"{'procs':>5} | {'replies/s':>9} {'ceiling':>7} {'×1':>5} | {'p50 ms':>7} {'p95 ms':>7} | "
          f"{'spread':<16} | {'CPU bots':>8} {'pg':>5} {'llm':>5} {'other':>5} | {'jobs':>5} {'errors':>6}")
    for r in results:
        p = r["replies"]
        ceiling = r["processes"] * args.conversations / latency
        busy = cpu_columns(p)
        print(f"{r['processes']:>5} | {p['rate']:9.1f} {ceiling:7.0f} {p['rate'] / base['replies']['rate']:5.2f} | "
              f"{p['p50']:7.1f} {p['p95']:7.1f} | {'/'.join(map(str, p['per_process'])):<16} | {busy} | "
              f"{p['jobs_done']:>5} {p['errors']:>6}")
    print(f"(replies/s in {args.duration:g} s after {args.warmup:g} s of warm-up; ceiling = processes × "
          f"conversations ÷ latency; latency includes the model's {args.latency_ms:g} ms; jobs = background jobs "
          f"the replies caused that ran in the window's processes)")
    for phase in ("jobs", "replies"):
        rates = [r[phase]["rate"] for r in results]
        flat = next((results[n]["processes"] for n in range(1, len(rates)) if rates[n] < rates[n - 1] * 1.15), None)
        gains = ", ".join(f"{results[n - 1]['processes']}→{results[n]['processes']}: ×{rates[n] / rates[n - 1]:.2f}"
                          for n in range(1, len(rates)))
        where = f"flattens at {flat} processes (less than +15 % over the previous step)" if flat else "still rising"
        print(f"{phase}: {gains or 'one point only'}; {where}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default="postgres", help="postgres (a temporary server, default) or a "
                        "postgresql:// URL (each process count gets a database of its own there)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="bot processes (default 1 2 4)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the fake LLM's latency per call (default 50)")
    parser.add_argument("--jobs", type=int, default=400, help="summary jobs per process count (default 400)")
    parser.add_argument("--history", type=int, default=120, help="messages per job's channel (default 120)")
    parser.add_argument("--conversation-history", type=int, default=200,
                        help="messages each conversation holds before the replies phase (default 200)")
    parser.add_argument("--job-concurrency", type=int, default=2, help="[jobs] concurrency per process (default 2)")
    parser.add_argument("--conversations", type=int, default=8, help="conversations at once per process (default 8)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of measured replies (default 15)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of replies before measuring (default 3)")
    parser.add_argument("--embedder", choices=["none", "default"], default="none",
                        help="the memory embedder of the bot processes (default none, see above)")
    parser.add_argument("--pool-size", type=int, default=10, help="[storage] pool_size per process (default 10)")
    parser.add_argument("--verbose", action="store_true", help="show the bot processes' logs")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--llm-url", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        await child(args)
        return
    try:
        targets = parse_targets([args.storage])
    except ValueError as exc:
        parser.error(str(exc))
    if targets[0].kind != "postgres":
        parser.error("scale-out needs PostgreSQL: --storage postgres or a postgresql:// URL")
    cores = os.cpu_count() or 1
    print(f"load average before the run: {os.getloadavg()[0]:.2f} ({cores} cores; other work on the machine skews "
          "figures)")
    print(f"engine: {targets[0].where}")
    latency = args.latency_ms / 1000

    def responder(request: RecordedRequest) -> FakeResponse:
        return FakeResponse.text(ANSWER, delay=latency, input_tokens=900, output_tokens=20)

    results = []
    with FakeLLMServer() as llm, Targets(targets) as where:
        llm.responder = responder
        for processes in args.processes:
            results.append(await measure(args, where, targets[0], llm.anthropic_url, processes))
            llm.reset()
            llm.responder = responder
    report(args, results, cores)
    print(f"load average after the run: {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps({"latency_ms": args.latency_ms, "job_concurrency": args.job_concurrency,
                          "conversations": args.conversations, "results": [
                              {"processes": r["processes"], "jobs": r["jobs"],
                               "replies": {k: v for k, v in r["replies"].items()}} for r in results]}))


if __name__ == "__main__":
    asyncio.run(main())
