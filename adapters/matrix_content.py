"""Reading Matrix event content that anyone in a room writes: each field is checked for its type before
use, so a malformed event is a message without that field, never an exception (used by the adapter and
its reactions); and the bounded records both keep of recent events."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, TypeVar

from nio import (
    RoomEncryptedMedia,
    RoomMessageEmote,
    RoomMessageMedia,
    RoomMessageText,
    RoomMessageUnknown,
    StickerEvent,
)

if TYPE_CHECKING:
    from nio import MatrixRoom

K = TypeVar("K")
V = TypeVar("V")
RECENT = 1000  # entries a record of recent events keeps
LATEST_STAMP_MS = 253_402_300_799_000  # 9999-12-31 23:59:59 UTC, the last second a date can show
# Every upload (a picture, a recording, a video, a file), encrypted or not: its caption is read as a message.
MEDIA_EVENTS = (RoomMessageMedia, RoomEncryptedMedia)
# Messages without words to read (an m.location, a msgtype of a client's own, a sticker): answered as an upload
# without a caption is (in a DM, or addressed in a room: a line saying the bot reads text). Their body is no
# text either: a location's is its client's description of the place ("Location: geo:52.5,13.4"), a sticker's
# its image's alt text, written for clients that cannot show them, as a file's name is an upload's body.
TEXTLESS = (RoomMessageUnknown, StickerEvent)
RECEIVED_EVENTS = (RoomMessageText, RoomMessageEmote, *MEDIA_EVENTS, *TEXTLESS)  # the messages the bot handles


def keep(recent: OrderedDict[K, V], key: K, value: V, most: int = RECENT) -> None:
    """Note ``key`` in a record of recent events, the oldest entries dropped beyond ``most``."""
    recent[key] = value
    while len(recent) > most:
        recent.popitem(last=False)


def message_key(event_id: str) -> str:
    """How the bot names a Matrix message (a reply's, for ``!memory why``; a remembered one's source; an undo's)."""
    return f"matrix-message:{event_id}"


def server_seconds(stamp: Any) -> float | None:
    """An ``origin_server_ts`` (milliseconds, written by the sender's own homeserver) in POSIX seconds, or None
    when it is missing or no date can show it: one past year 9999 made every later ``datetime`` of it raise, and
    the message was dropped unanswered."""
    if not isinstance(stamp, int) or isinstance(stamp, bool) or not 0 < stamp <= LATEST_STAMP_MS:
        return None
    return stamp / 1000


def json_object(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one: anyone in a room writes the events' content."""
    return value if isinstance(value, dict) else {}


def relates_to(content: Any) -> dict[str, Any]:
    """An event content's ``m.relates_to`` (empty when missing or malformed)."""
    return json_object(json_object(content).get("m.relates_to"))


def reply_target(content: Any) -> str | None:
    """The event a message replies to. Not the ``m.in_reply_to`` that clients add to thread messages for
    clients without threads (``is_falling_back``: the thread's latest event, which the user did not pick)."""
    relation = relates_to(content)
    if relation.get("is_falling_back") is True:
        return None
    target = json_object(relation.get("m.in_reply_to")).get("event_id")
    return target if isinstance(target, str) and target else None


def mentioned(content: Any) -> list[str]:
    """The user ids an event's ``m.mentions`` names (only strings)."""
    ids = json_object(json_object(content).get("m.mentions")).get("user_ids")
    return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []


_FALLBACK = re.compile(r"^> (\* )?<@[^>\s]+:[^>\s]+>")  # "> <@ann:example.org> what was said"


def without_reply_fallback(body: str) -> str:
    """A reply's own text: older clients start its body with the quoted message (``> <@sender:server> …``
    lines, then an empty line), which the spec no longer asks for; a command sent as a reply must still
    start with its ``!``. A quote the user typed (``> something``) is their text and stays."""
    if not _FALLBACK.match(body):
        return body
    lines = body.split("\n")
    quoted = 0
    while quoted < len(lines) and lines[quoted].startswith(">"):
        quoted += 1
    if not quoted or quoted == len(lines):
        return body
    return "\n".join(lines[quoted + (lines[quoted] == ""):])


def home_server(user_id: str) -> str:
    """The server part of a Matrix user id (``@ann:example.org`` → ``example.org``): where the user's account
    lives, which the access lists and the invite rules see as the user's server."""
    return user_id.split(":", 1)[-1]


def author_of(room: MatrixRoom, sender: str, *, shared: bool) -> tuple[str, str | None]:
    """A sender's display name and the id that tells who they are (the handle: the core labels the turn
    "Alice (@alice:example.org)"). In a conversation several people take part in (``shared``: a group room, or a
    direct room's group phase), always: a display name is anyone's to take, and one taken from a member who
    left, from the persona ("Cora"), the bot or "System" passed, bare, as theirs in the prompt and the summary.
    In a direct room's own conversation, whose turns are all its one user's, only when another member has the
    same name. nio's own disambiguated name already holds the id in parentheses, to which the core, seeing a
    name that ends as a label does, added the id once more."""
    user = room.users.get(sender)
    if user is None:
        return sender, None
    return user.name, sender if shared or len(room.user_name_clashes(user.name)) > 1 else None
