"""Scale-out on one PostgreSQL: several bot processes share the job queue, the periodic upkeep and the chat.

* The fast tests run two worker pools / several fleets in one event loop (each with its own connection
  pool): fenced completion after a lease takeover, one running job per key, one periodic run per period.
* The slow test starts real OS processes: three ``tests/fleet_worker.py`` workers (the real JobQueue,
  WorkerPool, Scheduler and Fleet) and three ``cortexbot chat`` processes with piped input, all on one
  database; it SIGKILLs the worker that runs a long job while it runs it, and checks the records every
  worker appended (see ``tests/fleet_worker.py``) against the database.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from bot.config import JobsConfig
from bot.fleet import Fleet
from bot.jobs import JobQueue, WorkerPool
from bot.scheduler import Scheduler
from bot.storage import Storage, open_storage
from bot.storage.base import Job
from tests.fakes.llm_server import FakeLLMServer
from tests.fleet_worker import KIND, RECOVER, TICK

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
API_KEY = "sk-test-DO-NOT-LOG-1234567890"

T = TypeVar("T")

FAST = JobsConfig(concurrency=2, max_attempts=3, retry_base_seconds=0.01, retry_max_seconds=0.05, poll_seconds=0.02)


async def until(check: Callable[[], Awaitable[T | None]], timeout: float, what: str, every: float = 0.02) -> T:
    """Poll ``check`` until it returns something other than None/False; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(every)


async def migrated(url: str) -> Storage:
    storage = await open_storage(url, pool_size=4)
    await storage.migrate()
    return storage


# -- fast: in one event loop ----------------------------------------------------------------------


async def test_a_worker_whose_lease_ran_out_cannot_finish_the_job_another_took_over(pg_url: str) -> None:
    store_a, store_b = await migrated(pg_url), await open_storage(pg_url, pool_size=4)
    a_started, a_release, b_started, b_release = (asyncio.Event() for _ in range(4))
    runs: list[tuple[str, int]] = []
    finishes: list[tuple[str, bool]] = []

    def handler(name: str, started: asyncio.Event, release: asyncio.Event):
        async def handle(job: Job) -> None:
            runs.append((name, job.attempts))
            started.set()
            await release.wait()
        return handle

    def observe(name: str, storage: Storage) -> None:
        real = storage.finish_job

        async def finish_job(job_id: int, worker: str | None = None, *, attempt: int | None = None) -> bool:
            ok = await real(job_id, worker, attempt=attempt)
            finishes.append((name, ok))
            return ok
        storage.finish_job = finish_job  # type: ignore[method-assign]

    observe("a", store_a)
    observe("b", store_b)
    class Stalled:  # A believes its renewals went through (a clock that ran slow, say): in the database its
        # lease (0.5 s) runs out all the same, so the fence is all that stands between A and B's run
        def __getattr__(self, name: str) -> object:
            return getattr(store_a, name)

        async def renew_lease(self, *args: object, **kwargs: object) -> bool:
            return True

    # A's one worker loop is busy with the job, so it cannot take it back once it is requeued.
    pool_a = WorkerPool(JobQueue(store_a, FAST.model_copy(update={"lease_seconds": 0.5, "concurrency": 1})),
                        {"k": handler("a", a_started, a_release)}, pid_checks=False,
                        storage=Stalled())  # type: ignore[arg-type]
    pool_b = WorkerPool(JobQueue(store_b, FAST.model_copy(update={"lease_seconds": 30.0})),
                        {"k": handler("b", b_started, b_release)}, pid_checks=False)
    try:
        await pool_a.start()
        job = await pool_a.queue.enqueue("k", "pair:1", {})
        assert job is not None
        await asyncio.wait_for(a_started.wait(), 10)
        await pool_b.start()

        async def taken_over() -> bool:
            await pool_b.recover()  # what the fleet's requeue-abandoned-jobs upkeep runs
            return b_started.is_set()

        await until(taken_over, 10, "B to take the job over after A's lease ran out")
        held = await store_b.get_job(job.id)
        assert held is not None and held.status == "running" and held.locked_by == pool_b.worker_id
        assert held.attempts == 2 and "interrupted" in held.last_error

        # A's handler now returns: its completion is fenced off, and so is every other change by A.
        a_release.set()
        async def a_finished() -> bool:
            return bool(finishes)

        await until(a_finished, 10, "A's finish")
        assert finishes == [("a", False)]
        assert not await store_a.finish_job(job.id, pool_a.worker_id)
        assert not await store_a.renew_lease(job.id, pool_a.worker_id, 30)
        assert not await store_a.release_job(job.id, pool_a.worker_id)
        assert not await store_a.fail_job(job.id, "late", pool_a.worker_id)
        still = await store_b.get_job(job.id)
        assert still is not None and still.status == "running" and still.locked_by == pool_b.worker_id

        b_release.set()

        async def done() -> Job | None:
            current = await store_b.get_job(job.id)
            return current if current is not None and current.status == "done" else None

        finished = await until(done, 10, "B to finish the job")
        assert finished.attempts == 2
        assert runs == [("a", 1), ("b", 2)]
        assert finishes == [("a", False), ("a", False), ("b", True)]
    finally:
        a_release.set()
        b_release.set()
        await pool_a.stop(1)
        await pool_b.stop(1)
        await store_a.close()
        await store_b.close()


