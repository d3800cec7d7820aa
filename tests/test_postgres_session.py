"""What a pooled PostgreSQL connection keeps once given back (no RESET ALL): no transaction, no lock."""

from __future__ import annotations

import asyncio

import pytest

from bot.storage import Storage


@pytest.fixture
def pg(pg_storage: Storage) -> Storage:
    return pg_storage


async def _advisory_locks(pg_url: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"))
    finally:
        await conn.close()


async def _locks_settle(pg_url: str, seconds: float = 5.0) -> int:
    """Advisory locks still held once the server had time to end what a cancelled task left running (a
    terminated connection's backend goes when it notices; a held lock stays for good)."""
    held = await _advisory_locks(pg_url)
    for _ in range(int(seconds / 0.05)):
        if not held:
            break
        await asyncio.sleep(0.05)
        held = await _advisory_locks(pg_url)
    return held


async def test_cancel_mid_transaction_leaves_nothing(pg: Storage, pg_url: str) -> None:
    async def work() -> None:
        async with pg.db.transaction() as tx:
            await tx.execute("INSERT INTO settings (key, value, updated_at) VALUES ('x', 'y', 0)")
            await tx.execute("SELECT pg_advisory_xact_lock(42)")
            await tx.execute("SELECT pg_sleep(5)")

    for delay in (0.0, 0.001, 0.01, 0.05, 0.2):
        task = asyncio.create_task(work())
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(12):
            row = await pg.db.fetch_one("SELECT now() = statement_timestamp(), (SELECT count(*) FROM settings"
                                        " WHERE key = 'x')")
            assert row[1] == 0
            assert row[0] is False  # not inside an old transaction
    assert await _locks_settle(pg_url) == 0


async def test_cancel_maintain_mid_statement_releases_its_lock(pg: Storage, pg_url: str) -> None:
    for delay in (0.0, 0.001, 0.005, 0.02, 0.2):
        task = asyncio.create_task(pg.db.maintain("SELECT pg_sleep(3)", lock="t", when="SELECT true"))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _locks_settle(pg_url) == 0, delay


async def test_cancel_landing_on_the_lock_query_leaks_no_session_lock(
        pg: Storage, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task is cancelled while pg_try_advisory_lock runs: the server grants the lock, the client sees
    CancelledError. With RESET ALL gone, nothing releases that session lock."""
    import asyncpg

    real = asyncpg.Connection.fetchval

    async def fetchval(self, query, *args, **kwargs):  # type: ignore[no-untyped-def]
        value = await real(self, query, *args, **kwargs)
        if "pg_try_advisory_lock" in query:
            raise asyncio.CancelledError
        return value

    monkeypatch.setattr(asyncpg.Connection, "fetchval", fetchval)
    with pytest.raises(asyncio.CancelledError):
        await pg.db.maintain("SELECT 1", lock="leak", when="SELECT true")
    monkeypatch.setattr(asyncpg.Connection, "fetchval", real)
    assert await _locks_settle(pg_url) == 0


async def test_real_cancellation_race_on_the_lock(pg: Storage, pg_url: str) -> None:
    leaked = []
    for spins in range(0, 40):
        task = asyncio.create_task(pg.db.maintain("SELECT 1", lock=f"race{spins}", when="SELECT true"))
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        if await _locks_settle(pg_url):
            leaked.append(spins)
            break
    assert not leaked, leaked
