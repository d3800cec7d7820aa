"""Tiers: when a pair's cortex update fires.

Each pair counts the messages of its exchanges (the user's and the persona's reply: +2 each) in a
cycle of ``context_limit`` messages. Tier *p* % fires once per cycle when the count reaches
``floor(context_limit × p / 100)``; it is marked fired (in the database) **before** its job is
enqueued, so a crash can never fire it twice. When the count reaches ``context_limit`` a new cycle
starts. If several tiers are reached at once (a small limit, or a limit lowered mid-cycle) only the
highest fires and the lower ones count as fired with it; so does a tier below one that already fired
(after a change of frequency mid-cycle).

Fired tiers are stored as percentages, so changing the frequency mid-cycle keeps what already fired.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from bot.config import CortexConfig
from bot.jobs import JobQueue
from bot.ports import Exchange
from bot.storage.base import Job
from cortex.settings import SettingsResolver
from cortex.store import CortexStore, Pair

log = logging.getLogger(__name__)

JOB_KIND = "cortex_update"
MESSAGES_PER_EXCHANGE = 2
MANUAL = "manual"


def job_key(pair_id: int) -> str:
    return f"pair:{pair_id}"


def thresholds(settings: CortexConfig) -> list[tuple[int, int]]:
    """``(percentage, message count)`` of each tier, in order."""
    return [(pct, math.floor(settings.context_limit * pct / 100)) for pct in settings.tier_percentages()]


@dataclass(frozen=True, slots=True)
class Decision:
    state: Pair  # the cycle state to store
    fire: int | None  # the tier percentage to fire now, if any


def decide(pair: Pair, settings: CortexConfig) -> Decision:
    fired = set(pair.fired_tiers)
    reached = [pct for pct, at in thresholds(settings) if pair.cycle_count >= at and pct not in fired]
    # A tier below one that already fired this cycle (after a frequency change) is covered by it.
    above = [pct for pct in reached if pct > max(fired, default=0)]
    fire = max(above) if above else None
    fired.update(reached)
    state = replace(pair, fired_tiers=tuple(sorted(fired)))
    if pair.cycle_count >= settings.context_limit:
        state = replace(state, cycle=pair.cycle + 1, cycle_count=0, fired_tiers=())
    return Decision(state, fire)


def tier_stage(tier: str, settings: CortexConfig) -> str:
    """``early``, ``deepening``, ``last`` (chance) or ``manual`` for a tier label."""
    if tier == MANUAL:
        return MANUAL
    tiers = settings.tier_percentages()
    pct = int(tier)
    if pct == max(tiers) and (len(tiers) > 1 or pct >= 90):
        return "last"
    if pct == min(tiers):
        return "early"
    return "deepening"


class TierEngine:
    """The exchange observer: counts, decides, marks, enqueues. Never waits on the update itself."""

    def __init__(self, store: CortexStore, resolver: SettingsResolver, queue: JobQueue) -> None:
        self.store = store
        self.resolver = resolver
        self.queue = queue

    async def on_exchange(self, exchange: Exchange) -> None:
        effective = await self.resolver.effective(exchange.persona, exchange.server_key)
        if not effective.settings.enabled:
            return
        incognito = exchange.incognito
        if incognito is None:
            incognito = await self.store.storage.incognito.active(exchange.user_db_id, exchange.persona)
        if incognito:
            return  # incognito: the stretch counts toward no tier
        pair = await self.store.count_messages(exchange.user_db_id, exchange.persona, MESSAGES_PER_EXCHANGE)
        for _attempt in range(5):
            decision = decide(pair, effective.settings)
            if decision.state == pair or await self.store.replace_cycle(pair, decision.state):
                break
            # Another exchange of this pair changed the row meanwhile: decide again on what it holds now.
            fresh = await self.store.pair_by_id(pair.id)
            if fresh is None:
                return
            pair = fresh
        else:
            log.warning("pair %d: cycle state kept changing; tier check skipped this time", pair.id)
            return
        if decision.fire is not None:
            log.info("pair %d: tier %d%% reached in cycle %d", pair.id, decision.fire, pair.cycle)
            await self.request_update(pair, str(decision.fire), exchange.server_key)

    async def after_failed_update(self, job: Job) -> None:
        """An update failed for good: the tiers it held back meanwhile (skipped while it was queued or running)
        would be lost with it, and the next tier may come only after the conversation it should have read left
        the update's window. The highest of them is queued now (tried again from the start)."""
        pair_id = int(job.payload["pair_id"])
        skipped = await self.store.skipped_tiers(pair_id, job.id)
        if not skipped:
            return
        tier = max(skipped, key=lambda t: int(t) if t.isdigit() else -1)  # (a manual one counts below any tier)
        queued = await self.queue.enqueue(JOB_KIND, job_key(pair_id), {
            "pair_id": pair_id, "tier": tier, "server_key": job.payload.get("server_key")})
        if queued is not None:
            log.info("pair %d: update job %d failed; tier %s, held back while it ran, is queued again (job %d)",
                     pair_id, job.id, tier, queued.id)

    async def request_update(self, pair: Pair, tier: str, server_key: str | None) -> Job | None:
        """Enqueue an update of ``pair``; while one is queued or running, record a skip instead."""
        if (active := await self.queue.storage.active_job(job_key(pair.id))) is not None:
            # (by the update that held it back: if that one fails for good, the highest such tier is queued again)
            await self.store.record_skip(pair.id, active.id, tier,
                                         "an update of this pair is already queued or running")
            log.info("pair %d: tier %s skipped, an update is already queued or running", pair.id, tier)
            return None
        return await self.queue.enqueue(
            JOB_KIND, job_key(pair.id), {"pair_id": pair.id, "tier": tier, "server_key": server_key}
        )