async def test_a_completion_after_the_lease_ran_out_is_refused_even_before_a_takeover(pg_url: str) -> None:
    storage = await migrated(pg_url)
    try:
        job = await storage.enqueue_job("k", "pair:1", {}, 3)
        assert job is not None
        claimed = await storage.claim_job("w:1:a", ["k"], 0.2)
        assert claimed is not None and claimed.id == job.id
        assert await storage.claim_job("w:2:b", ["k"], 30) is None  # running: nobody else takes it
        expires = time.time() + 0.2

        async def expired() -> bool:
            return time.time() > expires + 0.05

        await until(expired, 5, "the lease to run out")
        assert not await storage.finish_job(job.id, "w:1:a")
        current = await storage.get_job(job.id)
        assert current is not None and current.status == "running"
        # the upkeep then requeues it, and another worker completes it
        assert [j.id for j in await storage.recover_jobs()] == [job.id]
        again = await storage.claim_job("w:2:b", ["k"], 30)
        assert again is not None and again.id == job.id and again.attempts == 2
        assert not await storage.finish_job(job.id, "w:1:a")
        assert await storage.finish_job(job.id, "w:2:b")
        done = await storage.get_job(job.id)
        assert done is not None and done.status == "done"
    finally:
        await storage.close()


async def test_two_pools_on_one_database_run_each_job_once_and_one_per_key_at_a_time(pg_url: str) -> None:
    stores = [await migrated(pg_url), await open_storage(pg_url, pool_size=4)]
    config = FAST.model_copy(update={"concurrency": 3})
    active: Counter[str] = Counter()
    overlaps: list[str] = []
    runs: list[int] = []

    async def handle(job: Job) -> None:
        active[job.key] += 1
        if active[job.key] > 1:
            overlaps.append(job.key)
        runs.append(job.id)
        await asyncio.sleep(0.01)
        active[job.key] -= 1

    pools = [WorkerPool(JobQueue(store, config), {"k": handle}, pid_checks=False) for store in stores]
    try:
        for pool in pools:
            await pool.start()
        ids = []
        for i in range(60):
            job = await pools[i % 2].queue.enqueue("k", f"key-{i % 4}", {"n": i}, dedupe=False)
            assert job is not None
            ids.append(job.id)

        async def all_done() -> bool:
            return await stores[0].count_jobs(("queued", "running")) == 0

        await until(all_done, 30, "60 jobs to finish")
        assert sorted(runs) == sorted(ids)  # each ran once
        assert overlaps == []
        jobs = await stores[0].list_jobs(limit=100)
        assert len(jobs) == 60 and {(j.status, j.attempts) for j in jobs} == {("done", 1)}
    finally:
        for pool in pools:
            await pool.stop(1)
        for store in stores:
            await store.close()


