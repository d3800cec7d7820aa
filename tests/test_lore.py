"""Lore: a persona's knowledge for everyone, entering the prompt by keyword, always, or by search."""

from __future__ import annotations

from pathlib import Path

import pytest

from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.ports import IncomingMessage
from bot.storage.personas import LoreEntry
from cortex.personas import lore_commands
from cortex.personas.lore import keyword_match, mentions, search
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider


def _config(tmp_path: Path):
    return parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "cortex": {"context_limit": 1000},
        "personas": [{"name": "Cora", "identity": "You are {char_name}."}, {"name": "Max"}],
    })


BOSS = CommandContext("discord", "discord:1", "Root", "discord:chan1", "Cora", is_admin=True, is_bot_admin=True,
                      server_key="discord:guild1")


BOSS_OF_MAX = CommandContext("discord", "discord:1", "Root", "discord:chan1", "Max", is_admin=True, is_bot_admin=True,
                             server_key="discord:guild1")


async def run(app: App, line: str, context: CommandContext = BOSS) -> str:
    return (await app.commands.dispatch(line, context)).text


async def prompt(app: App, llm: ScriptedProvider, text: str, user: str = "7", persona: str = "Cora") -> str:
    await app.core.reply(IncomingMessage("discord", f"dm-{user}", user, f"user{user}", text, is_dm=True),
                         persona).text()
    return llm.requests[-1].system


def entry(content: str, keys: tuple[str, ...] = (), secondary: tuple[str, ...] = (), entry_id: int = 1) -> LoreEntry:
    from datetime import UTC, datetime

    return LoreEntry(entry_id, 1, "", content, keys, secondary, False, 0, True, "chat", "", datetime.now(UTC))


def test_keywords_match_whole_words_case_insensitively() -> None:
    assert mentions("We walked along the Rhône in Lyon.", "lyon")
    assert not mentions("Lyonnaise cooking", "Lyon")  # not inside another word
    assert mentions("C++ is hard", "C++") and mentions("ask @cora now", "@cora")
    river = entry("The city has two rivers.", keys=("Lyon",), secondary=("river", "rivers"))
    assert keyword_match(river, "Lyon has rivers") and not keyword_match(river, "Lyon is big")
    # an entry's many keys are matched at once (one-word keys among the text's words, the rest as one
    # pattern): the same answers as one key at a time
    keys = ("Straße", "New York", "C++", "@cora", "Ann's", "dragons", " ", "")
    many = entry("x", keys=keys)
    for text, expected in (("the STRASSE was empty", True), ("Newer York", False), ("see new  york", False),
                           ("in New York now", True), ("c++", True), ("mail @cora", True), ("Ann's cat", True),
                           ("Anns cat", False), ("dragonsfire", False), ("Dragons!", True), ("nothing", False)):
        assert keyword_match(many, text) is expected, text
        assert any(mentions(text, k) for k in keys) is expected, text


def test_keys_of_punctuation_alone_stored_before_their_import_refused_them_match_nothing() -> None:
    """A card imported by an older version kept "." as a key: its entry came into nearly every reply."""
    dotted = entry("Secret lore", keys=(".", "?!"))
    assert not any(keyword_match(dotted, text) for text in ("hi there.", "what is up?!", "ok. thanks"))
    assert keyword_match(entry("x", keys=(".", "figs")), "I like figs.")  # its other keys still count


def test_phrases_match_as_whole_words_as_the_patterns_did() -> None:
    """Keys of several words are found by their words first, then as a literal (a lore book's keys as one
    alternation behind lookbehinds took seconds per long message): the same answers as a pattern per key."""
    import random
    import re

    from cortex.personas.cards import only_punctuation

    def reference(text: str, key: str) -> bool:
        pattern = re.escape(key)
        pattern = (r"(?<!\w)" if key[0].isalnum() else "") + pattern + (r"(?!\w)" if key[-1].isalnum() else "")
        return re.search(pattern, text) is not None

    rng = random.Random(5)
    pieces = ["old", "mill", "olds", "bold", "x", "-", "_", " ", "  ", "'s", "+", "9", "é", "ha ha", "a", "o-o"]
    for _ in range(3000):
        key = "".join(rng.choice(pieces) for _ in range(rng.randrange(2, 5))).strip()
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 14)))
        if not key or re.fullmatch(r"\w+", key):
            continue
        if only_punctuation(key):  # ("-", "+ -": such a key matches nothing, see below)
            assert not mentions(text, key), (text, key)
            continue
        assert mentions(text, key) is reference(text, key), (text, key)
    assert mentions("aha ha ha", "ha ha") and mentions("xo-o-o", "o-o")  # (a match overlapping a refused one)


