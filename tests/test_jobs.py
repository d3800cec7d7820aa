from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import pytest

from bot.config import JobsConfig
from bot.jobs import JobQueue, WorkerPool, worker_is_dead
from bot.llm.errors import LLMBadRequest, LLMRateLimited
from bot.storage import Storage
from bot.storage.base import Job

FAST = JobsConfig(concurrency=3, max_attempts=3, retry_base_seconds=0.01, retry_max_seconds=0.05, poll_seconds=0.05)


async def _wait_status(storage: Storage, job_id: int, status: str, timeout: float = 5.0) -> Job:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        job = await storage.get_job(job_id)
        assert job is not None
        if job.status == status:
            return job
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {job_id} never became {status}: {await storage.get_job(job_id)}")


async def test_job_runs_and_finishes(storage: Storage) -> None:
    seen: list[dict] = []

    async def handler(job: Job) -> None:
        seen.append(job.payload)

    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": handler})
    await pool.start()
    job = await queue.enqueue("k", "a", {"x": 1})
    assert job is not None
    await _wait_status(storage, job.id, "done")
    assert seen == [{"x": 1}]
    await pool.stop()


async def test_transient_errors_are_retried_then_succeed(storage: Storage) -> None:
    calls = 0

    async def flaky(job: Job) -> None:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise LLMRateLimited("429 from server")

    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": flaky})
    await pool.start()
    job = await queue.enqueue("k", "a", {})
    done = await _wait_status(storage, job.id, "done")
    assert calls == 3 and done.attempts == 3
    await pool.stop()


