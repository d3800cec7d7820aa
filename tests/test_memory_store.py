"""The memory store on real SQLite: lifecycle, visibility, each ranking signal, escaping, recall."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.ports import IncomingMessage
from cortex.memory.embedders import HashEmbedder
from cortex.memory.embedding import EmbeddingService, message_model
from cortex.memory.store import Hit, MemoryError, MemoryStore, Weights, fts_query, says_name
from cortex.memory.vectors import VectorIndex, vector_search
from tests.engines import db_url_for, index_scans
from tests.fakes.provider import ScriptedProvider

pytestmark = pytest.mark.both_engines

DAY = 86_400.0


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def _setup(tmp_path: Path, **store_kw):
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    app = App(config, llm=ScriptedProvider())
    await app.start()
    users = {}
    for name in ("ann", "bob"):
        user = await app.storage.upsert_user(f"console:{name}", name.title())
        users[name] = (user, await app.cortex.store.count_messages(user.id, "Cora", 0))
    clock = Clock()
    store = MemoryStore(app.storage, clock=clock, **store_kw)
    return app, store, users, clock


async def _ann_says(app: App, user: Any) -> Callable[[str], Awaitable[Any]]:
    """Stores one of Ann's messages in her DM with Cora per call."""
    channel = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
    return lambda text: app.storage.add_message(channel.id, user.id, "Cora", "user", "Ann", text, 3)


async def test_lifecycle_supersede_archive_restore_expire(tmp_path: Path) -> None:
    app, store, users, clock = await _setup(tmp_path)
    try:
        pair = users["ann"][1].id
        old = await store.remember(pair, "Ann lives in Hamburg", category="user_info", importance=7,
                                   metadata={"told_in": "a DM", "confidence": 0.9})
        assert (await store.get(pair, old.id, count_access=False)).metadata == {"told_in": "a DM", "confidence": 0.9}
        new = await store.remember(pair, "Ann moved to Leipzig", category="correction", supersedes=old.id)
        hits = await store.search(pair, "where does Ann live Hamburg Leipzig")
        assert [h.id for h in hits] == [new.id]  # the corrected item is hidden, the chain is kept
        assert (await store.get(pair, old.id, count_access=False)).superseded_by == new.id
        with pytest.raises(MemoryError, match="already corrected"):
            await store.remember(pair, "again", supersedes=old.id)
        # (the correction holds: "restore that one" would send the user to an item that is not archived)
        with pytest.raises(MemoryError, match=rf"item #{old.id} was corrected by #{new.id}, which holds now: there is "
                                              "nothing to restore"):
            await store.restore(pair, old.id)
        archived = await store.archive(pair, new.id, "the user asked to forget it")
        with pytest.raises(MemoryError, match=rf"was corrected by #{new.id}: restore that one"):
            await store.restore(pair, old.id)
        assert archived.archived_at is not None and await store.search(pair, "Leipzig") == []
        listed, total = await store.list_items(pair, archived=True)
        assert total == 1 and listed[0].id == new.id
        await store.restore(pair, new.id)
        assert [h.id for h in await store.search(pair, "Leipzig")] == [new.id]
        soon = await store.remember(pair, "Ann's exam is on Friday", category="temporal",
                                    expires_at=clock.now + DAY)
        assert [h.id for h in await store.search(pair, "exam")] == [soon.id]
        clock.now += 2 * DAY
        assert await store.search(pair, "exam") == []  # expired: hidden, not deleted
        assert (await store.get(pair, soon.id, count_access=False)).content == "Ann's exam is on Friday"
        back = await store.restore(pair, soon.id)  # listed among the forgotten ones: restorable as they are
        assert back.expires_at is None and [h.id for h in await store.search(pair, "exam")] == [soon.id]
        with pytest.raises(MemoryError, match="not archived"):
            await store.restore(pair, soon.id)
        with pytest.raises(MemoryError, match="corrected by"):
            await store.restore(pair, old.id)
        for bad in ({"category": "gossip"}, {"importance": 11}):
            with pytest.raises(MemoryError):
                await store.remember(pair, "x", **bad)
        with pytest.raises(MemoryError, match="nothing to remember"):
            await store.remember(pair, "   ")
    finally:
        await app.stop()


async def test_an_item_with_a_key_from_before_its_limit_can_still_be_corrected(tmp_path: Path) -> None:
    """Keys are held to 200 characters now; an item stored before with a longer one (corrections carry the
    item's key over) could no longer be corrected at all: the correction keeps the key, cut."""
    app, store, users, _ = await _setup(tmp_path)
    try:
        pair = users["ann"][1].id
        with pytest.raises(MemoryError, match="a key is a short label of at most 200 characters, not 5,000"):
            await store.remember(pair, "Ann has a cat", key="k" * 5000)
        old = await store.remember(pair, "Ann has a cat", key="pet")
        await app.storage.db.write("UPDATE memory_items SET key = ? WHERE id = ?", ("k" * 5000, old.id))
        new = await store.remember(pair, "Ann has two cats", key="k" * 5000, supersedes=old.id)
        assert new.key == "k" * 200 and (await store.get(pair, old.id, count_access=False)).superseded_by == new.id
    finally:
        await app.stop()


async def test_pairs_never_see_each_other(tmp_path: Path) -> None:
    app, store, users, _ = await _setup(tmp_path)
    try:
        ann, bob = users["ann"][1].id, users["bob"][1].id
        secret = await store.remember(ann, "Ann's bank PIN hint: her cat's birthday")
        assert await store.search(bob, "bank PIN hint cat birthday") == []
        with pytest.raises(MemoryError, match="no memory item"):
            await store.get(bob, secret.id)
        with pytest.raises(MemoryError):
            await store.archive(bob, secret.id, "x")
        assert (await store.list_items(bob))[1] == 0
    finally:
        await app.stop()


@pytest.mark.parametrize("hostile", ['foo-bar', '"unbalanced', "NEAR(a b)", "a AND OR NOT", "*", "col:umn", "'; DROP"])
async def test_hostile_queries_never_break_full_text_search(tmp_path: Path, hostile: str) -> None:
    app, store, users, _ = await _setup(tmp_path)
    try:
        pair = users["ann"][1].id
        await store.remember(pair, "foo bar baz and a column with drop shadows")
        await store.search(pair, hostile)  # must not raise
        assert all(part.startswith('"') for part in fts_query(hostile).split(" OR ") if part)
    finally:
        await app.stop()


