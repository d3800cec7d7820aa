"""Character cards as role-play communities share them (SillyTavern, Chub, RisuAI): read V2/V3, write V2.

**The format.** A card is a JSON object ``{"spec": ..., "spec_version": ..., "data": {...}}``:

* Character Card V2: ``spec`` ``"chara_card_v2"``, ``spec_version`` ``"2.0"``; ``data`` holds ``name``,
  ``description``, ``personality``, ``scenario``, ``first_mes``, ``mes_example``, ``creator_notes``,
  ``system_prompt``, ``post_history_instructions``, ``alternate_greetings``, ``character_book``, ``tags``,
  ``creator``, ``character_version`` and ``extensions``.
* Character Card V3: ``spec`` ``"chara_card_v3"``, ``spec_version`` ``"3.0"``; the same ``data`` plus
  ``assets``, ``nickname``, ``creator_notes_multilingual``, ``source``, ``group_only_greetings``,
  ``creation_date`` and ``modification_date`` (all of which are ignored here), and lore entries may set
  ``use_regex`` (their keys are then regular expressions: kept as plain text with a flag, never compiled).
* V1 cards (the fields at the top level, no ``spec``) are refused.

The ``character_book`` is ``{name?, description?, scan_depth?, token_budget?, recursive_scanning?, extensions,
entries: [{keys, content, extensions, enabled, insertion_order, case_sensitive?, name?, priority?, id?,
comment?, selective?, secondary_keys?, constant?, position?}]}``.

A card comes either as that JSON (UTF-8) or inside a PNG image: the JSON, base64-encoded, is the text of a
``tEXt``, ``zTXt`` or ``iTXt`` chunk whose keyword is ``chara`` (V2) or ``ccv3`` (V3); when both are present
``ccv3`` wins (SillyTavern writes both, ``chara`` as a fallback for older readers).

**What is kept.** The texts become soul sections (see :data:`SECTION_FIELDS`), the lore book entries become
:class:`CardLoreEntry`, plus the name, tags and creator. Greetings other than ``first_mes``, creator notes,
assets (URLs) and extensions (regex scripts and the like) are ignored: nothing a card names is ever fetched,
compiled or run. Texts are cleaned: NULs and lone surrogates removed, line ends made ``\\n``, and the legacy
placeholders ``<USER>``/``<BOT>`` turned into ``{{user}}``/``{{char}}`` (which the prompt builder resolves).

Whatever the bytes, :func:`parse_card` either returns a :class:`Card` or raises :class:`CardError` with one
line for the user.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
import unicodedata
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bot.prompt import resolve_variables

MAX_CARD_BYTES = 8 * 1024 * 1024
MAX_NAME_CHARS = 80
MAX_FIELD_CHARS = 20_000
MAX_LORE_ENTRIES = 500
MAX_ENTRY_CHARS = 4_000
MAX_ENTRY_KEYS = 50
MAX_KEY_CHARS = 100  # of one keyword, as `!lore` takes them: a reply matches every key of every entry

SPEC_V2 = "chara_card_v2"
SPEC_V3 = "chara_card_v3"
SUPPORTED = "Character Card V2 and V3 are supported"
NOT_A_CARD = "not a character card: neither JSON nor a PNG with a chara/ccv3 chunk"

#: Soul section key → card field, in the order the sections of a :class:`Card` come.
SECTION_FIELDS: tuple[tuple[str, str], ...] = (
    ("identity", "description"),
    ("personality", "personality"),
    ("scenario", "scenario"),
    ("system_prompt", "system_prompt"),
    ("first_message", "first_mes"),
    ("example_dialogue", "mes_example"),
    ("post_history_instructions", "post_history_instructions"),
)
_FIELD_OF = dict(SECTION_FIELDS)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_TEXT_CHUNKS = (b"tEXt", b"zTXt", b"iTXt")
_KEYWORDS = ("ccv3", "chara")  # in order of preference
_MAX_CHUNK_LENGTH = 2**31 - 1
_MAX_PRIORITY = 2**31 - 1

_LEGACY_USER = re.compile(r"<user>", re.IGNORECASE)
_LEGACY_BOT = re.compile(r"<bot>", re.IGNORECASE)
_SURROGATE = re.compile("[\ud800-\udfff]")
_WHOLE_NUMBER = re.compile(r"[+-]?\d{1,12}")
_CARD_NAMES = {"char_name": "{{char}}", "user_name": "{{user}}"}  # the bot's spellings → the cards' own


class CardError(Exception):
    """One clear line for the user: what is wrong with the file; nothing was changed."""


@dataclass(frozen=True, slots=True)
class CardLoreEntry:
    """One lore book entry: ``content`` goes into the prompt when one of ``keys`` (and, if any, one of
    ``secondary_keys``) appears in the chat, or always when ``always_on``."""

    content: str
    keys: tuple[str, ...]
    secondary_keys: tuple[str, ...] = ()
    always_on: bool = False  # "constant"
    priority: int = 0  # "priority", else "insertion_order"
    enabled: bool = True
    name: str = ""  # "name" or "comment"
    use_regex: bool = False  # V3: the keys are regular expressions (kept as text, never compiled here)


@dataclass(frozen=True, slots=True)
class Card:
    """What a card holds that a persona can use."""

    spec: str  # "chara_card_v2" | "chara_card_v3"
    name: str
    sections: tuple[tuple[str, str], ...]  # (soul section key, text), non-empty, in SECTION_FIELDS order
    lore: tuple[CardLoreEntry, ...]
    tags: tuple[str, ...]
    creator: str = ""


# --- reading -------------------------------------------------------------------------------------------------


def parse_card(data: bytes) -> Card:
    """The card in ``data`` (JSON or PNG bytes); :class:`CardError` for anything else."""
    if len(data) > MAX_CARD_BYTES:
        size = math.ceil(len(data) * 10 / (1024 * 1024)) / 10
        raise CardError(f"the card is {size:.1f} MB; at most {MAX_CARD_BYTES // (1024 * 1024)} MB")
    return _card_from(_card_json(bytes(data)))


def _card_json(data: bytes) -> object:
    if data.startswith(PNG_SIGNATURE):
        keyword, payload = _png_payload(data)
        return _load_json(_decode_payload(payload, keyword), f"the PNG's '{keyword}' chunk")
    if data.startswith(b"PK\x03\x04"):
        raise CardError("a CHARX card (a zip) cannot be imported here: export the card as PNG or JSON (V2 or V3) "
                        "and import that")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise CardError("the card's JSON is UTF-16 text (Windows' \"Unicode\"): save it as UTF-8 and import it again")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        if data.lstrip().startswith(b"{"):
            raise CardError("the card's JSON is not UTF-8 text: save it as UTF-8 and import it again") from None
        raise CardError(NOT_A_CARD) from None
    if not text.lstrip().startswith("{"):
        raise CardError(NOT_A_CARD)
    return _load_json(text, "the card")


def _load_json(text: str, where: str) -> object:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise CardError(f"{where} is not usable JSON: it is nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError, NaN/Infinity, numbers too long to read
        raise CardError(f"{where} is not valid JSON: {_one_line(str(exc))}") from None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not allowed")


def _decode_payload(payload: bytes, keyword: str) -> str:
    """The JSON text in a chunk: base64 of UTF-8 (plain JSON is accepted too)."""
    where = f"the PNG's '{keyword}' chunk"
    compact = re.sub(rb"\s+", b"", payload)
    if not compact.startswith(b"{"):
        try:
            compact = base64.b64decode(compact + b"=" * (-len(compact) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise CardError(f"{where} is not valid base64") from None
    try:
        return compact.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise CardError(f"{where} does not hold UTF-8 text") from None


# --- PNG -------------------------------------------------------------------------------------------------------


def _png_payload(data: bytes) -> tuple[str, bytes]:
    """The keyword and text of the preferred card chunk (``ccv3`` over ``chara``; the first of each)."""
    found: dict[str, bytes] = {}
    for ctype, start, length, crc in _png_chunks(data):
        if ctype not in _TEXT_CHUNKS:
            continue
        body = data[start:start + length]
        keyword = _keyword(body)
        if keyword not in _KEYWORDS or keyword in found:
            continue
        if zlib.crc32(ctype + body) != crc:
            raise CardError(f"the PNG's '{keyword}' chunk is corrupt: its checksum does not match")
        found[keyword] = _chunk_text(ctype, body[len(keyword) + 1:], keyword)
    for keyword in _KEYWORDS:
        if keyword in found:
            return keyword, found[keyword]
    raise CardError("the PNG holds no character card: it has no 'chara' or 'ccv3' text chunk")


def _png_chunks(data: bytes) -> Iterator[tuple[bytes, int, int, int]]:
    """(type, body start, body length, CRC) of each chunk before IEND; CardError if the file is cut or mangled."""
    pos = len(PNG_SIGNATURE)
    while True:
        if pos + 12 > len(data):
            raise CardError("the PNG is truncated: it ends before its IEND chunk")
        length, ctype = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if not ctype.isalpha() or length > _MAX_CHUNK_LENGTH:
            raise CardError(f"the PNG is corrupt: bad chunk header at byte {pos}")
        if end > len(data):
            raise CardError(f"the PNG is truncated: its '{ctype.decode('ascii')}' chunk runs past the end of the file")
        if ctype == b"IEND":
            return
        (crc,) = struct.unpack_from(">I", data, end - 4)
        yield ctype, pos + 8, length, crc
        pos = end


def _keyword(body: bytes) -> str:
    """The chunk keyword (Latin-1, 1–79 bytes, NUL-terminated), lower-cased; "" if there is none."""
    nul = body.find(b"\0", 0, 80)
    return body[:nul].decode("latin-1").lower() if nul > 0 else ""


def _chunk_text(ctype: bytes, rest: bytes, keyword: str) -> bytes:
    """The text of a tEXt, zTXt or iTXt chunk, ``rest`` being what follows the keyword's NUL."""
    corrupt = f"the PNG's '{keyword}' chunk is corrupt"
    if ctype == b"tEXt":
        return rest
    if ctype == b"zTXt":
        if not rest or rest[0] != 0:
            raise CardError(f"{corrupt}: unknown compression method")
        return _inflate(rest[1:], keyword)
    if len(rest) < 2 or rest[0] not in (0, 1) or (rest[0] == 1 and rest[1] != 0):
        raise CardError(f"{corrupt}: bad compression flag or method")
    parts = rest[2:].split(b"\0", 2)  # language tag, translated keyword, text
    if len(parts) < 3:
        raise CardError(f"{corrupt}: its header is incomplete")
    return _inflate(parts[2], keyword) if rest[0] == 1 else parts[2]


