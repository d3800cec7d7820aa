"""Text that is safe to store and to show: no lone surrogates (they cannot be encoded as UTF-8: a
non-UTF-8 byte read from a terminal, or ``"\\ud800"`` in a JSON event, arrives as one), and, for
terminals, no control sequences (model output or a stored message must not move the cursor, clear the
screen or set the window title)."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
# CSI/OSC/other escape sequences, then any remaining C0/C1 control character but tab and newline.
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])|\x9b[0-?]*[ -/]*[@-~]")
# Control characters, and the bidirectional overrides, embeddings and isolates ("Trojan Source"): a terminal
# that reorders text by them shows a line other than the one written, and so would a name repeated by `shown`.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def storable(text: str) -> str:
    """``text`` as every store takes it: lone surrogates (UTF-8 has none) become U+FFFD and NUL characters
    (PostgreSQL's text has none) go. For what a model or another program sends."""
    return without_surrogates(text).replace("\x00", "") if text else text


def visible(text: str) -> bool:
    """Whether ``text`` holds anything to read: a character that is not a space, a control or an invisible
    format character (a zero-width space, a BOM, a word joiner)."""
    return any(unicodedata.category(ch)[0] not in "CZ" for ch in text)


NAME_CHARS = 64  # of a display name, as it enters prompts and the store
_NAME_BREAKS = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u2028\u2029]+")
# Invisible characters that reorder or hide text (direction overrides and isolates, zero-width space, word
# joiner, BOM); the zero-width (non-)joiners stay: Persian and Indic names and emoji sequences need them.
_NAME_HIDDEN = re.compile(r"[\u200b\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]")