async def test_each_signal_moves_the_ranking(tmp_path: Path) -> None:
    app, store, users, clock = await _setup(tmp_path, weights=Weights(), half_life_days=30)
    try:
        pair = users["ann"][1].id
        # importance
        low = await store.remember(pair, "Ann likes green tea", importance=2)
        high = await store.remember(pair, "Ann likes black tea", importance=9)
        assert [h.id for h in await store.search(pair, "Ann likes tea")][:2] == [high.id, low.id]
        # recency: the same text, one of them a year older
        clock.now -= 365 * DAY
        old = await store.remember(pair, "Ann plays chess on Sundays")
        clock.now += 365 * DAY
        fresh = await store.remember(pair, "Ann plays chess on Sundays")
        ranked = [h.id for h in await store.search(pair, "chess Sundays")]
        assert ranked.index(fresh.id) < ranked.index(old.id)
        # access frequency
        a = await store.remember(pair, "Ann's sister is called Mia")
        b = await store.remember(pair, "Ann's sister is called Mia")
        for _ in range(5):
            await store.get(pair, b.id)  # fetched singly: counts
        assert [h.id for h in await store.search(pair, "sister Mia")][0] == b.id
        listed, _ = await store.list_items(pair)
        assert (await store.get(pair, a.id, count_access=False)).access_count == 0  # list views do not count
        assert len(listed) >= 6
        # vector similarity: once the backfill embedded the items, a query with no word in common finds
        # the right one by meaning (here: the test double's shared word pieces)
        index = VectorIndex(app.storage, HashEmbedder().name)
        service = EmbeddingService(app.storage, HashEmbedder(), HashEmbedder(), index, app.config.memory)
        vstore = MemoryStore(app.storage, clock=clock, embeddings=service)
        v1 = await vstore.remember(pair, "Ann's favourite city is Lisbon")
        v2 = await vstore.remember(pair, "Ann once visited a city")
        assert v1.id not in [h.id for h in await vstore.search(pair, "Lisboa")]  # not embedded yet: text only
        report = await service.backfill()
        assert report.items == (await vstore.list_items(pair))[1] and not report.error
        hits = await vstore.search(pair, "Lisboa")
        assert hits[0].id == v1.id and hits[0].signals["vector"] == pytest.approx(1.0)
        assert hits[0].signals["text"] == 0.0  # found by meaning alone
        assert v2.id in [h.id for h in hits]
    finally:
        await app.stop()


async def test_the_words_of_addresses_hosts_paths_and_versions_are_found_on_both_engines(tmp_path: Path) -> None:
    """PostgreSQL kept "ann@example.org", "example.com" or "192.168.1.1" as one token each, and a search asks for
    the words ("example", "com"), as SQLite's tokenizer makes them: found there, nothing on PostgreSQL."""
    app, store, users, _ = await _setup(tmp_path)
    try:
        user, pair = users["ann"]
        texts = ("Ann's website is example.com", "Ann's email is ann@example.org", "Ann's router is 192.168.1.1",
                 "Ann keeps backups in /srv/data/backup", "Ann runs Python 3.11.7")
        for text in texts:
            await store.remember(pair.id, text)
        await store.remember(pair.id, "Ann's mail is Ann Smith <ann@plums.example>")
        said = await _ann_says(app, user)
        await said("write to me at hello@figs.example, or see https://figs.example/about")
        await said("the docs are at <https://docs.example/guide>")  # (as Discord users hide a link's preview)
        for query, found in (("example.com", texts[0]), ("ann@example.org", texts[1]), ("192.168.1.1", texts[2]),
                             ("srv data backup", texts[3]), ("python 3.11.7", texts[4]),
                             ("hello@figs.example", "write to me"), ("figs.example about", "write to me"),
                             ("plums.example", "Ann's mail"), ("docs.example guide", "the docs")):
            hits = await store.search(pair.id, query, user_id=user.id, persona="Cora", patient=True)
            assert any(found in h.text and h.signals["text"] > 0 for h in hits), (query, [h.text for h in hits])
    finally:
        await app.stop()


async def test_past_messages_are_found_with_their_source(tmp_path: Path) -> None:
    app, store, users, _ = await _setup(tmp_path)
    try:
        user, pair = users["ann"]
        await app.core.reply(IncomingMessage("console", "dm-ann", "ann", "Ann", "My dentist is Dr. Okafor")).text()
        await app.core.reply(IncomingMessage("console", "dm-bob", "bob", "Bob", "My dentist is Dr. Lindqvist")).text()
        hits = await store.search(pair.id, "dentist", user_id=user.id, persona="Cora")
        texts = [h.text for h in hits if h.kind == "message"]
        assert any("Okafor" in t for t in texts) and not any("Lindqvist" in t for t in texts)
        assert all(h.source.startswith("message #") for h in hits if h.kind == "message")
    finally:
        await app.stop()


async def test_knowledge_section_in_the_reply_prompt(tmp_path: Path) -> None:
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "memory": {"prompt_tokens": 120, "relevant_items": 20}})
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        user = await app.storage.upsert_user("console:ann", "Ann")
        pair = await app.cortex.store.count_messages(user.id, "Cora", 0)
        memory = app.cortex.memory
        pinned = await memory.remember(pair.id, "Ann is vegetarian", pinned=True, importance=8)
        relevant = await memory.remember(pair.id, "Ann's sister Mia lives in Oslo with two dogs")
        for i in range(12):
            await memory.remember(pair.id, f"Ann visited Oslo in spring number {i} and liked the museums there")
        await app.core.reply(IncomingMessage("console", "dm", "ann", "Ann", "what about my sister in Oslo?",
                                             is_dm=True)).text()
        system = llm.requests[-1].system
        assert "Ann is vegetarian" in system and "sister Mia lives in Oslo" in system
        assert "more memories that did not fit" in system  # the budget holds
        assert (await memory.get(pair.id, relevant.id, count_access=False)).access_count == 1
        assert (await memory.get(pair.id, pinned.id, count_access=False)).access_count == 0
        # in a group channel the user's memory stays out by default
        await app.core.reply(IncomingMessage("console", "room", "ann", "Ann", "my sister in Oslo?",
                                             server_id="g1")).text()
        assert "vegetarian" not in llm.requests[-1].system


