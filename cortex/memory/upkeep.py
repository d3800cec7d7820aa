"""Forgetting: pruning of unused items and archiving of expired ones (a daily job and ``!cortex prune``).

Rules (thresholds from ``[memory]``, ages counted from an item's last change: its creation, or a
user's pin, unpin or restore, so a restored item gets a fresh start; ``now`` from the injected
clock): an item older than ``prune_unused_days`` that was never accessed, or older than
``prune_rarely_used_days`` and accessed fewer than ``prune_min_access`` times, is archived. Pinned
items are exempt. Items past ``expires_at`` are hidden from search at once; this job also archives
them, so they show up in ``!memory archived`` with the reason. Nothing is deleted: users restore.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from bot.config import MemoryConfig
from bot.storage.core import Storage
from bot.storage.incognito import ENDED_KEPT_SECONDS
from bot.storage.memory import PruneReasons

log = logging.getLogger(__name__)

DAY = 86_400.0
LAST_PRUNE_SETTING = "memory.last_prune"


@dataclass(frozen=True, slots=True)
class PruneReport:
    at: float
    # category -> reason -> number of items archived
    archived: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(sum(reasons.values()) for reasons in self.archived.values())

    def lines(self) -> list[str]:
        when = datetime.fromtimestamp(self.at, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")
        if not self.total:
            return [f"Pruning at {when}: nothing to archive."]
        lines = [f"Pruning at {when}: archived {self.total} item(s) (restorable with memory restore):"]
        for category in sorted(self.archived):
            reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.archived[category].items()))
            lines.append(f"  {category}: {reasons}")
        return lines

    def to_json(self) -> str:
        return json.dumps({"at": self.at, "archived": self.archived})

    @classmethod
    def from_json(cls, text: str) -> PruneReport:
        data = json.loads(text)
        return cls(float(data["at"]), {str(k): {str(r): int(n) for r, n in v.items()}
                                       for k, v in data["archived"].items()})


class Pruner:
    def __init__(
        self, storage: Storage, config: MemoryConfig, *, clock: Callable[[], float] = time.time,
        on_archive: Callable[[set[int]], None] | None = None,
    ) -> None:
        self.storage = storage
        self.config = config
        self.clock = clock
        self.on_archive = on_archive  # told which pairs lost items (vector caches drop them)

    def _reasons(self) -> PruneReasons:
        c = self.config
        return PruneReasons(
            expired="expired",
            unused=f"never used in {c.prune_unused_days:g} days",
            rarely=f"used fewer than {c.prune_min_access} times in {c.prune_rarely_used_days:g} days",
        )

    async def prune(self) -> PruneReport:
        """Archive what the rules select, in one transaction; returns (and saves) the report."""
        now = self.clock()
        archived: dict[str, dict[str, int]] = {}
        pairs: set[int] = set()
        c = self.config
        pruned = await self.storage.memory.prune_items(
            now, self._reasons(), unused_before=now - c.prune_unused_days * DAY,
            rarely_before=now - c.prune_rarely_used_days * DAY, min_access=c.prune_min_access)
        for reason, category, pair_id in pruned:
            by_reason = archived.setdefault(category, {})
            by_reason[reason] = by_reason.get(reason, 0) + 1
            pairs.add(pair_id)
        report = PruneReport(now, archived)
        await self.storage.set_setting(LAST_PRUNE_SETTING, report.to_json())
        if pairs and self.on_archive is not None:
            self.on_archive(pairs)
        return report

    async def last_report(self) -> PruneReport | None:
        saved = await self.storage.get_setting(LAST_PRUNE_SETTING)
        try:
            return PruneReport.from_json(saved) if saved else None
        except (ValueError, KeyError, TypeError):
            return None


async def end_expired_incognito(storage: Storage, hours: float) -> int:
    """End the incognito stretches older than ``hours`` (their messages are deleted), and forget those that
    ended a while ago (with any message of theirs stored after their end); how many ended or were forgotten
    with such a message."""
    ended = 0
    for user_id, persona in await storage.incognito.expired(time.time() - hours * 3600):
        if await storage.end_incognito(user_id, persona) is not None:
            ended += 1
    late = await storage.sweep_ended_incognito(time.time() - ENDED_KEPT_SECONDS)
    if ended or late:
        await storage.scrub()
    if ended:
        log.info("ended %d incognito stretch(es) that ran past %g hours", ended, hours)
    if late:
        log.info("deleted %d message(s) sent in an incognito stretch and stored after its end", late)
    return ended + late


async def expire_old_messages(storage: Storage, days: float) -> int:
    """Delete raw messages older than ``days`` (0: keep them); the files, items and summaries stay."""
    if days <= 0:
        return 0
    deleted = await storage.delete_messages_before(time.time() - days * 86_400)
    if deleted:
        await storage.scrub()
        log.info("deleted %d message(s) older than %g days (memory.keep_messages_days)", deleted, days)
    return deleted
