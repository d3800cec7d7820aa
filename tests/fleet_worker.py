"""One bot process of a test fleet: the real JobQueue, WorkerPool, Scheduler and Fleet on a shared database.

Run by ``tests/test_fleet.py`` as a subprocess (several at once on one PostgreSQL)::

    python -m tests.fleet_worker --url postgresql://... --name w1 --records DIR --lease 2 --period 1

It wires the parts the way ``bot.app.App`` does (a fleet id as worker id, lease-only recovery on a shared
database, ``requeue-abandoned-jobs`` every lease through the fleet gate) with one handler, for jobs of
kind :data:`KIND`, and one periodic job, :data:`TICK`, run once per period across the fleet. It runs until
SIGTERM or SIGINT, then stops cleanly (scheduler, fleet, workers, storage) and exits 0.

Everything it does is appended to ``DIR/NAME.jsonl``, one JSON object a line, each written with a single
``os.write`` on an ``O_APPEND`` descriptor, so a line is whole and survives a SIGKILL of this process:

* ``{"ev": "ready", "pid", "worker"}`` once the workers and the scheduler run;
* ``{"ev": "start" | "end", "job", "key", "attempt", "hold", "t"}`` around each execution of the handler;
* ``{"ev": "finish", "job", "ok", "t"}`` with what ``Storage.finish_job`` answered the worker pool (``ok`` is
  false when the fenced completion was refused: the lease had run out or the job was handed to another);
* ``{"ev": "gate", "name", "t0", "t1", "won"}`` around each call of the fleet gate (``Fleet.claim_period``);
* ``{"ev": "tick", "t"}`` for each run of the periodic job; ``{"ev": "stopped"}`` after a clean stop.

A job whose payload has ``"hold": true`` sleeps ``--hold-seconds`` on its first attempt (so the test can
kill the process in the middle of it) and ``--job-seconds`` like the others on a later attempt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from bot.config import JobsConfig
from bot.fleet import Fleet
from bot.jobs import JobQueue, WorkerPool
from bot.scheduler import Scheduler
from bot.storage import open_storage
from bot.storage.base import Job

KIND = "fleet-test"
TICK = "fleet-test-tick"
RECOVER = "requeue-abandoned-jobs"  # the name bot.app gives the same upkeep


class Recorder:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **fields: Any) -> None:
        os.write(self._fd, (json.dumps(fields) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def jobs_config(args: argparse.Namespace) -> JobsConfig:
    config = JobsConfig(
        concurrency=args.concurrency, max_attempts=3, poll_seconds=args.poll,
        retry_base_seconds=0.05, retry_max_seconds=0.2, shutdown_grace_seconds=5.0,
    )
    # The configuration refuses leases under 5 s; the test wants takeovers within seconds.
    return config.model_copy(update={"lease_seconds": args.lease})


async def main(args: argparse.Namespace) -> int:
    record = Recorder(os.path.join(args.records, f"{args.name}.jsonl"))
    storage = await open_storage(args.url, pool_size=args.pool_size)
    fleet = Fleet(storage)
    config = jobs_config(args)
    queue = JobQueue(storage, config)

    async def handle(job: Job) -> None:
        hold = bool(job.payload.get("hold"))
        fields = {"job": job.id, "key": job.key, "attempt": job.attempts, "hold": hold}
        record.write(ev="start", t=time.time(), **fields)
        await asyncio.sleep(args.hold_seconds if hold and job.attempts == 1 else args.job_seconds)
        record.write(ev="end", t=time.time(), **fields)

    # Observe (not replace) the fenced completion the worker pool asks for.
    real_finish = storage.finish_job

    async def finish_job(job_id: int, worker: str | None = None, *, attempt: int | None = None) -> bool:
        ok = await real_finish(job_id, worker, attempt=attempt)
        record.write(ev="finish", job=job_id, ok=ok, t=time.time())
        return ok

    storage.finish_job = finish_job  # type: ignore[method-assign]

    async def gate(name: str, seconds: float) -> bool:
        t0 = time.time()
        won = await fleet.claim_period(name, seconds)
        record.write(ev="gate", name=name, t0=t0, t1=time.time(), won=won)
        return won

    async def tick() -> None:
        record.write(ev="tick", t=time.time())

    workers = WorkerPool(
        queue, {KIND: handle}, storage=storage, pid_checks=not storage.db.shared_across_hosts,
        worker_id=fleet.process_id,
    )
    scheduler = Scheduler(gate=gate)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await fleet.heartbeat()
        scheduler.every(5.0, "heartbeat", fleet.heartbeat, fleet_once=False)
        await workers.start()
        scheduler.every(config.lease_seconds, RECOVER, workers.recover)
        scheduler.every(args.period, TICK, tick)
        scheduler.start()
        record.write(ev="ready", pid=os.getpid(), worker=workers.worker_id, t=time.time())
        await stop.wait()
    finally:
        await scheduler.aclose()
        await fleet.leave()
        await workers.stop(config.shutdown_grace_seconds)
        await storage.close()
    record.write(ev="stopped", t=time.time())
    record.close()
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--records", required=True, help="directory for NAME.jsonl")
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--poll", type=float, default=0.05)
    parser.add_argument("--job-seconds", type=float, default=0.2)
    parser.add_argument("--hold-seconds", type=float, default=60.0)
    parser.add_argument("--pool-size", type=int, default=6)
    return parser.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(main(parse_args())))
