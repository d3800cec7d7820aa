"""!memory why: every reply records what went into its prompt (ids only); the caller sees it, privately,
with how to correct each piece."""

from __future__ import annotations

from pathlib import Path

import pytest

from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.ports import IncomingMessage
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider

pytestmark = pytest.mark.both_engines


def ctx(user: str = "ann", *, admin: bool = False) -> CommandContext:
    return CommandContext("discord", f"discord:{user}", user.title(), f"discord:dm-{user}", "Cora", is_dm=True,
                          is_admin=admin, is_bot_admin=admin)


async def test_why_names_the_items_files_and_lore_behind_a_reply(tmp_path: Path) -> None:
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        async def run(line: str, context: CommandContext | None = None) -> str:
            return (await app.commands.dispatch(line, context or ctx())).text

        async def say(text: str) -> None:
            await app.core.reply(IncomingMessage("discord", "dm-ann", "ann", "Ann", text, is_dm=True)).text()

        assert "not answered you here yet" in await run("!memory why")
        await say("hello")
        assert "used no memory" in await run("!memory why")
        await run("!memory remember --pin Ann is allergic to penicillin")
        await run("!memory edit memory.md\n# My memories of Ann\n- Ann runs marathons")
        await run("!lore add The clinic opens at eight. --keys clinic", ctx("root", admin=True))
        await say("should I go to the clinic?")
        why = await run("!memory why")
        assert "memory item #1: Ann is allergic to penicillin — wrong? !memory forget 1" in why
        assert "your memory.md, version 2" in why and "lore #1" in why
        assert "penicillin" not in await run("!memory why", ctx("bob"))  # only one's own replies
        await run("!memory forget 1")
        assert "#1 (forgotten since; !memory restore 1" in await run("!memory why")
        assert "Done" in await run("!memory forget-me confirm")  # its records go with the replies
        assert "not answered you here yet" in await run("!memory why")


async def test_why_says_an_item_corrected_since_was_corrected_not_that_restore_brings_it_back(tmp_path: Path
                                                                                          ) -> None:
    """"forgotten since; !memory restore 1 brings it back" was said of an item the persona had corrected, which
    !memory restore refuses; and of one that had expired, which no one forgot."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        async def run(line: str) -> str:
            return (await app.commands.dispatch(line, ctx())).text

        await run("!memory remember --pin Ann drinks tea")
        await run("!memory remember --pin Ann's exam is on Friday")
        await app.core.reply(IncomingMessage("discord", "dm-ann", "ann", "Ann", "hello", is_dm=True)).text()
        account = await app.storage.get_user("discord:ann")
        pair = await app.cortex.store.get_pair(account.id, "Cora")
        assert pair is not None
        await app.cortex.memory.remember(pair.id, "Ann drinks coffee", supersedes=1, source="model")
        await app.storage.db.write("UPDATE memory_items SET expires_at = ? WHERE id = ?", (1.0, 2))
        why = await run("!memory why")
        assert "- memory item #1 (corrected since by #3)" in why and "restore 1" not in why, why
        assert "- memory item #2 (expired since; !memory restore 2 brings it back)" in why, why
