"""Character cards through the commands: import (attachment, terminal path) into personas and lore,
export back, bad cards changing nothing; the prompt checked where the real SDK sends it (the fake LLM
server)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from bot.app import App
from bot.commands import Attachment, CommandContext
from bot.config import parse_config
from bot.ports import IncomingMessage
from cortex.personas import card_commands, cards
from tests.engines import db_url_for
from tests.fakes.llm_server import FakeLLMServer
from tests.test_cards import dumps, png, text_chunk, v2_card, v3_card

pytestmark = pytest.mark.both_engines


def _config(tmp_path: Path, server: FakeLLMServer):
    return parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "llm": {"provider": "anthropic", "model": "test-model", "base_url": server.anthropic_url,
                "api_key_env": "CB_TEST_API_KEY", "max_retries": 0},
        "cortex": {"context_limit": 1000},
        "personas": [{"name": "Max", "identity": "You are {char_name}."}],
    })


def ctx(*files: Attachment, platform: str = "discord", persona: str = "Max") -> CommandContext:
    return CommandContext(platform, f"{platform}:1", "Root", f"{platform}:dm", persona, is_admin=True,
                          is_bot_admin=True, is_dm=True, attachments=files)


async def run(app: App, line: str, context: CommandContext) -> str:
    return (await app.commands.dispatch(line, context)).text


async def test_a_png_card_becomes_a_persona_with_lore_and_reaches_the_model(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    card = png(text_chunk("chara", v2_card()), text_chunk("ccv3", v3_card()))
    async with App(_config(tmp_path, fake_llm)) as app:
        reply = await run(app, "!persona import", ctx(Attachment("cora.png", card)))
        assert reply.startswith("Imported Cora Three from cora.png (chara_card_v3): 7 soul section(s), 3 lore")
        # (the card's regular-expression keys are taken as plain keywords: the import says so)
        assert reply.endswith("1 lore entry had regular expressions as keys: this bot takes them as plain keywords "
                              "(check them with !lore list).")
        message = IncomingMessage("discord", "dm", "7", "Ann", "Is it raining on the greenhouse?", is_dm=True)
        await app.core.reply(message, "Cora Three").text()
        system = json.dumps(fake_llm.completion_requests[-1].body["system"])
        assert "Cora Three is a gardener who talks to Ann about roses." in system  # {{char}}, {{user}} filled
        assert "Stay in character as Cora Three." in system and "A greenhouse on a rainy afternoon." in system
        assert "The greenhouse has a leaking roof." in system  # lore: key and secondary key in the message
        assert "allergic to lilies" not in system  # a disabled entry
        assert "Made for cozy chats" not in system and "example.invalid" not in system
        history = await run(app, "!persona history", ctx(persona="Cora Three"))
        assert "by import" in history and "imported from cora.png by discord:1" in history


async def test_export_gives_a_v2_card_that_imports_again(tmp_path: Path, fake_llm: FakeLLMServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(_config(tmp_path, fake_llm)) as app:
        await run(app, "!persona import", ctx(Attachment("cora.json", dumps(v2_card()))))
        exported = (await app.commands.dispatch("!persona export Cora", ctx())).attachments[0]
        card = json.loads(exported.data)
        assert card["spec"] == "chara_card_v2" and card["data"]["name"] == "Cora"
        assert card["data"]["personality"] == "Warm, patient, a little nosy."
        assert {e["content"] for e in card["data"]["character_book"]["entries"]} == {
            "The greenhouse has a leaking roof.", "Cora is allergic to lilies."}
        assert "exists already" in await run(app, "!persona import", ctx(Attachment("again.json", exported.data)))
        await run(app, "!persona create Other", ctx())
        renamed = json.dumps({**card, "data": {**card["data"], "name": "Cora Copy"}}).encode()
        assert "Imported Cora Copy" in await run(app, "!persona import", ctx(Attachment("copy.json", renamed)))
        assert "The greenhouse has a leaking roof." in await run(app, "!lore list", ctx(persona="Cora Copy"))


async def test_bad_cards_get_one_line_and_change_nothing(tmp_path: Path, fake_llm: FakeLLMServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(_config(tmp_path, fake_llm)) as app:
        cases = [
            (Attachment("cat.png", png()), "`cat.png`: the PNG holds no character card"),
            (Attachment("notes.txt", b"hello"), "`notes.txt`: not a character card"),
            (Attachment("v1.json", json.dumps({"name": "Old", "description": "x"}).encode()), "unsupported"),
            (Attachment("huge.json", b" " * (9 * 1024 * 1024)), "at most 8 MB"),
            (Attachment("max.json", dumps(v2_card(name="Max"))), "exists already"),
            # a name that looks like Max's was refused as "a deleted persona", with advice that could not work
            (Attachment("m.json", dumps(v2_card(name="M\u0430x"))), "a persona called `Max` exists already (`M\u0430x` "
             "is the same name: letters that look alike do not tell names apart): delete it first (!persona delete "
             "Max)"),
            (Attachment("mx.json", dumps(v2_card(name="\uff2d\uff41\uff58"))), "a persona called `Max` exists already"),
            (Attachment("bell.json", dumps(v2_card(name="Bell\u0007\u200b"))), "`bell.json`: give the persona a name"),
            (Attachment("buff.json", dumps(v2_card(name="History Buff"))),
             "`buff.json`: a persona's name cannot start with `history`: !persona history is a command"),
            (Attachment("dots.json", dumps(v2_card(name=".."))), "`dots.json`: a persona's name cannot be only dots"),
            (Attachment("c.charx", _zip("card.json", dumps(v2_card()))), "`c.charx`: a CHARX card (a zip) cannot be "
             "imported here: export the card as PNG or JSON"),
            (Attachment("l.json", b'{"spec": "chara_card_v2", "data": {"name": "caf\xe9"}}'),
             "`l.json`: the card's JSON is not UTF-8 text: save it as UTF-8"),
            (Attachment("u.json", json.dumps(v2_card()).encode("utf-16")), "`u.json`: the card's JSON is UTF-16 text"),
        ]
        for attachment, expected in cases:
            reply = await run(app, "!persona import", ctx(attachment))
            assert expected in reply and "\n" not in reply.split("Usage:")[0].strip(), reply
        assert app.personas.names() == ["Max"]
        assert "attach the card" in await run(app, "!persona import /etc/passwd", ctx())  # no paths from chat
        member = CommandContext("discord", "discord:9", "Eve", "discord:dm", "Max", is_admin=True, is_dm=True,
                                attachments=(Attachment("cora.json", dumps(v2_card())),))
        assert "for the bot's admins only" in await run(app, "!persona import", member)
        assert app.personas.names() == ["Max"]


async def test_a_name_another_process_took_a_moment_ago_is_named_as_live(tmp_path: Path, fake_llm: FakeLLMServer,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A persona another bot process made a moment ago (this one's registry has not read it yet) under a name
    that looks like the card's was called "a deleted persona", with advice that could not work."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(_config(tmp_path, fake_llm)) as app:
        await app.storage.personas.create_persona("Rosa", "English", {}, "chat", "english")  # (the other process)
        reply = await run(app, "!persona import", ctx(Attachment("r.json", dumps(v2_card(name="R\u043esa")))))
        assert reply.startswith("a persona called `Rosa` exists already (`R\u043esa` is the same name: letters "
                                "that look alike"), reply
        await app.personas.load()  # (as every process does within seconds)
        assert "deleted" in await run(app, "!persona delete Rosa", ctx())
        reply = await run(app, "!persona import", ctx(Attachment("r.json", dumps(v2_card(name="ROSA")))))
        assert reply.startswith("a deleted persona was called `Rosa`; its soul and lore are kept, and !persona "
                                "create Rosa brings it back"), reply


async def test_an_import_names_placeholders_of_another_program(tmp_path: Path, fake_llm: FakeLLMServer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A card's {{original}} (a macro of another program) stayed in the soul as written without a word, where
    !persona edit names such a placeholder."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(_config(tmp_path, fake_llm)) as app:
        card = v2_card(name="Mo", description="{{original}} You are {{char}}, talking to {{user}}.")
        reply = await run(app, "!persona import", ctx(Attachment("mo.json", dumps(card))))
        assert reply.startswith("Imported Mo") and "Note: {{original}} is no template variable" in reply, reply
        plain = await run(app, "!persona import", ctx(Attachment("no.json", dumps(v2_card(name="No")))))
        assert "Note:" not in plain, plain


def _zip(name: str, data: bytes) -> bytes:
    import io
    import zipfile
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(name, data)
    return buffer.getvalue()


async def test_macros_with_arguments_are_named_and_comments_stay_out_of_the_prompt(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only {{word}} was named as unfilled: a card's {{random:a,b}} reached the model unsaid, and its comments
    ({{// a note}}, which the card's own program leaves out) reached it too."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(_config(tmp_path, fake_llm)) as app:
        card = v2_card(name="Mo", description="{{char}} feels {{random:happy,sad}} today. {{// note to self}}")
        reply = await run(app, "!persona import", ctx(Attachment("mo.json", dumps(card))))
        assert "Note: {{random:happy,sad}} is no template variable" in reply and "note to self" not in reply, reply
        await app.core.reply(IncomingMessage("discord", "dm", "7", "Ann", "hi", is_dm=True), "Mo").text()
        system = json.dumps(fake_llm.completion_requests[-1].body["system"])
        assert "Mo feels {{random:happy,sad}} today." in system and "note to self" not in system


async def test_a_name_with_quote_marks_can_be_typed_back(tmp_path: Path, fake_llm: FakeLLMServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A card named 'Alexandra "Alex" Reed' imported, but a command line reads its quotes as quoting: typed as the
    import's answer said (or sent by a slash command), the name was an unknown persona."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    name = 'Alexandra "Alex" Reed'
    async with App(_config(tmp_path, fake_llm)) as app:
        reply = await run(app, "!persona import", ctx(Attachment("alex.json", dumps(v2_card(name=name)))))
        assert reply.startswith(f"Imported {name}"), reply
        assert await run(app, f"!persona {name}", ctx()) == f"In your direct messages you now talk to {name}."
        slash = app.commands._commands["persona show"].line("!", {"name": name})
        assert (await run(app, slash, ctx())).startswith(f"Persona {name}:")
        taken = await run(app, "!persona create Alexandra Alex Reed", ctx())
        assert f"a persona called `{name}` exists already (`Alexandra Alex Reed` is the same name: quote marks do " \
            "not tell names apart)" in taken, taken
        assert (await run(app, f"!persona delete {name}", ctx())).startswith(f"Persona {name} deleted")


async def test_the_terminal_imports_by_path(tmp_path: Path, fake_llm: FakeLLMServer,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    path = tmp_path / "cards" / "ada lovelace.png"
    path.parent.mkdir()
    path.write_bytes(png(text_chunk("chara", v2_card(name="Ada"))))
    async with App(_config(tmp_path, fake_llm)) as app:
        assert "Imported Ada from ada lovelace.png" in await run(app, f"!persona import '{path}'",
                                                                 ctx(platform="console"))
        assert "cannot read" in await run(app, f"!persona import {tmp_path}/missing.png", ctx(platform="console"))
        assert "Ada" in app.personas.names()


async def test_a_huge_card_keeps_the_prompt_within_the_soul_budget(tmp_path: Path, fake_llm: FakeLLMServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    lines = "\n".join(f"Line {i} of a very long backstory about the greenhouse and its roses." for i in range(1500))
    card = dumps(v2_card(description=lines[:19_000], personality="Warm.", system_prompt="Stay kind."))
    async with App(_config(tmp_path, fake_llm)) as app:
        assert "Imported Cora" in await run(app, "!persona import", ctx(Attachment("big.json", card)))
        await app.core.reply(IncomingMessage("discord", "dm", "7", "Ann", "hi", is_dm=True), "Cora").text()
        system = json.dumps(fake_llm.completion_requests[-1].body["system"])
        assert "did not fit here" in system and "Line 0 of" in system and "Line 1400 of" not in system
        assert app.estimator.count(system) < 3_600  # the soul's 3,000 tokens, the headings and the rest


async def test_a_card_never_brings_back_a_deleted_persona_of_its_name(tmp_path: Path, fake_llm: FakeLLMServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing a card named like a deleted persona revived it with its old soul sections and lore mixed
    into the card's ("secret_notes" and a vault code came back live)."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(_config(tmp_path, fake_llm)) as app:
        await run(app, "!persona create Zed", ctx())
        edited = await run(app, "!persona edit secret_notes Zed keeps the spare keys", ctx(persona="Zed"))
        assert "secret_notes" in edited
        await run(app, "!persona delete Zed", ctx())
        refused = await run(app, "!persona import", ctx(Attachment("zed.json", dumps(v2_card(name="Zed")))))
        assert refused.startswith("a deleted persona was called `Zed`") and "nothing was imported" in refused, refused
        assert "Zed" not in app.personas.names()
        assert "Imported Zed Two" in await run(app, "!persona import", ctx(Attachment(
            "zed.json", dumps(v2_card(name="Zed Two")))))
        await run(app, "!persona create Zed", ctx())  # creating it again is the way back, with its soul
        assert "spare keys" in await run(app, "!persona show Zed", ctx())


async def test_a_file_name_with_odd_characters_imports_whole_on_one_line(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Matrix file's name is whatever its sender's client wrote: a lone surrogate (SQLite) or a NUL
    (PostgreSQL) in it failed the import after the persona was made, leaving it without a soul and its
    name taken; a line break in it forged lines of ``!persona history``."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    odd = "ca\ud800rd\0\n  v9 2020-01-01 by someone else — forged\n" + "x" * 500 + ".json"
    async with App(_config(tmp_path, fake_llm)) as app:
        reply = await run(app, "!persona import", ctx(Attachment(odd, dumps(v2_card()))))
        assert reply.startswith("Imported Cora from ca\ufffdrd v9 2020-01-01") and "\n" not in reply, reply
        assert "Warm, patient" in await run(app, "!persona show Cora", ctx())
        history = await run(app, "!persona history", ctx(persona="Cora"))
        assert len(history.splitlines()) == 1 + 7 and "x" * 100 not in history, history


async def test_a_persona_another_process_made_a_moment_ago_is_named_as_existing(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal asked the registry (reloaded every few seconds) whether the name was live, so a persona
    another process had just made was called deleted, with advice to bring it back by creating it."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(_config(tmp_path, fake_llm)) as app:
        made = await app.storage.personas.create_persona("Cora", "English", {}, "chat", "english")
        assert made is not None and "Cora" not in app.personas.names()  # this process has not reloaded yet
        refused = await run(app, "!persona import", ctx(Attachment("cora.json", dumps(v2_card()))))
        assert refused.startswith("a persona called `Cora` exists already"), refused


async def test_forget_me_takes_the_importers_key_out_of_the_soul_history(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget-me takes a user's key off the texts they wrote as an admin, but an import's reason
    ("imported from cora.png by discord:1") kept naming them in every section's history."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    other = CommandContext("discord", "discord:12", "Bo", "discord:dm", "Max", is_admin=True, is_bot_admin=True,
                           is_dm=True, attachments=(Attachment("ada.json", dumps(v2_card(name="Ada"))),))
    async with App(_config(tmp_path, fake_llm)) as app:
        await run(app, "!persona import", ctx(Attachment("cora.png", dumps(v2_card()))))
        await run(app, "!persona import", other)
        await app.storage.forget_user("discord:1")
        history = await run(app, "!persona history", ctx(persona="Cora"))
        assert "discord:1" not in history and history.count("imported from cora.png by a forgotten user") == 7
        assert (await run(app, "!persona history", ctx(persona="Ada"))).count("ada.json by discord:12") == 7


async def test_export_writes_the_card_placeholders_other_programs_fill(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bot's own spelling of the names ("{char_name}", "{{ user_name }}") went into the card as written:
    SillyTavern and the others fill only {{char}} and {{user}}, so their users read the braces."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(_config(tmp_path, fake_llm)) as app:
        await run(app, "!persona edit personality Calls {user_name} by name; {{ User_Name }} too; {mood} stays.",
                  ctx())
        await run(app, "!lore add {char_name} once met {{user}} at the harbour. --keys harbour", ctx())
        card = json.loads((await app.commands.dispatch("!persona export", ctx())).attachments[0].data)["data"]
        assert card["description"] == "You are {{char}}."
        assert card["personality"] == "Calls {{user}} by name; {{user}} too; {mood} stays."
        assert card["character_book"]["entries"][0]["content"] == "{{char}} once met {{user}} at the harbour."


async def test_a_card_is_read_beside_the_chat(tmp_path: Path, fake_llm: FakeLLMServer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8 MB card of a million short tags took 1.4 s to read on the event loop: no chat was answered
    meanwhile. It is read in a worker thread, as a memory import's archive is."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    on_loop: list[bool] = []

    def parse(data: bytes) -> cards.Card:
        on_loop.append(threading.current_thread() is threading.main_thread())
        return cards.parse_card(data)

    monkeypatch.setattr(card_commands, "parse_card", parse)
    async with App(_config(tmp_path, fake_llm)) as app:
        assert "Imported Cora" in await run(app, "!persona import", ctx(Attachment("cora.json", dumps(v2_card()))))
        assert on_loop == [False]


async def test_an_import_that_fails_half_way_leaves_nothing_behind(tmp_path: Path, fake_llm: FakeLLMServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The persona row, each soul section and the lore were written one after the other: a failure on the way (a
    database error, a process killed) left a persona without its soul whose name blocked the next import."""
    import bot.storage.personas as personas_module

    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    original = personas_module._lore_insert
    calls = {"n": 0}

    def failing(*args: object, **kwargs: object) -> tuple[str, tuple[object, ...]]:
        calls["n"] += 1
        if calls["n"] == 2:  # the second lore entry: the persona and its soul are written by now
            raise RuntimeError("the database went away")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(personas_module, "_lore_insert", failing)
    async with App(_config(tmp_path, fake_llm)) as app:
        card = Attachment("cora.json", dumps(v2_card()))
        failed = await run(app, "!persona import", ctx(card))
        assert not failed.startswith("Imported") and calls["n"] == 2, failed
        assert await app.storage.personas.get_persona("Cora") is None
        assert not await app.storage.db.fetch_all("SELECT id FROM personas WHERE name = 'Cora'")
        assert not await app.storage.db.fetch_all("SELECT id FROM lore_entries")
        assert len(await app.storage.db.fetch_all("SELECT id FROM versioned_texts WHERE kind = 'soul'")) == len(
            await app.storage.db.fetch_all("SELECT id FROM versioned_texts WHERE kind = 'soul' AND scope IN"
                                           " (SELECT CAST(id AS TEXT) FROM personas)"))
        monkeypatch.setattr(personas_module, "_lore_insert", original)
        assert (await run(app, "!persona import", ctx(card))).startswith("Imported Cora")