async def test_words_too_common_to_rank_by_are_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranking by bm25 scores every matching row: a word found everywhere is dropped from the query, and
    when every word is that common the newest matches are ranked (bounded cost, same visibility)."""
    import cortex.memory.store as store_module

    monkeypatch.setattr(store_module, "COMMON_MATCHES", 5)
    app, store, users, _ = await _setup(tmp_path, candidates=5)
    try:
        user, pair = users["ann"]
        channel = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        rare = await app.storage.add_message(channel.id, user.id, "Cora", "user", "Ann", "my garden has okra", 5)
        for i in range(12):
            await app.storage.add_message(channel.id, user.id, "Cora", "user", "Ann", f"garden day {i}", 3)
        terms, newest = await store._bounded("messages_fts", fts_query("garden okra"), persona="Cora")
        assert (list(terms), newest) == (['"okra"'], False)
        hits = await store.search(pair.id, "garden okra", user_id=user.id, persona="Cora")
        assert [h.id for h in hits] == [rare.id]
        terms, newest = await store._bounded("messages_fts", fts_query("garden"), persona="Cora")
        assert (list(terms), newest) == (['"garden"'], True)
        hits = await store.search(pair.id, "garden", user_id=user.id, persona="Cora", limit=20)
        assert {h.text for h in hits} == {f"Ann: garden day {i}" for i in range(7, 12)}  # the 5 newest
    finally:
        await app.stop()


async def test_ranking_scores_a_bounded_number_of_matches_rarest_words_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Words are ranked by rarest first, as many as match ``COMMON_MATCHES`` rows together: a query of many
    words that each match a few hundred rows does not score thousands."""
    import cortex.memory.store as store_module

    monkeypatch.setattr(store_module, "COMMON_MATCHES", 10)
    app, store, users, _ = await _setup(tmp_path, candidates=5)
    try:
        user, pair = users["ann"]
        say = await _ann_says(app, user)
        both = await say("okra and basil")
        await say("okra soup")
        for i in range(3):
            await say(f"basil pesto {i}")
        for i in range(7):
            await say(f"garden day {i}")  # 7 matches: alone it would be ranked, but not after okra's and basil's 6
        terms, newest = await store._bounded("messages_fts", fts_query("garden basil okra"), persona="Cora")
        assert (list(terms), newest) == (['"basil"', '"okra"'], False)
        hits = await store.search(pair.id, "garden basil okra", user_id=user.id, persona="Cora", limit=3)
        assert hits[0].id == both.id and not any("garden" in h.text for h in hits)
        terms, _ = await store._bounded("messages_fts", fts_query("garden"), persona="Cora")
        assert list(terms) == ['"garden"']
        # A table no larger than the budget costs at most its size to rank whole: every word is kept there
        # (PostgreSQL counts them anyway, for its weights)
        for i in range(6):
            await say(f"garden basil okra mix {i}")  # 23 rows; the words' matches add up to 31
        monkeypatch.setattr(store_module, "COMMON_MATCHES", 25)
        store._table_sizes.clear()
        terms, _ = await store._bounded("messages_fts", fts_query("garden basil okra"), persona="Cora")
        assert sorted(terms) == ['"basil"', '"garden"', '"okra"']
    finally:
        await app.stop()


async def test_a_small_table_that_grows_fast_has_its_words_checked_soon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table small enough to rank every match is measured again within seconds, not a minute later: a new
    bot or an import fills it fast, and every match of every word would be ranked meanwhile."""
    import cortex.memory.store as store_module

    monkeypatch.setattr(store_module, "COMMON_MATCHES", 5)
    app, store, users, _ = await _setup(tmp_path, candidates=5)
    try:
        user, _pair = users["ann"]
        say = await _ann_says(app, user)
        await say("garden day")
        assert list((await store._bounded("messages_fts", fts_query("garden day"), persona="Cora"))[0]) == [
            '"garden"', '"day"']
        await say("okra")
        for i in range(12):
            await say(f"garden day {i}")
        await asyncio.sleep(1.1)
        terms, newest = await store._bounded("messages_fts", fts_query("garden okra"), persona="Cora")
        assert (list(terms), newest) == (['"okra"'], False)
    finally:
        await app.stop()


async def test_the_newest_matches_of_common_words_rank_by_how_many_words_they_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When every word is too common, the newest matches are taken; among them a message or item holding
    more of the words ranks first (SQLite scores them from the words FTS5 marks, without its bm25's count
    of every row each word matches)."""
    import cortex.memory.store as store_module

    monkeypatch.setattr(store_module, "COMMON_MATCHES", 5)
    app, store, users, _ = await _setup(tmp_path, candidates=5)
    try:
        user, pair = users["ann"]
        say = await _ann_says(app, user)
        for i in range(8):
            await say(f"garden day {i}")
            await say(f"tea cup {i}")
            await store.remember(pair.id, f"Ann's garden plot {i}")
            await store.remember(pair.id, f"Ann's tea brand {i}")
        both = await say("tea in the garden, the garden of tea")
        item = await store.remember(pair.id, "Ann drinks tea in her garden")
        await say("garden day 8")
        await store.remember(pair.id, "Ann's garden plot 8")
        assert (await store._bounded("messages_fts", fts_query("garden tea"), persona="Cora"))[1]  # newest mode
        hits = await store.search(pair.id, "garden tea", user_id=user.id, persona="Cora", limit=5,
                                  include_items=False)
        assert hits[0].id == both.id and len(hits) == 5
        assert {h.text for h in hits[1:]} >= {"Ann: garden day 8"}
        items = await store.search(pair.id, "garden tea", include_messages=False, limit=5)
        assert items[0].id == item.id
    finally:
        await app.stop()