async def test_lore_looks_through_the_end_of_a_long_message_before(tmp_path: Path) -> None:
    """The message before (a reply may have 40,000 characters) is looked through for keys at its last 4,000:
    all of it made every message cost seconds over a large lore book."""
    from datetime import UTC, datetime

    from bot.ports import PromptContext
    from cortex.personas.lore import PREVIOUS_CHARS, LoreSection

    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "personas": [{"name": "Cora"}]})
    async with App(config, llm=ScriptedProvider()) as app:
        assert "added" in await run(app, '!lore add The old mill burned in 1902. --keys "old mill"')
        assert "added" in await run(app, '!lore add The harbour froze. --keys "frozen harbour"')
        early = "We saw the frozen harbour. " + "and then " * (PREVIOUS_CHARS // 9 + 10)
        previous = early + " the old mill was there"
        assert "added" in await run(app, "!lore add Windmills turn. --keys mill")
        cut = "the windmill" + " x" * ((PREVIOUS_CHARS - len("mill")) // 2)  # the last 4,000 start inside it
        context = PromptContext("Cora", "English", 1, "discord:7", "Ann", "discord:dm-7", True, None, "ok",
                                datetime.now(UTC), previous=previous)
        sections = await LoreSection(app.lore, app.personas, app.estimator).sections(context, 10_000)
        body = sections[0].body if sections else ""
        assert "old mill burned" in body and "harbour froze" not in body
        at_the_cut = PromptContext("Cora", "English", 1, "discord:7", "Ann", "discord:dm-7", True, None, "ok",
                                   datetime.now(UTC), previous=cut)
        assert not await LoreSection(app.lore, app.personas, app.estimator).sections(at_the_cut, 10_000)


async def test_a_lore_page_past_the_end_says_how_many_there_are(tmp_path: Path) -> None:
    """`!lore list 5` was an error with the usage (and a failed exit status when piped), where `!memory list 5`
    answers how many pages there are."""
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "personas": [{"name": "Cora"}]})
    async with App(config, llm=ScriptedProvider()) as app:
        assert "added" in await run(app, "!lore add The mill is old. --keys mill")
        reply = await app.commands.dispatch("!lore list 5", BOSS)
        assert reply.text == "There is only 1 page (1 entry)." and not reply.failed


def test_keywords_match_however_an_accent_is_typed() -> None:
    """"Zoë" is one letter ë (NFC, most keyboards) or e and a combining diaeresis (NFD, macOS file names and
    some cards and phones): a key written one way never matched a message written the other."""
    nfc, nfd = "Zo\u00eb", "Zoe\u0308"
    for key, text in ((nfc, f"Ask {nfd} about it"), (nfd, f"Ask {nfc} about it"), (f"{nfd} Vale", f"{nfc} VALE")):
        assert mentions(text, key) and keyword_match(entry("x", keys=(key,)), text), (key, text)
    assert not mentions(f"{nfd}s", nfc)  # still whole words only
    lore = [entry(f"{nfc} tends the lighthouse.", entry_id=1), entry("Market day is Thursday.", entry_id=2)]
    assert [e.id for e in search(lore, f"who is {nfd.upper()}?")] == [1]


def test_keys_written_with_the_cards_placeholders_match_the_names() -> None:
    """A card keys entries on {{char}} and {{user}} (or <BOT>, made {{char}} at import): stored as written, they
    never matched a message. They stand for the persona's and the user's names when the text is read."""
    sword = entry("Cora's sword is called Dawn.", keys=("{{char}}'s sword",))
    assert keyword_match(sword, "Tell me about Cora's sword!", names=("Cora", "Ann"))
    assert not keyword_match(sword, "Tell me about Max's sword!", names=("Cora", "Ann"))
    assert not keyword_match(sword, "Tell me about Cora's sword!")  # (without the names: as written)
    home = entry("Ann lives in Lyon.", keys=("{{user}}",), secondary=("{{ Char }}", "home"))
    assert keyword_match(home, "Cora, where does Ann live?", names=("Cora", "Ann"))
    assert not keyword_match(home, "Where does Ann live?", names=("Cora", "Ann"))  # the secondary key is missing
    assert not keyword_match(home, "Cora, where does Bo live?", names=("Cora", "Bo Ann"))


