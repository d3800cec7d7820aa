"""The relevance floor with the default offline embedder: a search with nothing related says so
instead of returning the least bad ten, on both engines; related memory is still found by meaning
alone (no shared word), and the reply prompt uses the same floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.ports import IncomingMessage
from cortex.memory.embedders import create_embedder
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider

pytestmark = pytest.mark.both_engines
FACTS = [
    "Ann has a golden retriever named Rufus", "Ann works as a night nurse at the city hospital",
    "Ann's sister Mia lives in Oslo", "Ann is learning to play the cello", "Ann is allergic to peanuts",
    "Ann's favourite film is Spirited Away", "Ann grew up on a farm in Devon", "Ann runs every Sunday morning",
    "Ann drives an old red Volvo", "Ann's birthday is on the 3rd of March", "Ann collects vinyl records",
    "Ann wants to visit Japan next spring",
]
MORE_FACTS = [  # with these, 40 facts: a pair's memory after some weeks
    "Ann is vegetarian", "Ann's son Leo starts school in September", "Ann speaks fluent Portuguese",
    "Ann is afraid of flying", "Ann goes bouldering twice a week", "Ann lives in a flat above a bakery in Leeds",
    "Ann's husband Tom is a carpenter", "Ann takes medication for high blood pressure",
    "Ann is saving money for a house deposit", "Ann volunteers at a food bank on Thursdays",
    "Ann hates coriander", "Ann studied chemistry at university", "Ann has two cats called Pixel and Mochi",
    "Ann usually goes to bed after midnight", "Ann's favourite food is Thai green curry",
    "Ann supports Liverpool football club", "Ann is colour-blind", "Ann prefers tea over coffee",
    "Ann is reading the Harry Potter series to her son", "Ann's mother passed away last year",
    "Ann spielt seit Jahren Schach", "Ann backt jeden Samstag Brot", "Ann hat eine Laktoseintoleranz",
    "Ann fährt im Winter gern Ski", "Ann sammelt alte Briefmarken", "Ann träumt von einer Reise nach Island",
    "Ann hat Angst vor Spinnen", "Anns Großvater hat früher in einer Zeche gearbeitet",
]
ANN = CommandContext("console", "console:ann", "Ann", "console:dm-ann", "Cora", is_dm=True)


@pytest.fixture(scope="module")
def e5():  # type: ignore[no-untyped-def]
    return create_embedder("default")


async def _app(tmp_path: Path, e5, llm: ScriptedProvider, facts: list[str] = FACTS) -> App:  # type: ignore[no-untyped-def]
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    app = await App(config, llm=llm, embedder=e5).start(workers=False)
    _, pair = await app.cortex.store.pair_for("console:ann", "Ann", "Cora")
    for fact in facts:
        await app.cortex.memory.remember(pair.id, fact)
    assert app.cortex.embeddings is not None
    report = await app.cortex.embeddings.backfill(max_seconds=120)
    assert report.items == len(facts)
    return app


@pytest.mark.parametrize("nonsense", ["zzzqqq", "qwertzuiop", "🙂🙂🙂", "How do I configure a BGP router?"])
async def test_a_search_for_nothing_related_finds_nothing(tmp_path: Path, e5, nonsense: str) -> None:  # type: ignore[no-untyped-def]
    app = await _app(tmp_path, e5, ScriptedProvider())
    try:
        reply = (await app.commands.dispatch(f"!memory search {nonsense}", ANN)).text
        assert reply == f"Nothing found for `{nonsense}`."
        # found by meaning alone: no word of the question is in the fact
        hits = await app.cortex.memory.search(
            (await app.cortex.store.pair_for("console:ann", "Ann", "Cora"))[1].id, "tell me about my dog")
        assert hits and hits[0].text == "Ann has a golden retriever named Rufus"
    finally:
        await app.stop()


async def test_the_reply_prompt_uses_the_same_floor(tmp_path: Path, e5) -> None:  # type: ignore[no-untyped-def]
    llm = ScriptedProvider()
    app = await _app(tmp_path, e5, llm)
    try:
        await app.core.reply(IncomingMessage("console", "dm-ann", "ann", "Ann", "zzzqqq", is_dm=True)).text()
        assert not any(fact in llm.requests[-1].system for fact in FACTS)
        await app.core.reply(IncomingMessage("console", "dm-ann-2", "ann", "Ann", "what instrument do I play?",
                                             is_dm=True)).text()
        assert "learning to play the cello" in llm.requests[-1].system
    finally:
        await app.stop()


async def test_forty_items_leave_unrelated_queries_empty_and_find_paraphrases(tmp_path: Path, e5) -> None:  # type: ignore[no-untyped-def]
    """With more items, a floor on raw cosines let nearly every query through (some items are "hubs",
    near to anything); the centred floor keeps gibberish and unrelated questions empty and still finds
    facts asked for in other words (no word of the question is in the fact), in English and German."""
    app = await _app(tmp_path, e5, ScriptedProvider(), FACTS + MORE_FACTS)
    try:
        for nonsense in ("blorf snargle", "zzzqqq", "How do I configure a BGP router?", "explain quantum tunnelling",
                         "Wie funktioniert eine Wärmepumpe?", "thanks!"):
            reply = (await app.commands.dispatch(f"!memory search {nonsense}", ANN)).text
            assert reply == f"Nothing found for `{nonsense}`.", reply
        pair = (await app.cortex.store.pair_for("console:ann", "Ann", "Cora"))[1].id
        for question, fact in (("what's my dog called?", "Ann has a golden retriever named Rufus"),
                               ("Wo wohnt meine Schwester?", "Ann's sister Mia lives in Oslo"),
                               ("am I scared of planes?", "Ann is afraid of flying"),
                               ("which herb do I dislike?", "Ann hates coriander")):
            hits = await app.cortex.memory.search(pair, question)
            assert hits and hits[0].text == fact, (question, [h.text for h in hits])
    finally:
        await app.stop()


CONVERSATION = [  # a DM in German: (role, author, text)
    ("user", "Ann", "Seit März arbeite ich auf der Kardiologie an der Uniklinik."),
    ("assistant", "Cora", "Das klingt nach viel Verantwortung. Wie sind die Kollegen?"),
    ("user", "Ann", "Am Wochenende war ich mit Lena klettern, dabei habe ich mir die Hand verstaucht."),
    ("assistant", "Cora", "Autsch, gute Besserung!"),
    ("user", "Ann", "Meine Schwester hat im Juli ein Mädchen bekommen, sie heißt Frieda."),
    ("assistant", "Cora", "Wie schön, herzlichen Glückwunsch an euch alle!"),
    ("user", "Ann", "Im Herbst ziehen wir nach Connewitz, die neue Wohnung hat einen Balkon."),
    ("assistant", "Cora", "Dann kannst du endlich Tomaten pflanzen."),
]


async def test_questions_in_the_first_person_find_past_messages_by_meaning(tmp_path: Path, e5) -> None:  # type: ignore[no-untyped-def]
    """As a user asks (about themself, in German, no word shared with the message): the floor for past
    messages once stood so high that these found nothing, while questions naming the speaker did."""
    app = await _app(tmp_path, e5, ScriptedProvider(), facts=[])
    try:
        user = await app.storage.upsert_user("console:ann", "Ann")
        dm = await app.storage.upsert_channel("console:dm-ann", "dm-ann", is_dm=True)
        ids = [(await app.storage.add_message(dm.id, user.id, "Cora", role, author, text, 20)).id
               for role, author, text in CONVERSATION]
        assert (await app.cortex.embeddings.backfill(max_seconds=120)).messages == len(ids)
        pair = (await app.cortex.store.pair_for("console:ann", "Ann", "Cora"))[1].id
        for question, said in (("Auf welcher Station bin ich tätig?", ids[0]),
                               ("Welchen Namen hat meine Nichte?", ids[4]),
                               ("Wo werde ich bald wohnen?", ids[6])):
            hits = await app.cortex.memory.search(pair, question, user_id=user.id, persona="Cora")
            assert said in [h.id for h in hits[:3]], (question, [h.text for h in hits])
        for nonsense in ("zzzqqq", "🙂🙂🙂"):
            assert not await app.cortex.memory.search(pair, nonsense, user_id=user.id, persona="Cora")
    finally:
        await app.stop()