async def test_claim_period_lets_one_process_of_the_fleet_run_each_period(pg_url: str) -> None:
    stores = [await migrated(pg_url), await open_storage(pg_url, pool_size=4), await open_storage(pg_url, pool_size=4)]
    fleets = [Fleet(store) for store in stores for _ in range(2)]
    try:
        wins = await asyncio.gather(*(fleet.claim_period("upkeep", 3600) for fleet in fleets))
        assert sum(wins) == 1
        again = await asyncio.gather(*(fleet.claim_period("upkeep", 3600) for fleet in fleets))
        assert not any(again)
        # other names are independent
        assert await fleets[1].claim_period("other", 3600)

        # Period boundaries, on the clock the claim is given: due 5 % early (timers drift), never sooner.
        repo, t0 = stores[0].fleet, 1_000_000.0
        assert await repo.claim_period("p", 100, "x", now=t0)
        assert not await repo.claim_period("p", 100, "y", now=t0 + 90)
        assert not await repo.claim_period("p", 100, "y", now=t0 + 94.9)
        assert await repo.claim_period("p", 100, "y", now=t0 + 95.1)
        assert not await repo.claim_period("p", 100, "x", now=t0 + 100)
        late = await asyncio.gather(*(repo.claim_period("p", 100, f"o{i}", now=t0 + 300) for i in range(8)))
        assert sum(late) == 1
    finally:
        for store in stores:
            await store.close()


async def test_schedulers_gated_by_two_fleets_run_a_periodic_job_once_per_period(pg_url: str) -> None:
    stores = [await migrated(pg_url), await open_storage(pg_url, pool_size=4)]
    period = 0.2
    gates: list[tuple[str, float, float, bool]] = []
    schedulers = []
    for index, store in enumerate(stores):
        fleet = Fleet(store)

        async def gate(name: str, seconds: float, fleet: Fleet = fleet) -> bool:
            t0 = time.time()
            won = await fleet.claim_period(name, seconds)
            gates.append((name, t0, time.time(), won))
            return won

        async def job(index: int = index) -> None:
            pass

        scheduler = Scheduler(gate=gate)
        scheduler.every(period, "tick", job)
        schedulers.append(scheduler)
    try:
        for scheduler in schedulers:
            scheduler.start()

        async def enough() -> bool:
            return sum(won for *_, won in gates) >= 8

        await until(enough, 20, "8 periodic runs")
    finally:
        for scheduler in schedulers:
            await scheduler.aclose()
        for store in stores:
            await store.close()
    wins = [(t0, t1) for _, t0, t1, won in gates if won]
    assert_once_per_period(wins, period)
    runs = [s.jobs["tick"].runs for s in schedulers]
    assert sum(runs) == len(wins)
    assert sum(s.jobs["tick"].elsewhere for s in schedulers) == len(gates) - len(wins)


def assert_once_per_period(wins: list[tuple[float, float]], period: float) -> None:
    """``wins`` are (before, after) the gate call of each successful claim. The claim's own clock reading
    lies between the two, and two successful claims are at least ``period`` minus the 5 % slack apart."""
    wins = sorted(wins, key=lambda w: w[0] + w[1])
    slack = min(period * 0.05, 5.0)
    for (a0, _a1), (_b0, b1) in zip(wins, wins[1:], strict=False):
        assert b1 - a0 >= period - slack - 0.001, f"two runs {b1 - a0:.3f} s apart with a period of {period} s"


# -- slow: real processes -------------------------------------------------------------------------

WORKERS = ("w1", "w2", "w3")
LEASE = 2.0
PERIOD = 1.0
JOB_SECONDS = 0.2
N_JOBS, N_KEYS = 300, 30
CHAT_USERS = ("ann", "bob", "cyd")
CHAT_MESSAGES = 15


@dataclass
class Execution:
    proc: str
    job: int
    key: str
    attempt: int
    hold: bool
    start: float
    end: float | None = None
    finished: bool | None = None  # what the fenced finish_job answered; None: never asked


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    # A process being killed may leave no partial line (each line is one write), but be safe about it.
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def executions(proc: str, records: list[dict[str, Any]]) -> list[Execution]:
    result: list[Execution] = []
    open_by_job: dict[int, Execution] = {}
    ended_by_job: dict[int, Execution] = {}
    for r in records:
        if r["ev"] == "start":
            assert r["job"] not in open_by_job, f"{proc} started job {r['job']} twice at once"
            ex = open_by_job[r["job"]] = Execution(proc, r["job"], r["key"], r["attempt"], r["hold"], r["t"])
            result.append(ex)
        elif r["ev"] == "end":
            ex = open_by_job.pop(r["job"])
            ex.end = r["t"]
            ended_by_job[r["job"]] = ex
        elif r["ev"] == "finish":
            ended = ended_by_job.pop(r["job"])
            assert ended.finished is None
            ended.finished = r["ok"]
    return result