async def test_a_card_entry_keyed_on_the_persona_comes_into_the_reply(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        assert "added to Cora" in await run(app, '!lore add --keys "{{char}}\'s sword" Cora\'s sword is called Dawn.')
        assert "called Dawn" in await prompt(app, llm, "Show me Cora's sword, please")
        assert "called Dawn" not in await prompt(app, llm, "Show me Max's shield, please", user="8")


def test_search_needs_a_real_overlap() -> None:
    lore = [entry("The lighthouse keeper Bram lost his brother at sea.", entry_id=1),
            entry("Market day is Thursday in the old town.", entry_id=2)]
    assert [e.id for e in search(lore, "who keeps the lighthouse?")] == [1]
    assert search(lore, "tell me a joke") == []


def test_function_words_bring_no_lore_in() -> None:
    """A message shares "the" or "and" with half a lore book: those entries came into the reply (and the only
    entry of a one-entry book came in for any message with one of its words)."""
    lore = [entry("The mill is old.", entry_id=1), entry("The river is cold.", entry_id=2),
            entry("Dragons breathe fire and the smoke lingers.", entry_id=3)]
    assert search(lore, "how is the weather today") == []
    assert search(lore, "and you?") == [] and search(lore, "Und du? Was ist das?") == []
    assert search([entry("The mill is new.", entry_id=4)], "I walk into the forest") == []
    assert [e.id for e in search(lore, "is the mill still standing?")] == [1]
    assert [e.id for e in search(lore, "The river, the river!")] == [2]


def test_the_function_words_are_the_personas_languages() -> None:
    """German's "war", "die" and "hat" are English words that say something: dropped from an English persona's
    search too, "tell me about the war" found nothing."""
    lore = [entry("The war of the three kingdoms ended at the ford.", entry_id=1),
            entry("The old mill grinds barley.", entry_id=2), entry("A red hat is worn by the king.", entry_id=3)]
    assert [e.id for e in search(lore, "tell me about the war", language="English")] == [1]
    assert [e.id for e in search(lore, "what hat?", language="en")] == [3]
    assert [e.id for e in search(lore, "what hat?", language="Klingon")] == [3]  # (unknown: both lists, less those)
    assert search(lore, "Was war das?", language="Deutsch") == []  # German's function words, in German
    german = [entry("Der Krieg der drei Reiche endete an der Furt.", entry_id=4),
              entry("Die alte Mühle mahlt Gerste.", entry_id=5)]
    assert [e.id for e in search(german, "Was war mit der Mühle?", language="de")] == [5]


@pytest.mark.both_engines
async def test_lore_enters_by_keyword_always_or_search_for_every_user(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        assert "Lore #1 added to Cora" in await run(app, "!lore add The Guild meets at the old mill. --keys guild,mill")
        await run(app, "!lore add Bram keeps the lighthouse on the northern cape.")
        text = await prompt(app, llm, "When does the guild meet?")
        assert "The Guild meets at the old mill." in text and "lighthouse" not in text
        assert "Bram keeps the lighthouse" in await prompt(app, llm, "who keeps the lighthouse?", user="8")
        assert "old mill" not in await prompt(app, llm, "hello there", user="9")
        assert "old mill" not in await prompt(app, llm, "tell me about the guild", persona="Max")  # Cora's lore
        assert "is off" in await run(app, "!lore disable 1")
        assert "Lore #1 is off already." in await run(app, "!lore disable 1")  # (said as if it had switched it)
        assert "old mill" not in await prompt(app, llm, "When does the guild meet?")
        assert "Lore #1 is on" in await run(app, "!lore enable 1")
        assert "changed" in await run(app, "!lore edit 1 --keys harbour")
        assert "old mill" in await prompt(app, llm, "a ship in the harbour")  # by its new keyword
        assert "[keys harbour]" in await run(app, "!lore show 1")
        listed = await run(app, "!lore list")
        assert "#1 [keys harbour] The Guild meets" in listed and "#2 [search only] Bram" in listed
        assert "priority 0, from chat by discord:1" in await run(app, "!lore show 2")
        assert "#2" in await run(app, "!lore search lighthouse keeper")
        assert "has no lore entry #9" in await run(app, "!lore show 9")
        assert "it enters every reply." in await run(app, "!lore add The sky is green here. --always --priority 7")
        assert "The sky is green here." in await prompt(app, llm, "hello there", user="10")
        assert "#3 [always] The sky is green" in await run(app, "!lore list")
        assert "priority 7" in await run(app, "!lore show 3")
        assert "choose one of --always and --not-always" in await run(app, "!lore edit 3 --always --not-always")
        assert "--priority is given twice" in await run(app, "!lore edit 3 --priority 5 --priority 6")
        assert "changed" in await run(app, "!lore edit 3 --not-always --priority 0")
        assert "The sky is green here." not in await prompt(app, llm, "hello there", user="11")
        # a new text: no version is kept, so the answer says the old one (an attacker's finding: it was just gone)
        assert await run(app, "!lore edit 3 The sky is blue here.") == (
            "Lore #3 changed. Its text before, to put back with !lore edit 3:\nThe sky is green here.")


@pytest.mark.both_engines
async def test_lore_and_keys_narrow_an_entry_and_edit_sets_or_clears_them(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        added = await run(app, "!lore add Its stone arches are Roman. --keys Lyon --and-keys bridge,bridges")
        assert "when Lyon comes up, together with one of bridge, bridges" in added
        assert "arches are Roman" in await prompt(app, llm, "Are the bridges of Lyon nice?")
        assert "arches are Roman" not in await prompt(app, llm, "Is Lyon big?", user="8")
        assert "[keys Lyon; and bridge, bridges]" in await run(app, "!lore show 1")
        assert "changed" in await run(app, "!lore edit 1 --and-keys river")
        assert "arches are Roman" in await prompt(app, llm, "the river in Lyon", user="9")
        assert "arches are Roman" not in await prompt(app, llm, "Lyon bridges", user="10")
        assert "changed" in await run(app, "!lore edit 1 --and-keys -")  # cleared: Lyon alone brings it in
        assert "arches are Roman" in await prompt(app, llm, "Is Lyon big?", user="11")
        assert "[keys Lyon]" in await run(app, "!lore show 1")
        await run(app, "!lore edit 1 --and-keys river")
        assert "changed" in await run(app, "!lore edit 1 --keys -")  # no keywords: their narrowing goes too
        assert (await app.storage.lore.get(app.personas.persona_id("Cora") or 0, 1)).secondary_keys == ()
        assert "[search only]" in await run(app, "!lore show 1")
        assert "would have none" in await run(app, "!lore edit 1 --and-keys river")
        assert "narrows --keys" in await run(app, "!lore add Rivers run. --and-keys river")
        assert "--and-keys needs a value" in await run(app, "!lore edit 1 --and-keys")
        assert "!lore edit" in (await run(app, "!help lore edit")) and "--and-keys" in await run(app, "!help lore edit")


@pytest.mark.both_engines
async def test_a_long_entry_does_not_keep_the_other_lore_out(tmp_path: Path) -> None:
    """Lore was cut by whole lines from the top: one entry longer than the lore's share of the prompt, ranked
    first, left nothing but "(… more lore did not fit here)", though both entries said they enter every reply."""
    llm = ScriptedProvider()
    long = " ".join(f"The harbour of Vell has a story number {i} that goes on." for i in range(70))  # ~3,900 chars
    async with App(_config(tmp_path), llm=llm) as app:
        await run(app, "!lore add --always Vell's harbour master is called Oda.")
        await run(app, f"!lore add --always --priority 10 {long}")
        text = await prompt(app, llm, "hello")
        assert "Vell's harbour master is called Oda." in text
        assert "The harbour of Vell has a story number 0" in text  # the long one's start
        assert "story number 69" not in text and "more lore did not fit here" in text


def test_lore_that_fits_exactly_comes_whole() -> None:
    """The note's room was kept even when every entry fitted: lore at the budget's edge lost an entry."""
    from bot.tokens import BPETokenEstimator
    from cortex.personas.lore import LoreSection

    estimator = BPETokenEstimator(margin=0.0)
    chosen = [entry("Vell's harbour master is called Oda.", entry_id=1),
              entry("The lighthouse keeper is named Brann and he is old.", entry_id=2)]
    budget = estimator.count("\n".join(f"- {e.content}" for e in chosen))
    section = LoreSection(None, None, estimator)  # type: ignore[arg-type]  # only the fitting is used here
    lines, used, whole = section._fitting(chosen, budget)
    assert whole and len(lines) == 2 and [e.id for e in used] == [1, 2]


async def test_only_bot_admins_change_lore(tmp_path: Path) -> None:
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        member = CommandContext("discord", "discord:7", "Ann", "discord:chan1", "Cora", server_key="discord:guild1")
        server_admin = CommandContext("discord", "discord:8", "Bo", "discord:chan1", "Cora", is_admin=True,
                                      server_key="discord:guild1")
        assert "admins only" in await run(app, "!lore list", member)
        assert "no lore yet" in await run(app, "!lore list", server_admin)
        for line in ("!lore add x", "!lore edit 1 y", "!lore disable 1", "!lore remove 1"):
            assert "for the bot's admins only" in await run(app, line, server_admin)
        assert "at most 4,000" in await run(app, "!lore add " + "x" * 4001)
        assert "--keys needs a value" in await run(app, "!lore add hi --keys")
        # (a flag after it is no value: the entry meant always on got "--always" for its only keyword)
        assert "--keys needs a value" in await run(app, "!lore add --keys --always The river is wide.")
        assert "--priority needs a value" in await run(app, "!lore add --priority --keys a,b The river.")
        # (a key of punctuation alone comes up in nearly every message; a symbol or "C++" is a key)
        assert "the keyword `.` is only punctuation" in await run(app, "!lore add --keys .,river The river.")
        assert "no lore yet" in await run(app, "!lore list", server_admin)
        assert "enters replies when" in await run(app, "!lore add --keys C++,🎂 Birthday cake.")
        assert "the priority must be 0 or more, not `-3`" in await run(app, "!lore add hi --priority -3")


async def test_lore_remove_deletes_an_entry_and_a_persona_holds_what_a_card_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """There was no way to delete an entry, and `!lore add` had no cap: a persona with more entries than a
    character card holds was exported as a card this bot refused to import again."""
    monkeypatch.setattr(lore_commands, "MAX_LORE_ENTRIES", 2)  # 500 in use: the same code path, faster
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        await run(app, "!lore add The Guild meets at the old mill. --keys guild")
        await run(app, "!lore add The ferry leaves at dawn. --keys ferry")
        full = await run(app, "!lore add The bell rings at noon. --keys bell")
        assert "Cora has 2 lore entries, as many as a character card holds" in full and "!lore remove" in full
        assert "#3" not in await run(app, "!lore list")
        removed = await run(app, "!lore remove 1")
        assert removed == "Lore #1 removed. It said:\nThe Guild meets at the old mill."
        assert "old mill" not in await prompt(app, llm, "When does the guild meet?")
        assert "has no lore entry #1" in await run(app, "!lore remove 1")
        assert "has no lore entry #2" in await run(app, "!lore remove 2", BOSS_OF_MAX)  # Cora's, not Max's
        assert "added" in await run(app, "!lore add The bell rings at noon. --keys bell")
        assert "rings at noon" in await prompt(app, llm, "is that the bell?")


async def test_another_process_sees_new_lore(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=ScriptedProvider()) as first, App(_config(tmp_path), llm=llm) as second:
        await second.lore.refresh(force=True)
        await run(first, "!lore add The moon is made of cheese here. --keys moon")
        await second.lore.refresh(force=True)  # what the next reply does after a few seconds
        assert "made of cheese" in await prompt(second, llm, "look at the moon")


async def test_not_always_on_a_new_entry_is_an_option_not_its_text(tmp_path: Path) -> None:
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        assert "added" in await run(app, "!lore add Paris has many bridges --not-always")
        assert "--not-always" not in await run(app, "!lore show 1")
        assert "choose one of --always and --not-always" in await run(app, "!lore add --always --not-always x")
        assert "(1 entry, page 1/1)" in await run(app, "!lore list")


async def test_a_large_lore_book_is_matched_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """An attacker's finding: a card of 500 entries × 50 keys written with {{user}} took 2.6 s of the event loop
    to prepare for each new person, and every other reply and command waited. A lore book of many keys is matched
    on a thread of its own: the loop goes on meanwhile (here the matching is made slow on purpose)."""
    import asyncio
    import threading
    import time

    from cortex.personas import lore

    monkeypatch.setattr(lore, "THREAD_ABOVE_KEYS", 10)  # (a few entries stand for a card's thousands of keys)
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        for n in range(11):
            await run(app, f"!lore add Fact {n} about the harbour. --keys harbour{n}")
        matched_on: list[str] = []
        slow = lore.LoreIndex.chosen

        def chosen(self: lore.LoreIndex, *args: object) -> list[LoreEntry]:
            matched_on.append(threading.current_thread().name)
            time.sleep(0.5)  # (a big card's keys being prepared)
            return slow(self, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(lore.LoreIndex, "chosen", chosen)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            assert "Fact 7 about the harbour." in await prompt(app, llm, "what about harbour7?")
        finally:
            ticker.cancel()
        assert matched_on and matched_on[0].startswith("lore-match")
        assert ticks >= 5  # (the loop ran on while the lore was matched: on it, hardly a tick in the 0.5 s)