async def test_a_persona_too_big_for_a_card_is_not_exported_into_one_that_would_not_import(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Soul sections without a card field of their own go into the description: seven long ones made a
    description over the 20,000 characters an import takes, so the exported backup could not come back."""
    sections = {key: f"{key} " + "word " * 700 for key in (
        "identity", "boundaries", "communication_style", "values", "tone", "domain_expertise", "error_handling")}
    config = _config(tmp_path, fake_llm).model_dump()
    config["personas"] = [{"name": "Max", **sections}]
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    async with App(parse_config(config)) as app:
        reply = await app.commands.dispatch("!persona export Max", ctx())
        assert not reply.attachments
        assert reply.text.startswith("Max does not fit in a character card: the card's 'description' is 24,")
        assert "characters; at most 20,000" in reply.text
        assert "Nothing was exported" in reply.text
        await run(app, "!persona edit identity A short identity.", ctx())  # shortened: it fits now
        await run(app, "!persona edit boundaries Few.", ctx())
        exported = (await app.commands.dispatch("!persona export Max", ctx())).attachments[0]
        assert cards.parse_card(exported.data).name == "Max"


async def test_a_lore_book_too_big_for_a_card_is_named_with_what_to_do(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A persona of an older version could hold more lore entries than a card takes (`!lore add` had no cap):
    its export says so and points at `!lore remove`."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    monkeypatch.setattr(cards, "MAX_LORE_ENTRIES", 1)  # what a card takes (500 in use); !lore add keeps its own
    async with App(_config(tmp_path, fake_llm)) as app:
        for text in ("The mill is old.", "The river is cold."):
            assert "added" in await run(app, f"!lore add {text}", ctx())
        reply = await app.commands.dispatch("!persona export Max", ctx())
        assert not reply.attachments and "lore book has 2 entries; at most 1" in reply.text
        assert "remove entries with !lore remove and export again" in reply.text


async def test_lore_keywords_of_punctuation_alone_are_left_out_and_named(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """!lore refuses "." as a keyword (nearly every message holds one); a card's came in, and its entry was in
    every reply of every user, listed as "[keys .]" rather than as always on."""
    monkeypatch.setenv("CB_TEST_API_KEY", "sk-test")
    card = dumps({"spec": "chara_card_v2", "spec_version": "2.0", "data": {
        "name": "Pun", "description": "A punster.", "character_book": {"entries": [
            {"keys": ["."], "content": "Pun owes the baker ten coins."},
            {"keys": ["tax", "?"], "content": "Pun fears the tax collector."},
            {"keys": ["bread"], "content": "Pun bakes on Sundays."}]}}})
    async with App(_config(tmp_path, fake_llm)) as app:
        reply = await run(app, "!persona import", ctx(Attachment("pun.json", card)))
        assert reply.startswith("Imported Pun") and "2 lore entries had keywords of punctuation alone" in reply
        listed = await run(app, "!lore list", ctx(persona="Pun"))
        assert listed.splitlines()[1:] == [
            "#1 [search only] Pun owes the baker ten coins.", "#2 [keys tax] Pun fears the tax collector.",
            "#3 [keys bread] Pun bakes on Sundays."]
        assert "baker" not in await run(app, "!lore search Nice weather today.", ctx(persona="Pun"))
