"""Files holding people's words are created for their owner's eyes alone, and the database's place is plain."""

from __future__ import annotations

import io
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.terminal import TerminalAdapter
from bot.app import App
from bot.config import parse_config
from bot.storage import open_storage
from tests.fakes.provider import ScriptedProvider
from tests.synapse import SynapseServer
from tests.test_cli import cortexbot, write_config


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that lets everyone read new files (022, the usual one): the bot must not rely on a strict one."""
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


@pytest.mark.usefixtures("open_umask")
async def test_a_new_database_its_folders_and_its_wal_are_the_owners_alone(tmp_path: Path) -> None:
    path = tmp_path / "srv" / "cortex" / "bot.db"
    storage = await open_storage(f"sqlite:///{path}")
    try:
        await storage.migrate()
        await storage.upsert_user("console:ann", "Ann")
        assert mode(path) == 0o600 and mode(path.with_name("bot.db-wal")) == 0o600
        assert mode(tmp_path / "srv") == 0o700 and mode(tmp_path / "srv" / "cortex") == 0o700
    finally:
        await storage.close()


@pytest.mark.usefixtures("open_umask")
async def test_an_existing_database_keeps_the_mode_its_operator_gave_it(tmp_path: Path) -> None:
    path = tmp_path / "bot.db"
    path.touch(mode=0o640)
    storage = await open_storage(f"sqlite:///{path}")
    await storage.close()
    assert mode(path) == 0o640


@pytest.mark.usefixtures("open_umask")
async def test_a_saved_export_is_the_users_alone(tmp_path: Path) -> None:
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "personas": [{"name": "Cora"}]})
    screen = io.StringIO()
    exports = tmp_path / "exports" / "ann"
    async with App(config, llm=ScriptedProvider()) as app:
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO("!memory remember Ann grows figs\n"
                                                                      "!memory export\n"),
                                   stdout=screen, stderr=screen, export_dir=exports)
        assert await terminal.run() == 0
    [saved] = list(exports.iterdir())
    assert saved.name.endswith(".zip") and mode(saved) == 0o600 and mode(exports) == 0o700


async def test_a_relative_sqlite_path_is_named_in_full_and_a_new_file_there_is_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="bot.storage.sqlite"):
        storage = await open_storage("sqlite:///var/lib/cortex/bot.db")  # meant /var/lib/…: three slashes
        await storage.close()
    where = tmp_path / "var" / "lib" / "cortex" / "bot.db"
    assert storage.db.url == f"sqlite:///{where}" and where.exists()
    assert f"created at {where}" in caplog.text and "four slashes: sqlite:///" + str(where) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bot.storage.sqlite"):  # the same file again: nothing to say
        await (await open_storage("sqlite:///var/lib/cortex/bot.db")).close()
    assert caplog.text == ""


def test_doctor_says_when_others_may_read_the_database(tmp_path: Path, fake_llm) -> None:  # type: ignore[no-untyped-def]
    from bot.cli import _doctor_file_modes

    config = write_config(tmp_path, fake_llm)
    if "postgresql" in config.read_text():
        pytest.skip("an SQLite file's mode")
    config.write_text(config.read_text() + '[memory]\nembedder = "none"\n')  # (no model to load for this)
    db = tmp_path / "bot.db"

    async def create() -> None:
        await (await open_storage(f"sqlite:///{db}")).close()
    import asyncio
    asyncio.run(create())
    said: list[tuple[bool, str, str]] = []
    _doctor_file_modes(db, lambda ok, what, detail="": said.append((ok, what, detail)))
    assert mode(db) == 0o600 and said == []
    db.chmod(0o644)
    result = cortexbot("--config", str(config), "doctor")
    assert result.returncode == 1
    assert f"database file: other accounts of this machine may read {db}" in result.stdout
    assert f"chmod 600 {db}" in result.stdout


@pytest.mark.usefixtures("open_umask")
def test_a_history_file_made_again_after_a_forget_me_is_still_the_users_alone(tmp_path: Path) -> None:
    from adapters.terminal import _PrivateHistory

    path = tmp_path / "history"
    history = _PrivateHistory(str(path))
    history.store_string("first line")
    assert mode(path) == 0o600
    history.forget()
    assert not path.exists()
    history.store_string("after the forget-me")
    assert mode(path) == 0o600 and "after the forget-me" in path.read_text()


@pytest.mark.usefixtures("open_umask")
async def test_the_matrix_key_store_is_the_owners_alone_in_a_folder_made_before(synapse: SynapseServer,
                                                                                tmp_path: Path) -> None:
    """With e2ee, in a store_path folder that existed already (made by the operator, or a Docker volume) with mode
    755, nio created its key database (the bot's E2EE account and every room's keys, which nio's default passphrase
    opens) readable by every account of the machine: only a folder the bot made itself was private."""
    from bot.cli import _doctor_matrix_store
    from tests.test_matrix import start_bot, stop_bot

    store = tmp_path / "matrix"
    store.mkdir(mode=0o755)
    bot = await start_bot(synapse, tmp_path, e2ee=True)
    await stop_bot(bot)
    keys = [f for f in store.iterdir() if f.suffix == ".db"]
    assert keys, sorted(store.iterdir())
    assert mode(store) == 0o700
    assert {f.name: mode(f) for f in store.iterdir()} == {f.name: 0o600 for f in store.iterdir()}

    # A key store an earlier version left open to others is the owner's alone from the next start.
    store.chmod(0o755)
    keys[0].chmod(0o644)
    said: list[tuple[bool, str, str]] = []
    _doctor_matrix_store(bot.adapter.config, lambda ok, what, detail="": said.append((ok, what, detail)))
    assert said == [(False, "Matrix store", f"other accounts of this machine may read {store}, {keys[0]}: chmod 700 "
                                            f"{store} (the bot makes it its own at start)")], said
    again = await start_bot(synapse, tmp_path, user_id=bot.user_id, e2ee=True)
    await stop_bot(again)
    assert mode(store) == 0o700 and mode(keys[0]) == 0o600
    said.clear()
    _doctor_matrix_store(bot.adapter.config, lambda ok, what, detail="": said.append((ok, what, detail)))
    assert said == []


@pytest.mark.usefixtures("open_umask")
def test_a_matrix_store_folder_that_cannot_be_made_private_stops_the_start(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A store folder of another account (the chmod is refused) is said in one line with what to do."""
    import bot.privatefs
    from adapters.matrix import MatrixError, keep_private

    store = tmp_path / "shared"
    store.mkdir(mode=0o755)

    def refused(path: object, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(bot.privatefs.os, "chmod", refused)
    with pytest.raises(MatrixError) as info:
        keep_private(store)
    assert str(info.value) == (f"the Matrix store folder {store} holds the bot's login and keys, and others may read "
                               "it; it cannot be made private (Operation not permitted): chmod 700 it as its owner, "
                               "or set [matrix] store_path to a folder of the account running the bot")