def chat_config(tmp_path: Path, url: str, server: FakeLLMServer) -> Path:
    path = tmp_path / "chat.toml"
    path.write_text("\n".join([
        "[storage]", f'url = "{url}"', "pool_size = 4",
        "[llm]", 'provider = "anthropic"', 'model = "test-model"', f'base_url = "{server.anthropic_url}"',
        'api_key_env = "CB_TEST_API_KEY"', "max_retries = 0", "timeout_seconds = 60",
        "[history]", "history_tokens = 400", "summary_tokens = 200", "summary_trigger = 20",
        "[jobs]", "poll_seconds = 0.1", "retry_base_seconds = 0.05", "shutdown_grace_seconds = 3",
    ]) + "\n")
    return path


def start_worker(name: str, url: str, records: Path, logs: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tests.fleet_worker", "--url", url, "--name", name, "--records", str(records),
            "--lease", str(LEASE), "--period", str(PERIOD), "--job-seconds", str(JOB_SECONDS),
            "--concurrency", "3", "--hold-seconds", "60"]
    with open(logs / f"{name}.log", "wb") as log:
        return subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})


def start_chat(user: str, config: Path, logs: Path) -> subprocess.Popen[bytes]:
    """A ``cortexbot chat`` reading a pipe that :func:`feed_chats` writes to."""
    env = {**os.environ, "CB_TEST_API_KEY": API_KEY, "OPENBLAS_NUM_THREADS": "1"}
    with open(logs / f"chat-{user}.out", "wb") as out, open(logs / f"chat-{user}.err", "wb") as err:
        return subprocess.Popen([str(BIN / "cortexbot"), "--config", str(config), "chat", "--user", user],
                                cwd=logs, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)


async def feed_chats(chats: dict[str, subprocess.Popen[bytes]], every: float) -> None:
    """Type one message to each chat every ``every`` seconds (while the workers run), then end the input."""
    for i in range(CHAT_MESSAGES):
        for user, proc in chats.items():
            assert proc.stdin is not None
            proc.stdin.write(f"{user} message {i}\n".encode())
            proc.stdin.flush()
        await asyncio.sleep(every)
    for proc in chats.values():
        assert proc.stdin is not None
        proc.stdin.close()  # end of input: the chat answers every line, then exits


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


