"""Versioned texts and persona rows on both engines: every change a new version, the newest one live."""

from __future__ import annotations

import asyncio

import pytest

from bot.storage import Storage, personas
from bot.storage.personas import NameTaken, NewLore, PersonaRow


async def test_texts_are_versioned_and_the_newest_is_live(storage: Storage) -> None:
    texts = storage.personas
    first = await texts.put("soul", "1", "identity", "You are Cora.", author="config")
    assert (first.version, first.position, first.enabled) == (1, 1, True)
    tone = await texts.put("soul", "1", "tone", "Warm.", author="config")
    assert tone.position == 2  # a new name goes last
    second = await texts.put("soul", "1", "identity", "You are Cora, a gardener.", author="discord:7",
                             reason="more detail")
    assert (second.version, second.position) == (2, 1)  # the position is carried over
    live = await texts.current("soul", "1")
    assert [(t.name, t.version, t.content) for t in live] == [
        ("identity", 2, "You are Cora, a gardener."), ("tone", 1, "Warm.")]
    history = await texts.history("soul", "1", "identity")
    assert [(h.version, h.author, h.reason) for h in history] == [(1, "config", ""), (2, "discord:7", "more detail")]
    assert (await texts.version("soul", "1", "identity", 1)).content == "You are Cora."
    assert await texts.current("soul", "2") == []  # another persona's soul is its own
    off = await texts.put("rule", "*", "no-spoilers", "Never spoil endings.", author="x", enabled=False)
    assert not off.enabled
    assert not (await texts.put("rule", "*", "no-spoilers", "Never spoil books.", author="x")).enabled


async def test_two_writers_at_once_get_consecutive_versions(storage: Storage) -> None:
    writes = [storage.personas.put("guidelines", "discord:guild1", "", f"text {i}", author=f"u{i}")
              for i in range(6)]
    versions = sorted(v.version for v in await asyncio.gather(*writes))
    assert versions == [1, 2, 3, 4, 5, 6]


async def test_persona_rows_are_created_once_hidden_and_revived(storage: Storage) -> None:
    repo = storage.personas
    made = await repo.create_persona("Lena", "German", {"model": "m1"}, "chat", "german")
    assert made is not None and made.settings == {"model": "m1"} and made.language == "German"
    assert await repo.create_persona("lena", "English", {}, "chat", "english") is None  # names ignore case
    assert [p.name for p in await repo.list_personas()] == ["Lena"]
    await repo.delete_persona(made.id)
    assert await repo.get_persona("Lena") is None and await repo.list_personas() == []
    revived = await repo.create_persona("LENA", "French", {}, "chat", "french")
    assert revived is not None and revived.id == made.id and revived.language == "French"


async def test_concurrent_capped_lore_adds_never_pass_the_cap(storage: Storage) -> None:
    """The cap was checked, then the entry written: two `!lore add` at once (two admins, two processes,
    PostgreSQL's pooled connections) could both pass a count of 499 and leave 501 entries."""
    persona = await storage.personas.create_persona("Cora", "English", {}, "chat", "english")
    other = await storage.personas.create_persona("Max", "English", {}, "chat", "english")
    assert persona is not None and other is not None
    await storage.lore.add(other.id, [NewLore("Max's own.")] * 3, source="chat", author="x")
    adds = [storage.lore.add_capped(persona.id, NewLore(f"entry {i}"), source="chat", author=f"u{i}", cap=4)
            for i in range(12)]
    ids = await asyncio.gather(*adds)
    assert sum(i is not None for i in ids) == 4  # the cap counts Cora's entries, not Max's
    assert len(await storage.lore.entries(persona.id)) == 4
    assert await storage.lore.add_capped(other.id, NewLore("one more"), source="chat", author="x", cap=4) is not None


