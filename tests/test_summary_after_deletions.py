"""Rolling summaries after old messages are deleted (retention, withdrawals): the positions they cover."""

from __future__ import annotations

from pathlib import Path

import pytest

from bot.app import App
from bot.llm.base import Completion, Usage
from tests.fakes.provider import ScriptedProvider
from tests.test_conversation import _config, _msg, is_summary

pytestmark = pytest.mark.both_engines


async def test_summaries_keep_coming_after_retention_deletes_old_messages(tmp_path: Path) -> None:
    """Retention (`keep_messages_days`) deletes old messages but keeps the summaries: the channel's positions
    must not restart below what the last summary covers, or no summary is written for as many messages as
    were deleted, and everything that leaves the window meanwhile is in neither the window nor a summary."""
    llm = ScriptedProvider()
    llm.default = lambda r: Completion(text="kurz." if is_summary(r) else "antwort " * 30, usage=Usage(0, 1))
    async with App(_config(tmp_path), llm=llm) as app:
        for i in range(30):
            await app.core.reply(_msg(f"Nachricht {i} " + "text " * 20)).text()
            assert await app.workers.drain(5)
        channel = await app.storage.get_channel("console:c1")
        before = await app.storage.list_summaries(channel.id)
        assert before
        covered = max(s.covers_to_id for s in before)
        old = [m for m in await app.storage.recent_messages(channel.id, 1000) if m.id <= covered]
        cutoff = max(m.created_at for m in old).timestamp() + 1e-6
        assert await app.storage.delete_messages_before(cutoff) == len(old)
        for i in range(30, 60):
            await app.core.reply(_msg(f"Nachricht {i} " + "text " * 20)).text()
            assert await app.workers.drain(5)
        after = [s for s in await app.storage.list_summaries(channel.id) if s.status == "ok"]
        latest = after[-1]
        # the latest summary reaches close to the window: nothing that left it waits for more than a batch or two
        window_oldest = min(m.id for m in (await app.storage.recent_messages(channel.id, 12)))
        uncovered = await app.storage.count_messages_between(channel.id, latest.covers_to_id, window_oldest)
        assert uncovered <= 10, (len(before), len(after), uncovered)