@pytest.mark.slow
async def test_three_bot_processes_share_one_postgres(pg_url: str, tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    records, logs = tmp_path / "records", tmp_path / "logs"
    records.mkdir()
    logs.mkdir()
    storage = await migrated(pg_url)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    chats: dict[str, subprocess.Popen[bytes]] = {}

    def recs(name: str) -> list[dict[str, Any]]:
        return read_records(records / f"{name}.jsonl")

    def check_alive() -> None:
        for name, proc in procs.items():
            if name != victim and proc.poll() is not None:
                pytest.fail(f"worker {name} exited with {proc.returncode}:\n{log_tail(logs / f'{name}.log')}")

    victim: str | None = None
    feeder: asyncio.Task[None] | None = None
    began = time.time()
    try:
        for name in WORKERS:
            procs[name] = start_worker(name, pg_url, records, logs)
        config = chat_config(tmp_path, pg_url, fake_llm)
        for user in CHAT_USERS:
            chats[user] = start_chat(user, config, logs)

        async def ready() -> bool:
            check_alive()
            return all(any(r["ev"] == "ready" for r in recs(name)) for name in WORKERS)

        await until(ready, 30, "the three workers to start")
        worker_ids = {name: next(r["worker"] for r in recs(name) if r["ev"] == "ready") for name in WORKERS}

        # Every process (workers and chats) announces itself with a heartbeat once it is up.
        async def all_up() -> bool:
            check_alive()
            for user, proc in chats.items():
                if proc.poll() is not None:
                    pytest.fail(f"chat {user} exited early:\n{log_tail(logs / f'chat-{user}.err')}")
            live = await Fleet(storage).live()
            return set(worker_ids.values()) <= {p.id for p in live} and len(live) == len(WORKERS) + len(CHAT_USERS)

        await until(all_up, 40, "the workers and the chats to be up", every=0.1)
        # The chats get their messages while the workers run, through the kill and the takeover.
        feeder = asyncio.create_task(feed_chats(chats, 0.4))

        queue = JobQueue(storage, JobsConfig())
        ids: list[int] = []
        for i in range(N_JOBS):
            # Job 0 runs long on its first attempt: whoever takes it is killed in the middle of it.
            job = await queue.enqueue(KIND, f"key-{i % N_KEYS:02d}", {"n": i, "hold": i == 0}, dedupe=False)
            assert job is not None
            ids.append(job.id)

        async def hold_running() -> tuple[str, dict[str, Any]] | None:
            check_alive()
            for name in WORKERS:
                rs = recs(name)
                starts = [r for r in rs if r["ev"] == "start" and r["hold"]]
                if starts and not any(r["ev"] == "end" and r["job"] == starts[0]["job"] for r in rs):
                    return name, starts[0]
            return None

        victim, hold = await until(hold_running, 20, "a worker to start the long job")

        # Its lease is renewed while it runs: let it outlive two leases, then check nobody took it over.
        async def outlived_two_leases() -> bool:
            check_alive()
            return time.time() > hold["t"] + 2 * LEASE + 0.5

        await until(outlived_two_leases, 10, "two leases to pass")
        hold_execs = [r for name in WORKERS for r in recs(name) if r["ev"] == "start" and r["job"] == hold["job"]]
        assert len(hold_execs) == 1, "the long job was taken over while its worker was alive"
        victim_recs = recs(victim)
        assert not any(r["ev"] == "end" and r["job"] == hold["job"] for r in victim_recs)

        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)
        killed_at = time.time()  # the victim stopped at or before this moment

        async def all_done() -> int | None:
            check_alive()
            row = await storage.db.fetch_one(
                "SELECT count(*) FROM jobs WHERE kind = ? AND status = 'done'", (KIND,))
            return int(row[0]) if row and int(row[0]) == N_JOBS else None

        await until(all_done, 45, f"all {N_JOBS} jobs to be done", every=0.1)
        all_done_at = time.time()
        await asyncio.wait_for(feeder, 30)

        async def chats_exited() -> bool:
            return all(proc.poll() is not None for proc in chats.values())

        await until(chats_exited, 40, "the chats to exit", every=0.1)
        for name, proc in procs.items():
            if name != victim:
                proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            if name != victim:
                try:
                    code = proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"worker {name} did not stop on SIGTERM:\n{log_tail(logs / f'{name}.log')}")
                assert code == 0, f"worker {name} exited with {code}:\n{log_tail(logs / f'{name}.log')}"
                assert recs(name)[-1]["ev"] == "stopped"
        jobs = {j.id: j for j in await storage.list_jobs(limit=10 * N_JOBS) if j.kind == KIND}
        # Clean stops removed their heartbeat rows; the killed worker's stays until it is old enough.
        assert {p.id for p in await Fleet(storage).live()} == {worker_ids[victim]}
        messages = await storage.db.fetch_all(
            "SELECT c.key, m.role, m.text, m.seq, m.created_at FROM messages AS m"
            " JOIN channels AS c ON c.id = m.channel_id ORDER BY c.key, m.seq")
    finally:
        if feeder is not None and not feeder.done():
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        for proc in [*procs.values(), *chats.values()]:
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        await storage.close()
    elapsed = time.time() - began

    # -- jobs: all done, each completed exactly once, no two of one key at a time -----------------
    assert sorted(jobs) == sorted(ids) and {j.status for j in jobs.values()} == {"done"}
    by_proc = {name: executions(name, recs(name)) for name in WORKERS}
    survivors = [name for name in WORKERS if name != victim]
    for name in survivors:
        for ex in by_proc[name]:
            assert ex.end is not None and ex.finished is not None, f"{name} left {ex} unfinished at a clean stop"
            assert ex.finished, f"{name}'s completion of job {ex.job} was refused: a live worker lost its lease"
    interrupted = [ex for ex in by_proc[victim] if ex.end is None]
    unconfirmed = [ex for ex in by_proc[victim] if ex.end is not None and ex.finished is None]
    assert any(ex.job == hold["job"] for ex in interrupted)
    assert all(ex.finished for ex in by_proc[victim] if ex.finished is not None)

    all_execs = [ex for execs in by_proc.values() for ex in execs]
    per_job: dict[int, list[Execution]] = defaultdict(list)
    for ex in all_execs:
        per_job[ex.job].append(ex)
    for job_id in ids:
        execs = per_job[job_id]
        completed = [ex for ex in execs if ex.finished]
        if len(completed) != 1:
            # Killed between its finish committing and its record: done by the victim, run by no one else.
            assert not completed and len(execs) == 1 and execs[0] in unconfirmed, (job_id, execs)
        extra = jobs[job_id].attempts - len(execs)
        # (the victim may have died after claiming a job and before recording its start)
        assert extra == 0 or (extra == 1 and all(ex.start >= killed_at for ex in execs)), (jobs[job_id], execs)

    for ex in interrupted:
        again = [other for other in per_job[ex.job] if other is not ex]
        assert len(again) == 1 and again[0].finished and again[0].proc != victim, (ex, again)
        # taken over only once the victim was gone and its lease (renewed up to its death) had run out
        assert again[0].start >= killed_at, (ex, again)
        assert again[0].attempt == ex.attempt + 1 and jobs[ex.job].attempts == 2
        assert "interrupted" in jobs[ex.job].last_error

    per_key: dict[str, list[tuple[float, float, Execution]]] = defaultdict(list)
    for ex in all_execs:
        per_key[ex.key].append((ex.start, ex.end if ex.end is not None else killed_at, ex))
    assert len(per_key) == N_KEYS
    for key, spans in per_key.items():
        spans.sort(key=lambda s: s[0])
        for (_s1, e1, a), (s2, _e2, b) in zip(spans, spans[1:], strict=False):
            assert s2 >= e1, f"two jobs of {key} ran at once: {a} and {b}"

    # -- periodic: once per period across the fleet, and repeatedly -----------------------------
    gate_recs = [(name, r) for name in WORKERS for r in recs(name) if r["ev"] == "gate"]
    for periodic, period in ((TICK, PERIOD), (RECOVER, LEASE)):
        wins = [(r["t0"], r["t1"]) for _, r in gate_recs if r["name"] == periodic and r["won"]]
        assert_once_per_period(wins, period)
    tick_wins = sorted(r["t1"] for _, r in gate_recs if r["name"] == TICK and r["won"])
    ticks = sorted(r["t"] for name in WORKERS for r in recs(name) if r["ev"] == "tick")
    # (the victim may have been killed between winning a period and recording its run)
    assert 0 <= len(tick_wins) - len(ticks) <= 1 and len(ticks) >= 5
    assert ticks[-1] - ticks[0] >= 4 * PERIOD
    # each period somebody ran it (3 timers a period between the processes, one of them killed)
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert max(gaps) < 3 * PERIOD, gaps

    # -- chats: every user message stored, each with its reply, in order --------------------------
    for user, proc in chats.items():
        out = (logs / f"chat-{user}.out").read_text()
        assert proc.returncode == 0, log_tail(logs / f"chat-{user}.err")
        for i in range(CHAT_MESSAGES):
            assert f"echo: {user} message {i}" in out
    stored: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    for row in messages:
        stored[str(row[0])].append((str(row[1]), str(row[2]), int(row[3])))
    assert len(stored) == len(CHAT_USERS)
    for user in CHAT_USERS:
        (channel,) = [key for key in stored if key.startswith(f"console:{user}/")]
        expected = []
        for i in range(CHAT_MESSAGES):
            expected += [("user", f"{user} message {i}"), ("assistant", f"echo: {user} message {i}")]
        assert [(role, text) for role, text, _ in stored[channel]] == expected
        assert [seq for *_, seq in stored[channel]] == list(range(1, 2 * CHAT_MESSAGES + 1))

    during = sum(1 for row in messages if str(row[1]) == "user" and killed_at <= float(row[4]) <= all_done_at)
    print(f"\nfleet: {N_JOBS} jobs, killed {victim} with {len(interrupted)} job(s) in progress; all done "
          f"{all_done_at - killed_at:.1f} s after the kill; {len(ticks)} ticks; {during} user messages stored "
          f"between the kill and the end of the jobs; {elapsed:.1f} s in all")