def _inflate(compressed: bytes, keyword: str) -> bytes:
    """zlib-decompressed ``compressed``, never more than MAX_CARD_BYTES (no decompression bombs)."""
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(compressed, MAX_CARD_BYTES)
    except zlib.error:
        raise CardError(f"the PNG's '{keyword}' chunk is corrupt: it does not decompress") from None
    if inflater.unconsumed_tail:
        raise CardError(f"the PNG's '{keyword}' chunk decompresses to more than "
                        f"{MAX_CARD_BYTES // (1024 * 1024)} MB")
    if not inflater.eof:
        raise CardError(f"the PNG's '{keyword}' chunk is corrupt: its compressed text is cut short")
    return text


# --- the card object -------------------------------------------------------------------------------------------


def _card_from(obj: object) -> Card:
    if not isinstance(obj, dict):
        raise CardError(f"not a character card: the JSON is {_kind(obj)}, not an object")
    spec = _spec(obj)
    data = obj.get("data")
    if not isinstance(data, dict):
        raise CardError(f"the card's 'data' must be an object, not {_kind(data)}")
    sections = tuple((key, text) for key, field in SECTION_FIELDS
                     if (text := _text(data.get(field), f"the card's '{field}'")))
    return Card(spec=spec, name=_name(data), sections=sections, lore=_lore(data.get("character_book")),
                tags=_strings(data.get("tags"), "the card's 'tags'"),
                creator=_text(data.get("creator"), "the card's 'creator'"))