async def test_a_database_locked_a_moment_by_another_process_is_tried_again(storage: Storage, tmp_path) -> None:
    """A handler that met SQLite's "database is locked" (a write lock held past the busy timeout) failed for good
    at its first attempt."""
    import sqlite3

    holder = sqlite3.connect(tmp_path / "held.db", isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        sqlite3.connect(tmp_path / "held.db", timeout=0).execute("INSERT INTO t VALUES (1)")
    except sqlite3.OperationalError as exc:
        locked = exc
    finally:
        holder.close()
    calls = 0

    async def meets_the_lock(job: Job) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise locked

    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": meets_the_lock})
    await pool.start()
    job = await queue.enqueue("k", "a", {})
    done = await _wait_status(storage, job.id, "done")
    assert calls == 2 and done.attempts == 2 and "locked" in done.last_error
    await pool.stop()


async def test_transient_errors_give_up_after_max_attempts(storage: Storage) -> None:
    async def always(job: Job) -> None:
        raise LLMRateLimited("429 again")

    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": always})
    await pool.start()
    job = await queue.enqueue("k", "a", {})
    failed = await _wait_status(storage, job.id, "failed")
    assert failed.attempts == 3 and failed.last_error == "LLMRateLimited"
    assert "429 again" not in failed.last_error  # (a server's text may quote the request: kept for days, it is not)
    await pool.stop()


async def test_a_retry_waits_at_least_as_long_as_the_server_asked(storage: Storage) -> None:
    """A rate-limited server asking for an hour got five attempts in 35 s (each with the SDK's own retries): the
    next attempt now waits what it asked for, up to retry_max_seconds; and the default back-off outlasts a
    provider's usual overload (529s for a minute or two), where it gave up after 30 s."""
    from datetime import UTC, datetime

    from bot.jobs import backoff_delay

    async def limited(job: Job) -> None:
        error = LLMRateLimited("429 slow down")
        error.retry_after = 3600.0
        raise error

    config = JobsConfig(concurrency=1, max_attempts=3, retry_base_seconds=0.01, retry_max_seconds=120,
                        poll_seconds=0.05)
    queue = JobQueue(storage, config)
    pool = WorkerPool(queue, {"k": limited})
    await pool.start()
    job = await queue.enqueue("k", "a", {})
    for _ in range(500):  # (queued again after its first attempt)
        waiting = await storage.get_job(job.id)
        assert waiting is not None
        if waiting.attempts == 1 and waiting.status == "queued":
            break
        await asyncio.sleep(0.01)
    assert 110 < (waiting.run_after - datetime.now(UTC)).total_seconds() <= 132  # retry_max_seconds, jittered
    await pool.stop()
    assert 40 <= backoff_delay(1, JobsConfig(), 40.0) <= 300 and backoff_delay(1, JobsConfig(), None) < 7
    defaults = JobsConfig()
    total = sum(min(defaults.retry_base_seconds * 2 ** (n - 1), defaults.retry_max_seconds)
                for n in range(1, defaults.max_attempts))
    assert total > 300  # five minutes and more before a job is given up


async def test_permanent_errors_fail_at_once(storage: Storage, caplog: pytest.LogCaptureFixture) -> None:
    """An operator's finding: the log said "job 3 (summary) failed after 2 attempt(s): LLMBadRequest", which
    neither names the channel or pair nor tells an unknown model from a prompt too long; the key and the HTTP
    status are said now (still not the server's text, which may quote the request)."""
    async def bad(job: Job) -> None:
        raise LLMBadRequest("unknown model: Ann's words echoed back", status_code=404)

    caplog.set_level(logging.INFO, logger="bot.jobs")
    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": bad})
    await pool.start()
    job = await queue.enqueue("k", "channel:7", {})
    failed = await _wait_status(storage, job.id, "failed")
    assert failed.attempts == 1 and failed.last_error == "LLMBadRequest (HTTP 404)"  # (not the server's echo)
    await pool.stop()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert said == [f"job {job.id} (k, channel:7) failed after 1 attempt(s): LLMBadRequest (HTTP 404); cortexbot "
                    f"jobs retry {job.id} tries it again"], said
    assert "Ann" not in caplog.text


async def test_one_job_per_key_at_a_time_but_keys_run_in_parallel(storage: Storage) -> None:
    active: dict[str, int] = {}
    peak_per_key: dict[str, int] = {}
    peak_total = 0

    async def slow(job: Job) -> None:
        nonlocal peak_total
        active[job.key] = active.get(job.key, 0) + 1
        peak_per_key[job.key] = max(peak_per_key.get(job.key, 0), active[job.key])
        peak_total = max(peak_total, sum(active.values()))
        await asyncio.sleep(0.05)
        active[job.key] -= 1

    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": slow})
    jobs = []
    for i in range(3):
        jobs.append(await queue.enqueue("k", "same", {"i": i}, dedupe=False))
    jobs.append(await queue.enqueue("k", "other", {}))
    await pool.start()
    for job in jobs:
        await _wait_status(storage, job.id, "done")
    assert peak_per_key == {"same": 1, "other": 1}
    assert peak_total == 2
    await pool.stop()


async def test_a_job_of_a_dead_process_is_picked_up_again(storage: Storage) -> None:
    queue = JobQueue(storage, FAST)
    job = await queue.enqueue("k", "a", {"n": 7})
    # A worker on this host whose process no longer exists claimed it and then died.
    dead = f"{socket.gethostname()}:999999:deadbeef"
    assert (await storage.claim_job(dead, ["k"], 3600)) is not None
    ran: list[int] = []

    async def handler(j: Job) -> None:
        ran.append(j.payload["n"])

    pool = WorkerPool(queue, {"k": handler})
    await pool.start()
    done = await _wait_status(storage, job.id, "done")
    assert ran == [7] and done.attempts == 2
    await pool.stop()


async def test_shutdown_waits_for_grace_then_requeues_unfinished(storage: Storage) -> None:
    started = asyncio.Event()
    finished: list[str] = []

    async def handler(job: Job) -> None:
        started.set()
        await asyncio.sleep(0.5 if job.key == "quick" else 30)
        finished.append(job.key)

    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": handler})
    await pool.start()
    quick = await queue.enqueue("k", "quick", {})
    stuck = await queue.enqueue("k", "stuck", {})
    await started.wait()
    await asyncio.sleep(0.05)
    await pool.stop(grace=1.0)
    assert finished == ["quick"]
    assert (await storage.get_job(quick.id)).status == "done"
    requeued = await storage.get_job(stuck.id)
    assert requeued.status == "queued" and requeued.attempts == 0


async def test_drain_waits_for_queued_jobs(storage: Storage) -> None:
    async def handler(job: Job) -> None:
        await asyncio.sleep(0.05)

    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": handler})
    await pool.start()
    for i in range(4):
        await queue.enqueue("k", f"k{i}", {})
    assert await pool.drain(5.0)
    assert await storage.count_jobs(("queued", "running")) == 0
    await pool.stop()


async def test_drain_does_not_wait_for_a_job_due_after_its_time(storage: Storage) -> None:
    """A job backing off from a rate limit (now as long as the server asked) held a terminal chat's exit for
    its whole grace, though it could not run in it."""
    from datetime import UTC, datetime, timedelta

    queue = JobQueue(storage, FAST)
    pool = WorkerPool(queue, {"k": lambda job: asyncio.sleep(0)})
    await pool.start()
    later = await storage.enqueue_job("k", "later", {}, 3, run_after=datetime.now(UTC) + timedelta(minutes=5))
    assert later is not None
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await pool.drain(3.0) and loop.time() - started < 1.0
    kept = await storage.get_job(later.id)
    assert kept is not None and kept.status == "queued"  # (still there, for the next start)
    await pool.stop()


async def _logged(caplog: pytest.LogCaptureFixture, matches: Callable[[str], bool], timeout: float = 5.0) -> None:
    """Wait until a log line ``matches``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if any(matches(r.getMessage()) for r in caplog.records):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the expected log line never came")


def test_worker_liveness() -> None:
    me = f"{socket.gethostname()}:{__import__('os').getpid()}:aaaa"
    assert worker_is_dead(f"{socket.gethostname()}:999999:x", own_worker=me)
    assert worker_is_dead(f"{socket.gethostname()}:{__import__('os').getpid()}:bbbb", own_worker=me)
    assert not worker_is_dead(me, own_worker=me)
    assert not worker_is_dead("other-host:1:x", own_worker=me)  # only the lease can tell
    assert not worker_is_dead("garbage", own_worker=me)


async def test_the_scheduler_requeues_jobs_whose_lease_expired(tmp_path) -> None:
    from bot.app import App
    from bot.config import parse_config
    from tests.fakes.provider import ScriptedProvider

    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
                           "jobs": {"lease_seconds": 5, "poll_seconds": 0.05}})
    async with App(config, llm=ScriptedProvider()) as app:
        await app.workers.stop()  # so that this process's own workers cannot take the job first
        job = await app.storage.enqueue_job("summary", "channel:999", {"channel_id": 999}, 3)
        # another machine's worker took it and vanished: only its lease can tell
        assert await app.storage.claim_job("elsewhere:1:x", ["summary"], 0.01) is not None
        await asyncio.sleep(0.05)
        assert await app.workers.recover() == 1  # what the periodic upkeep job runs
        await app.workers.start()
        done = await _wait_status(app.storage, job.id, "done")
        assert "interrupted" in done.last_error
        assert app.scheduler._scheduler.get_job("requeue-abandoned-jobs") is not None


async def test_scheduler_runs_jobs_periodically_and_survives_failures() -> None:
    from bot.scheduler import Scheduler

    scheduler = Scheduler()
    calls = {"ok": 0, "bad": 0}

    async def ok() -> None:
        calls["ok"] += 1

    async def bad() -> None:
        calls["bad"] += 1
        raise RuntimeError("boom")

    scheduler.every(0.05, "ok", ok)
    scheduler.every(0.05, "bad", bad)
    scheduler.start()
    for _ in range(200):  # (a busy machine runs them later than every 0.05 s)
        if calls["ok"] >= 3 and calls["bad"] >= 3:
            break
        await asyncio.sleep(0.05)
    scheduler.stop()
    assert calls["ok"] >= 3 and calls["bad"] >= 3
    ok_job, bad_job = scheduler.jobs["ok"], scheduler.jobs["bad"]
    assert ok_job.runs == calls["ok"] and ok_job.failures == 0 and not ok_job.last_error
    assert bad_job.failures == calls["bad"] and bad_job.runs == 0
    assert bad_job.last_error == "RuntimeError: boom" and bad_job.last_run_at is not None
    assert "2 failed" not in ok_job.describe() and "last error: RuntimeError: boom" in bad_job.describe()


async def test_a_run_longer_than_its_interval_is_said_once_per_run_not_once_per_skipped_run(
        caplog: pytest.LogCaptureFixture) -> None:
    """APScheduler warned "maximum number of running instances reached" for every run a long one skipped: one
    line every 5 s while a locked database held the lease check up."""
    from bot.scheduler import Scheduler

    scheduler = Scheduler()
    release, started = asyncio.Event(), asyncio.Event()

    async def stuck() -> None:
        started.set()
        await release.wait()

    scheduler.every(0.05, "stuck", stuck, first_after=0.01)
    with caplog.at_level(logging.WARNING):
        scheduler.start()
        try:
            for _ in range(2):  # two long runs, each skipping many due ones
                await asyncio.wait_for(started.wait(), 5)
                started.clear()
                await asyncio.sleep(0.6)
                release.set()
                await asyncio.sleep(0.02)
                release.clear()
        finally:
            await scheduler.aclose()
    skipped = [r.getMessage() for r in caplog.records if "maximum number of running instances" in r.getMessage()]
    said = [r.getMessage() for r in caplog.records if "longer than its interval" in r.getMessage()]
    assert not skipped and len(said) == 2, caplog.text
    assert said[0].startswith("periodic job stuck has been running for ")


async def test_scheduler_close_cancels_a_run_in_progress(caplog: pytest.LogCaptureFixture) -> None:
    """(APScheduler logged the cancelled run as a job that "raised an exception", with a traceback, when the bot
    stopped during a periodic run: seen under load in `cortexbot run` stopped by SIGTERM.)"""
    from bot.scheduler import Scheduler

    scheduler = Scheduler()
    started = asyncio.Event()
    finished: list[str] = []

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            finished.append("cleaned up")

    scheduler.every(60, "slow", slow, first_after=0.01)
    scheduler.start()
    await asyncio.wait_for(started.wait(), 5)
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(scheduler.aclose(), 2)  # does not wait out the 30 s
        await asyncio.sleep(0.05)  # APScheduler's own callback on the cancelled run
    assert finished == ["cleaned up"] and not scheduler.running
    assert not caplog.records, caplog.text  # stopping is not a failure
    assert scheduler.jobs["slow"].runs == 0 and scheduler.jobs["slow"].last_run_at is not None


async def test_a_job_whose_worker_keeps_dying_fails_after_max_attempts(storage: Storage) -> None:
    # A job that kills its process (out of memory, a SIGKILL mid-job) must not be run again for ever.
    job = await storage.enqueue_job("k", "a", {}, 2)
    assert job is not None
    dead = f"{socket.gethostname()}:999999:deadbeef"
    first = await storage.claim_job(dead, ["k"], 3600)
    assert first is not None and first.attempts == 1
    assert [(j.id, j.status) for j in await storage.recover_jobs(lambda _w: True)] == [(job.id, "queued")]
    second = await storage.claim_job(dead, ["k"], 3600)
    assert second is not None and second.attempts == 2
    assert [(j.id, j.status) for j in await storage.recover_jobs(lambda _w: True)] == [(job.id, "failed")]
    failed = await storage.get_job(job.id)
    assert failed is not None and failed.status == "failed" and failed.attempts == 2
    assert "interrupted" in failed.last_error
    assert await storage.claim_job("w:1:a", ["k"], 30) is None


async def test_a_stalled_run_cannot_finish_the_job_another_loop_of_its_own_pool_took_over(
    storage: Storage, caplog: pytest.LogCaptureFixture,
) -> None:
    # All the loops of one pool claim under one worker id: a run whose lease ran out (a stall, a clock that
    # jumped) must still be told apart from the run of the same job that a sibling loop claimed afterwards.
    # It is stopped at its next renewal (before, it ran on beside the other run: two results of one key).
    first_started, first_release, second_started, second_release = (asyncio.Event() for _ in range(4))
    first_stopped = asyncio.Event()

    async def handler(job: Job) -> None:
        started, release = (first_started, first_release) if job.attempts == 1 else (second_started, second_release)
        started.set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            if job.attempts == 1:
                first_stopped.set()
            raise

    class StalledRenewals:  # (its renewals answer late: the lease runs out meanwhile)
        def __getattr__(self, name: str) -> object:
            return getattr(storage, name)

        async def renew_lease(self, *args: object, **kwargs: object) -> bool:
            await asyncio.sleep(1.0)
            return await storage.renew_lease(*args, **kwargs)  # type: ignore[arg-type]

    config = FAST.model_copy(update={"lease_seconds": 0.5, "concurrency": 2})
    pool = WorkerPool(JobQueue(storage, config), {"k": handler}, storage=StalledRenewals())  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="bot.jobs")
    try:
        await pool.start()
        job = await pool.queue.enqueue("k", "pair:1", {})
        assert job is not None
        await asyncio.wait_for(first_started.wait(), 10)
        while not second_started.is_set():  # the lease runs out; the upkeep requeues it; the other loop takes it
            await pool.recover()
            await asyncio.sleep(0.05)
        second_release.set()  # the run that holds the job now finishes it
        done = await _wait_status(storage, job.id, "done")
        assert done.attempts == 2
        await asyncio.wait_for(first_stopped.wait(), 10)  # the stalled one stops at its next renewal
        await _logged(caplog, lambda m: m.startswith(f"job {job.id} (k) lost its lease") and "this run stopped" in m)
        said = [r.getMessage() for r in caplog.records]
        assert sum("done in" in m for m in said) == 1 and not any("finished after" in m for m in said), said
        for _ in range(200):  # (the stopped run leaves the pool's list a moment after it said so)
            if pool.running_jobs == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.running_jobs == 0
    finally:
        first_release.set()
        second_release.set()
        await pool.stop(1)


async def test_a_job_whose_payload_is_no_json_object_fails_at_once(storage: Storage) -> None:
    """A payload that is not a JSON object (a hand-edited row) failed inside every claim, after the row was set
    running: the worker loop crashed and restarted, and the job sat running until its lease ran out, again and
    again. Its handler now gets an empty payload, and the job fails at its first attempt."""
    seen: list[dict[str, object]] = []

    async def handler(job: Job) -> None:
        seen.append(dict(job.payload))
        raise KeyError("channel_id")  # as a real handler does without its fields

    pool = WorkerPool(JobQueue(storage, FAST), {"k": handler})
    job = await pool.queue.enqueue("k", "pair:1", {"channel_id": 1})
    assert job is not None
    await storage.db.write("UPDATE jobs SET payload = ? WHERE id = ?", ("{not json", job.id))
    try:
        await pool.start()
        failed = await _wait_status(storage, job.id, "failed")
    finally:
        await pool.stop(1)
    assert failed.attempts == 1 and "channel_id" in failed.last_error and seen == [{}]


async def test_enqueues_of_one_key_at_once_queue_one_job(storage: Storage, db_url: str) -> None:
    """An attacker's finding: on PostgreSQL each statement sees the rows committed when it began, so enqueues of one
    kind and key at the same moment (two processes, a pool's connections) each found no queued job and inserted:
    16 at once left up to 12. One queued job per kind and key, on each engine, from two handles."""
    from bot.storage import open_storage

    other = await open_storage(db_url)  # (a second handle: another process, its own connections)
    try:
        for key in range(20):
            made = await asyncio.gather(*(s.enqueue_job("summary", f"channel:{key}", {"n": n}, 3)
                                          for n in range(8) for s in (storage, other)))
            assert sum(job is not None for job in made) == 1, key
    finally:
        await other.close()
    assert len(await storage.list_jobs("queued")) == 20


class _Renewals:
    """A worker's storage whose lease renewals fail (``hang``: never answer) as over a broken connection;
    everything else works."""

    def __init__(self, storage: Storage, *, hang: bool = False) -> None:
        self._storage, self._hang = storage, hang

    def __getattr__(self, name: str) -> object:
        return getattr(self._storage, name)

    async def renew_lease(self, *args: object, **kwargs: object) -> bool:
        if self._hang:
            await asyncio.sleep(3600)
        raise ConnectionError("connection reset")


async def _writes_beside_a_takeover(storage: Storage, first_storage: _Renewals) -> list[str]:
    """A job's first run, whose renewals go through ``first_storage``, and the run of a second worker that
    takes it over once the first lease ran out: what each run wrote at its end."""
    config = FAST.model_copy(update={"concurrency": 1, "lease_seconds": 0.6})
    writes: list[str] = []
    second_running = asyncio.Event()

    async def handler(job: Job) -> None:
        if job.attempts == 1:  # the first run: a slow model call
            await asyncio.sleep(2.0)
            writes.append("first")
        else:
            second_running.set()
            await asyncio.sleep(0.3)
            writes.append("second")

    first = WorkerPool(JobQueue(storage, config), {"k": handler}, worker_id="hostA:1:aaaa", pid_checks=False,
                       storage=first_storage)  # type: ignore[arg-type]
    second = WorkerPool(JobQueue(storage, config), {"k": handler}, worker_id="hostB:2:bbbb", pid_checks=False)
    await first.start()
    await first.queue.enqueue("k", "pair:1", {})
    await asyncio.sleep(0.9)  # the first run's lease ran out
    await second.start()  # its recovery queues the job again, and it runs it
    await asyncio.wait_for(second_running.wait(), 5)
    await asyncio.sleep(2.0)
    await first.stop(1)
    await second.stop(1)
    return writes


async def test_a_run_whose_lease_runs_out_unrenewed_stops_before_another_takes_over(storage: Storage) -> None:
    """Renewals that failed (a dropped connection) were only logged: the lease ran out, another worker took the
    job over, and both runs went on to the end, each writing its result (two summaries, two file versions)."""
    assert await _writes_beside_a_takeover(storage, _Renewals(storage)) == ["second"]


async def test_a_claim_answered_while_the_pool_stops_is_handed_back(storage: Storage) -> None:
    """A stop with no job running cancelled the worker loops at once: a claim already made in the database, its
    answer still on the way, left the job 'running' under a pool that was gone, until its lease ran out."""
    claimed = asyncio.Event()

    class SlowAnswers:
        def __getattr__(self, name: str) -> object:
            return getattr(storage, name)

        async def claim_job(self, *args: object, **kwargs: object) -> Job | None:
            job = await storage.claim_job(*args, **kwargs)  # type: ignore[arg-type]
            if job is not None:
                claimed.set()
                await asyncio.sleep(0.5)  # (the answer on its way back)
            return job

    async def handler(job: Job) -> None:
        return None

    pool = WorkerPool(JobQueue(storage, FAST.model_copy(update={"concurrency": 1})), {"k": handler},
                      pid_checks=False, storage=SlowAnswers())  # type: ignore[arg-type]
    await pool.start()
    job = await storage.enqueue_job("k", "a", {}, 5)
    await asyncio.wait_for(claimed.wait(), 5)
    await pool.stop(1)
    row = await storage.get_job(job.id)
    assert row is not None and (row.status, row.locked_by) == ("queued", "")


def test_a_process_in_another_pid_namespace_is_never_taken_for_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two containers with one host name (network_mode: host) on one SQLite file, each pid 1 in its own PID
    namespace: each took the other's live pid 1 for a dead (or its own earlier) process and requeued its jobs."""
    import os

    from bot.jobs import local_host

    here = socket.gethostname()
    monkeypatch.setattr(os, "readlink", lambda path: "pid:[4026531836]")  # the first namespace: the name alone
    assert local_host() == here
    monkeypatch.setattr(os, "readlink", lambda path: "pid:[4026532301]")  # a container's
    assert local_host() == f"{here}/4026532301"
    other = f"{here}/4026532999:1:aaaa"  # the other container's pid 1, alive or not: only its lease can tell
    assert not worker_is_dead(other, own_worker=f"{local_host()}:1:bbbb")
    assert worker_is_dead(f"{local_host()}:1:cccc", own_worker=f"{local_host()}:1:bbbb")  # (this process's own)


async def test_a_run_whose_renewal_hangs_stops_before_another_takes_over(storage: Storage) -> None:
    """A renewal that never answered (a half-open connection, a pool with no free connection) was waited for,
    and its run went on beside the run of the worker that took the job over."""
    assert await _writes_beside_a_takeover(storage, _Renewals(storage, hang=True)) == ["second"]