async def test_a_clean_stop_releases_a_lock_a_stop_during_hold_left_taken(db_url: str) -> None:
    """A start refused right after the Matrix adapter began (the web port taken) or a SIGTERM during it could stop
    ``hold`` after its row was written and before it was recorded: the stop released only recorded locks, and the
    next start was refused for a minute as "already served by another running process"."""
    from bot.fleet import LockHeld

    storage = await migrated(db_url)
    try:
        first, second = Fleet(storage), Fleet(storage)
        await first.hold("matrix:@bot:example.org", "the Matrix account")
        await storage.fleet.acquire_lock("matrix:@other:example.org", first.process_id, 60)  # (as a stopped hold)
        with pytest.raises(LockHeld, match="already served by another running process"):
            await second.hold("matrix:@other:example.org", "the Matrix account @other")
        await first.leave()
        await second.hold("matrix:@other:example.org", "the Matrix account @other")
        await second.hold("matrix:@bot:example.org", "the Matrix account")
        await second.leave()
    finally:
        await storage.close()


async def test_periodic_runs_and_locks_stamped_by_a_clock_that_was_far_ahead_do_not_block_for_ever(
    db_url: str,
) -> None:
    # A machine that booted with its clock a year ahead, then was set right by NTP (or a process on a machine
    # whose clock is wrong): its stamps lie in the future, and the upkeep and the lock must not wait for them.
    storage = await migrated(db_url)
    try:
        repo, now, year = storage.fleet, time.time(), 365 * 86_400.0
        assert await repo.claim_period("upkeep", 60, "wrong-clock", now=now + year)
        assert await repo.claim_period("upkeep", 60, "right-clock", now=now)
        assert not await repo.claim_period("upkeep", 60, "other", now=now + 1)  # still once per period
        assert not await repo.claim_period("upkeep", 60, "other", now=now + 30)
        # a lock whose expiry a clock a year ahead set (its holder is gone) is free
        assert await repo.acquire_lock("matrix:@bot:example.org", "wrong-clock", year + 60) is None
        assert await repo.acquire_lock("matrix:@bot:example.org", "right-clock", 60) is None
        assert await repo.acquire_lock("matrix:@bot:example.org", "other", 60) == "right-clock"
    finally:
        await storage.close()


