"""Personas as data: seeding from config across restarts, versioned soul sections, the commands and
who may use them, the prompt the model receives, threads inheriting their channel's persona."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from bot.app import App
from bot.commands import CommandContext
from bot.config import Config, ConfigError, parse_config
from bot.policy import Inbound
from bot.ports import IncomingMessage
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider
from tests.test_router import Sink

pytestmark = pytest.mark.both_engines


def _config(tmp_path: Path, identity: str = "You are {char_name}, a gardener.", **persona: Any):
    return parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "cortex": {"context_limit": 1000},
        "personas": [{"name": "Cora", "identity": identity, "tone": "Warm.", **persona},
                     {"name": "Max", "identity": "You are {char_name}."}],
    })


def ctx(admin: bool = True, bot_admin: bool = True, persona: str = "Cora") -> CommandContext:
    return CommandContext("discord", "discord:7", "Ann", "discord:chan1", persona, is_admin=admin,
                          is_bot_admin=bot_admin, server_key="discord:guild1")


async def run(app: App, line: str, context: CommandContext | None = None) -> str:
    return (await app.commands.dispatch(line, context or ctx())).text


async def system_prompt(app: App, llm: ScriptedProvider, persona: str = "Cora") -> str:
    await app.core.reply(IncomingMessage("discord", "dm-ann", "7", "Ann", "hello", is_dm=True), persona).text()
    return llm.requests[-1].system


async def test_seeding_twice_duplicates_nothing(tmp_path: Path) -> None:
    for _ in range(2):
        async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
            assert app.personas.names() == ["Cora", "Max"]
            history = await run(app, "!persona history")
    assert history.count(" v1 ") == 2 and " v2 " not in history  # identity and tone, once each


async def test_a_changed_config_section_becomes_a_new_version(tmp_path: Path) -> None:
    async with App(_config(tmp_path), llm=ScriptedProvider()):
        pass
    llm = ScriptedProvider()
    async with App(_config(tmp_path, identity="You are {char_name}, a beekeeper."), llm=llm) as app:
        assert "You are Cora, a beekeeper." in await system_prompt(app, llm)
        history = await run(app, "!persona history identity")
        assert "identity v2" in history and "by config" in history


async def test_an_admins_edit_survives_a_config_change_and_the_log_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        assert "version 2" in await run(app, "!persona edit identity You are {char_name}, a potter.")
    llm = ScriptedProvider()
    with caplog.at_level(logging.WARNING, logger="cortex.personas.registry"):
        async with App(_config(tmp_path, identity="You are {char_name}, a beekeeper."), llm=llm) as app:
            system = await system_prompt(app, llm)
            assert "You are Cora, a potter." in system and "beekeeper" not in system
            history = await run(app, "!persona history identity")
            assert "identity v3" in history and "identity v4" in history and "kept the chat edit" in history
            assert "back to version 3" in await run(app, "!persona revert identity 3")  # take the config's text
            assert "You are Cora, a beekeeper." in await system_prompt(app, llm)
    assert "the chat edit stays" in caplog.text and "!persona revert identity 3" in caplog.text


async def test_a_section_the_config_leaves_empty_keeps_its_chat_text_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A section the config never set (values = "", as in config.example.toml) and an admin wrote in chat: the
    next start stored the config's empty text as a version of its own, put the chat text back on top of it and
    warned that the section "changed in the config file", which nobody had touched."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        assert "version 1" in await run(app, "!persona edit values Kindness first.")
    with caplog.at_level(logging.WARNING, logger="cortex.personas.registry"):
        async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
            history = await run(app, "!persona history values")
    assert "values v1" in history and "values v2" not in history, history
    assert "changed in the config file" not in caplog.text


async def test_the_note_on_variables_names_exactly_what_the_prompt_leaves_as_written(tmp_path: Path) -> None:
    """The note listed {char} and {user} as variables, but only {{char}} and {{user}} are filled; {Language}
    and {CHAR_NAME} passed without a note and stayed as written."""
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        reply = await run(app, "!persona edit quirk {char} and {Language} and {CHAR_NAME}, {{CHAR}} in {{language}}"
                               " for {user_name}, {{mood}}.")
        assert "Note: {char}, {Language}, {CHAR_NAME}, {{mood}} are no template variables and stay as written" in reply
        assert "{char_name}" in reply and "{{char}}" in reply  # what to write instead
        system = await system_prompt(app, llm)
        assert "{char} and {Language} and {CHAR_NAME}, Cora in English for Ann, {{mood}}." in system
        assert "Note" not in await run(app, "!persona edit quirk {{char}} likes {{User}} on {date}.")


async def test_edit_history_revert_change_the_prompt_at_once(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        assert "Cora: section tone is now version 2" in await run(app, "!persona edit tone Dry and {{mood}}.")
        assert "{mood} is no template variable" in await run(app, "!persona edit tone Dry and {mood}.")
        await run(app, "!persona edit backstory Grew up in Lyon.")  # a free-form section
        system = await system_prompt(app, llm)
        assert "## Tone\nDry and {mood}." in system and "## Backstory\nGrew up in Lyon." in system
        assert system.index("## Identity") < system.index("## Tone") < system.index("## Backstory")
        shown = await run(app, "!persona show")
        assert "Tone [tone] (version 3, discord:7" in shown and "Grew up in Lyon." in shown
        assert "back to version 1's text (as version 4)" in await run(app, "!persona revert tone v1")
        assert "## Tone\nWarm." in await system_prompt(app, llm)
        again = await run(app, "!persona revert tone 1")  # holds that text already: no version 5 of the same
        assert "section tone holds version 1's text already (as version 4); nothing changed." in again
        assert "v5" not in await run(app, "!persona history tone")
        assert "no version 9" in await run(app, "!persona revert tone 9")
        assert "at most 20,000" in await run(app, "!persona edit tone " + "x" * 20_001)
        assert "a section is one word" in await run(app, "!persona edit ../../etc hi")
        assert "did you mean identity?" in await run(app, "!persona edit identiy You are a pirate.")
        assert "No history for Cora section identiy. Did you mean identity?" in await run(
            app, "!persona history identiy")
        unknown = await run(app, "!persona history bogus")  # not "no history": there is no such section
        assert unknown.startswith("Cora has no section `bogus`; the sections are identity,"), unknown
        assert "backstory" in unknown
        asked = await run(app, "!persona edit tone")  # no text: asked for, not emptied
        assert "Give the new text of tone" in asked and "--empty" in asked
        assert "either the new text or --empty" in await run(app, "!persona edit tone Be warm, say --empty")
        assert "did you mean boundaries?" in await run(app, "!persona edit boundary Be kind.")
        assert "section tone emptied" in await run(app, "!persona edit --empty tone")
        assert "has no section hobbies to empty (a new section needs its text)" in await run(
            app, "!persona edit hobbies --empty")
        assert "section backstory is now version 2" in await run(app, "!persona edit backstory Grew up\nin Lyon.")


async def test_who_may_do_what(tmp_path: Path) -> None:
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        member, server_admin = ctx(admin=False, bot_admin=False), ctx(admin=True, bot_admin=False)
        for line in ("!persona list", "!persona show", "!persona history", "!persona edit tone Rude."):
            assert "admins only" in await run(app, line, member)
        assert "Cora" in await run(app, "!persona list", server_admin)
        for line in ("!persona edit tone Rude.", "!persona create Evil", "!persona revert tone 1",
                     "!persona delete Max"):
            assert "for the bot's admins only" in await run(app, line, server_admin)
        assert "Rude" not in await run(app, "!persona show", server_admin)
        helped = await run(app, "!help", server_admin)
        assert "!persona show" in helped and "!persona edit" not in helped


async def test_create_pick_delete(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        assert "Persona Nova created" in await run(app, "!persona create Nova")
        taken = await run(app, "!persona create nova")  # named as it is spelled, where "nova" was said to exist
        assert taken.startswith("a persona called `Nova` exists already (`nova` is the same name: case does not"), taken
        alike = await run(app, "!persona create N\u043eva")  # a Cyrillic о
        assert "a persona called `Nova` exists already (`N\u043eva` is the same name: letters that look alike" in alike
        assert "exists already" in await run(app, "!persona create Nova")
        for name in ("History Buff", "list", "EXPORT me"):  # "!persona History Buff" would run !persona history
            assert "is a command, so nobody could pick it" in await run(app, f"!persona create {name}")
        assert "on one line" in await run(app, "!persona create Ada\nLovelace")
        assert "section identity is now version 1" in await run(app, "!persona edit identity You are {char_name}.",
                                                                 ctx(persona="Nova"))
        sink = Sink()
        await app.router.handle(_inbound("!persona Nova", admin=True), sink)
        assert "Nova now answers" in sink.public[0].text
        await app.router.handle(_inbound("hi", mention=True), Sink())
        assert "You are Nova." in llm.requests[-1].system
        assert "comes from the config file" in await run(app, "!persona delete Max")
        # picked for a channel (or in any member's DMs: one could keep the admins from deleting it): the pick goes
        bobs_dm = CommandContext("discord", "discord:8", "Bob", "discord:dm-bob", "Cora", is_dm=True)
        assert "you now talk to Nova" in await run(app, "!persona Nova", bobs_dm)
        reply = await app.commands.dispatch("!persona delete Nova", ctx())  # (Bob's pick is his: not named)
        deleted = reply.text
        assert reply.private  # (in a server's channel: the places may be other servers' channels and rooms)
        assert deleted.startswith("Persona Nova deleted") and deleted.endswith(
            "The 2 place(s) that had picked it (channel discord:chan1; the direct messages of 1 member) now talk "
            "to Cora."), deleted
        assert "discord:8" not in deleted
        await app.router.handle(_inbound("hi", mention=True), Sink())
        assert "You are Cora, a gardener." in llm.requests[-1].system
        assert "Nova" not in await run(app, "!persona list") and app.personas.names() == ["Cora", "Max"]
        back = await run(app, "!persona create Nova")  # its soul came back with it: not "give it a soul"
        assert back.startswith("Persona Nova is back (English), with the soul it had when it was deleted"), back
        assert "give it a soul" not in back


async def test_names_that_differ_only_in_unicode_case_are_one_persona(tmp_path: Path) -> None:
    """SQL folds only ASCII letters, the registry all of Unicode: "!persona create ZOË" made a second row
    that hid the config's Zoë (its soul gone from every prompt) and could not be deleted."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)},
                           "personas": [{"name": "Zoë", "identity": "You are Zoë, a gardener."},
                                        {"name": "Straße", "identity": "You are a street."}]})
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        for name in ("ZOË", "STRASSE", "zoë", "Zoe\u0308", "ZOE\u0308"):  # (also as e and a combining diaeresis)
            assert "exists already" in await run(app, f"!persona create {name}", ctx(persona="Zoë"))
        assert "Persona Corá created" in await run(app, "!persona create Cora\u0301", ctx(persona="Zoë"))
        assert "Persona Corá deleted" in await run(app, "!persona delete Corá", ctx(persona="Zoë"))
        assert app.personas.names() == ["Zoë", "Straße"]
        assert "You are Zoë, a gardener." in await system_prompt(app, llm, "Zoë")
        assert "Persona Élan created" in await run(app, "!persona create Élan", ctx(persona="Zoë"))
        assert "exists already" in await run(app, "!persona create éLAN", ctx(persona="Zoë"))
        assert "Persona Élan deleted" in await run(app, "!persona delete ÉLAN", ctx(persona="Zoë"))
        revived = await run(app, "!persona create éLAN", ctx(persona="Zoë"))  # the deleted one comes back
        assert "Persona Élan created" in revived and app.personas.names() == ["Zoë", "Straße", "Élan"]
        rows = await app.storage.db.fetch_all("SELECT name FROM personas ORDER BY id")
        assert [r[0] for r in rows] == ["Zoë", "Straße", "Corá", "Élan"]  # Corá deleted, stored as one "á"


