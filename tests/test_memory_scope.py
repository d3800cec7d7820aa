"""A privacy scope per memory item: private items stay in DMs, shared ones may enter group channels,
and a group prompt never holds another user's items."""

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


def ctx(user: str, *, dm: bool) -> CommandContext:
    return CommandContext("discord", f"discord:{user}", user.title(), "discord:dm" if dm else "discord:chan1",
                          "Cora", is_dm=dm, server_key=None if dm else "discord:guild1", seen_by_all=not dm)


async def prompt(app: App, llm: ScriptedProvider, user: str, *, dm: bool) -> str:
    message = IncomingMessage("discord", f"dm-{user}" if dm else "chan1", user, user.title(), "hello",
                              is_dm=dm, server_id=None if dm else "guild1", mentions_bot=True)
    await app.core.reply(message).text()
    return llm.requests[-1].system


async def test_private_items_stay_out_of_group_channels(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=llm) as app:
        async def run(line: str, context: CommandContext) -> str:
            return (await app.commands.dispatch(line, context)).text

        assert "Remembered as #1" in await run("!memory remember --pin my diagnosis is asthma", ctx("ann", dm=True))
        assert "Remembered as #2" in await run("!memory remember --pin I love jazz", ctx("ann", dm=False))
        listed = await run("!memory list", ctx("ann", dm=True))
        assert "(shared) I love jazz" in listed and "(shared) my diagnosis" not in listed
        in_dm = await prompt(app, llm, "ann", dm=True)
        assert "asthma" in in_dm and "jazz" in in_dm
        in_group = await prompt(app, llm, "ann", dm=False)
        assert "jazz" in in_group and "asthma" not in in_group
        assert "jazz" not in await prompt(app, llm, "bob", dm=False)  # never another user's items
        assert "#1 is shared now" in await run("!memory scope 1 shared", ctx("ann", dm=True))
        assert "asthma" in await prompt(app, llm, "ann", dm=False)
        assert "#1 is private now" in await run("!memory scope 1 private", ctx("ann", dm=True))
        assert "asthma" not in await prompt(app, llm, "ann", dm=False)
        assert "give the scope" in await run("!memory scope 1 public", ctx("ann", dm=True))
        assert "no memory item #2" in await run("!memory scope 2 private", ctx("bob", dm=True))


async def test_many_private_pins_never_push_a_shared_pin_out_of_a_group_prompt(tmp_path: Path) -> None:
    """A reply reads at most 100 pinned items, the most important first, and dropped the private ones after:
    100 more important private pins kept every shared pin out of the group channel's prompt."""
    llm = ScriptedProvider()
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "memory": {"embedder": "none"}})
    async with App(config, llm=llm) as app:
        _, pair = await app.cortex.store.pair_for("discord:ann", "Ann", "Cora")
        for i in range(101):
            await app.cortex.memory.remember(pair.id, f"private detail number {i}", importance=9, pinned=True)
        await app.cortex.memory.remember(pair.id, "Ann plays the cello", importance=5, pinned=True, scope="shared")
        in_group = await prompt(app, llm, "ann", dm=False)
        assert "cello" in in_group and "private detail" not in in_group
        in_dm = await prompt(app, llm, "ann", dm=True)  # (more pins than a reply reads: the prompt says so)
        assert "private detail number 0" in in_dm and "(and more memories that did not fit here)" in in_dm


async def test_a_message_of_function_words_recalls_nothing_by_its_words(tmp_path: Path) -> None:
    """On SQLite "how are you?" kept its function words as terms when nothing else was left: any item holding
    "are" matched by words (which skips the relevance floor) and went into the reply's prompt."""
    llm = ScriptedProvider()
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "memory": {"embedder": "none"}})
    async with App(config, llm=llm) as app:
        _, pair = await app.cortex.store.pair_for("discord:ann", "Ann", "Cora")
        await app.cortex.memory.remember(pair.id, "Ann's parents are both doctors in Berlin")
        message = IncomingMessage("discord", "dm-ann", "ann", "Ann", "how are you?", is_dm=True)
        await app.core.reply(message).text()
        assert "doctors" not in llm.requests[-1].system
        assert await app.cortex.memory.search(pair.id, "how are you?", include_messages=False) == []
        asked = await app.cortex.memory.search(pair.id, "are", include_messages=False, patient=True)
        # (someone's own search keeps them: PostgreSQL's configuration drops them from what it stores, and reads
        # the newest rows' words as written instead)
        assert [h.text for h in asked] == ["Ann's parents are both doctors in Berlin"]