async def test_names_that_fold_alike_are_claimed_once_however_many_try_at_once(storage: Storage) -> None:
    """"Zoë" and "ZOË" are one name, but the unique index folds ASCII letters only: each creation checked
    the folded name, then wrote, so creations (and a card's import) at once could all pass the check."""
    repo = storage.personas
    tries = [repo.create_persona(name, "English", {}, "chat", "english") for name in ("Zoë", "ZOË", "zoë", "ZoË")]
    imported = repo.import_persona("ZOË", "English", "card", "english", [("identity", "You are Zoë.")], [],
                                   author="x", reason="import", lore_author="x")
    made = await asyncio.gather(*tries, imported)
    [winner] = [p for p in made if isinstance(p, PersonaRow)]
    assert made[-1] in (winner, NameTaken(winner.name, deleted=False))  # the import made it, or names who did
    assert len(await repo.list_personas()) == 1


async def test_a_replaced_place_gives_its_guidelines_settings_and_persona_to_the_new_one(storage: Storage) -> None:
    old, new = "matrix:!old:hs", "matrix:!new:hs"
    await storage.personas.put("guidelines", old, "", "Be kind.", author="matrix:@a:hs")
    await storage.cortex.set_setting(f"server:{old}", "tiers", "on", "matrix:@a:hs")
    await storage.cortex.set_setting(f"server:{old}", "frequency", 5, "matrix:@a:hs")
    await storage.cortex.set_setting(f"server:{new}", "frequency", 9, "matrix:@b:hs")  # set there already: stays
    await storage.set_setting(f"persona.channel.{old}", "Cora")
    await storage.places.carry_over(old, new, author="matrix:@a:hs", reason="an upgrade")
    [guidelines] = await storage.personas.current("guidelines", new)
    assert (guidelines.content, guidelines.version, guidelines.reason) == ("Be kind.", 1, "an upgrade")
    assert await storage.cortex.settings(f"server:{new}") == {"tiers": "on", "frequency": 9}
    assert await storage.get_setting(f"persona.channel.{new}") == "Cora"
    await storage.personas.put("guidelines", new, "", "", author="matrix:@b:hs")  # cleared in the new room
    await storage.places.carry_over(old, new, author="matrix:@a:hs", reason="an upgrade")
    assert [t.content for t in await storage.personas.current("guidelines", new)] == [""]


async def test_each_text_keeps_its_newest_versions_only(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guidelines edited in a loop (by an admin, a script) kept every version for ever: a save past the newest
    KEEP_VERSIONS deletes the older ones of that text, and the daily upkeep those of texts that grew before."""
    texts = storage.personas
    monkeypatch.setattr(personas, "KEEP_VERSIONS", 3)
    for n in range(1, 6):
        await texts.put("guidelines", "discord:g1", "", f"Guideline {n}.", author="discord:7")
        await texts.put("rule", "*", "kind", f"Rule {n}.", author="discord:7")
    assert [v.version for v in await texts.history("guidelines", "discord:g1", "")] == [3, 4, 5]
    assert [v.version for v in await texts.history("rule", "*", "kind")] == [3, 4, 5]
    assert await texts.version("guidelines", "discord:g1", "", 2) is None
    assert await texts.revert("guidelines", "discord:g1", "", 2, author="discord:7") is None  # no longer kept
    reverted = await texts.revert("guidelines", "discord:g1", "", 3, author="discord:7")
    assert reverted is not None and reverted[0].version == 6 and reverted[0].content == "Guideline 3."
    assert [v.version for v in await texts.history("guidelines", "discord:g1", "")] == [4, 5, 6]
    assert await texts.put_based_on(6, "guidelines", "discord:g1", "", "Based on 6.", author="x") is not None
    assert [v.version for v in await texts.history("guidelines", "discord:g1", "")] == [5, 6, 7]
    # texts that grew before (or whose save's trim did not run): the upkeep, over every text at once
    monkeypatch.setattr(personas, "KEEP_VERSIONS", 1)
    assert await texts.prune_versions() == 4
    assert [v.version for v in await texts.history("guidelines", "discord:g1", "")] == [7]
    assert [(t.version, t.content) for t in await texts.current("rule", "*")] == [(5, "Rule 5.")]
    assert await texts.prune_versions() == 0