async def test_a_look_alike_name_is_the_persona_it_looks_like(tmp_path: Path) -> None:
    """"Сora" with a Cyrillic С, or "Ｃｏｒａ" in full-width letters, made a second persona that passed for Cora
    in every list and reply; now each is Cora's name, typed another way."""
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        # Сora, Cоrа, Ｃｏｒａ, Μαx
        for name in ("\u0421ora", "C\u043er\u0430", "\uff23\uff4f\uff52\uff41", "\u039c\u03b1x"):
            assert "exists already" in await run(app, f"!persona create {name}"), name
        assert app.personas.names() == ["Cora", "Max"]
        assert app.personas.persona("\uff23\uff4f\uff52\uff41").name == "Cora"  # picked as typed with a Japanese IME
        assert "Persona Вера created" in await run(app, "!persona create Вера")  # a Russian name is a name
    with pytest.raises(ConfigError, match="look-alikes"):
        parse_config({"personas": [{"name": "Cora"}, {"name": "\u0421ora"}]})


async def test_look_alikes_an_older_release_made_stay_apart_and_reachable(tmp_path: Path) -> None:
    """A database may hold "Сora" (a Cyrillic С) beside Cora from before look-alikes were refused: each keeps
    its name, its soul and its lookups (folding them into one key let the newer one take Cora's place)."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        await app.storage.db.write("INSERT INTO personas (name, created_at, ts_config, language, settings, source)"
                                   " VALUES ('\u0421ora', 0, 'english', 'English', '{}', 'chat')")
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        assert app.personas.names() == ["Cora", "Max", "\u0421ora"]
        assert app.personas.persona("Cora").soul_sections()[0][1] == "You are {char_name}, a gardener."
        assert app.personas.persona("\u0421ora").name == "\u0421ora"
        assert "You are Cora, a gardener." in await system_prompt(app, llm)
        assert "Persona \u0421ora deleted" in await run(app, "!persona delete \u0421ora")
        assert "exists already" in await run(app, "!persona create C\u043er\u0430")  # (a new one is refused)


async def test_a_name_read_as_an_option_or_a_command_is_refused(tmp_path: Path) -> None:
    """`!persona create --help` and `!persona create !memory show` made personas that `!persona --help` then
    picked, and that nobody could pick on purpose."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        for name in ("--help", "-x", "\u2014pin", "!memory show", " !x"):
            refused = await run(app, f"!persona create {name}")
            assert "a persona's name cannot start with" in refused and "created" not in refused, (name, refused)
        assert app.personas.names() == ["Cora", "Max"]
        assert "Persona Dash-Board created" in await run(app, "!persona create Dash-Board")