def name_key(name: str) -> str:
    """How two words are the same word: Unicode's caseless match ("ZOË", "zoë" typed as z-o-e and a
    combining diaeresis, and "Zoë" are one), for persona names and lore's keywords."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", name).casefold())


# Cyrillic and Greek letters (case-folded) that look like a Latin one, in some case ("Сora" with a Cyrillic С);
# where the two cases look like different letters, as the capital does (Greek Μ, μ: M), which starts a name.
_LOOK_ALIKES = str.maketrans(
    "аеорсхуіјѕԁһԛԝүӏвкмнтьαβεζηικμνορτυχ",
    "aeopcxyijsdhqwylbkmhtbabezhikmnoptyx")


def persona_key(name: str) -> str:
    """When a new persona's name is too like one that exists for both to be told apart (it is refused then):
    :func:`name_key`, width and compatibility forms folded ("Ｃｏｒａ" typed with a Japanese input method is
    Cora), Cyrillic or Greek look-alikes read as the Latin letter ("Сora") and quote marks left out
    (``Alexandra "Alex" Reed`` is ``Alexandra Alex Reed``, as a command line reads it). Names are found by
    :func:`name_key` (a database of an older release may hold two that this folds into one)."""
    # (on the decomposed form: "ё" is "е" and a diaeresis there, so "Zoё" with a Cyrillic ё is "Zoë")
    decomposed = unicodedata.normalize("NFKD", unicodedata.normalize("NFKD", name).casefold())
    return unicodedata.normalize("NFC", decomposed.translate(_LOOK_ALIKES).translate(QUOTE_MARKS))


# Quote marks a name may hold (a card's 'Alexandra "Alex" Reed'), which a command line reads as quoting: typed
# back, such a name arrives without them, and is found as the name it looks like (see PersonaRegistry.persona).
QUOTE_MARKS = str.maketrans("", "", "\"'\u201c\u201d\u201e\u201f\u2018\u2019\u201a\u201b\u00ab\u00bb\u2039\u203a")


def one_line_name(name: str) -> str:
    """A display name (a user's, a channel's) as it may enter a prompt: storable, on one line (line breaks
    and control characters become one space, so a name cannot start a line of its own, such as a "# Rules"
    heading, or forge a speaker's label), without direction overrides, and at most ``NAME_CHARS`` characters."""
    return _cut_name(_flat_name(name))


def speaker_name(name: str, author_id: str, handle: str | None = None) -> str:
    """A message author's name as the prompt labels their turns: :func:`one_line_name`, and with their
    platform id after it when making it so took hidden characters or line breaks out, or when it ends as such a
    label does, in parentheses. Otherwise "alice" and
    "alice" with a zero-width space, names the platform tells apart (it marks only the same name twice), got
    one label, and one member's turns read as another's.

    ``handle`` is the author's unique user name where the platform has one besides a display name anyone may
    take (Discord's): a display name other than it is followed by it, in place of the id, so two members who both
    call themselves "Alice" read as "Alice (@alice)" and "Alice (@mallory)". A handle that could not be read as
    one (spaces, parentheses) is replaced by the id."""
    flat = _flat_name(name)
    mark = None if handle is None else f"@{handle}" if _HANDLE.fullmatch(handle) else author_id[:NAME_CHARS // 2]
    if not flat:
        return mark or author_id
    # (a name ending in "(…)" gets the mark too: "bob (@bob:example.org)" as anyone's display name is no label)
    plain = flat == re.sub(" +", " ", storable(name).strip(" ")) and not _ENDS_IN_PARENTHESES.search(flat)
    if plain and (handle is None or flat == handle):
        return _cut_name(flat)
    suffix = f" ({mark or author_id[:NAME_CHARS // 2]})"
    return _cut_name(flat, NAME_CHARS - len(suffix)) + suffix


_HANDLE = re.compile(r"[\w.-]{1,32}(#\d{4})?")  # Discord's user names; an older one with its discriminator
_ENDS_IN_PARENTHESES = re.compile(r"\([^()]*\)$")


def _flat_name(name: str) -> str:
    return _NAME_BREAKS.sub(" ", _NAME_HIDDEN.sub("", storable(name))).strip()


def _cut_name(flat: str, limit: int = NAME_CHARS) -> str:
    return flat if len(flat) <= limit else flat[:limit - 1].rstrip() + "…"


def storable_json(value: Any) -> Any:
    """``value`` (parsed JSON: dicts, lists, strings) with every string made :func:`storable`."""
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        return {storable(str(k)): storable_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable_json(v) for v in value]
    return value


MAX_JSON_DEPTH = 64  # nesting a model's tool arguments may have (deeper: not taken as arguments)


def nested_within(value: Any, depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON ``value`` nests at most ``depth`` lists and objects deep (checked without
    recursion: a model looping on "[" sends thousands, and recursive code then fails the whole reply)."""
    level: list[tuple[Any, int]] = [(value, 1)]
    while level:
        item, at = level.pop()
        if isinstance(item, dict | list):
            if at > depth:
                return False
            level.extend((child, at + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


# Printable by Unicode's rules, yet shown as blank space: the Hangul fillers and the blank Braille pattern ("Cora⠀"
# looks like "Cora", and a name of "ㅤ" alone like no name).
BLANK_LOOKING = frozenset("\u034f\u115f\u1160\u2800\u3164\uffa0")  # (and the combining grapheme joiner)


def readable(name: str) -> bool:
    """Whether a name people read and type is visible text: not blank, no control or invisible (format)
    characters ("Co\u200bra" looks like "Cora" and cannot be typed), nor ones that show as blank space."""
    return bool(name.strip()) and all(ch.isprintable() and ch not in BLANK_LOOKING for ch in name)


ONLY_DOTS = "a persona's name cannot be only dots (the web page could not reach it): give it a word"


def only_dots(name: str) -> bool:
    """Whether a name is dots alone (``..``, ``.``; full-width ones or "‥" too, as persona names are told apart).
    In a web address ``.`` and ``..`` mean "here" and "the folder above": browsers and the server remove them,
    so the page's addresses of a persona of that name would lead elsewhere."""
    return not persona_key(name).strip().strip(".")


def without_surrogates(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD, the replacement character."""
    return _SURROGATE.sub("\ufffd", text)


def printable(text: str) -> str:
    """``text`` for a terminal: escape sequences, control characters and bidirectional overrides removed (tabs
    and newlines kept)."""
    return _CONTROL.sub("", _ESCAPE.sub("", without_surrogates(text)))


# An escape sequence begun at the end of a piece of a stream, whose rest may come in the next piece.
_ESCAPE_BEGUN = re.compile(r"(?:\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*)?|\x9b[0-?]*[ -/]*)\Z")
HELD_ESCAPE_CHARS = 256  # held at most: a sequence never ended does not hold back the rest of the reply


class PrintableStream:
    """:func:`printable` for a text that comes in pieces (a streamed reply): an escape sequence split between
    two pieces is held until its end comes and then removed whole (each piece alone lost its escape character
    but printed the rest, "[31m" or a window title, as text). :meth:`end` gives what is held at the end."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, piece: str) -> str:
        text = self._held + piece
        begun = _ESCAPE_BEGUN.search(text)
        cut = begun.start() if begun and len(text) - begun.start() <= HELD_ESCAPE_CHARS else len(text)
        self._held = text[cut:]
        return printable(text[:cut])

    def end(self) -> str:
        held, self._held = self._held, ""
        return printable(held)


def one_line(text: str, limit: int | None = None) -> str:
    """``text`` on one line (every run of whitespace, line breaks included, one space), cut to ``limit``
    characters with "…" at the end when longer."""
    flat = " ".join(text.split())
    return flat if limit is None or len(flat) <= limit else flat[:limit - 1] + "\u2026"


_MARKUP = re.compile(r"([\\`*_~|\[\]<>])")  # what Discord's and Matrix's Markdown read as markup within a line
_ESCAPED = re.compile(r"\\([\\`*_~|\[\]<>])")


def inert(text: str, limit: int | None = None) -> str:
    """Someone's words within a line of the bot's Markdown (a memory item in a list): on one line (see
    :func:`one_line`), markup characters escaped, so that they show as written and change nothing around them
    (a code span or a spoiler begun in one item hid the items after it)."""
    return _MARKUP.sub(r"\\\1", one_line(text, limit))


def unescaped(markdown: str) -> str:
    """Markdown's escapes of :func:`inert` undone, for a place that shows the text as it is (a terminal)."""
    return _ESCAPED.sub(r"\1", markdown)


def shown(text: str, limit: int = 60) -> str:
    """Someone's input repeated in a reply: cut to ``limit`` characters, on one line, without control
    characters, as inline code, so that what they typed shows as typed and never as a link, markup or
    mention in the bot's own message (Discord and Matrix clients render Markdown and link bare URLs, but
    neither inside code)."""
    clean = one_line(printable(text), limit).replace("`", "\u02cb")  # a backtick would end the code span
    return f"`{clean}`" if clean else "(nothing)"


def quoted(value: object, limit: int = 80) -> str:
    """``value`` as Python writes it (``'memory.md'``, ``[1, 2]``) for a tool error the model reads, cut to
    ``limit`` characters: a model's whole argument quoted back would go into every later request."""
    written = repr(value)
    return written if len(written) <= limit else written[:limit - 1] + "\u2026"


def plural(count: int, singular: str, many: str | None = None) -> str:
    """``1 reply``, ``2 replies``, ``1,200 summaries`` (``many`` for irregular plurals)."""
    if count == 1:
        return f"1 {singular}"
    if many is None:
        many = singular[:-1] + "ies" if singular.endswith("y") and singular[-2:-1] not in "aeiou" else singular + "s"
    return f"{count:,} {many}"


def error_line(exc: BaseException) -> str:
    """An error as one line for a person: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def continued(text: str) -> str:
    """``text`` as one entry of a transcript: its further lines indented, so none starts like a new entry."""
    lines = text.splitlines()  # (every line break a reader may see: \r, \u2028, …)
    return "\n    ".join(lines) if len(lines) > 1 else text


# Characters a person reading the text does not see but a model does: Unicode tags (a whole hidden sentence can be
# spelled in them; a flag of a country's region, 🏴 and a few tag letters, is kept) and the bidi embeddings, overrides
# and isolates (text shown in another order than sent).
_HIDDEN = re.compile("(\U0001F3F4[\U000E0030-\U000E0039\U000E0061-\U000E007A]{2,6}\U000E007F)"
                     "|[\U000E0000-\U000E007F\u202A-\u202E\u2066-\u2069]")


def without_hidden(text: str) -> str:
    """``text`` without the characters a reader does not see (``_HIDDEN``): what the model gets is what an admin or
    user can read on the page or in chat."""
    return _HIDDEN.sub(lambda m: m.group(1) or "", text)


_ZERO_WIDTH = re.compile("[\u200b\u2060\ufeff\u180e]")  # (not the joiners U+200C/U+200D: scripts and emoji need them)
_SPACES = re.compile(r"[^\S\n]+")


def single_spaced(text: str) -> str:
    """``text`` as it reads: without characters nobody sees (zero-width spaces, ``_HIDDEN``), each run of spaces
    and tabs within a line one space, none at a line's end; a line's indentation stays (code, a nested list).
    Two texts that look the same are then the same."""
    lines = []
    for line in _ZERO_WIDTH.sub("", without_hidden(text)).split("\n"):
        body = line.lstrip(" \t")
        lines.append(line[:len(line) - len(body)] + _SPACES.sub(" ", body).rstrip())
    return "\n".join(lines).strip("\n").rstrip()