async def test_the_replys_own_window_is_left_out_before_the_limit(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages already in the prompt (the history window) are never recall candidates: the engine leaves
    them out itself, so the limit counts only messages kept (best first and newest first alike)."""
    import cortex.memory.store as store_module

    monkeypatch.setattr(store_module, "COMMON_MATCHES", 5)
    app, store, users, _ = await _setup(tmp_path, candidates=4)
    try:
        user, pair = users["ann"]
        channel = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        said = [await app.storage.add_message(channel.id, user.id, "Cora", "user", "Ann", f"garden day {i}", 3)
                for i in range(12)]
        window = {m.id for m in said[-6:]}
        repo = app.storage.memory
        for newest in (True, False):
            rows = await repo.message_text_candidates(user.id, "Cora", {'"garden"': 1.0}, newest=newest, limit=4,
                                                      exclude=window)
            assert len(rows) == 4 and not {int(r["id"]) for r in rows} & window
        newest_rows = await repo.message_text_candidates(user.id, "Cora", {'"garden"': 1.0}, newest=True, limit=4,
                                                         exclude=window)
        assert [int(r["id"]) for r in newest_rows] == [m.id for m in reversed(said[2:6])]
        hits = await store.search(pair.id, "garden", user_id=user.id, persona="Cora", limit=10,
                                  exclude_messages=window, include_items=False)
        assert {h.text for h in hits} == {f"Ann: garden day {i}" for i in range(2, 6)}
    finally:
        await app.stop()


def test_marked_words_rank_like_bm25_without_counting_every_match() -> None:
    from bot.storage.textsearch import MARK_CLOSE as C
    from bot.storage.textsearch import MARK_OPEN as O
    from bot.storage.textsearch import marked_ranks

    one, two, twice, long_one, none = marked_ranks([
        f"{O}tea{C} time", f"{O}tea{C} in the {O}garden{C}", f"{O}Tea{C} and {O}tea{C}",
        f"{O}tea{C} " + "word " * 30, "nothing marked"])
    assert two < twice < one < 0 and none == 0  # negative, lower is better (as FTS5's bm25)
    assert long_one > one  # a long text holding the word once says less about it
    assert marked_ranks([]) == []


async def test_a_short_follow_up_searches_with_the_message_before_it(tmp_path: Path) -> None:
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "memory": {"embedder": "none"}})
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        user = await app.storage.upsert_user("console:ann", "Ann")
        pair = await app.cortex.store.count_messages(user.id, "Cora", 0)
        await app.cortex.memory.remember(pair.id, "Ann's sister Mia lives in Oslo")
        say = lambda text: app.core.reply(  # noqa: E731
            IncomingMessage("console", "dm", "ann", "Ann", text, is_dm=True)).text()
        await say("where is that again?")
        assert "Mia lives in Oslo" not in llm.requests[-1].system  # nothing to go on
        await say("I keep thinking about my sister")
        await say("where is that again?")  # short: the reply before it ("echo: … my sister") joins the search
        assert "Mia lives in Oslo" in llm.requests[-1].system


def test_full_text_queries_drop_function_words_and_keep_a_long_texts_longest_words() -> None:
    assert fts_query("What is the name of my sister?") == '"name" OR "sister"'
    assert fts_query("what is it?") == ""  # nothing else left: nothing to match by words ("how are you?")
    assert fts_query("what is it?", function_words=True) == '"what" OR "is" OR "it"'  # (a search someone asked for)
    assert fts_query("Wie heißt meine Schwester?", language="German") == '"heißt" OR "meine" OR "schwester"'
    long_text = " ".join(f"w{i}" for i in range(40)) + " extraordinarily photosynthesis"
    terms = fts_query(long_text).split(" OR ")
    assert len(terms) == 16 and terms[:2] == ['"w10"', '"w11"'] and terms[-2:] == [
        '"extraordinarily"', '"photosynthesis"']
    assert fts_query("") == "" and fts_query("!!! ???") == ""


def test_only_the_personas_languages_function_words_are_dropped() -> None:
    """Every search dropped the German function words too: "war", "hat", "die", "bin", "mit" and "von", English
    words that say something, were never looked for, whatever the persona's language."""
    assert fts_query("Tell me about the war", language="English") == '"tell" OR "war"'
    assert fts_query("the hat, the bin, MIT, von Trapp", language="en") == '"hat" OR "bin" OR "mit" OR "von" OR "trapp"'
    assert fts_query("Was war das mit dem Hut?", language="Deutsch") == '"hut"'
    assert fts_query("How was the war, und die Katze?", language="German") == '"katze"'  # (English ones too)
    # German ones that are no English words stay out for the others ("wie", "eine")
    assert fts_query("Wie funktioniert eine Wärmepumpe?", language="English") == '"funktioniert" OR "wärmepumpe"'
    # Any other language, and one written in a way no configuration knows, leaves both lists out, as before: for
    # "Deutsch (Österreich)" or "German (formal)", "war" and "mit" are German (a match by them skipped the floor)
    assert fts_query("the war des chats und ich", language="French") == '"chats"'
    for german in ("Deutsch (Österreich)", "German (formal)", "Schweizerdeutsch", "simple", ""):
        assert fts_query("wie war die Reise mit dem Zug", language=german) == '"reise" OR "zug"', german


async def test_memory_search_finds_english_words_that_are_german_function_words(tmp_path: Path) -> None:
    """An English persona's searches left "war", "hat", "MIT" and "bin" out (German function words): a reply
    about the war, a hat, MIT or a bin got no knowledge section, and `!memory search red hat` found nothing."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"},
                           "personas": [{"name": "Cora", "language": "English"},
                                        {"name": "Lena", "language": "German"}]})
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        def ctx(persona: str) -> CommandContext:
            return CommandContext("console", "console:ann", "Ann", f"console:dm-{persona}", persona, is_dm=True)

        async def say(text: str, persona: str = "Cora") -> str:
            await app.core.reply(IncomingMessage("console", f"dm-{persona}", "ann", "Ann", text, is_dm=True),
                                 persona).text()
            return llm.requests[-1].system

        facts = {"Tell me about the war again": "My grandfather fought in the war",
                 "Where is my hat now": "I lost my favourite hat", "How is it going at MIT": "I moved to MIT last year",
                 "Which colour is my bin": "My old trash bin is green"}
        for fact in facts.values():
            assert "Remembered" in (await app.commands.dispatch(f"!memory remember {fact}", ctx("Cora"))).text
        for question, fact in facts.items():
            assert fact in await say(question)
        assert "favourite hat" in (await app.commands.dispatch("!memory search red hat", ctx("Cora"))).text
        # A German persona still leaves its language's function words out: "war" and "das" match nothing
        await app.commands.dispatch("!memory remember Das Konzert war toll", ctx("Lena"))
        assert "Konzert" not in await say("wie war das?", "Lena")
        assert "Konzert" in await say("wie war das Konzert?", "Lena")


async def test_a_word_with_ss_finds_its_spelling_with_sharp_s_and_back(tmp_path: Path) -> None:
    """SQLite's tokenizer keeps "ß" and "ss" apart: "Strasse" never found "Straße", "Weisswurst" never "Weißwurst"
    and "groß" never "GROSS" (PostgreSQL's German configuration finds each)."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"},
                           "personas": [{"name": "Cora", "language": "German"}]})
    async with App(config, llm=ScriptedProvider()) as app:
        ctx = CommandContext("console", "console:ann", "Ann", "console:dm-ann", "Cora", is_dm=True)
        for fact in ("Ich wohne in der Langen Straße 5", "Mein Lieblingsessen ist Weißwurst", "Er heißt GROSS",
                     "Ich arbeite in der Gartenstrasse"):
            await app.commands.dispatch(f"!memory remember {fact}", ctx)
        for query, fact in (("STRASSE", "Straße"), ("Strasse", "Straße"), ("strasse", "Straße"),
                            ("Straße", "Straße"), ("Weisswurst", "Weißwurst"), ("WEISSWURST", "Weißwurst"),
                            ("groß", "GROSS"), ("Gross", "GROSS"), ("Gartenstraße", "Gartenstrasse")):
            found = (await app.commands.dispatch(f"!memory search {query}", ctx)).text
            assert fact in found, (query, found)