async def test_a_machine_whose_clock_runs_an_hour_ahead_goes_by_the_database_servers_clock(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # Two machines share one PostgreSQL; B's clock runs an hour ahead (no NTP). A's live lease, lock, period
    # and heartbeat must mean to B what they mean to A: B goes by the server's clock, not its own.
    store_a, store_b = await migrated(pg_url), await open_storage(pg_url, pool_size=4)
    try:
        job = await store_a.enqueue_job("k", "pair:1", {}, 3)
        assert job is not None
        claimed = await store_a.claim_job("a", ["k"], 300)
        assert claimed is not None and claimed.id == job.id
        assert await store_a.fleet.acquire_lock("matrix:@bot:example.org", "a", 300) is None
        assert await store_a.fleet.claim_period("upkeep", 300, "a")
        await store_a.fleet.heartbeat("process-a", "host-a", 1, {}, time.time())

        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 3600)  # from here on, this is machine B

        assert await store_b.recover_jobs() == []
        held = await store_b.get_job(job.id)
        assert held is not None and held.status == "running" and held.locked_by == "a"
        assert (await store_b.fleet.queue_stats()).lapsed == 0
        assert await store_b.fleet.acquire_lock("matrix:@bot:example.org", "b", 300) == "a"
        assert not await store_b.fleet.claim_period("upkeep", 300, "b")
        assert [p.id for p in await store_b.fleet.live_processes()] == ["process-a"]
        # a job B queues is due by the server's clock
        later = await store_b.enqueue_job("k", "pair:2", {}, 3)
        assert later is not None and abs(later.run_after.timestamp() - real_time()) < 5
        assert "clock is 3600" in caplog.text and "ahead of the database server's" in caplog.text
    finally:
        await store_a.close()
        await store_b.close()


async def test_status_counts_a_process_up_by_the_database_servers_clock(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A process on a machine whose clock is 30 minutes slow showed "up 30 min" in `cortexbot status` right after
    its start: its start was stamped by its own clock, and status counts from it by the server's."""
    from bot.cli import _fleet_status, _print_status
    from bot.config import parse_config

    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - 1800)  # this machine: 30 min slow
    storage = await migrated(pg_url)
    try:
        fleet = Fleet(storage)
        await fleet.heartbeat()
        monkeypatch.undo()  # (status asked on a machine whose clock is right)
        processes, queue, now = await _fleet_status(parse_config({"storage": {"url": pg_url}}))
        assert [p.id for p in processes] == [fleet.process_id]
        assert abs(now - processes[0].started_at) < 60, now - processes[0].started_at
        _print_status(processes, queue, now)
        shown = capsys.readouterr().out
        up = re.search(r" up (\d+) s, seen", shown)
        assert up is not None and int(up[1]) < 60, shown
    finally:
        await storage.close()