async def test_many_private_matches_never_push_a_shared_item_out_of_a_group_search(tmp_path: Path) -> None:
    """The candidates of a group channel's search are the shared items alone: many private items about the
    garden (more than a search takes as candidates) once hid the one shared item about it."""
    from cortex.memory.embedders import HashEmbedder

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}})
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        _, pair = await app.cortex.store.pair_for("discord:ann", "Ann", "Cora")
        memory = app.cortex.memory
        for i in range(150):  # more than a search takes as text (50) and as vector (100) candidates
            await memory.remember(pair.id, f"Ann's garden, Ann's garden {i}", category="fact")
        shared = await memory.remember(pair.id, "On Sundays Ann opens the old garden behind her house to the "
                                       "visitors of the village fair", category="fact", scope="shared")
        await app.cortex.embeddings.backfill()
        hits = await memory.search(pair.id, "Ann's garden", scopes=("shared",), include_messages=False)
        assert [h.id for h in hits] == [shared.id]
        everything = await memory.search(pair.id, "Ann's garden", include_messages=False)
        assert len(everything) == 10  # in a DM every item competes


async def test_a_shared_item_found_by_meaning_alone_is_not_lost_behind_many_private_ones(tmp_path: Path) -> None:
    """On SQLite the vector part took the best 400 of all the pair's vectors and dropped the private ones after:
    450 private items closer to the query left the one shared item, which shares no word with it, out."""
    from cortex.memory.embedders import HashEmbedder

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}})
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        _, pair = await app.cortex.store.pair_for("discord:ann", "Ann", "Cora")
        memory = app.cortex.memory
        for i in range(450):
            await memory.remember(pair.id, f"photography photography {i}", category="fact")
        shared = await memory.remember(pair.id, "an old photograph album", category="fact", scope="shared")
        await app.cortex.embeddings.backfill()
        hits = await memory.search(pair.id, "photography", scopes=("shared",), include_messages=False)
        assert [h.id for h in hits] == [shared.id]


async def test_what_is_stored_is_found_after_the_personas_language_changes(tmp_path: Path) -> None:
    """PostgreSQL stems words by the persona's language when a row is written: after the language changed,
    queries were stemmed the new way and the old rows' stems ("running" stored as English "run") met nothing."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "memory": {"embedder": "none"}})
    async with App(config, llm=ScriptedProvider()) as app:
        _, pair = await app.cortex.store.pair_for("discord:ann", "Ann", "Cora")
        memory = app.cortex.memory
        await app.core.reply(IncomingMessage("discord", "dm-ann", "ann", "Ann", "I went running by the rivers",
                                             is_dm=True)).text()
        user = await app.storage.get_user("discord:ann")
        assert user is not None
        item = await memory.remember(pair.id, "Ann loves running every morning")

        async def found(query: str) -> list[str]:
            app.storage.memory._ts_configs.clear()  # (a minute's cache of each persona's configuration)
            hits = await memory.search(pair.id, query, user_id=user.id, persona="Cora")
            return sorted(h.text for h in hits)

        before = await found("running rivers")
        assert item.content in before and "Ann: I went running by the rivers" in before
        await app.storage.upsert_persona("Cora", "German")
        assert await found("running rivers") == before
        row = await app.storage.personas.get_persona("Cora")
        assert row is not None
        await app.storage.personas.update_persona(row.id, "English", {}, "english")
        assert await found("running rivers") == before