def test_an_ss_or_sharp_s_word_has_a_bounded_number_of_spellings() -> None:
    from bot.storage.textsearch import fts5_match

    assert fts5_match(['"tea"', '"strasse"']) == '"tea" OR ("strasse" OR "straße")'
    assert fts5_match(['"groß"']) == '("groß" OR "gross")'
    assert fts5_match(['"schlossstraße"']) == (
        '("schlossstraße" OR "schlossstrasse" OR "schloßstraße" OR "schloßstrasse")')
    assert fts5_match(['"maßenstrassenpass"']).count(" OR ") == 2  # itself, all "ß", all "ss": at most three
    assert fts5_match([]) == ""


async def test_after_forget_me_reused_ids_never_show_another_users_messages(tmp_path: Path, engine: str) -> None:
    """Nothing cached for a forgotten user may surface the messages of whoever comes next (SQLite used to
    hand the ids of deleted rows to the next rows; ids are never reused now)."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        def say(user: str, text: str):  # type: ignore[no-untyped-def]
            return app.core.reply(IncomingMessage("console", f"dm-{user}", user, user.title(), text,
                                                  is_dm=True)).text()

        await say("carl", "hello")  # Carl came first: user 1, messages 1-2
        await say("ann", "my garden has roses")  # Ann: user 2, messages 3-4
        await app.cortex.embeddings.backfill()
        ann = await app.storage.get_user("console:ann")
        pair = await app.cortex.store.count_messages(ann.id, "Cora", 0)
        assert await app.cortex.memory.search(pair.id, "roses garden", user_id=ann.id, persona="Cora")
        context = CommandContext("console", "console:ann", "Ann", "console:dm-ann", "Cora", is_dm=True)
        assert "Done" in (await app.commands.dispatch("!memory forget-me confirm", context)).text
        await say("carl", "my bank PIN is 4821 and my garden has roses")
        await app.cortex.embeddings.backfill()
        await say("ann", "hello again")
        ann = await app.storage.get_user("console:ann")
        assert ann.id > 2  # a new id (SQLite reused the deleted one before migration 6: stale caches were dangerous)
        pair = await app.cortex.store.count_messages(ann.id, "Cora", 0)
        hits = await app.cortex.memory.search(pair.id, "bank PIN garden roses", user_id=ann.id, persona="Cora")
        assert not any("Carl" in h.text or "PIN" in h.text for h in hits)


async def test_a_word_found_nowhere_does_not_hide_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cortex.memory.store as store_module

    monkeypatch.setattr(store_module, "COMMON_MATCHES", 5)
    app, store, users, _ = await _setup(tmp_path)
    try:
        user, pair = users["ann"]
        channel = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        for i in range(8):
            await app.storage.add_message(channel.id, user.id, "Cora", "user", "Ann", f"tea time {i}", 3)
        hits = await store.search(pair.id, "tea qwertyuiop", user_id=user.id, persona="Cora")
        assert hits and all("tea" in h.text for h in hits)  # the typo matches nothing; tea still counts
    finally:
        await app.stop()


async def test_message_neighbours_are_the_pairs_own_in_the_same_channel(tmp_path: Path) -> None:
    app, store, users, _ = await _setup(tmp_path)
    try:
        (ann, _), (bob, _) = users["ann"], users["bob"]
        group = await app.storage.upsert_channel("console:group", "group", is_dm=False)
        dm = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)

        async def say(channel: int, user: int, text: str, persona: str = "Cora", role: str = "user") -> int:
            return (await app.storage.add_message(channel, user, persona, role, "x", text, 3)).id

        a1 = await say(group.id, ann.id, "one")
        await say(group.id, bob.id, "bob speaks")
        a2 = await say(group.id, ann.id, "reply to ann", role="assistant")
        await say(dm.id, ann.id, "in the DM")
        await say(group.id, ann.id, "to another persona", persona="Max")
        a3 = await say(group.id, ann.id, "three")
        a4 = await say(group.id, ann.id, "four")
        b1 = await say(group.id, bob.id, "bob again")
        found = await app.storage.memory.message_neighbours(ann.id, "Cora", [a2, a4, b1], 2)
        assert sorted(found) == [(a2, a1, 1), (a2, a3, 1), (a2, a4, 2), (a4, a2, 2), (a4, a3, 1)]
        assert await app.storage.memory.message_neighbours(ann.id, "Cora", [], 2) == []
    finally:
        await app.stop()


async def test_a_message_takes_relevance_from_the_turns_next_to_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import cortex.memory.store as store_module

    app, store, users, _ = await _setup(tmp_path)
    try:
        ann, pair = users["ann"]
        dm = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        turns = [("user", "Do you remember my dog Rufus?"), ("user", "His birthday is on Friday."),
                 *[("assistant", f"Unrelated small talk number {n}.") for n in range(6)],
                 ("user", "Birthday birthday cake.")]
        ids = [(await app.storage.add_message(dm.id, ann.id, "Cora", role, "Ann", text, 5)).id
               for role, text in turns]
        said_with_rufus, cake = ids[1], ids[-1]

        async def order() -> list[int]:
            hits = await store.search(pair.id, "Rufus birthday", user_id=ann.id, persona="Cora", include_items=False)
            return [h.id for h in hits]

        ranked = await order()
        assert ranked.index(said_with_rufus) < ranked.index(cake)  # "his birthday" next to "my dog Rufus"
        hit = next(h for h in await store.search(pair.id, "Rufus birthday", user_id=ann.id, persona="Cora")
                   if h.id == said_with_rufus)
        assert hit.signals["context"] > 0
        monkeypatch.setattr(store_module, "CONTEXT_SHARE", 0.0)
        alone = await order()
        assert alone.index(cake) < alone.index(said_with_rufus)  # without its neighbour the short one wins
    finally:
        await app.stop()


def test_a_query_names_a_person_by_a_word_of_their_name_or_its_possessive() -> None:
    def names(query: str, name: str, **kw: object) -> bool:
        return says_name(re.findall(r"\w+", query), name, **kw)  # type: ignore[arg-type]

    assert names("Was kostete Pauls Wagen?", "Paul")
    assert names("What is Jonas' job?", "Jonas") and names("what is ann's job", "Ann")
    assert names("where does smith live", "Caroline Smith")
    assert not names("Coral reefs are dying", "Cora")  # a word of its own, not a part of one
    assert not names("what is the plan", "The")  # function words are nobody's name
    assert not names("a b c", "A B")
    # a possessive s only on a capitalised word that is no function word
    assert not names("This is odd. Has it? Does it?", "Thi Ha Doe")
    assert not names("she grows roses", "Rose") and names("Roses Garten", "Rose")
    assert not names("Cora, what is my job?", "Cora Lee", not_names={"cora"})  # the persona's name
    assert names("what is Lee's job?", "Cora Lee", not_names={"cora"})


async def test_messages_of_the_person_the_query_names_rank_first(tmp_path: Path) -> None:
    app, store, users, _ = await _setup(tmp_path)
    try:
        ann, pair = users["ann"]
        dm = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        said = [("user", "Ann", "I went hiking in the Alps last summer."),
                ("assistant", "Cora", "Ann, hiking in the Alps every summer! Going hiking there in summer, "
                                      "what a dream."),
                *[("assistant", "Cora", f"Unrelated small talk number {n}.") for n in range(4)]]
        ids = [(await app.storage.add_message(dm.id, ann.id, "Cora", role, author, text, 9)).id
               for role, author, text in said]
        item = await store.remember(pair.id, "Ann hikes in the Alps every summer", importance=1)
        anns, coras = ids[0], ids[1]

        async def hits(query: str) -> list[Hit]:
            return await store.search(pair.id, query, user_id=ann.id, persona="Cora")

        named = await hits("Where does Ann go hiking in summer?")
        order = [h.id for h in named if h.kind == "message"]
        assert order.index(anns) < order.index(coras)
        assert {h.id: h.signals.get("author") for h in named if h.kind == "message"}[anns] == 1.0
        assert "author" not in next(h for h in named if h.id == coras).signals
        assert next(h for h in named if h.kind == "item").signals["author"] == 1.0  # what is known of Ann
        # the same query without the signal, naming nobody, or naming only the persona: Cora's says more
        store.weights = Weights(author=0.0)
        assert [h.id for h in await hits("Where does Ann go hiking in summer?") if h.kind == "message"][0] == coras
        store.weights = Weights()
        for query in ("Where does she go hiking in summer?", "Cora, where do we go hiking in summer?",
                      "Where do you and I go hiking in summer?"):  # nobody, the persona's name, both
            found = await hits(query)
            assert [h.id for h in found if h.kind == "message"][0] == coras, query
            assert not any("author" in h.signals for h in found), query
        assert item.id in {h.id for h in found if h.kind == "item"}
        # the user speaking of themself means the user; speaking to the persona, the persona
        for query in ("Where do I go hiking in summer?", "Do you remember where I go hiking in summer?",
                      "Could you tell me where I go hiking in summer?",
                      "Weißt du noch, wo ich im Sommer wandern gehe? hiking"):  # a way of asking is no "you"
            mine = await hits(query)
            assert [h.id for h in mine if h.kind == "message"][0] == anns, query
            assert next(h for h in mine if h.kind == "item").signals["author"] == 1.0
        yours = await store.search(pair.id, "Where do you go hiking in summer?", user_id=ann.id,
                                   persona="Cora", include_items=False)
        assert yours[0].id == coras and "author" in yours[0].signals and "author" not in next(
            h for h in yours if h.id == anns).signals
        # the persona's messages never push the user's items out: items keep their place against them
        pick = {("message", coras), ("item", item.id)}
        both = [h for h in await hits("Where do you go hiking in summer?") if (h.kind, h.id) in pick]
        store.weights = Weights(author=0.0)
        plain = [h for h in await hits("Where do you go hiking in summer?") if (h.kind, h.id) in pick]
        store.weights = Weights()
        assert len(both) == 2 and [h.kind for h in both] == [h.kind for h in plain]
        assert all(h.signals["author"] == 1.0 for h in both)
        # only the searcher's own words say who is meant: "I" in the persona's reply before a follow-up is not
        # the user
        follow_up = await hits("Cora: I would go hiking in summer!\nand Ann?")
        assert "author" in next(h for h in follow_up if h.id == anns).signals  # "I" taken for the user too
        about = await store.search(pair.id, "Cora: I would go hiking in summer!\nand Ann?", user_id=ann.id,
                                   persona="Cora", about="and Ann?")
        assert [h.id for h in about if h.kind == "message"][0] == anns
        assert "author" not in next(h for h in about if h.id == coras).signals
    finally:
        await app.stop()


class _WaitsForTheTextPart(HashEmbedder):
    """A query embedder that finishes only once the search's full-text part has run (or after 3 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.text_part_ran = threading.Event()
        self.waited = False

    def embed(self, texts):  # type: ignore[no-untyped-def]
        self.waited = self.text_part_ran.wait(3.0)
        return super().embed(texts)


