"""This process as one of a fleet sharing a database: its id, its heartbeat, fleet-wide periodic runs
and named locks (one process per Matrix account).

With SQLite there is one process (or a few on one machine) and all of this still works the same way;
with PostgreSQL it is what lets several bot processes (Discord shards, several Matrix accounts) share
one database: periodic upkeep runs once per period across the fleet, and ``cortexbot status`` lists
who is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from bot.jobs import local_host
from bot.storage.core import Storage
from bot.storage.fleet import ProcessInfo

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 15.0
LOCK_TTL_SECONDS = 60.0


class LockHeld(RuntimeError):
    """Another live process holds a lock this one needs; the message names it and what to do."""


def new_process_id() -> str:
    return f"{local_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Fleet:
    def __init__(self, storage: Storage, *, process_id: str | None = None) -> None:
        self.storage = storage
        self.process_id = process_id or new_process_id()
        self.started_at: float | None = None  # by the database's clock, as the heartbeats (`cortexbot status`)
        self.info: dict[str, Any] = {}  # shown by `cortexbot status` (adapters, shards, accounts)
        self._locks: dict[str, asyncio.Task[None]] = {}

    async def claim_period(self, name: str, seconds: float) -> bool:
        """Whether this process runs the periodic job ``name`` this period (exactly one does)."""
        return await self.storage.fleet.claim_period(name, seconds, self.process_id)

    async def heartbeat(self) -> None:
        if self.started_at is None:  # (this machine's clock may be off the server's, by which status counts)
            self.started_at = await self.storage.now()
        await self.storage.fleet.heartbeat(
            self.process_id, local_host(), os.getpid(), self.info, self.started_at)

    async def show(self, key: str, value: Any) -> None:
        """Add what `cortexbot status` shows of this process (a web page once it serves it), written at once when
        the process beats already (else its first beat writes it)."""
        self.info[key] = value
        if self.started_at is not None:
            await self.heartbeat()

    async def hold(self, name: str, what: str, on_lost: Callable[[str], None] | None = None) -> None:
        """Take the lock ``name`` for as long as this process runs, renewing it in the background;
        :class:`LockHeld` when another live process holds it. ``on_lost(why)`` is called once when the claim is
        lost (another process holds it now: this one could not renew it for its whole time, stalled or cut off from
        the database): the caller stops what the lock guards, or two processes serve one account."""
        holder = await self.storage.fleet.acquire_lock(name, self.process_id, LOCK_TTL_SECONDS)
        if holder is not None:
            raise LockHeld(
                f"{what} is already served by another running process ({holder}); run one process per "
                f"account, or stop the other one (its claim expires {LOCK_TTL_SECONDS:.0f} s after it stops)"
            )
        self._locks[name] = asyncio.create_task(self._renew(name, what, on_lost), name=f"fleet-lock-{name}")

    async def _renew(self, name: str, what: str, on_lost: Callable[[str], None] | None) -> None:
        while True:
            await asyncio.sleep(LOCK_TTL_SECONDS / 3)
            try:  # (within a third of the claim's time: a pool with every connection busy must not stall it)
                holder = await asyncio.wait_for(
                    self.storage.fleet.acquire_lock(name, self.process_id, LOCK_TTL_SECONDS), LOCK_TTL_SECONDS / 3)
            except Exception as exc:  # the database may be back by the next renewal (then it says who holds it:
                # a process alone on it is still the holder, and goes on)
                log.warning("could not renew the claim on %s: %s", what, exc if str(exc) else type(exc).__name__)
                continue
            if holder is None:
                continue
            why = f"the claim on {what} was lost to {holder}: this process stalled or could not reach the database"
            log.error("%s; it stops serving it", why)
            if on_lost is not None:
                on_lost(why)
            return

    async def live(self) -> list[ProcessInfo]:
        return await self.storage.fleet.live_processes()

    async def leave(self) -> None:
        """Release the locks and remove the heartbeat row (a clean stop). Every lock of this process goes, also
        one a stop during :meth:`hold` left taken but not recorded (the start refused right after the adapter
        began, a SIGTERM): the next start was refused for a minute as "already served by another process"."""
        for task in self._locks.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._locks.clear()
        with contextlib.suppress(Exception):
            await self.storage.fleet.release_locks(self.process_id)
        with contextlib.suppress(Exception):
            await self.storage.fleet.leave(self.process_id)
