"""Character cards (V2/V3, JSON or PNG): every mapped field, the PNG chunk variants, text cleaning, each refusal
as one clear line, the export round trip, and no crash whatever the bytes."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex.personas.cards import (
    MAX_CARD_BYTES,
    PNG_SIGNATURE,
    Card,
    CardError,
    CardLoreEntry,
    export_card_v2,
    parse_card,
)

# --- building cards ------------------------------------------------------------------------------------------


def v2_data(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "Cora",
        "description": "{{char}} is a gardener who talks to {{user}} about roses.",
        "personality": "Warm, patient, a little nosy.",
        "scenario": "A greenhouse on a rainy afternoon.",
        "first_mes": "*looks up from the seedlings* Oh, hello {{user}}!",
        "mes_example": "<START>\n{{user}}: Hi\n{{char}}: Hello there.",
        "creator_notes": "Made for cozy chats. Not part of the prompt.",
        "system_prompt": "Stay in character as {{char}}.",
        "post_history_instructions": "Keep replies short.",
        "alternate_greetings": ["Another greeting."],
        "character_book": {
            "name": "Cora's garden",
            "description": "Places and people",
            "scan_depth": 4,
            "token_budget": 512,
            "recursive_scanning": False,
            "extensions": {},
            "entries": [
                {"keys": ["greenhouse", "glasshouse"], "content": "The greenhouse has a leaking roof.",
                 "extensions": {}, "enabled": True, "insertion_order": 10, "case_sensitive": False,
                 "name": "Greenhouse", "priority": 5, "id": 0, "comment": "place", "selective": True,
                 "secondary_keys": ["rain"], "constant": False, "position": "before_char"},
                {"keys": [], "content": "Cora is allergic to lilies.", "extensions": {}, "enabled": False,
                 "insertion_order": 20, "comment": "allergy", "constant": True},
            ],
        },
        "tags": ["female", "wholesome", "female", " "],
        "creator": "ann",
        "character_version": "1.2",
        "extensions": {"regex_scripts": [{"findRegex": "(a+)+b", "replaceString": "x"}], "talkativeness": "0.5"},
    }
    data.update(overrides)
    return data


def v2_card(**overrides: Any) -> dict[str, Any]:
    return {"spec": "chara_card_v2", "spec_version": "2.0", "data": v2_data(**overrides)}


def v3_card(**overrides: Any) -> dict[str, Any]:
    data = v2_data(**{"name": "Cora Three", **overrides})
    data.update(
        assets=[{"type": "icon", "uri": "https://example.invalid/cora.png", "name": "main", "ext": "png"}],
        nickname="Cori", creator_notes_multilingual={"fr": "Pour discuter."}, source=["https://example.invalid"],
        group_only_greetings=["Hi all."], creation_date=1700000000, modification_date=1700000001,
    )
    data["character_book"]["entries"].append(
        {"keys": ["/ros(e|es)/i"], "content": "Roses are her favourite.", "extensions": {}, "enabled": True,
         "insertion_order": 30, "use_regex": True})
    return {"spec": "chara_card_v3", "spec_version": "3.0", "data": data}


def dumps(card: object) -> bytes:
    return json.dumps(card).encode("utf-8")


def chunk(ctype: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + ctype + body + struct.pack(">I", zlib.crc32(ctype + body))


def png(*chunks: bytes) -> bytes:
    """A valid 1×1 RGB PNG with the given chunks between its IDAT and IEND."""
    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
    idat = chunk(b"IDAT", zlib.compress(b"\x00\xff\x80\x00"))  # filter byte + one pixel
    return PNG_SIGNATURE + ihdr + idat + b"".join(chunks) + chunk(b"IEND", b"")


def b64(card: object) -> bytes:
    return base64.b64encode(dumps(card))


def text_chunk(keyword: str, card: object) -> bytes:
    return chunk(b"tEXt", keyword.encode("latin-1") + b"\0" + b64(card))


def ztxt_chunk(keyword: str, card: object) -> bytes:
    return chunk(b"zTXt", keyword.encode("latin-1") + b"\0\0" + zlib.compress(b64(card)))


def itxt_chunk(keyword: str, card: object, compressed: bool) -> bytes:
    text = zlib.compress(b64(card)) if compressed else b64(card)
    return chunk(b"iTXt", keyword.encode("latin-1") + b"\0" + bytes([int(compressed), 0]) + b"en\0Chara\0" + text)


def refused(data: bytes) -> str:
    with pytest.raises(CardError) as caught:
        parse_card(data)
    message = str(caught.value)
    assert message and "\n" not in message
    return message


# --- reading -------------------------------------------------------------------------------------------------

EXPECTED_SECTIONS = (
    ("identity", "{{char}} is a gardener who talks to {{user}} about roses."),
    ("personality", "Warm, patient, a little nosy."),
    ("scenario", "A greenhouse on a rainy afternoon."),
    ("system_prompt", "Stay in character as {{char}}."),
    ("first_message", "*looks up from the seedlings* Oh, hello {{user}}!"),
    ("example_dialogue", "<START>\n{{user}}: Hi\n{{char}}: Hello there."),
    ("post_history_instructions", "Keep replies short."),
)
EXPECTED_LORE = (
    CardLoreEntry(content="The greenhouse has a leaking roof.", keys=("greenhouse", "glasshouse"),
                  secondary_keys=("rain",), always_on=False, priority=5, enabled=True, name="Greenhouse"),
    CardLoreEntry(content="Cora is allergic to lilies.", keys=(), secondary_keys=(), always_on=True, priority=20,
                  enabled=False, name="allergy"),
)


def test_a_v2_json_card_maps_every_field() -> None:
    card = parse_card(dumps(v2_card()))
    assert card == Card(spec="chara_card_v2", name="Cora", sections=EXPECTED_SECTIONS, lore=EXPECTED_LORE,
                        tags=("female", "wholesome"), creator="ann")


def test_a_v3_json_card_keeps_the_regex_flag_and_ignores_the_v3_extras() -> None:
    card = parse_card(dumps(v3_card()))
    assert (card.spec, card.name, card.sections, card.tags, card.creator) == (
        "chara_card_v3", "Cora Three", EXPECTED_SECTIONS, ("female", "wholesome"), "ann")
    assert card.lore[:2] == EXPECTED_LORE
    assert card.lore[2] == CardLoreEntry(content="Roses are her favourite.", keys=("/ros(e|es)/i",), priority=30,
                                         use_regex=True)
    assert "example.invalid" not in repr(card)  # asset URLs and sources are not kept


def test_empty_and_null_fields_are_left_out_and_a_bom_is_fine() -> None:
    card = parse_card(b"\xef\xbb\xbf" + dumps(v2_card(personality="", scenario=None, mes_example="  \n",
                                                      character_book=None, tags=None, creator=None)))
    assert [key for key, _ in card.sections] == ["identity", "system_prompt", "first_message",
                                                 "post_history_instructions"]
    assert (card.lore, card.tags, card.creator) == ((), (), "")


def test_lore_entry_details() -> None:
    entries = [
        {"keys": ["a"], "content": "uses insertion_order", "insertion_order": 7},
        {"keys": ["b"], "content": "numeric text and floats", "priority": "3", "enabled": 1, "constant": 0},
        {"keys": ["c"], "content": "not selective", "selective": False, "secondary_keys": ["ignored"],
         "priority": 2.0},
        {"keys": ["d"], "content": "   ", "comment": "no content: skipped"},
        {"keys": ["e", "e", ""], "content": "name over comment", "name": "N", "comment": "C", "priority": 10**20},
        {"keys": ["f"], "content": "an integer of 400 digits", "insertion_order": -10**400},
    ]
    lore = parse_card(dumps(v2_card(character_book={"entries": entries}))).lore
    assert lore == (
        CardLoreEntry(content="uses insertion_order", keys=("a",), priority=7),
        CardLoreEntry(content="numeric text and floats", keys=("b",), priority=3),
        CardLoreEntry(content="not selective", keys=("c",), priority=2),
        CardLoreEntry(content="name over comment", keys=("e",), priority=2**31 - 1, name="N"),
        CardLoreEntry(content="an integer of 400 digits", keys=("f",), priority=-(2**31 - 1)),
    )


def test_text_is_cleaned() -> None:
    raw = dumps(v2_card(description="<USER> meets <bot>\r\nand <Bot> greets <user>.\0 {{char}}/{{user}} stay",
                        personality="broken \ud800half", name="  Cora \r\n  Vale ",
                        character_book={"entries": [{"keys": ["<BOT>"], "content": "<user>\r\nline"}]}))
    assert b"\\ud800" in raw  # a lone surrogate, escaped in the JSON
    card = parse_card(raw)
    assert card.name == "Cora Vale"
    assert dict(card.sections)["identity"] == (
        "{{user}} meets {{char}}\nand {{char}} greets {{user}}. {{char}}/{{user}} stay")
    assert dict(card.sections)["personality"] == "broken half"
    assert card.lore == (CardLoreEntry(content="{{user}}\nline", keys=("{{char}}",)),)


# --- PNG -----------------------------------------------------------------------------------------------------


def test_a_png_card_with_a_chara_text_chunk() -> None:
    card = parse_card(png(text_chunk("chara", v2_card())))
    assert (card.spec, card.name, card.sections, card.lore) == ("chara_card_v2", "Cora", EXPECTED_SECTIONS,
                                                                EXPECTED_LORE)


@pytest.mark.parametrize("v3_first", [True, False])
def test_ccv3_is_preferred_over_chara(v3_first: bool) -> None:
    chunks = [text_chunk("ccv3", v3_card()), text_chunk("chara", v2_card())]
    card = parse_card(png(*(chunks if v3_first else chunks[::-1])))
    assert (card.spec, card.name) == ("chara_card_v3", "Cora Three")


@pytest.mark.parametrize("make", [
    lambda keyword, card: ztxt_chunk(keyword, card),
    lambda keyword, card: itxt_chunk(keyword, card, compressed=False),
    lambda keyword, card: itxt_chunk(keyword, card, compressed=True),
], ids=["zTXt", "iTXt", "iTXt-compressed"])
def test_ztxt_and_itxt_chunks(make: Any) -> None:
    other = chunk(b"tEXt", b"Software\0SomeEditor")
    assert parse_card(png(other, make("chara", v2_card()))).sections == EXPECTED_SECTIONS
    assert parse_card(png(make("ccv3", v3_card()), text_chunk("chara", v2_card()))).spec == "chara_card_v3"


def test_only_the_first_chunk_of_a_keyword_counts_and_keywords_ignore_case() -> None:
    assert parse_card(png(text_chunk("Chara", v2_card()), text_chunk("chara", v2_card(name="Other")))).name == "Cora"


# --- refusals --------------------------------------------------------------------------------------------------


def test_too_big() -> None:
    assert refused(b" " * int(9.1 * 1024 * 1024)) == "the card is 9.1 MB; at most 8 MB"
    assert refused(b"{" + b" " * MAX_CARD_BYTES) == "the card is 8.1 MB; at most 8 MB"


@pytest.mark.parametrize("data", [b"", b"hello", b"GIF89a\x00\x01", b"\xff\xd8\xff\xe0 jpeg", b"[1, 2]"])
def test_not_a_card(data: bytes) -> None:
    assert refused(data) in {"not a character card: neither JSON nor a PNG with a chara/ccv3 chunk",
                             "not a character card: the JSON is a list, not an object"}


def test_json_without_a_spec_is_not_a_card() -> None:
    assert refused(b'{"hello": 1}') == "not a character card: the JSON has no 'spec' field"


def test_broken_json() -> None:
    assert refused(b'{"spec": "chara_card_v2", "data": {').startswith("the card is not valid JSON: ")
    assert refused(b'{"spec": "chara_card_v2", "data": {"name": NaN}}') == (
        "the card is not valid JSON: NaN is not allowed")
    assert refused(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}") == (
        "the card is not usable JSON: it is nested too deeply")


def test_a_png_without_the_chunk() -> None:
    assert refused(png(chunk(b"tEXt", b"Comment\0hello"))) == (
        "the PNG holds no character card: it has no 'chara' or 'ccv3' text chunk")


def test_bad_base64_or_json_in_the_chunk() -> None:
    assert refused(png(chunk(b"tEXt", b"chara\0not*base64!"))) == "the PNG's 'chara' chunk is not valid base64"
    not_json = base64.b64encode(b"this is not json")
    assert refused(png(chunk(b"tEXt", b"ccv3\0" + not_json))).startswith(
        "the PNG's 'ccv3' chunk is not valid JSON: ")
    not_utf8 = base64.b64encode(b'{"name": "\xff"}')
    assert refused(png(chunk(b"tEXt", b"chara\0" + not_utf8))) == "the PNG's 'chara' chunk does not hold UTF-8 text"


def test_unsupported_specs() -> None:
    assert refused(dumps({"spec": "chara_card_v1", "data": v2_data()})) == (
        "unsupported card spec 'chara_card_v1'; Character Card V2 and V3 are supported")
    assert refused(dumps({"spec": 3, "data": v2_data()})) == (
        "unsupported card spec 3; Character Card V2 and V3 are supported")
    v1 = {"name": "Cora", "description": "A gardener.", "personality": "", "first_mes": "Hi"}
    assert refused(dumps(v1)) == "unsupported card spec V1 (no 'spec' field); Character Card V2 and V3 are supported"
    assert refused(png(text_chunk("chara", v1))).startswith("unsupported card spec V1")


@pytest.mark.parametrize(("card", "message"), [
    ({"spec": "chara_card_v2"}, "the card's 'data' must be an object, not null"),
    (v2_card(name=None), "the card has no name"),
    (v2_card(name=" \n "), "the card has no name"),
    (v2_card(name="x" * 81), "the card's name is 81 characters; at most 80"),
    (v2_card(name=7), "the card's 'name' must be text, not a number"),
    (v2_card(scenario="x" * 20_001), "the card's 'scenario' is 20,001 characters; at most 20,000"),
    (v3_card(mes_example="y" * 20_001), "the card's 'mes_example' is 20,001 characters; at most 20,000"),
    (v2_card(description=12), "the card's 'description' must be text, not a number"),
    (v2_card(first_mes=["a"]), "the card's 'first_mes' must be text, not a list"),
    (v2_card(tags="a, b"), "the card's 'tags' must be a list of texts, not text"),
    (v2_card(tags=["a", 1]), "each of the card's 'tags' must be text, not a number"),
    (v2_card(character_book=[]), "the card's 'character_book' must be an object, not a list"),
    (v2_card(character_book={"entries": {}}), "the card's lore book 'entries' must be a list, not an object"),
    (v2_card(character_book={"entries": [{"keys": ["a"], "content": "x"}] * 501}),
     "the card's lore book has 501 entries; at most 500"),
    (v2_card(character_book={"entries": [{"keys": ["a"], "content": "c" * 4001}]}),
     "lore entry 1's 'content' is 4,001 characters; at most 4,000"),
    (v2_card(character_book={"entries": [{"keys": [f"k{i}" for i in range(51)], "content": "x"}]}),
     "lore entry 1 has 51 'keys'; at most 50"),
    (v2_card(character_book={"entries": [{"keys": ["a"], "secondary_keys": [f"k{i}" for i in range(51)],
                                          "content": "x"}]}),
     "lore entry 1 has 51 'secondary_keys'; at most 50"),
    (v2_card(character_book={"entries": [{"keys": ["a", "the harbour " * 9], "content": "x"}]}),  # 108 characters
     "lore entry 1 has a 'keys' entry over 100 characters; keywords are words or short phrases"),
    (v2_card(character_book={"entries": [{"keys": ["a"], "content": "x"}, {"keys": "a", "content": "x"}]}),
     "lore entry 2's 'keys' must be a list of texts, not text"),
    (v2_card(character_book={"entries": [{"keys": ["a"], "content": 5}]}),
     "lore entry 1's 'content' must be text, not a number"),
    (v2_card(character_book={"entries": ["text"]}), "lore entry 1 must be an object, not text"),
    (v2_card(character_book={"entries": [{"keys": ["a"], "content": "x", "constant": "yes"}]}),
     "lore entry 1's 'constant' must be true or false, not text"),
    (v2_card(character_book={"entries": [{"keys": ["a"], "content": "x", "insertion_order": "soon"}]}),
     "lore entry 1's 'insertion_order' must be a number, not text"),
])
def test_each_refusal_is_one_clear_line(card: dict[str, Any], message: str) -> None:
    assert refused(dumps(card)) == message


def test_an_infinite_number_is_refused() -> None:
    raw = dumps(v2_card(character_book={"entries": [{"keys": ["a"], "content": "x", "priority": 12345}]}))
    assert refused(raw.replace(b"12345", b"1e999")) == "lore entry 1's 'priority' is too large a number"


def test_limits_count_the_text_as_written() -> None:
    content = "<user> " * 570  # 3,990 characters; 5,130 once the placeholders are modernised
    book = {"entries": [{"keys": ["a"], "content": content}]}
    assert parse_card(dumps(v2_card(character_book=book))).lore[0].content == "{{user}} " * 569 + "{{user}}"


def test_50_keys_is_fine() -> None:
    book = {"entries": [{"keys": [f"k{i}" for i in range(50)], "content": "x"}] * 500}
    assert len(parse_card(dumps(v2_card(character_book=book))).lore) == 500


def test_broken_pngs() -> None:
    good = png(text_chunk("chara", v2_card()))
    assert refused(good[:-12]) == "the PNG is truncated: it ends before its IEND chunk"
    assert refused(good[:good.index(b"tEXtchara") + 20]) == (
        "the PNG is truncated: its 'tEXt' chunk runs past the end of the file")
    assert refused(PNG_SIGNATURE) == "the PNG is truncated: it ends before its IEND chunk"
    huge_length = PNG_SIGNATURE + struct.pack(">I4s", 2**31, b"IHDR") + bytes(20)
    assert refused(huge_length) == "the PNG is corrupt: bad chunk header at byte 8"
    assert refused(PNG_SIGNATURE + struct.pack(">I4s", 0, b"\0\0\0\0") + bytes(4)).startswith("the PNG is corrupt")
    at = good.index(b"tEXtchara") + 20
    flipped = good[:at] + bytes([good[at] ^ 1]) + good[at + 1:]
    assert refused(flipped) == "the PNG's 'chara' chunk is corrupt: its checksum does not match"


def test_broken_compressed_chunks() -> None:
    assert refused(png(chunk(b"zTXt", b"chara\0\0not zlib"))) == (
        "the PNG's 'chara' chunk is corrupt: it does not decompress")
    assert refused(png(chunk(b"zTXt", b"chara\0\x01" + zlib.compress(b"x")))) == (
        "the PNG's 'chara' chunk is corrupt: unknown compression method")
    cut = zlib.compress(b64(v2_card()))[:-10]
    assert refused(png(chunk(b"zTXt", b"chara\0\0" + cut))) == (
        "the PNG's 'chara' chunk is corrupt: its compressed text is cut short")
    assert refused(png(chunk(b"iTXt", b"ccv3\0\x01\x00en"))) == (
        "the PNG's 'ccv3' chunk is corrupt: its header is incomplete")
    assert refused(png(chunk(b"iTXt", b"ccv3\0\x02"))) == (
        "the PNG's 'ccv3' chunk is corrupt: bad compression flag or method")


def test_a_decompression_bomb_is_refused() -> None:
    bomb = zlib.compress(b"A" * (MAX_CARD_BYTES + 1), 9)
    assert len(bomb) < 100_000
    assert refused(png(chunk(b"zTXt", b"chara\0\0" + bomb))) == (
        "the PNG's 'chara' chunk decompresses to more than 8 MB")


# --- export --------------------------------------------------------------------------------------------------


def test_export_round_trip() -> None:
    original = parse_card(dumps(v3_card()))
    exported = export_card_v2(original.name, original.sections, original.lore, original.tags)
    assert exported.decode("utf-8").startswith('{\n  "spec": "chara_card_v2",\n  "spec_version": "2.0",')
    again = parse_card(exported)
    assert (again.spec, again.name, again.sections, again.lore, again.tags) == (
        "chara_card_v2", original.name, original.sections, original.lore, original.tags)
    assert parse_card(png(text_chunk("chara", json.loads(exported)))) == again


def test_export_maps_sections_onto_v2_fields() -> None:
    sections = [("identity", "You are {{char}}."), ("tone", "Warm."), ("first_message", "Hi!"),
                ("speech_style", "Short sentences."), ("scenario", ""), ("example_dialogue", "{{user}}: hi")]
    data = json.loads(export_card_v2("Cora", sections, []))["data"]
    assert data["description"] == "You are {{char}}.\n\n## Tone\n\nWarm.\n\n## Speech style\n\nShort sentences."
    assert (data["first_mes"], data["mes_example"], data["scenario"], data["personality"]) == (
        "Hi!", "{{user}}: hi", "", "")
    assert "character_book" not in data
    assert set(data) >= {"name", "description", "personality", "scenario", "first_mes", "mes_example",
                         "creator_notes", "system_prompt", "post_history_instructions", "alternate_greetings",
                         "tags", "creator", "character_version", "extensions"}
    card = parse_card(export_card_v2("Cora", sections, []))
    assert card.sections[0] == ("identity", data["description"])


def test_export_writes_complete_book_entries() -> None:
    lore = [CardLoreEntry(content="Roses.", keys=("/roses?/",), secondary_keys=("garden",), always_on=True,
                          priority=3, enabled=False, name="roses", use_regex=True)]
    entry = json.loads(export_card_v2("Cora", [], lore, ["tag"]))["data"]["character_book"]["entries"][0]
    assert entry == {"keys": ["/roses?/"], "content": "Roses.", "extensions": {}, "enabled": False,
                     "insertion_order": 3, "case_sensitive": False, "name": "roses", "priority": 3, "id": 0,
                     "comment": "roses", "selective": True, "secondary_keys": ["garden"], "constant": True,
                     "position": "before_char", "use_regex": True}


def test_export_never_writes_what_cannot_be_encoded() -> None:
    data = json.loads(export_card_v2("Co\0ra", [("identity", "bad \ud800 text\r\n")], []))["data"]
    assert (data["name"], data["description"]) == ("Cora", "bad  text")


# --- no crash, whatever the bytes ------------------------------------------------------------------------------

GOOD_PNG = png(ztxt_chunk("chara", v2_card()), itxt_chunk("ccv3", v3_card(), compressed=True))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["name", "content", "keys", "entries", "priority", "constant", "spec", "data", "x"]),
        inner, max_size=5),
    max_leaves=20)
card_shaped = st.builds(lambda spec, data: {"spec": spec, "data": data},
                        st.sampled_from(["chara_card_v2", "chara_card_v3"]),
                        st.dictionaries(st.sampled_from([*v2_data()]), json_values, max_size=8))


@st.composite
def mutated_png(draw: st.DrawFn) -> bytes:
    data = bytearray(GOOD_PNG)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    return bytes(data[:draw(st.integers(0, len(data)))])


any_bytes = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=300).map(lambda tail: PNG_SIGNATURE + tail),
    mutated_png(),
    card_shaped.map(lambda card: json.dumps(card).encode("utf-8")),
    card_shaped.map(lambda card: png(text_chunk("chara", card))),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=any_bytes)
def test_any_bytes_give_a_card_or_a_card_error(data: bytes) -> None:
    try:
        card = parse_card(data)
    except CardError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert card.name and card.spec in {"chara_card_v2", "chara_card_v3"}


def test_a_name_keeps_its_angle_brackets() -> None:
    """The legacy placeholders were replaced in the name too: a card called "<Bot> Builder" made a persona
    called "{{char}} Builder"."""
    assert parse_card(dumps(v2_card(name="<Bot> Builder for <USER>"))).name == "<Bot> Builder for <USER>"