def _with_vectors(app: App, clock: Any, queries: HashEmbedder, *, query_timeout: float | None = None
                  ) -> tuple[EmbeddingService, MemoryStore]:
    """A memory store over the app's storage that searches by meaning too: items embedded by a HashEmbedder,
    queries by ``queries`` (within ``query_timeout`` seconds, when given)."""
    config = app.config.memory
    if query_timeout is not None:
        config = config.model_copy(update={"query_timeout_seconds": query_timeout})
    index = vector_search(app.storage, queries.name, message_model=message_model(queries.name), max_vectors=1000)
    service = EmbeddingService(app.storage, HashEmbedder(), queries, index, config)
    return service, MemoryStore(app.storage, clock=clock, embeddings=service)


async def test_the_query_is_embedded_while_the_full_text_part_runs(tmp_path: Path) -> None:
    app, store, users, clock = await _setup(tmp_path)
    try:
        pair = users["ann"][1].id
        queries = _WaitsForTheTextPart()
        service, vstore = _with_vectors(app, clock, queries, query_timeout=10.0)
        lisbon = await vstore.remember(pair, "Ann's favourite city is Lisbon")
        await service.backfill()
        text_part = vstore.repo.item_text_candidates

        async def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
            queries.text_part_ran.set()
            return await text_part(*args, **kwargs)

        vstore.repo.item_text_candidates = recorded  # type: ignore[method-assign]
        hits = await vstore.search(pair, "Lisboa favourite")
        assert queries.waited  # the embedding saw the text part start: they ran side by side
        assert hits and hits[0].id == lisbon.id and hits[0].signals["vector"] > 0
    finally:
        await app.stop()


