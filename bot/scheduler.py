"""Periodic upkeep in the bot's own process, on APScheduler's asyncio scheduler.

Each job is supervised: a failure is logged with the job's name and the schedule goes on; jobs never
overlap themselves (``max_instances=1``) and a missed run is folded into the next one (``coalesce``).
Today it requeues jobs whose worker (maybe another process sharing the database) stopped renewing
its lease; the memory store adds embedding backfill and pruning here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from apscheduler.schedulers.asyncio import AsyncIOScheduler

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self) -> None:
        self._scheduler = AsyncIOScheduler(timezone="UTC")
        self.runs: dict[str, int] = {}
        self.failures: dict[str, int] = {}

    def every(self, seconds: float, name: str, job: Callable[[], Awaitable[object]]) -> None:
        async def supervised() -> None:
            try:
                await job()
                self.runs[name] = self.runs.get(name, 0) + 1
            except Exception:
                self.failures[name] = self.failures.get(name, 0) + 1
                log.exception("periodic job %s failed; it runs again in %.0f s", name, seconds)

        self._scheduler.add_job(
            supervised, "interval", seconds=seconds, id=name, name=name, max_instances=1, coalesce=True
        )

    def start(self) -> None:
        self._scheduler.start()

    def stop(self) -> None:
        if self._scheduler.running:
            self._scheduler.shutdown(wait=False)
