"""Durable background jobs: rows in the database, run by supervised asyncio workers.

* **Durable.** A job is a row (``queued → running → done | failed``). A worker claims it atomically
  with a lease it keeps renewing; a job whose worker died (lease expired, or the worker's process is
  gone) is put back in the queue by :meth:`WorkerPool.start` and runs again, unless that was its last
  attempt: a job that keeps killing its process fails after ``max_attempts`` instead of running for ever.
* **One per key.** A job is never claimed while another job with the same key runs (summaries are
  keyed per channel, cortex updates per user-persona pair).
* **Retries.** A handler that raises an error marked ``transient`` (LLM rate limits, outages,
  time-outs) is retried with exponential back-off and jitter up to ``max_attempts``; any other error
  fails the job at once, recording the error.
* **Bounded and supervised.** ``concurrency`` worker tasks; a crashing worker loop is logged and
  restarted; :meth:`WorkerPool.stop` stops claiming, waits ``grace`` seconds for running jobs, then
  cancels them and returns their rows to the queue untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from bot.config import JobsConfig
from bot.llm.errors import LLMError
from bot.storage.base import Job, Storage

log = logging.getLogger(__name__)

JobHandler = Callable[[Job], Awaitable[None]]


class JobQueue:
    """Enqueues jobs and wakes idle workers of this process at once."""

    def __init__(self, storage: Storage, config: JobsConfig) -> None:
        self.storage = storage
        self.config = config
        self.wakeup = asyncio.Event()

    async def enqueue(
        self, kind: str, key: str, payload: Mapping[str, Any], *, dedupe: bool = True
    ) -> Job | None:
        job = await self.storage.enqueue_job(kind, key, dict(payload), self.config.max_attempts, dedupe=dedupe)
        if job is not None:
            log.info("queued job %d (%s, key %s)", job.id, kind, key)
            self.wakeup.set()
        return job


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` (if still running) and wait for it to end."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


INIT_PID_NAMESPACE = "4026531836"  # the kernel's number for the first PID namespace (PROC_PID_INIT_INO)


def local_host() -> str:
    """This machine's name as process and worker ids carry it, and the PID namespace after it when it is not the
    first one (a container's): two containers with one host name (network_mode: host) on one SQLite file each
    count their own pids, and one's live pid 1 was taken for the other's dead one (its running jobs taken away)."""
    name = socket.gethostname()
    try:
        namespace = os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:  # (not Linux)
        return name
    return name if namespace == INIT_PID_NAMESPACE else f"{name}/{namespace}"


def new_worker_id() -> str:
    return f"{local_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine with that id runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def worker_is_dead(worker: str, *, own_worker: str) -> bool:
    """Whether the worker that locked a job certainly stopped (same host, and its process is gone)."""
    try:
        host, pid_text, _token = worker.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False
    own_host, own_pid_text, _ = own_worker.rsplit(":", 2)
    if host != own_host:
        return False  # another machine: only its lease can tell
    if pid == int(own_pid_text):
        return worker != own_worker  # an earlier pool of this very process
    return not pid_alive(pid)


def _kept_error(exc: Exception) -> str:
    """What the job's row keeps of its error (shown by cortexbot jobs and the web page for days): of a model
    server's error its kind and HTTP status, not its text, which may quote the request (people's words) and would
    outlive a forget-me (``cortexbot doctor`` asks the models again and shows what they say now)."""
    if isinstance(exc, LLMError):
        return _why(exc)
    return f"{type(exc).__name__}: {exc}"[:2000]


def _why(exc: Exception) -> str:
    """A failure for the log: the error's class, and a model server's HTTP status (never its message, which may
    quote what it was sent)."""
    status = getattr(exc, "status_code", None) if isinstance(exc, LLMError) else None
    return f"{type(exc).__name__} (HTTP {status})" if status else type(exc).__name__


class LeaseLost(Exception):
    """A handler found, before writing a result, that its job went to another worker (its lease ran out while
    it stalled): the result is the other worker's to write."""


def backoff_delay(attempt: int, config: JobsConfig, asked: float | None = None) -> float:
    """The wait before a failed job's next attempt: ``retry_base_seconds`` doubling with each attempt, with
    jitter; at least what the server asked for (its Retry-After), up to ``retry_max_seconds``."""
    base: float = min(config.retry_base_seconds * 2.0 ** max(attempt - 1, 0), config.retry_max_seconds)
    delay = base * random.uniform(0.8, 1.2)
    # (jittered too: jobs one rate limit stopped together would otherwise all come back at the same moment)
    return max(delay, min(asked, config.retry_max_seconds) * random.uniform(1.0, 1.1)) if asked else delay