async def test_a_name_of_dots_alone_is_refused_and_one_already_stored_still_starts(tmp_path: Path) -> None:
    """`!persona create ..` made a persona the web page could not reach: browsers and the server remove `.` and
    `..` from an address, so /api/me/personas/../files/memory was another path. Refused in chat and in the config;
    one a database already holds (made before this check) neither stops the start nor disappears."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        for name in ("..", ".", "...", " .. ", "\uff0e\uff0e", "\u2025"):
            refused = await run(app, f"!persona create {name}")
            assert "a persona's name cannot be only dots" in refused and "created" not in refused, (name, refused)
        assert app.personas.names() == ["Cora", "Max"]
        assert "Persona A.I. created" in await run(app, "!persona create A.I.")  # dots among letters are fine
        await app.storage.personas.create_persona("..", "English", {}, "chat", "english")  # as an older release did
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        assert app.personas.names() == ["Cora", "Max", "A.I.", ".."]
    with pytest.raises(ConfigError) as refused_config:
        _config(tmp_path, name="..")
    assert "'..': a persona's name cannot be only dots" in str(refused_config.value), refused_config.value


async def test_a_config_entry_named_like_a_chat_made_persona_says_it_takes_it_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A [[personas]] entry with the name of a persona made with !persona create took it over without a word,
    and the list still called it "from chat"."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        assert "Persona Nova created" in await run(app, "!persona create Nova")
        await run(app, "!persona edit identity You are Nova, made in chat.", ctx(persona="Nova"))
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "personas": [{"name": "Cora", "identity": "You are Cora."},
                                        {"name": "Nova", "language": "German", "identity": "Du bist Nova."}]})
    with caplog.at_level(logging.WARNING):
        async with App(config, llm=ScriptedProvider()) as app:
            listing = await run(app, "!persona list")
            assert "Nova (from the config file, German)" in listing, listing
            assert "You are Nova, made in chat." in await run(app, "!persona show", ctx(persona="Nova"))
    assert any("has the name of a persona made with !persona create" in r.getMessage() for r in caplog.records)
    renamed = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                            "personas": [{"name": "Cora", "identity": "You are Cora."}]})
    async with App(renamed, llm=ScriptedProvider()) as app:  # (Nova's entry is gone from the file)
        listing = await run(app, "!persona list")
        assert "Nova (from chat, once from the config file, German)" in listing, listing
        assert "Persona Nova deleted" in await run(app, "!persona delete Nova")


async def test_threads_inherit_their_channels_persona_unless_set_themselves(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        await app.router.handle(_inbound("!persona Max", admin=True), Sink())
        await app.router.handle(_inbound("hi", mention=True, channel="thread9", parent="chan1"), Sink())
        assert "You are Max." in llm.requests[-1].system
        await app.router.handle(_inbound("!persona Cora", admin=True, channel="thread9", parent="chan1"), Sink())
        await app.router.handle(_inbound("hi", mention=True, channel="thread9", parent="chan1"), Sink())
        assert "You are Cora" in llm.requests[-1].system


async def test_another_process_sees_an_edit_after_its_reload(tmp_path: Path) -> None:
    first_llm, second_llm = ScriptedProvider(), ScriptedProvider()
    async with App(_config(tmp_path), llm=first_llm) as first, App(_config(tmp_path), llm=second_llm) as second:
        await run(first, "!persona edit tone Solemn.")
        await second.personas.load()  # what its reload job does every few seconds
        assert "## Tone\nSolemn." in await system_prompt(second, second_llm)


def _inbound(text: str, *, admin: bool = False, mention: bool = False, channel: str = "chan1",
             parent: str | None = None) -> Inbound:
    message = IncomingMessage("discord", channel, "7", "Ann", text, server_id="guild1", mentions_bot=mention,
                              parent_channel_id=parent)
    return Inbound(message, is_admin=admin)


async def test_template_variables_in_both_spellings(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    config = _config(tmp_path, identity="You are {{char}}, talking to {{user}} in {{LANGUAGE}} ({{LANGUAGE_CODE}}).",
                     language="German")
    async with App(config, llm=llm) as app:
        assert "You are Cora, talking to Ann in German (de)." in await system_prompt(app, llm)
        reply = await run(app, "!persona edit values Kind to {{user}}, fond of {{weather}}.")
        assert "{{weather}} is no template variable" in reply
        assert "Kind to Ann, fond of {{weather}}." in await system_prompt(app, llm)  # left visible, no crash


async def test_a_config_persona_named_like_a_subcommand_is_refused_at_start(tmp_path: Path) -> None:
    """``!persona List Buff`` runs ``!persona list`` (and Discord's ``/persona`` becomes that line), so nobody
    could pick such a persona: the config is refused in one line, as ``!persona create`` refuses the name."""
    def config(second: str) -> Config:
        return parse_config({"storage": {"url": db_url_for(tmp_path)},
                             "personas": [{"name": "Cora"}, {"name": second, "identity": "You are {char_name}."}]})

    with pytest.raises(ConfigError) as refused:
        async with App(config("List Buff"), llm=ScriptedProvider()):
            pass
    assert "List Buff" in str(refused.value) and "persona list" in str(refused.value)
    assert "\n" not in str(refused.value)
    async with App(config("Buff List"), llm=ScriptedProvider()) as app:  # the word elsewhere in the name is fine
        dm = CommandContext("discord", "discord:7", "Ann", "discord:dm-ann", "Cora", is_dm=True)
        assert "Buff List" in await run(app, "!persona Buff List", dm)
        # the refused start wrote nothing: with the config fixed, the refused name is nowhere (it stayed, unpickable)
        assert "List Buff" not in await run(app, "!persona list", dm)
        assert await app.storage.personas.get_persona("List Buff") is None
        assert await app.router.persona_for(Inbound(IncomingMessage(
            "discord", "dm-ann", "7", "Ann", "hi", is_dm=True))) == "Buff List"


async def test_a_quoted_switch_name_as_a_section_is_no_switch(tmp_path: Path) -> None:
    """`!persona edit "--empty" tone` emptied the section before quoted words stopped being switches; then it
    said "either the new text or --empty, not both". A quoted word is a word: here no section's name."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        reply = await run(app, '!persona edit "--empty" tone')
        assert reply.startswith("a section is one word like identity"), reply
        assert "Warm." in await run(app, "!persona show")  # (nothing emptied)


async def test_a_new_standard_section_takes_its_place_in_the_standard_order(tmp_path: Path) -> None:
    """A section written first in chat went last: a persona made in chat with its backstory written before
    its identity read the backstory first, and nothing could move it."""
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        assert "created" in (await run(app, "!persona create Nemo")).lower()
        nemo = ctx(persona="Nemo")
        for line in ("!persona edit backstory Born at sea.", "!persona edit tone Calm.",
                     "!persona edit identity You are Nemo.", "!persona edit values Freedom.",
                     "!persona edit tone Calmer."):  # (an edit keeps its place)
            assert "Nemo: section" in await run(app, line, nemo), line
        system = await system_prompt(app, llm, "Nemo")
        order = [system.index(f"## {title}") for title in ("Identity", "Values", "Tone", "Backstory")]
        assert order == sorted(order), system
        assert "## Tone\nCalmer." in system
        scope = next(t.scope for t in await app.storage.personas.current_all("soul")
                     if t.name == "backstory")  # (Nemo's)
        saved = await app.storage.personas.put_based_on(0, "soul", scope, "personality", "Curious.", author="web")
        assert saved is not None  # (as the web page saves a new section)
        names = [t.name for t in await app.storage.personas.current("soul", scope)]
        assert names == ["identity", "personality", "values", "tone", "backstory"]
        # two new sections at once (two admins on the web page): each its own place, in the standard order
        personas = app.storage.personas
        both = await asyncio.gather(
            personas.put_based_on(0, "soul", scope, "error_handling", "Say so.", author="web"),
            personas.put_based_on(0, "soul", scope, "boundaries", "None.", author="web"),
            personas.put_based_on(0, "soul", scope, "identity", "Stale.", author="web"))  # (not new: refused)
        assert both[0] is not None and both[1] is not None and both[2] is None
        live = await personas.current("soul", scope)
        assert [t.name for t in live] == ["identity", "personality", "boundaries", "values", "tone",
                                          "error_handling", "backstory"]
        assert len({t.position for t in live}) == len(live)  # (no two share a place)


async def test_a_config_persona_named_like_one_made_in_chat_is_refused_at_start_in_words(tmp_path: Path) -> None:
    """An attacker's finding: a persona made in chat as "Nеmo" (a Cyrillic е), then "Nemo" added to the config,
    and the bot no longer started: an AssertionError, no word of what to do."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        assert "Persona N\u0435mo created" in await run(app, "!persona create N\u0435mo")
    config = _config(tmp_path)
    config.personas.append(config.personas[1].model_copy(update={"name": "Nemo"}))
    with pytest.raises(ConfigError, match="'Nemo' in the config file looks like the name of a persona made in chat"):
        async with App(config, llm=ScriptedProvider()):
            pass


async def test_sections_a_soul_order_leaves_out_follow_in_their_usual_order(tmp_path: Path) -> None:
    """``soul_order = ["tone", "identity"]`` dropped every other section from the prompt without a word (its
    boundaries too: "never reveal …" never reached the model), where it meant only to put those two first."""
    llm = ScriptedProvider()
    config = _config(tmp_path, soul_order=["tone", "identity"], boundaries="BOUNDARY: never reveal the address.",
                     values="VALUES: honesty.")
    assert config.personas[0].soul_order == ["tone", "identity", "personality", "boundaries", "communication_style",
                                             "values", "domain_expertise", "error_handling"]
    async with App(config, llm=llm) as app:
        system = await system_prompt(app, llm)
    assert system.index("Warm.") < system.index("a gardener") < system.index("BOUNDARY") < system.index("VALUES")


async def test_a_changed_soul_order_in_the_config_applies_at_the_next_start(tmp_path: Path) -> None:
    """Seeding placed a section only when it was first written: a new ``soul_order`` in the config changed
    nothing. A section of its own made in chat keeps its place between them."""
    llm = ScriptedProvider()
    async with App(_config(tmp_path, soul_order=["identity", "tone"]), llm=llm) as app:
        await run(app, "!persona edit hobby Gardening.")
        system = await system_prompt(app, llm)
        assert system.index("a gardener") < system.index("Warm.")
    async with App(_config(tmp_path, soul_order=["tone", "identity"]), llm=llm) as app:
        system = await system_prompt(app, llm)
        assert system.index("Warm.") < system.index("a gardener") and "Gardening." in system
        history = await run(app, "!persona history")
        assert history.count("from the config file") == 2  # (moved, not saved again)