class _SlowFirstQuery(HashEmbedder):
    """A query embedder whose first query takes 1.5 s (a model loading), the others none."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def embed(self, texts):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            time.sleep(1.5)
        return super().embed(texts)


async def test_a_search_someone_asked_for_waits_for_the_models_first_load(tmp_path: Path) -> None:
    """The reply path's recall waits memory.query_timeout_seconds for the query's vector; the model's first
    load took longer, and a !memory search right after the start found only what matched by words. A search
    someone asked for tries again, and waits longer."""
    app, store, users, clock = await _setup(tmp_path)
    try:
        pair = users["ann"][1].id
        queries = _SlowFirstQuery()
        service, vstore = _with_vectors(app, clock, queries, query_timeout=0.2)
        await vstore.remember(pair, "Ann's favourite city is Lisbon")
        await service.backfill()
        hurried = await vstore.search(pair, "Lisboa")  # (a reply's recall: gives up on the vector)
        assert all(h.signals.get("vector", 0) == 0 for h in hurried)
        await asyncio.sleep(1.6)  # (the slow first query's thread ends)
        service.forget_queries()
        queries.calls = 0  # (its first query slow again)
        patient = await vstore.search(pair, "Lisboa favourite", patient=True)
        assert patient and patient[0].signals["vector"] > 0
    finally:
        await app.stop()


async def test_the_vector_part_is_started_before_the_full_text_part(tmp_path: Path) -> None:
    """The vector part is the longer one (PostgreSQL's k-NN walk: ~5 ms at 1M items, the full-text query
    ~0.5 ms). Started second, its statement waited for the other's to be sent: 0.45 ms on every search."""
    app, store, users, clock = await _setup(tmp_path)
    try:
        pair = users["ann"][1].id
        service, vstore = _with_vectors(app, clock, HashEmbedder())
        lisbon = await vstore.remember(pair, "Ann's favourite city is Lisbon")
        await service.backfill()
        started: list[str] = []

        def recording(name: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def recorded(*args: Any, **kwargs: Any) -> Any:
                started.append(name)
                return await call(*args, **kwargs)
            return recorded

        vstore.repo.item_text_candidates = recording("text", vstore.repo.item_text_candidates)  # type: ignore[method-assign]
        vstore.repo.vector_top_items = recording("vector", vstore.repo.vector_top_items)  # type: ignore[method-assign]
        service.index.top = recording("vector", service.index.top)  # type: ignore[method-assign]
        query = "Lisboa favourite"
        vector = await service.embed_query(query)
        await vstore.search(pair, query, query_vector=vector)  # the first reads what later ones keep
        started.clear()
        hits = await vstore.search(pair, query, query_vector=vector)
        assert started == ["vector", "text"]
        assert hits and hits[0].id == lisbon.id and hits[0].signals["vector"] > 0
    finally:
        await app.stop()


async def test_a_reply_reads_a_bounded_number_of_pinned_items(tmp_path: Path) -> None:
    """5,000 pinned items (as an import could bring) were all read and token-counted in every reply: half a
    second of the event loop each time."""
    import cortex.memory.section as section

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "memory": {"embedder": "none"}})
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        user = await app.storage.upsert_user("console:ann", "Ann")
        pair = await app.cortex.store.count_messages(user.id, "Cora", 0)
        for i in range(section.PINNED_READ + 30):
            await app.storage.memory.add_item(pair.id, {"category": "fact", "content": f"pinned fact {i}",
                                                        "pinned": 1, "importance": 9 if i == 0 else 3}, None, 1.0)
        read = await app.cortex.memory.pinned(pair.id, section.PINNED_READ)
        assert len(read) == section.PINNED_READ and read[0].content == "pinned fact 0"  # the most important first
        await app.core.reply(IncomingMessage("console", "dm", "ann", "Ann", "hello", is_dm=True)).text()
        assert "pinned fact 0" in llm.requests[-1].system