def _spec(obj: dict[Any, Any]) -> str:
    if "spec" not in obj:
        if "name" in obj and any(field in obj for _, field in SECTION_FIELDS):
            raise CardError(f"unsupported card spec V1 (no 'spec' field); {SUPPORTED}")
        raise CardError("not a character card: the JSON has no 'spec' field")
    spec = obj["spec"]
    if spec not in (SPEC_V2, SPEC_V3):
        raise CardError(f"unsupported card spec {_shown(spec)}; {SUPPORTED}")
    return str(spec)


def _name(data: dict[Any, Any]) -> str:
    name = " ".join(_text(data.get("name"), "the card's 'name'", placeholders=False).split())
    if not name:
        raise CardError("the card has no name")
    if len(name) > MAX_NAME_CHARS:
        raise CardError(f"the card's name is {len(name)} characters; at most {MAX_NAME_CHARS}")
    return name


def _lore(book: object) -> tuple[CardLoreEntry, ...]:
    if book is None:
        return ()
    if not isinstance(book, dict):
        raise CardError(f"the card's 'character_book' must be an object, not {_kind(book)}")
    entries = book.get("entries")
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise CardError(f"the card's lore book 'entries' must be a list, not {_kind(entries)}")
    if len(entries) > MAX_LORE_ENTRIES:
        raise CardError(f"the card's lore book has {len(entries)} entries; at most {MAX_LORE_ENTRIES}")
    parsed = (_lore_entry(raw, number) for number, raw in enumerate(entries, 1))
    return tuple(entry for entry in parsed if entry is not None)