async def test_old_process_rows_are_pruned_by_the_upkeep_not_by_reading_the_fleet(pg_url: str) -> None:
    """Listing the live processes deleted the rows of processes gone for a day: `cortexbot status` and a copy
    from a read-only database (a hot standby) ended in the driver's read-only error. The upkeep deletes them."""
    storage = await migrated(pg_url)
    try:
        now = await storage.now()
        for name, seen in (("gone", now - 2 * 86_400), ("stopped", now - 600), ("alive", now)):
            await storage.fleet.heartbeat(name, "host", 1, {}, seen)
            await storage.db.write("UPDATE processes SET last_seen = ? WHERE id = ?", (seen, name))
        assert [p.id for p in await storage.fleet.live_processes()] == ["alive"]
        assert await storage.db.fetch_one("SELECT 1 FROM processes WHERE id = 'gone'") is not None
        assert await storage.fleet.prune_processes() == 1
        assert sorted(str(r[0]) for r in await storage.db.fetch_all("SELECT id FROM processes")) == ["alive", "stopped"]
    finally:
        await storage.close()


async def test_a_users_rate_limits_hold_across_the_processes_of_a_fleet(pg_url: str) -> None:
    """Two processes on one PostgreSQL (a user's mentions in two servers whose shards two processes serve): each
    counted the user's messages and commands on its own, so a user could send the limit times the processes a
    minute. They are counted in the database now, with the wait the limit says."""
    from bot.app import App
    from bot.config import parse_config
    from bot.policy import Inbound
    from bot.ports import IncomingMessage
    from tests.fakes.provider import ScriptedProvider
    from tests.test_router import Sink

    config = parse_config({"storage": {"url": pg_url}, "memory": {"embedder": "none"},
                           "chat": {"rate_limit_per_minute": 3, "command_rate_limit_per_minute": 2,
                                    "edit_interval_seconds": 0.2}})
    async with App(config, llm=ScriptedProvider()) as shard0, App(config, llm=ScriptedProvider()) as shard1:
        for text, allowed, what in (("hello", 3, "messages"), ("!help", 2, "commands")):
            answered, notices = 0, []
            for n in range(8):
                app, guild = (shard0, "guildA") if n % 2 == 0 else (shard1, "guildB")
                sink = Sink()
                said = f"{text} {n}" if what == "messages" else text
                message = IncomingMessage("discord", f"chan-{guild}", "666", "mallory", said, server_id=guild,
                                          mentions_bot=True)
                await app.router.handle(Inbound(message), sink)
                answered += bool(sink.messages) or any("faster" not in r.text for r in sink.public)
                notices += [r.text for r in sink.public if "faster" in r.text]
            assert answered == allowed, (what, answered)
            assert notices and all(f"You are sending {what} faster" in t for t in notices), notices
            assert all(55 <= int(re.findall(r"wait (\d+) s", t)[0]) <= 60 for t in notices), notices


async def test_a_rate_limit_the_database_cannot_count_is_counted_by_the_process(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Counted in the database, a user's limit must not fail their message when it cannot be reached: this process
    counts it alone then, with the sends it saw counted before. The table holds no user's key, and the upkeep
    deletes the rows of those who sent nothing for a minute."""
    from bot.ratelimit import FleetRateLimiter

    storage = await migrated(pg_url)
    limiter = FleetRateLimiter(2, lambda key, per_minute: storage.rate_limits.count("chat", key, per_minute))
    assert await limiter.check("discord:1") == 0 and await limiter.check("discord:2") == 0
    rows = [str(r[0]) for r in await storage.db.fetch_all("SELECT subject FROM rate_limits")]
    assert len(rows) == 2 and not any("discord" in r for r in rows), rows
    await storage.db.write("UPDATE rate_limits SET updated_at = updated_at - 61 WHERE subject = ?", (rows[1],))
    assert await storage.rate_limits.prune() == 1
    await storage.close()  # (the database gone)
    assert await limiter.check("discord:1") == 0  # the second send: this process saw the first
    assert 55 < await limiter.check("discord:1") <= 60
    assert "counted by this process alone while the database cannot count them" in caplog.text