class WorkerPool:
    def __init__(
        self,
        queue: JobQueue,
        handlers: Mapping[str, JobHandler],
        *,
        worker_id: str | None = None,
        storage: Storage | None = None,
        pid_checks: bool = True,
        on_failed: Mapping[str, JobHandler] | None = None,
        on_interrupted: Mapping[str, JobHandler] | None = None,
    ) -> None:
        self.queue = queue
        # Called with a job of that kind once it failed for good (a cortex update makes up for tiers it held back).
        self.on_failed = dict(on_failed or {})
        # Called with a job of that kind whose worker stopped, once it is queued again or failed (a cortex update
        # closes the run its stopped process left marked running).
        self.on_interrupted = dict(on_interrupted or {})
        # Workers may claim through a connection of their own (see Storage.sibling).
        self.storage = storage or queue.storage
        self.config = queue.config
        self.handlers = dict(handlers)
        self.worker_id = worker_id or new_worker_id()
        # On a database only this machine uses (SQLite), a job whose worker's process is gone is requeued
        # at once; on a shared one (PostgreSQL) only an expired lease tells, whatever the host.
        self.pid_checks = pid_checks
        self._loops: list[asyncio.Task[None]] = []
        self._running: set[asyncio.Task[None]] = set()  # one job each (two may be claims of one job)
        self._stopping = asyncio.Event()

    @property
    def running_jobs(self) -> int:
        return len(self._running)

    async def recover(self) -> int:
        """Requeue jobs whose worker is gone (lease expired, or its process on this host died)."""
        dead = (lambda w: worker_is_dead(w, own_worker=self.worker_id)) if self.pid_checks else None
        recovered = await self.storage.recover_jobs(dead)
        for job in recovered:
            await self._hook(self.on_interrupted, job, "what follows the interruption of")
            if job.status == "failed":
                log.error("job %d (%s) was interrupted on its last attempt (%d of %d: its worker stopped or its "
                          "lease ran out each time); it failed", job.id, job.kind, job.attempts, job.max_attempts)
                await self._failed_for_good(job)
            else:
                log.warning("job %d (%s) was interrupted (its worker stopped or its lease ran out); it is queued "
                            "again", job.id, job.kind)
        if any(job.status == "queued" for job in recovered):
            self.queue.wakeup.set()
        return len(recovered)

    async def start(self) -> None:
        await self.recover()
        self._stopping.clear()
        for index in range(self.config.concurrency):
            self._loops.append(asyncio.create_task(self._supervise(index), name=f"job-worker-{index}"))

    async def _supervise(self, index: int) -> None:
        while not self._stopping.is_set():
            try:
                await self._work()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("job worker %d crashed; restarting it in 1 s", index)
                await asyncio.sleep(1.0)

    async def _work(self) -> None:
        kinds = sorted(self.handlers)
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            claimed_at = loop.time()  # (the lease counts from before the claim: never later than the database's)
            claim = asyncio.ensure_future(self.storage.claim_job(self.worker_id, kinds, self.config.lease_seconds))
            try:
                job = await asyncio.shield(claim)
            except asyncio.CancelledError:  # (a stop while the claim's answer was on its way: hand the job back)
                with contextlib.suppress(Exception):
                    if (claimed := await claim) is not None:
                        await self.storage.release_job(claimed.id, self.worker_id, attempt=claimed.attempts)
                raise
            if job is None:
                self.queue.wakeup.clear()
                try:
                    await asyncio.wait_for(self.queue.wakeup.wait(), timeout=self.config.poll_seconds)
                except TimeoutError:
                    pass
                continue
            task = asyncio.create_task(self._run(job, claimed_at), name=f"job-{job.id}-{job.kind}")
            self._running.add(task)
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                await _cancelled(task)
                raise
            finally:
                self._running.discard(task)

    async def _keep_lease(self, job: Job, claimed_at: float) -> None:
        """Renew the job's lease until it is lost (then return, which stops the run: another worker took the job
        over), or until it runs out unrenewed (a dropped connection, a stalled loop: another worker may take it
        over then, and two runs of one key must not go on side by side)."""
        loop = asyncio.get_running_loop()
        lease = self.config.lease_seconds
        interval, margin = max(lease / 3, 1.0), lease / 10
        held_until = claimed_at + lease
        while True:
            await asyncio.sleep(max(min(interval, held_until - margin - loop.time()), 0.0))
            asked = loop.time()
            try:  # (a renewal that hangs, a half-open connection, is given up when the lease would run out)
                renewed = self.storage.renew_lease(job.id, self.worker_id, lease, attempt=job.attempts)
                if not await asyncio.wait_for(renewed, max(held_until - asked - margin / 2, margin / 2)):
                    return
                held_until = asked + lease
            except Exception as exc:  # a dropped connection: the next renewal may work, keep trying
                log.warning("could not renew the lease of job %d (%s): %s", job.id, job.kind,
                            exc if str(exc) else type(exc).__name__)
            if loop.time() >= held_until - margin:
                log.warning("job %d (%s): its lease runs out unrenewed; this run stops (another worker may take "
                            "the job over)", job.id, job.kind)
                return

    async def _run(self, job: Job, claimed_at: float) -> None:
        """Run the job's handler while its lease is renewed; a run whose lease is lost stops at once (the
        worker that took the job over runs it: two runs of one key at a time would each write their result)."""
        lease = asyncio.create_task(self._keep_lease(job, claimed_at), name=f"job-{job.id}-lease")
        work = asyncio.ensure_future(self.handlers[job.kind](job))
        started = asyncio.get_running_loop().time()
        try:
            await asyncio.wait({work, lease}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                await _cancelled(work)
                log.warning("job %d (%s) lost its lease (another worker took it over after a stall); this run "
                            "stopped", job.id, job.kind)
                return
            await work
        except asyncio.CancelledError:
            await _cancelled(work)
            await self.storage.release_job(job.id, self.worker_id, attempt=job.attempts)
            log.info("job %d (%s) was stopped by shutdown; it is queued again", job.id, job.kind)
            raise
        except Exception as exc:
            await self._after_failure(job, exc)
        else:
            if await self.storage.finish_job(job.id, self.worker_id, attempt=job.attempts):
                log.info(
                    "job %d (%s) done in %.2f s", job.id, job.kind, asyncio.get_running_loop().time() - started
                )
            else:
                log.warning("job %d (%s) finished after its lease ran out; it was not marked done (it may run "
                            "again: another worker may have taken it over)", job.id, job.kind)
        finally:
            await _cancelled(lease)

    async def _after_failure(self, job: Job, exc: Exception) -> None:
        if isinstance(exc, LeaseLost):  # (the worker that has the job now finishes it)
            log.warning("job %d (%s): %s; this run stopped before writing it", job.id, job.kind, exc)
            return
        error = _kept_error(exc)
        # (a database that could not be used a moment, locked by another process, say, is tried again too)
        transient = getattr(exc, "transient", False) or self.storage.unavailable(exc) is not None
        if transient and job.attempts < job.max_attempts:
            delay = backoff_delay(job.attempts, self.config, getattr(exc, "retry_after", None))
            await self.storage.retry_job(job.id, error, datetime.now(UTC) + timedelta(seconds=delay), self.worker_id,
                                         attempt=job.attempts)
            log.warning(
                "job %d (%s, %s) attempt %d/%d failed (%s); retrying in %.1f s",
                job.id, job.kind, job.key, job.attempts, job.max_attempts, _why(exc), delay,
            )
            return
        failed = await self.storage.fail_job(job.id, error, self.worker_id, attempt=job.attempts)
        if failed:  # (not when another worker has it now)
            await self._failed_for_good(job)
        if isinstance(exc, LLMError):
            # No traceback and no message: a chained SDK exception, or a provider's error text, may quote the request.
            log.error("job %d (%s, %s) failed after %d attempt(s): %s; cortexbot jobs retry %d tries it again",
                      job.id, job.kind, job.key, job.attempts, _why(exc), job.id)
        else:
            log.error("job %d (%s, %s) failed: %s", job.id, job.kind, job.key, type(exc).__name__, exc_info=exc)

    async def _failed_for_good(self, job: Job) -> None:
        """Run what follows a failure for good of a job of its kind (``on_failed``); its own failure is logged."""
        await self._hook(self.on_failed, job, "what follows the failure of")

    @staticmethod
    async def _hook(hooks: Mapping[str, JobHandler], job: Job, what: str) -> None:
        """Run the hook of the job's kind in ``hooks``, if any; its own failure is logged (``what`` the job)."""
        if (hook := hooks.get(job.kind)) is not None:
            try:
                await hook(job)
            except Exception:
                log.exception("%s job %d (%s) did not run", what, job.id, job.kind)

    async def drain(self, timeout: float) -> bool:
        """Wait until no job is queued or running (or ``timeout`` passes). True when idle. A job queued to run
        after the timeout (backing off from a rate limit) is not waited for: it could not run meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        due_by = time.time() + timeout
        while loop.time() < deadline:
            if not self._running and await self.storage.count_jobs(("queued", "running"), self.handlers,
                                                                    due_by=due_by) == 0:
                return True
            self.queue.wakeup.set()
            await asyncio.sleep(0.05)
        return False

    async def stop(self, grace: float | None = None) -> None:
        """Stop claiming, let running jobs finish for ``grace`` seconds, then cancel and requeue them."""
        grace = self.config.shutdown_grace_seconds if grace is None else grace
        self._stopping.set()
        self.queue.wakeup.set()
        running = list(self._running)
        if running:
            log.info("waiting up to %.0f s for %d running job(s)", grace, len(running))
            _done, pending = await asyncio.wait(running, timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        for loop_task in self._loops:
            loop_task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops.clear()