def _lore_entry(raw: object, number: int) -> CardLoreEntry | None:
    """The entry, or None when it has no content (nothing to put in a prompt)."""
    where = f"lore entry {number}"
    if not isinstance(raw, dict):
        raise CardError(f"{where} must be an object, not {_kind(raw)}")

    def field(key: str) -> str:
        return f"{where}'s '{key}'"

    content = _text(raw.get("content"), field("content"), MAX_ENTRY_CHARS)
    if not content:
        return None
    keys = _keys(raw, "keys", where)
    # secondary keys only count for a "selective" entry; absent means the writer did not say, so keep them
    secondary = () if raw.get("selective") is False else _keys(raw, "secondary_keys", where)
    priority = _whole(raw.get("priority"), field("priority"))
    if priority is None:
        priority = _whole(raw.get("insertion_order"), field("insertion_order")) or 0
    name = _text(raw.get("name"), field("name")) or _text(raw.get("comment"), field("comment"))
    return CardLoreEntry(content=content, keys=keys, secondary_keys=secondary,
                         always_on=_flag(raw.get("constant"), field("constant"), False), priority=priority,
                         enabled=_flag(raw.get("enabled"), field("enabled"), True), name=name,
                         use_regex=_flag(raw.get("use_regex"), field("use_regex"), False))


def only_punctuation(keyword: str) -> bool:
    """Whether a lore keyword holds no letter, digit or symbol: "." or "?" comes up in nearly every message, so
    its entry would be in every reply (as an always-on one, without saying so)."""
    return not any(ch.isalnum() or unicodedata.category(ch).startswith("S") for ch in keyword)


def _keys(raw: dict[Any, Any], key: str, where: str) -> tuple[str, ...]:
    keys = _strings(raw.get(key), f"{where}'s '{key}'")
    if len(keys) > MAX_ENTRY_KEYS:
        raise CardError(f"{where} has {len(keys)} '{key}'; at most {MAX_ENTRY_KEYS}")
    if any(len(k) > MAX_KEY_CHARS for k in keys):
        raise CardError(f"{where} has a '{key}' entry over {MAX_KEY_CHARS} characters; keywords are words or "
                        "short phrases")
    return keys


# --- values ----------------------------------------------------------------------------------------------------


def clean_text(text: str) -> str:
    """NULs and lone surrogates removed, line ends made LF, ``<USER>``/``<BOT>`` made ``{{user}}``/``{{char}}``."""
    return _placeholders(_tidy(text))


def _tidy(text: str) -> str:
    text = _SURROGATE.sub("", text.replace("\0", ""))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _placeholders(text: str) -> str:
    return _LEGACY_BOT.sub("{{char}}", _LEGACY_USER.sub("{{user}}", text))


def _text(value: object, field: str, limit: int = MAX_FIELD_CHARS, *, placeholders: bool = True) -> str:
    """A field's text, tidied; ``<USER>``/``<BOT>`` made ``{{user}}``/``{{char}}`` unless not ``placeholders``
    (in a name they are just its letters)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise CardError(f"{field} must be text, not {_kind(value)}")
    text = _tidy(value).strip()
    if len(text) > limit:  # counted as the author wrote it, before <USER>/<BOT> become {{user}}/{{char}}
        raise CardError(f"{field} is {len(text):,} characters; at most {limit:,}")
    return _placeholders(text) if placeholders else text


def _strings(value: object, field: str) -> tuple[str, ...]:
    """A list of texts, cleaned, without blanks or repeats; None is an empty list."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise CardError(f"{field} must be a list of texts, not {_kind(value)}")
    texts = (_text(item, f"each of {field}") for item in value)
    return tuple(dict.fromkeys(text for text in texts if text))


