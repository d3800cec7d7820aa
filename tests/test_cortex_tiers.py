"""Tier arithmetic and the tier engine on real SQLite."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bot.app import App
from bot.config import CortexConfig, parse_config
from bot.ports import IncomingMessage
from cortex.store import Pair
from cortex.tiers import decide, thresholds, tier_stage
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider

pytestmark = pytest.mark.both_engines


def _pair(count: int, fired: tuple[int, ...] = (), cycle: int = 1) -> Pair:
    return Pair(1, 1, "Cora", cycle, count, fired)


@pytest.mark.parametrize(
    "limit, expected",
    [(60, [30, 45, 57]), (10, [5, 7, 9]), (4, [2, 3, 3]), (1000, [500, 750, 950]), (65, [32, 48, 61])],
)
def test_thresholds_are_floored_percentages(limit: int, expected: list[int]) -> None:
    assert [at for _, at in thresholds(CortexConfig(context_limit=limit))] == expected


@pytest.mark.parametrize(
    "frequency, tiers", [("frequent", (25, 50, 75, 95)), ("medium", (50, 75, 95)), ("rare", (95,))]
)
def test_presets_choose_the_tier_set(frequency: str, tiers: tuple[int, ...]) -> None:
    settings = CortexConfig(frequency=frequency)  # type: ignore[arg-type]
    assert settings.tier_percentages() == tiers
    assert CortexConfig(frequency=frequency, tiers=[30, 60]).tier_percentages() == (30, 60)  # type: ignore[arg-type]


def test_each_tier_fires_once_per_cycle_then_a_new_cycle_starts() -> None:
    settings = CortexConfig(context_limit=10)  # tiers at 5, 7, 9
    pair = _pair(0)
    fired = []
    for _ in range(15):  # 30 messages: three cycles
        pair = Pair(pair.id, pair.user_id, pair.persona, pair.cycle, pair.cycle_count + 2, pair.fired_tiers)
        decision = decide(pair, settings)
        if decision.fire:
            fired.append((pair.cycle, decision.fire))
        pair = decision.state
    # counts 2,4,6(50%),8(75%),10(95% and cycle ends) per cycle
    assert fired == [(1, 50), (1, 75), (1, 95), (2, 50), (2, 75), (2, 95), (3, 50), (3, 75), (3, 95)]
    assert pair.cycle == 4 and pair.cycle_count == 0


def test_several_tiers_reached_at_once_fire_only_the_highest() -> None:
    settings = CortexConfig(context_limit=4)  # tiers at 2, 3, 3
    decision = decide(_pair(4), settings)
    assert decision.fire == 95
    assert decision.state.cycle == 2 and decision.state.fired_tiers == ()


def test_limit_lowered_mid_cycle() -> None:
    pair = _pair(30, fired=(50,))  # reached 50 % of 60
    decision = decide(pair, CortexConfig(context_limit=20))  # now 30 >= 19: the highest unfired fires, cycle ends
    assert decision.fire == 95 and decision.state.cycle == 2
    raised = decide(_pair(30, fired=(50,)), CortexConfig(context_limit=200))  # 30 < 100: nothing more yet
    assert raised.fire is None and raised.state.fired_tiers == (50,) and raised.state.cycle == 1


def test_frequency_changed_mid_cycle_keeps_fired_tiers() -> None:
    pair = _pair(46, fired=(50, 75))
    assert decide(pair, CortexConfig(frequency="frequent")).fire is None  # 25 counts as done with 50
    assert decide(pair, CortexConfig(frequency="frequent")).state.fired_tiers == (25, 50, 75)


def test_tier_stages() -> None:
    medium = CortexConfig()
    assert [tier_stage(str(t), medium) for t in (50, 75, 95)] == ["early", "deepening", "last"]
    assert tier_stage("manual", medium) == "manual"
    assert tier_stage("95", CortexConfig(frequency="rare")) == "last"


def _config(tmp_path: Path, **cortex) -> object:
    return parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "cortex": {"context_limit": 10, "cooldown_seconds": 0, **cortex},
        "jobs": {"poll_seconds": 0.05},
    })


def _msg(text: str, user: str = "ann") -> IncomingMessage:
    return IncomingMessage("console", f"dm-{user}", user, user.title(), text, is_dm=True)


async def test_engine_fires_marks_and_enqueues_and_survives_restart(tmp_path: Path) -> None:
    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as app:
        await app.workers.stop()  # keep jobs queued so they can be inspected
        for i in range(3):
            await app.core.reply(_msg(f"hello {i}")).text()  # 6 messages: tier 50 % (5) fired
        jobs = await app.storage.list_jobs("queued")
        assert [(j.kind, j.payload["tier"]) for j in jobs] == [("cortex_update", "50")]
        user = await app.storage.get_user("console:ann")
        pair = await app.cortex.store.get_pair(user.id, "Cora")
        assert pair.cycle_count == 6 and pair.fired_tiers == (50,)
        # (not due for an hour: the next App's workers, which start with it, must not run it before they stop)
        await app.storage.db.write("UPDATE jobs SET run_after = ? WHERE kind = 'cortex_update'", (time.time() + 3600,))
    # a restart keeps the cycle: 2 more messages reach 75 % (7)
    async with App(config, llm=ScriptedProvider()) as app:
        await app.workers.stop()
        await app.core.reply(_msg("again")).text()
        pair = await app.cortex.store.get_pair((await app.storage.get_user("console:ann")).id, "Cora")
        assert pair.cycle_count == 8 and pair.fired_tiers == (50, 75)
        # the 50 % job is still queued: the 75 % tier is recorded as skipped, not queued twice
        runs = await app.cortex.store.runs(pair.id)
        assert [(r.tier, r.status) for r in runs] == [("75", "skipped")]
        assert "already queued or running" in runs[0].reason
        assert len(await app.storage.list_jobs("queued")) == 1


async def test_disabled_cortex_counts_nothing(tmp_path: Path) -> None:
    async with App(_config(tmp_path, enabled=False), llm=ScriptedProvider()) as app:
        for i in range(6):
            await app.core.reply(_msg(f"hello {i}")).text()
        assert await app.storage.list_jobs() == []
        user = await app.storage.get_user("console:ann")
        assert await app.cortex.store.get_pair(user.id, "Cora") is None


async def test_pairs_are_per_user_and_persona(tmp_path: Path) -> None:
    config = parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "cortex": {"context_limit": 100},
        "personas": [{"name": "Cora"}, {"name": "Max"}],
    })
    async with App(config, llm=ScriptedProvider()) as app:
        await app.core.reply(_msg("hi"), "Cora").text()
        await app.core.reply(_msg("hi"), "Max").text()
        await app.core.reply(_msg("hi", user="bob"), "Cora").text()
        ann = await app.storage.get_user("console:ann")
        bob = await app.storage.get_user("console:bob")
        counts = {
            (u, p): (await app.cortex.store.get_pair(uid, p)).cycle_count
            for u, uid in (("ann", ann.id), ("bob", bob.id)) for p in ("Cora", "Max")
            if await app.cortex.store.get_pair(uid, p)
        }
        assert counts == {("ann", "Cora"): 2, ("ann", "Max"): 2, ("bob", "Cora"): 2}


async def test_tiers_held_back_by_an_update_that_then_failed_are_queued_again(tmp_path: Path) -> None:
    """An operator's finding: while an update was queued (or retrying through an outage), the tiers reached meanwhile
    were recorded as skipped; when it then failed for good (here at once: the model is gone), nothing made up for
    them, and the conversation they should have read could leave the next update's window."""
    from bot.llm.base import Completion, LLMRequest
    from bot.llm.errors import LLMBadRequest

    llm = ScriptedProvider()

    def answer(request: LLMRequest) -> Completion:
        if any(tool.name == "write_file" for tool in request.tools):  # a cortex update: the model is gone
            raise LLMBadRequest("model not found", status_code=404)
        return Completion(text="ok")

    llm.default = answer
    async with App(_config(tmp_path), llm=llm) as app:
        await app.workers.stop()  # the first update stays queued while the conversation goes on
        for i in range(4):
            await app.core.reply(_msg(f"hello {i}")).text()  # tier 50 % queued, then 75 % skipped
        await app.workers.start()
        assert await app.workers.drain(10)
        jobs = sorted(await app.storage.list_jobs(), key=lambda j: j.id)
        assert [(j.payload["tier"], j.status) for j in jobs] == [("50", "failed"), ("75", "failed")]
        # (the second failed with nothing held back during it: no third)


async def test_tiers_held_back_by_an_update_interrupted_on_its_last_attempt_are_queued_again(tmp_path: Path) -> None:
    """The same when the update fails for good because its worker stopped on its last attempt (its lease ran out and
    the recovery marks it failed): the highest tier it held back is queued again."""
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        await app.workers.stop()
        for i in range(4):
            await app.core.reply(_msg(f"hello {i}")).text()  # tier 50 % queued, then 75 % skipped
        [held] = await app.storage.list_jobs()
        await app.storage.db.write(  # (claimed by a worker that is gone, its lease over, on its last attempt)
            "UPDATE jobs SET status = 'running', locked_by = 'gone-host:1:x', lease_until = 1, attempts = max_attempts"
            " WHERE id = ?", (held.id,))
        await app.workers.recover()
        jobs = sorted(await app.storage.list_jobs(), key=lambda j: j.id)
        assert [(j.payload["tier"], j.status) for j in jobs] == [("50", "failed"), ("75", "queued")]
