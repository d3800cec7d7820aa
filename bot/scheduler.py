"""Periodic upkeep in the bot's own process, on APScheduler's asyncio scheduler.

Each job is supervised: a failure is logged with the job's name and the schedule goes on; jobs never
overlap themselves (``max_instances=1``) and a missed run is folded into the next one (``coalesce``).
Jobs: requeue work whose worker (maybe another process sharing the database) stopped renewing its
lease, the embedding backfill and memory pruning. Every job's runs, failures and last outcome are
kept for ``!cortex stats``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobSubmissionEvent
from apscheduler.schedulers.asyncio import AsyncIOScheduler

log = logging.getLogger(__name__)
SKIPPED = "maximum number of running instances reached"  # APScheduler's warning for each run a long one skips


class _NoSkipWarnings(logging.Filter):
    """APScheduler warns of every due run a run still going makes it skip: one line every interval (every 5 s
    while a locked database held the lease check up). The scheduler says it once per such run instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return SKIPPED not in record.getMessage()


@dataclass(slots=True)
class JobRecord:
    name: str
    interval_seconds: float
    runs: int = 0
    failures: int = 0
    elsewhere: int = 0  # periods another process of the fleet ran it
    last_run_at: float | None = None
    last_seconds: float = 0.0
    last_error: str = ""
    running_since: float | None = None  # time.monotonic() of the run in progress
    overlap_said: bool = False  # that run's overlap was logged

    def describe(self) -> str:
        every = (f"{self.interval_seconds / 3600:g} h" if self.interval_seconds >= 3600
                 else f"{self.interval_seconds:g} s")
        last = "never ran yet" if self.last_run_at is None else (
            f"last {time.strftime('%Y-%m-%d %H:%M', time.gmtime(self.last_run_at))} UTC "
            f"({self.last_seconds:.1f} s)")
        error = f"; last error: {self.last_error}" if self.last_error else ""
        elsewhere = f", {self.elsewhere} run by another process" if self.elsewhere else ""
        return f"{self.name} (every {every}): {self.runs} runs, {self.failures} failed{elsewhere}, {last}{error}"


Gate = Callable[[str, float], Awaitable[bool]]


class Scheduler:
    """``gate(name, seconds)``, when given, decides for each due run of a fleet-wide job whether this
    process runs it (see ``bot.fleet.Fleet.claim_period``): several processes sharing one database
    then run it once per period between them."""

    def __init__(self, gate: Gate | None = None) -> None:
        self._gate = gate
        quiet = logging.getLogger("apscheduler.scheduler.cortexbot")  # (its own: the filter stays on this one)
        quiet.addFilter(_NoSkipWarnings())
        self._scheduler = AsyncIOScheduler(timezone="UTC", logger=quiet)
        self._scheduler.add_listener(self._skipped, EVENT_JOB_MAX_INSTANCES)
        self.jobs: dict[str, JobRecord] = {}
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False

    def every(
        self, seconds: float, name: str, job: Callable[[], Awaitable[object]], *, first_after: float | None = None,
        fleet_once: bool = True,
    ) -> None:
        """Run ``job`` every ``seconds``; the first time after ``first_after`` seconds (default: one interval),
        so a daily job also runs for a bot that restarts more often than daily. With ``fleet_once`` (and a
        gate) the run happens in one process of the fleet per period."""
        record = self.jobs[name] = JobRecord(name, seconds)
        gate = self._gate if fleet_once else None

        async def supervised() -> None:
            started = record.running_since = time.monotonic()
            task = asyncio.current_task()
            if task is not None:
                self._running.add(task)
            ran = True
            try:
                if gate is not None and not await gate(name, seconds):
                    record.elsewhere += 1
                    ran = False
                    return
                await job()
                record.runs += 1
                record.last_error = ""
            except asyncio.CancelledError:
                if not self._closing:
                    raise
                # The bot is stopping (aclose): not a failure, and APScheduler would log it as one, traceback and all.
            except Exception as exc:
                record.failures += 1
                record.last_error = f"{type(exc).__name__}: {exc}"[:300]
                log.exception("periodic job %s failed; it runs again in %.0f s", name, seconds)
            finally:
                record.running_since, record.overlap_said = None, False
                if ran:
                    record.last_run_at = time.time()
                    record.last_seconds = time.monotonic() - started
                if task is not None:
                    self._running.discard(task)

        first = None if first_after is None else datetime.now(UTC) + timedelta(seconds=first_after)
        self._scheduler.add_job(
            supervised, "interval", seconds=seconds, id=name, name=name, max_instances=1, coalesce=True,
            **({"next_run_time": first} if first is not None else {}),
        )

    def _skipped(self, event: JobSubmissionEvent) -> None:
        record = self.jobs.get(str(event.job_id))
        if record is None or record.overlap_said or record.running_since is None:
            return
        record.overlap_said = True
        log.warning("periodic job %s has been running for %.0f s, longer than its interval: its runs wait until it "
                    "ends", record.name, time.monotonic() - record.running_since)

    @property
    def running(self) -> bool:
        return bool(self._scheduler.running)

    def start(self) -> None:
        self._scheduler.start()

    def stop(self) -> None:
        if self._scheduler.running:
            self._scheduler.shutdown(wait=False)

    async def aclose(self) -> None:
        """Stop scheduling and cancel the runs in progress (before the database they use is closed)."""
        self._closing = True
        self.stop()
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