def _flag(value: object, field: str, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise CardError(f"{field} must be true or false, not {_kind(value)}")


def _whole(value: object, field: str) -> int | None:
    """A whole number (numeric text and finite floats accepted), clamped to ±2³¹; None if absent."""
    if value is None:
        return None
    if isinstance(value, str) and _WHOLE_NUMBER.fullmatch(value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CardError(f"{field} must be a number, not {_kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):  # (math.isfinite cannot take a huge int)
        raise CardError(f"{field} is too large a number")
    return max(-_MAX_PRIORITY, min(_MAX_PRIORITY, int(value)))


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "text"
    return "a list" if isinstance(value, list) else "an object"


def _shown(value: object) -> str:
    """A spec value for a message: quoted text or a number, cut to 40 characters; else only its kind."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return f"({_kind(value)})"
    shown = _one_line(repr(value))
    return shown if len(shown) <= 40 else shown[:39] + "…"


def _one_line(text: str) -> str:
    return " ".join(clean_text(text).split())


# --- writing ---------------------------------------------------------------------------------------------------


def export_card_v2(name: str, sections: Sequence[tuple[str, str]], lore: Sequence[CardLoreEntry],
                   tags: Sequence[str] = ()) -> bytes:
    """A V2 JSON card (UTF-8, indented): the sections mapped back onto the V2 fields (identity→description,
    etc.; any other section key is appended to description under a '## <Title>' heading), lore as
    character_book entries."""
    texts = _section_texts(sections)
    data: dict[str, object] = {
        "name": " ".join(clean_text(name).split()),
        "description": texts["description"], "personality": texts["personality"], "scenario": texts["scenario"],
        "first_mes": texts["first_mes"], "mes_example": texts["mes_example"], "creator_notes": "",
        "system_prompt": texts["system_prompt"], "post_history_instructions": texts["post_history_instructions"],
        "alternate_greetings": [],
    }
    if lore:
        data["character_book"] = {"name": f"{data['name']} lore", "extensions": {},
                                  "entries": [_book_entry(entry, index) for index, entry in enumerate(lore)]}
    data.update(tags=[clean_text(tag).strip() for tag in tags if clean_text(tag).strip()], creator="",
                character_version="", extensions={})
    card = {"spec": SPEC_V2, "spec_version": "2.0", "data": data}
    return (json.dumps(card, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _section_texts(sections: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Card field → text; repeated keys are joined, unknown keys go under a heading in the description."""
    parts: dict[str, list[str]] = {field: [] for _, field in SECTION_FIELDS}
    extra: list[str] = []
    for key, raw in sections:
        text = _card_placeholders(raw).strip()
        if not text:
            continue
        if key in _FIELD_OF:
            parts[_FIELD_OF[key]].append(text)
        else:
            extra.append(f"## {_title(key)}\n\n{text}")
    parts["description"].extend(extra)
    return {field: "\n\n".join(texts) for field, texts in parts.items()}


def _card_placeholders(text: str) -> str:
    """``text`` cleaned, with the persona's and the user's name in the spelling every card reader fills
    (``{char_name}``, ``{{ Char_Name }}`` → ``{{char}}``); other variables stay as written."""
    return resolve_variables(clean_text(text), _CARD_NAMES)


def _title(key: str) -> str:
    words = " ".join(key.replace("_", " ").replace("-", " ").split())
    return words[:1].upper() + words[1:] if words else "Notes"


def _book_entry(entry: CardLoreEntry, index: int) -> dict[str, object]:
    book: dict[str, object] = {
        "keys": list(entry.keys), "content": _card_placeholders(entry.content), "extensions": {},
        "enabled": entry.enabled, "insertion_order": entry.priority, "case_sensitive": False, "name": entry.name,
        "priority": entry.priority, "id": index, "comment": entry.name, "selective": bool(entry.secondary_keys),
        "secondary_keys": list(entry.secondary_keys), "constant": entry.always_on, "position": "before_char",
    }
    if entry.use_regex:
        book["use_regex"] = True
    return book