async def test_a_pairs_pinned_items_are_read_without_going_through_its_other_items(tmp_path: Path) -> None:
    """Every reply reads the pair's pinned items, and the pair's index made that query go through all of its
    items: 60 ms a reply at 100k items. An index of the pinned items alone serves it now: the work does not
    grow with the unpinned items (SQLite: the statement's virtual machine steps; PostgreSQL: the index's own
    scan count)."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"}})
    async with App(config, llm=ScriptedProvider()) as app:
        repo, memory = app.storage.memory, app.cortex.memory
        user = await app.storage.upsert_user("console:ann", "Ann")
        pair = await app.cortex.store.count_messages(user.id, "Cora", 0)
        for i, importance in enumerate((4, 9, 6)):
            await repo.add_item(pair.id, {"category": "fact", "content": f"pinned {i}", "pinned": 1,
                                          "importance": importance}, None, 1.0)
        gone = await repo.add_item(pair.id, {"category": "fact", "content": "pinned, archived", "pinned": 1}, None, 1.0)
        assert gone is not None
        await memory.archive(pair.id, int(gone["id"]), "test")

        async def unpinned(count: int) -> None:
            for i in range(count):
                await repo.add_item(pair.id, {"category": "fact", "content": f"plain {i}"}, None, 1.0)

        async def work() -> int:
            if app.storage.db.dialect == "postgres":
                await app.storage.db.write("ANALYZE memory_items")
                before = await index_scans(app.storage, "memory_items_pinned")
                assert [i.content for i in await memory.pinned(pair.id, 100)] == ["pinned 1", "pinned 2", "pinned 0"]
                return await index_scans(app.storage, "memory_items_pinned", above=before) - before
            steps = 0

            def step() -> int:
                nonlocal steps
                steps += 1
                return 0

            connection = app.storage.db.connection  # type: ignore[attr-defined]
            await connection.set_progress_handler(step, 10)
            try:
                assert [i.content for i in await memory.pinned(pair.id, 100)] == ["pinned 1", "pinned 2", "pinned 0"]
            finally:
                await connection.set_progress_handler(None, 10)
            return steps

        await unpinned(50)
        few = await work()
        await unpinned(2000)
        many = await work()
        if app.storage.db.dialect == "postgres":
            assert many == 1, (few, many)  # read by the pinned items' index (a table of 50 is scanned whole)
        else:
            assert many < few * 2, (few, many)  # a scan of the pair's items: about 40 times the steps



@pytest.mark.parametrize("sparse_below", [2000, 3])
async def test_the_embedding_backlog_is_the_live_items_without_the_models_vector_newest_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sparse_below: int) -> None:
    """The backlog is found by its index when it is small (sorted) and by walking the items when it is large
    (``SPARSE_BACKLOG``): either way the same items, newest first, none archived, none of the model's own,
    those of another model included (a new embedder embeds everything again)."""
    import numpy as np

    from bot.storage import memory as memory_storage

    monkeypatch.setattr(memory_storage, "SPARSE_BACKLOG", sparse_below)
    app, store, users, _clock = await _setup(tmp_path)
    try:
        pair = users["ann"][1].id
        ids = [(await store.remember(pair, f"fact number {n}")).id for n in range(8)]
        repo = app.storage.memory
        vector = np.ones(8, dtype=np.float32) / np.sqrt(8)
        await repo.store_item_vectors("a-model", [(i, vector) for i in ids[:3]])
        await repo.store_item_vectors("z-model", [(ids[3], vector)])  # (sorts after the wanted model's name)
        await repo.store_item_vectors("m-model", [(i, vector) for i in ids[4:6]])
        await store.archive(pair, ids[7], "gone")
        rows = await repo.items_to_embed("m-model", 10)
        assert [int(r["id"]) for r in rows] == [ids[6], ids[3], ids[2], ids[1], ids[0]]
        assert [int(r["id"]) for r in await repo.items_to_embed("m-model", 2)] == [ids[6], ids[3]]
        await repo.store_item_vectors("m-model", [(i, vector) for i in (ids[0], ids[1], ids[2], ids[3], ids[6])])
        assert await repo.items_to_embed("m-model", 10) == []
    finally:
        await app.stop()


async def test_a_pairs_memory_holds_a_bounded_number_of_items(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`!memory remember` (and the persona's tools) had no cap: at the command rate limit one account could add
    43,000 items a day. Past PAIR_ITEMS (an import's cap too) one more is refused with what to do; a correction
    (it replaces one) and room made by forgetting still go, and another pair has its own count."""
    import cortex.memory.store as store_module

    monkeypatch.setattr(store_module, "PAIR_ITEMS", 3)
    app, store, users, _ = await _setup(tmp_path)
    try:
        pair, other = users["ann"][1].id, users["bob"][1].id
        kept = [await store.remember(pair, f"Ann fact number {n}") for n in range(3)]
        with pytest.raises(MemoryError, match="this memory holds 3 items, as many as it may: forget some first"):
            await store.remember(pair, "Ann fact number 4")
        await store.remember(pair, "Ann fact number 0, corrected", supersedes=kept[0].id)
        assert (await store.remember(other, "Bob fact")).content == "Bob fact"
        await store.archive(pair, kept[1].id, "forgotten by the user")
        with pytest.raises(MemoryError, match="as many as it may"):  # (the correction took the room: 3 again)
            await store.remember(pair, "Ann fact number 4")
        await store.archive(pair, kept[2].id, "forgotten by the user")
        assert (await store.remember(pair, "Ann fact number 4")).content == "Ann fact number 4"
    finally:
        await app.stop()


async def test_a_search_of_function_words_only_finds_the_items_and_messages_that_hold_them(
        tmp_path: Path, engine: str) -> None:
    """A search someone asks for keeps a query's function words when it has nothing else ("The Who", "who are
    you"). PostgreSQL's language configurations drop them when the text is stored, so their query there was
    empty and found nothing by its words, where SQLite's FTS5 keeps every word and found them."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"},
                           "personas": [{"name": "Cora", "language": "English"},
                                        {"name": "Lena", "language": "German"}]})
    async with App(config, llm=ScriptedProvider()) as app:
        user = await app.storage.upsert_user("console:ann", "Ann")
        store = app.cortex.memory
        for persona, facts in (("Cora", ["The weather is fine today", "My favourite band is The Who",
                                         "I bought concert tickets"]),
                               ("Lena", ["Das Wetter ist schön", "Wer ist sie? Meine Schwester", "Ich mag Konzerte"])):
            pair = (await app.storage.cortex.ensure_pair(user.id, persona)).id
            for fact in facts:
                await store.remember(pair, fact, category="fact", importance=3, source="user")
        channel = await app.storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
        for text in ("I slept well", "Who are you, by the way?", "Tell me about concerts"):
            await app.storage.add_message(channel.id, user.id, "Cora", "user", "Ann", text, 3)

        async def found(persona: str, query: str) -> list[str]:
            pair = (await app.storage.cortex.ensure_pair(user.id, persona)).id
            hits = await store.search(pair, query, user_id=user.id, persona=persona, function_words=True)
            return [h.text for h in hits]

        # (the item holding both words before the one holding "the" alone, the message holding neither not at all)
        the_who = await found("Cora", "The Who")
        assert the_who == ["My favourite band is The Who", "Ann: Who are you, by the way?", "The weather is fine today"]
        assert "Ann: Who are you, by the way?" in await found("Cora", "who are you")  # a message
        assert (await found("Lena", "wer ist sie"))[0] == "Wer ist sie? Meine Schwester"
        # A query with words of its own is searched by them alone, as before
        assert await found("Cora", "the concert") == ["I bought concert tickets", "Ann: Tell me about concerts"]
        assert await found("Lena", "das Konzert") == ["Ich mag Konzerte"]
