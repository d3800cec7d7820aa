"""The Matrix adapter against hostile or unusual input, on a real Synapse with real nio clients on both sides:
malformed events, rooms made to catch private answers, edits by others, thread fallbacks, denied users'
reactions, encrypted files and replies over Matrix's event size limit."""

from __future__ import annotations

import asyncio
import io
import re
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from nio import AsyncClient, MatrixRoom, RedactionEvent, RoomEncryptedFile, RoomMessageFile, RoomPutStateResponse
from nio.crypto.attachments import decrypt_attachment

from adapters.matrix import render
from bot.commands import CommandReply
from bot.llm.base import Completion, LLMRequest, Usage
from bot.storage.memory import ItemFilters
from tests.synapse import SynapseServer
from tests.test_matrix import (
    DEADLINE,
    Bot,
    Timeline,
    dm_with,
    group_with,
    joined,
    open_room,
    send_text,
    start_bot,
    stop_bot,
    user,
)

pytestmark = pytest.mark.slow


@pytest.fixture
async def bot(synapse: SynapseServer, tmp_path: Path) -> AsyncIterator[Bot]:
    running = await start_bot(synapse, tmp_path)
    yield running
    await stop_bot(running)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, deadline: float = DEADLINE) -> None:
    for _ in range(int(deadline / 0.2)):
        if await check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def items_of(bot: Bot, user_id: str) -> list[str]:
    """The user's active memory items (over all personas)."""
    user = await bot.app.storage.get_user(f"matrix:{user_id}")
    if user is None:
        return []
    owned, _ = await bot.app.cortex.memory.user_items(user.id, ItemFilters())
    return [o.item.content for o in owned]


async def remembered(bot: Bot, user_id: str) -> list[str]:
    """The user's memory items, once there is one (a reaction is handled in the background)."""
    async def stored() -> bool:
        return bool(await items_of(bot, user_id))
    await eventually(stored, f"{user_id}'s memory item")
    return await items_of(bot, user_id)


def final_texts(seen: Timeline, room: str, sender: str) -> list[str]:
    """The sender's messages in the room as they read after their last edit, in order."""
    texts: dict[str, str] = {}
    for event in seen.from_(room, sender):
        content = event["content"]
        relation = content.get("m.relates_to", {})
        if relation.get("rel_type") == "m.replace":
            texts[relation["event_id"]] = content["m.new_content"]["body"]
        else:
            texts.setdefault(event["event_id"], content["body"])
    return list(texts.values())


def squeezed(text: str) -> str:
    return "".join(text.split())


async def react(client: AsyncClient, room: str, event_id: str, key: str = "🧠") -> None:
    await client.room_send(room, "m.reaction", {"m.relates_to": {
        "rel_type": "m.annotation", "event_id": event_id, "key": key}}, ignore_unverified_devices=True)


async def test_a_malformed_event_does_not_stop_the_bot(synapse: SynapseServer, bot: Bot) -> None:
    """Events are written by anyone: a string where an object belongs must not end the sync (nor the bot)."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        for bad in ({"m.relates_to": "oops"}, {"m.relates_to": {"m.in_reply_to": "oops"}},
                    {"m.relates_to": {"rel_type": "m.thread", "event_id": 7}}, {"m.mentions": "everyone"}):
            await send_text(alice, room, "a malformed message", **bad)
        await send_text(alice, room, "still there?")
        await seen.sync_until(lambda: any("echo: still there?" in t for t in final_texts(seen, room, bot.user_id)),
                              "an answer after the malformed events")
        assert not bot.task.done()
    finally:
        await alice.close()


@pytest.mark.parametrize("trap_kind", ["invited", "additional creator"])
async def test_private_answers_skip_a_room_someone_else_made(synapse: SynapseServer, bot: Bot, trap_kind: str) -> None:
    """Mallory makes a "direct" room with the bot, invites Alice and leaves: the room holds only the bot and
    Alice, but Alice's private answers go to a new direct room (and the next ones to that same room). Room
    version 12 lets Mallory name Alice an "additional creator" of the room she made (and let anyone read its
    history): Alice made nothing by accepting the invite."""
    mallory, alice = await user(synapse, "mallory"), await user(synapse, "alice")
    mallorys, seen = Timeline(mallory), Timeline(alice)
    try:
        if trap_kind == "invited":
            trap = await open_room(mallory, [bot.user_id], direct=True)
            await joined(mallorys, trap, bot.user_id)
            await mallory.room_invite(trap, alice.user_id)
        else:
            trap = synapse.request("POST", "/_matrix/client/v3/createRoom", {
                "room_version": "12", "is_direct": True, "preset": "private_chat",
                "creation_content": {"additional_creators": [alice.user_id]},
                "invite": [bot.user_id, alice.user_id]}, token=mallory.access_token)["room_id"]
            await joined(mallorys, trap, bot.user_id)
        await alice.join(trap)
        await mallory.room_leave(trap)

        async def bot_sees_only_alice() -> bool:
            room = bot.adapter.client.rooms.get(trap)
            return room is not None and set(room.users) == {bot.user_id, alice.user_id} and not room.invited_users
        await eventually(bot_sees_only_alice, "the bot to see Mallory leave")
        group = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, group, bot.user_id)
        await send_text(alice, group, "!memory show")
        await seen.sync_until(lambda: any(r != trap for r in alice.invited_rooms), "an invite to a new direct room")
        dm = next(r for r in alice.invited_rooms if r != trap)
        await alice.join(dm)

        def answers() -> int:
            return sum("memory.md (version" in b for b in seen.bodies(dm, bot.user_id))
        await seen.sync_until(lambda: answers() == 1, "the private answer in the new room")
        await send_text(alice, group, "!memory show")
        await seen.sync_until(lambda: answers() == 2, "the second private answer in the same room")
        # In the trap itself: it looks direct, but Mallory made it (and may read it): a group room, so the
        # answer about Alice's memory goes to her real direct room, and nothing private lands in the trap.
        await send_text(alice, trap, "!memory remember my bank PIN is 4711")
        await seen.sync_until(lambda: any("Remembered as #" in b for b in seen.bodies(dm, bot.user_id)),
                              "the private answer to a command sent in the trap")
        assert all("4711" not in b and "Remembered" not in b for b in seen.bodies(trap, bot.user_id))
        assert not any("4711" in b for b in seen.bodies(trap, bot.user_id)) and not alice.invited_rooms
    finally:
        await mallory.close()
        await alice.close()


async def test_private_answers_go_to_the_direct_room_the_user_made(synapse: SynapseServer, bot: Bot) -> None:
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        dm = await dm_with(seen, bot.user_id)
        group = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, group, bot.user_id)
        await send_text(alice, group, "!memory show")
        await seen.sync_until(lambda: any("memory.md (version" in b for b in seen.bodies(dm, bot.user_id)),
                              "the private answer in her direct room")
        assert not alice.invited_rooms
    finally:
        await alice.close()


async def test_private_answers_skip_a_direct_room_anyone_may_read(synapse: SynapseServer, bot: Bot) -> None:
    """A direct room whose history is world-readable is read by anyone, member or not: no private answers."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        open_dm = synapse.request("POST", "/_matrix/client/v3/createRoom", {
            "is_direct": True, "preset": "private_chat", "invite": [bot.user_id],
            "initial_state": [{"type": "m.room.history_visibility", "state_key": "",
                               "content": {"history_visibility": "world_readable"}}]},
            token=alice.access_token)["room_id"]
        await joined(seen, open_dm, bot.user_id)
        group = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, group, bot.user_id)
        await send_text(alice, group, "!memory show")
        await seen.sync_until(lambda: any(r != open_dm for r in alice.invited_rooms), "an invite to a new direct room")
        assert not any("memory.md" in b for b in seen.bodies(open_dm, bot.user_id))
    finally:
        await alice.close()


async def test_a_thread_fallback_is_no_reply_to_the_bot(synapse: SynapseServer, bot: Bot) -> None:
    """Clients put ``m.in_reply_to`` (the thread's latest event) with ``is_falling_back`` in every thread
    message: once the bot spoke in a thread, that is no reason to answer each later message there."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, room, bot.user_id)
        root = (await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "a thread"})).event_id
        await send_text(alice, room, f"{bot.user_id}: first", **{
            "m.relates_to": {"rel_type": "m.thread", "event_id": root}})
        await seen.sync_until(lambda: bool(seen.from_(room, bot.user_id)), "the bot's answer in the thread")
        mine = seen.from_(room, bot.user_id)[0]["event_id"]

        async def in_thread(text: str, falling_back: bool) -> None:
            await send_text(alice, room, text, **{"m.relates_to": {
                "rel_type": "m.thread", "event_id": root, "is_falling_back": falling_back,
                "m.in_reply_to": {"event_id": mine}}})
        await in_thread("just chatting in the thread", True)
        await in_thread("a real reply to the bot", False)
        await seen.sync_until(lambda: any("a real reply" in t for t in final_texts(seen, room, bot.user_id)),
                              "the answer to the real reply")
        await asyncio.sleep(1.0)
        await seen.sync_until(lambda: True, "a last sync")
        assert not any("just chatting" in t for t in final_texts(seen, room, bot.user_id))
    finally:
        await alice.close()


async def test_reactions_follow_the_access_rules_and_rate_limit(synapse: SynapseServer, tmp_path: Path) -> None:
    """🧠 runs a command: a denied user's stores nothing, and the rate limit counts reactions too."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    running = await start_bot(synapse, tmp_path, sections={
        "access": {"deny_users": [f"matrix:{alice.user_id}"]}, "chat": {"rate_limit_per_minute": 1}})
    bobs = Timeline(bob)
    try:
        room = await group_with(bobs, running.user_id, alice)
        secret = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "my pin is 1234"})
        await react(alice, room, secret.event_id)
        tea = await bob.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "I like green tea"})
        await react(bob, room, tea.event_id)
        await remembered(running, bob.user_id)
        coffee = await bob.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "I hate coffee"})
        await react(bob, room, coffee.event_id)  # his second within the minute
        await asyncio.sleep(1.5)
        assert await items_of(running, alice.user_id) == []
        assert await items_of(running, bob.user_id) == ["I like green tea"]
    finally:
        await alice.close()
        await bob.close()
        await stop_bot(running)


async def test_leave_follows_the_access_lists(synapse: SynapseServer, bot: Bot) -> None:
    """!leave was handled before the access lists: in a denied room it was answered (each time, publicly)
    or obeyed, where every other message is ignored."""
    bob = await user(synapse, "bob")
    bobs = Timeline(bob)
    try:
        denied = await open_room(bob, [bot.user_id], direct=False)
        await joined(bobs, denied, bot.user_id)
        bot.app.config.access.deny_channels.append(f"matrix:{denied}")
        for _ in range(3):
            await send_text(bob, denied, "!leave")  # bob made the room: he is its admin
        other = await open_room(bob, [bot.user_id], direct=False)
        await joined(bobs, other, bot.user_id)
        await send_text(bob, other, f"{bot.user_id}: hello")
        await bobs.sync_until(lambda: any("echo" in b for b in bobs.bodies(other, bot.user_id)), "an answer")
        await asyncio.sleep(1.0)
        members = await bob.joined_members(denied)
        assert bot.user_id in {m.user_id for m in members.members}  # type: ignore[union-attr]
        assert bobs.bodies(denied, bot.user_id) == []
    finally:
        await bob.close()


async def test_brain_reaction_ignores_edits_by_others(synapse: SynapseServer, bot: Bot) -> None:
    """Anyone can send an ``m.replace`` of any message: 🧠 takes the author's own latest edit."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        room = await group_with(seen, bot.user_id, bob)
        sent = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "my cat is Pixel"})

        async def edit(client: AsyncClient, text: str) -> None:
            await client.room_send(room, "m.room.message", {
                "msgtype": "m.text", "body": f"* {text}", "m.new_content": {"msgtype": "m.text", "body": text},
                "m.relates_to": {"rel_type": "m.replace", "event_id": sent.event_id}})
        await edit(alice, "my cat is Pixel the Great")
        await edit(bob, "I owe Bob 100 euros")
        await react(alice, room, sent.event_id)
        assert await remembered(bot, alice.user_id) == ["my cat is Pixel the Great"]
    finally:
        await alice.close()
        await bob.close()


async def test_brain_reaction_on_a_reply_leaves_the_quoted_message_out(synapse: SynapseServer, bot: Bot) -> None:
    """An older client's reply starts with the quoted message: 🧠 on Bob's own reply stored Alice's words
    as Bob's memory (shared, so they came up in his replies in group channels)."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        room = await group_with(seen, bot.user_id, bob)
        hers = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "my diagnosis came back"})
        reply = await bob.room_send(room, "m.room.message", {
            "msgtype": "m.text", "body": f"> <{alice.user_id}> my diagnosis came back\n\nI'm vegetarian",
            "m.relates_to": {"m.in_reply_to": {"event_id": hers.event_id}}})
        await react(bob, room, reply.event_id)
        assert await remembered(bot, bob.user_id) == ["I'm vegetarian"]
    finally:
        await alice.close()
        await bob.close()


CJK = " ".join(["長い返事を書きます"] * 2_400)  # 23,999 characters, 3 bytes each in UTF-8 (but the spaces)


async def test_a_long_cjk_reply_arrives_whole_in_several_messages(synapse: SynapseServer, bot: Bot) -> None:
    """Matrix refuses events over 64 KiB; an edit repeats its text (fallback and new content, each as text and
    HTML): a long streamed reply and a long command answer are split so that every event fits."""
    def answer(request: LLMRequest) -> Completion:
        last = request.messages[-1].content if request.messages else ""
        return Completion(text=CJK if "write a lot" in str(last) else f"echo: {last}", usage=Usage(0, 10))
    bot.app.llm.default = answer  # type: ignore[attr-defined]  # the ScriptedProvider of start_bot
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        await send_text(alice, room, "write a lot")
        await seen.sync_until(lambda: squeezed("".join(final_texts(seen, room, bot.user_id))) == squeezed(CJK),
                              "the whole streamed reply")
        streamed = len(final_texts(seen, room, bot.user_id))
        assert streamed >= 3
        await bot.adapter.deliver(room, CommandReply(CJK))
        await seen.sync_until(lambda: squeezed("".join(final_texts(seen, room, bot.user_id)[streamed:]))
                              == squeezed(CJK), "the whole command answer")
    finally:
        await alice.close()


async def test_an_answer_quoting_items_has_a_plain_body_without_the_escapes(synapse: SynapseServer, bot: Bot) -> None:
    """Items are escaped for the HTML's Markdown (a code span begun in one hid the next): the plain body, which
    notifications and text-only clients show, carried the backslashes."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        await bot.adapter.deliver(room, CommandReply(r"#1 [fact] my\_user\_name is ann\_b, C++ \<3", escaped=True))
        await seen.sync_until(lambda: any(e["content"].get("body", "").startswith("#1")
                                          for e in seen.from_(room, bot.user_id)), "the answer")
        [content] = [e["content"] for e in seen.from_(room, bot.user_id) if e["content"]["body"].startswith("#1")]
        assert content["body"] == "#1 [fact] my_user_name is ann_b, C++ <3", content
        assert "my_user_name is ann_b, C++ &lt;3" in content["formatted_body"], content
    finally:
        await alice.close()


EMOJI = " ".join(["🧠🐈🍵🎲"] * 2_500)  # 12,499 characters, each 12 bytes of the JSON nio encrypts


async def test_encrypted_room_gets_an_encrypted_file_and_long_answers(synapse: SynapseServer, tmp_path: Path) -> None:
    """In an encrypted room the export zip is uploaded encrypted (its keys travel in the encrypted event), and a
    long answer is split for the larger encrypted events."""
    running = await start_bot(synapse, tmp_path, e2ee=True)
    (tmp_path / "alice").mkdir()
    alice = await user(synapse, "alice", store=tmp_path / "alice")
    seen = Timeline(alice)
    files: list[RoomMessageFile | RoomEncryptedFile] = []

    def on_file(room: MatrixRoom, event: RoomMessageFile | RoomEncryptedFile) -> None:
        files.append(event)
    alice.add_event_callback(on_file, (RoomMessageFile, RoomEncryptedFile))
    try:
        room = await open_room(alice, [running.user_id], direct=True, encrypted=True)
        await joined(seen, room, running.user_id)
        await seen.sync_until(lambda: True, "keys")
        await send_text(alice, room, "!memory export")
        await seen.sync_until(lambda: any(b.endswith(".zip") for b in seen.bodies(room, running.user_id)),
                              "the export file")
        assert files and isinstance(files[0], RoomEncryptedFile), files  # a file with "url" is no encrypted file
        download = await alice.download(mxc=files[0].url)
        stored = getattr(download, "body", b"")
        assert isinstance(stored, bytes) and not stored.startswith(b"PK")  # the server holds ciphertext
        data = decrypt_attachment(stored, files[0].key["k"], files[0].hashes["sha256"], files[0].iv)
        assert "data.json" in zipfile.ZipFile(io.BytesIO(data)).namelist()
        before = len(seen.bodies(room, running.user_id))
        await running.adapter.deliver(room, CommandReply(EMOJI))
        await seen.sync_until(lambda: squeezed("".join(seen.bodies(room, running.user_id)[before:]))
                              == squeezed(EMOJI), "the whole long answer")
    finally:
        await alice.close()
        await stop_bot(running)


def test_no_room_ping_in_any_case() -> None:
    for text in ("@room look", "@ROOM look", "@Room look", "@&#114;oom look", "@&#x52;OOM look", "&#64;room look"):
        content = render(text, "m.notice")
        assert "@room" not in content["body"].lower() and "@room" not in content["formatted_body"].lower(), text
        assert content["body"].replace("\u2060", "") == text  # the text reads the same
    # (Markdown turns a character reference into the character: "@&#114;oom" became "@room" in the HTML)


MENTION_LINKS = ("[Alice](https://matrix.to/#/@alice:localhost)", "<https://matrix.to/#/@alice:localhost>",
                 "[a](https://matrix.to/#/%40alice%3Alocalhost)", "[a](https://matrix.to/#/&#64;alice:localhost)",
                 "[a](MATRIX:u/alice:localhost)", "[a](matrix://localhost/u/alice:localhost?action=chat)",
                 "[a](https://app.element.io/#/user/@alice:localhost)", "[a][r]\n\n[r]: https://matrix.to/#/@alice:l")


@pytest.mark.parametrize("text", MENTION_LINKS)
def test_no_mention_link_in_the_html(text: str) -> None:
    """A link to a user is shown by clients as a mention (a pill): the HTML never holds one, whatever the model
    writes; the text stays readable, and other links stay links."""
    html = render(text, "m.notice")["formatted_body"]
    assert "<a " not in html and "alice" in html, html
    assert '<a href="https://matrix.to/#/#room:localhost">' in render("[r](https://matrix.to/#/#room:localhost)",
                                                                     "m.notice")["formatted_body"]


def test_a_users_permalink_written_as_text_is_no_pill() -> None:
    """Element shows a user's matrix.to permalink in plain text as a mention pill too: a word joiner keeps it
    text, in the body and the HTML; a room's permalink stays as it is."""
    for text in ("ask https://matrix.to/#/@alice:localhost", "ask HTTPS://MATRIX.TO/#/%40alice:localhost",
                 "ask matrix:u/alice:localhost"):
        content = render(text, "m.notice")
        for field in ("body", "formatted_body"):
            assert not re.search(r"matrix\.to/#/(@|%40)|matrix:u/[a-z]", content[field], re.IGNORECASE), content
            assert "alice" in content[field]
    assert render("https://matrix.to/#/#room:localhost", "m.notice")["body"] == "https://matrix.to/#/#room:localhost"


def test_creators_outrank_the_power_levels_only_from_room_version_12() -> None:
    """Before version 12 a creator who lowered their own power level is no admin any more."""
    from adapters.matrix import creators_outrank

    assert [creators_outrank(v) for v in ("12", "13", 12)] == [True, True, True]
    assert [creators_outrank(v) for v in (None, "1", "10", "11", "org.matrix.hydra.11", "１２", "")] == [False] * 7


async def test_files_with_another_bots_command_are_not_downloaded(synapse: SynapseServer, bot: Bot,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """In a group room a file captioned with another bot's command (``!play``) is neither read nor
    answered; captioned with one of this bot's that its sender may not run, it is answered (refused) but
    not read either; for a bot admin it is read."""
    from nio import UploadResponse

    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    read: list[str] = []
    download = bot.adapter._download

    async def spy(event: RoomMessageFile | RoomEncryptedFile, filename: str, content: dict[str, object]) -> object:
        read.append(event.body)
        return await download(event, filename, content)

    monkeypatch.setattr(bot.adapter, "_download", spy)
    try:
        room = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, room, bot.user_id)
        upload, _ = await alice.upload(lambda *_: io.BytesIO(b"{}"), content_type="application/json",
                                       filename="card.json", filesize=2)
        assert isinstance(upload, UploadResponse), upload
        for caption in ("!play my song", "!persona import"):
            await alice.room_send(room, "m.room.message", {
                "msgtype": "m.file", "body": caption, "filename": "card.json", "url": upload.content_uri,
                "info": {"size": 2, "mimetype": "application/json"}})
        await seen.sync_until(lambda: any("admins" in b for b in seen.bodies(room, bot.user_id)),
                              "the refusal of the import")
        assert read == []  # (a room admin, not the bot's: 8 MB fetched for a refusal, before)
        assert not any("Unknown command" in b for b in seen.bodies(room, bot.user_id))
        bot.adapter.config.admin_ids.append(alice.user_id)
        await alice.room_send(room, "m.room.message", {
            "msgtype": "m.file", "body": "!persona import", "filename": "card.json", "url": upload.content_uri,
            "info": {"size": 2, "mimetype": "application/json"}})
        await seen.sync_until(lambda: read == ["!persona import"], "the bot admin's file read")
    finally:
        await alice.close()


async def test_one_user_brings_the_bot_into_a_limited_number_of_rooms(synapse: SynapseServer, tmp_path: Path) -> None:
    """On a public homeserver anyone could fill the bot with rooms: past max_rooms_per_inviter a user's
    invites are declined (an admin's are not)."""
    alice, root = await user(synapse, "alice"), await user(synapse, "root")
    running = await start_bot(synapse, tmp_path, max_rooms_per_inviter=2, admin_ids=[root.user_id])
    seen, roots = Timeline(alice), Timeline(root)
    try:
        for _ in range(2):
            await joined(seen, await open_room(alice, [running.user_id], direct=False), running.user_id)
        third = await open_room(alice, [running.user_id], direct=False)

        def declined() -> bool:
            room = alice.rooms.get(third)
            return room is not None and running.user_id not in room.users and running.user_id not in room.invited_users

        await seen.sync_until(declined, "the third invite declined")
        await joined(roots, await open_room(root, [running.user_id], direct=False), running.user_id)
        await joined(roots, await open_room(root, [running.user_id], direct=False), running.user_id)
        await joined(roots, await open_room(root, [running.user_id], direct=False), running.user_id)  # an admin
    finally:
        await alice.close()
        await root.close()
        await stop_bot(running)


async def test_a_file_bigger_than_it_claims_is_not_read_whole(synapse: SynapseServer, bot: Bot,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A file's ``info.size`` is written by its sender: one that leaves it out (or says 0) was downloaded
    whole into memory, whatever the homeserver allows to upload, and only then found too big."""
    import tracemalloc

    from nio import UploadResponse

    import adapters.matrix

    monkeypatch.setattr(adapters.matrix, "MAX_FILE_BYTES", 256 * 1024)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        big = bytes(16 * 1024 * 1024)
        upload, _ = await alice.upload(lambda *_: io.BytesIO(big), content_type="application/zip",
                                       filename="export.zip", filesize=len(big))
        assert isinstance(upload, UploadResponse), upload
        tracemalloc.start()
        try:
            await alice.room_send(room, "m.room.message", {
                "msgtype": "m.file", "body": "!memory import", "filename": "export.zip", "url": upload.content_uri,
                "info": {"mimetype": "application/zip"}})
            await seen.sync_until(lambda: any("`export.zip` is over" in b for b in seen.bodies(room, bot.user_id)),
                                  "the refusal of the file")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 * 1024 * 1024, f"{peak / 2**20:.1f} MiB held for a file refused at 0.25 MiB"
    finally:
        await alice.close()


async def test_invites_arriving_together_count_against_the_limit(synapse: SynapseServer, tmp_path: Path) -> None:
    """Invites that reach the bot in one sync (sent while it was stopped, or a burst) were each checked
    against the rooms already synced as joined, not the ones joined a moment before: five went through a
    limit of two."""
    from tests.test_matrix import PASSWORD, _unique

    bot_id = synapse.register(_unique("cortex"), PASSWORD)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    rooms = [await open_room(alice, [bot_id], direct=False) for _ in range(5)]
    running = await start_bot(synapse, tmp_path, user_id=bot_id, max_rooms_per_inviter=2)
    try:
        def answered() -> bool:  # every invite joined or declined
            return all(alice.rooms.get(r) is not None and bot_id not in alice.rooms[r].invited_users for r in rooms)

        await seen.sync_until(answered, "the invites answered")
        assert sum(1 for r in rooms if bot_id in alice.rooms[r].users) == 2
    finally:
        await alice.close()
        await stop_bot(running)


async def test_what_was_said_before_the_bot_joined_is_not_answered(synapse: SynapseServer, bot: Bot) -> None:
    """A room's history is shown to a newcomer: a question put to the bot's name before it was invited is
    not answered on the join (it was asked of the room, not of the bot); the next one is."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [], direct=False)
        await send_text(alice, room, f"{bot.user_id}: what is the capital of France?")
        before = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "my cat is Pixel"})
        await react(alice, room, before.event_id)  # 🧠 before the bot was there: not for it either
        await alice.room_invite(room, bot.user_id)
        await joined(seen, room, bot.user_id)
        await send_text(alice, room, f"{bot.user_id}: and of Spain?")
        await seen.sync_until(lambda: any("Spain" in b for b in seen.bodies(room, bot.user_id)), "the answer")
        assert not any("France" in b for b in seen.bodies(room, bot.user_id))
        after = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "my dog is Rex"})
        await react(alice, room, after.event_id)
        assert await remembered(bot, alice.user_id) == ["my dog is Rex"]  # (handled after the earlier one)
    finally:
        await alice.close()


async def test_a_member_taking_the_bots_display_name_does_not_silence_it(synapse: SynapseServer, bot: Bot) -> None:
    """Two members of one name are told apart as "Cora (@id)": the bot's own name must still call it."""
    await bot.adapter.client.set_displayname("Cora")
    alice, mal = await user(synapse, "alice"), await user(synapse, "mal")
    seen = Timeline(alice)
    try:
        room = await group_with(seen, bot.user_id, mal)
        await joined(seen, room, mal.user_id)
        await mal.set_displayname("Cora")
        await seen.sync_until(lambda: bot.adapter.client.rooms[room].user_name(bot.user_id) != "Cora",
                              "the bot to see two members called Cora")
        await send_text(alice, room, "Cora, are you still there?")
        await seen.sync_until(lambda: any("are you still there?" in b for b in seen.bodies(room, bot.user_id)),
                              "the answer to the bot's name")
    finally:
        await alice.close()
        await mal.close()


async def test_an_invite_from_before_the_first_start_keeps_its_kind(synapse: SynapseServer, tmp_path: Path) -> None:
    """A group room's invite, waiting for the bot's first start, was joined as direct: its maker was then
    nobody's admin there (everyone holds power 100 in a DM), and it would count as a DM at two members."""
    from tests.test_matrix import PASSWORD, _unique

    bot_id = synapse.register(_unique("cortex"), PASSWORD)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    room = await open_room(alice, [bot_id], direct=False)
    running = await start_bot(synapse, tmp_path, user_id=bot_id)
    try:
        await joined(seen, room, bot_id)
        assert running.adapter._kinds.get(room) == "group"
        await send_text(alice, room, "!cortex settings")
        await seen.sync_until(lambda: any("Cortex settings" in b or "admins only" in b
                                          for b in seen.bodies(room, bot_id)), "the answer")
        assert not any("admins only" in b for b in seen.bodies(room, bot_id))
    finally:
        await alice.close()
        await stop_bot(running)


async def test_a_direct_room_others_join_keeps_its_direct_conversation_out(synapse: SynapseServer, bot: Bot) -> None:
    """Alice's DM became a group when she invited Bob: the DM's messages were in the window of Bob's replies
    (with history visibility "joined" he cannot read them himself). Once Bob leaves, her DM goes on."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        room = await _secret_dm_bob_joins(bot, seen, bob)
        await send_text(bob, room, f"{bot.user_id}: what did alice tell you?")
        await seen.sync_until(lambda: any("what did alice" in b for b in seen.bodies(room, bot.user_id)), "Bob's reply")
        request = bot.app.llm.requests[-1]  # type: ignore[attr-defined]
        assert "XYZ-42" not in str(request.system) + str([m.content for m in request.messages])
        reacted = await bot.adapter.reactions.inbound(bot.adapter.client.rooms[room], SimpleNamespace(
            sender=bob.user_id))  # a 🧠 there is the group conversation's too (its persona, its lists)
        assert reacted.message.channel_key == f"matrix:{room}/group"
        assert reacted.message.parent_channel_key == f"matrix:{room}"
        await bob.room_leave(room)
        await eventually(lambda: _members(bot, room, 2), "the bot to see Bob leave")
        await send_text(alice, room, "and what was my diagnosis?")
        await seen.sync_until(lambda: any("my diagnosis?" in b for b in seen.bodies(room, bot.user_id)), "her reply")
        request = bot.app.llm.requests[-1]  # type: ignore[attr-defined]
        assert "XYZ-42" in str([m.content for m in request.messages])  # the DM's own window again
    finally:
        await alice.close()
        await bob.close()


async def test_a_turned_down_direct_room_is_offered_again_not_made_anew(synapse: SynapseServer, bot: Bot) -> None:
    """A user who turned down the invite to their direct room got a new room, bot alone, for every private
    answer (one memory command after another: rooms piling up on the bot and the homeserver). The room the
    bot opened for them is offered again."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        room = await group_with(seen, bot.user_id, bob)
        invites: list[str] = []

        async def invited(dm: str) -> bool:  # (as the bot sees it)
            known = bot.adapter.client.rooms.get(dm)
            return known is not None and alice.user_id in known.invited_users

        async def has_dm() -> bool:
            return alice.user_id in bot.adapter._dms

        async def turned_down(dm: str) -> bool:
            return not await invited(dm) and await _members(bot, dm, 1)

        for turn in range(3):
            await send_text(alice, room, "!memory list")
            await eventually(has_dm, "a direct room for her")
            dm = bot.adapter._dms[alice.user_id]
            await eventually(partial(invited, dm), f"invite {turn + 1}")
            invites.append(dm)
            await alice.room_leave(dm)  # turned down
            await eventually(partial(turned_down, dm), "the bot to see her turn it down")
        assert len(set(invites)) == 1 and len(bot.adapter.client.rooms) == 2, (invites, bot.adapter.client.rooms)
        await send_text(alice, room, "!memory list")
        await eventually(lambda: invited(invites[0]), "the fourth invite, to the same room")
        await alice.join(invites[0])  # she takes it at last: the answers are there
        await seen.sync_until(lambda: any("No memory items" in b for b in seen.bodies(invites[0], bot.user_id)),
                              "the private answers")
    finally:
        await alice.close()
        await bob.close()


async def test_a_direct_room_its_maker_left_is_not_the_direct_chat_of_who_stayed(synapse: SynapseServer,
                                                                                 bot: Bot) -> None:
    """Alice invited Bob into her DM and left: two members again, so the room counted as direct, and Bob's
    replies had her DM's window and rolling summary (his !summary printed it), her DM's row turned into a
    group's (gone from her export), and a 🧠 on the bot's DM reply would have remembered it for him."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    mine, seen = Timeline(alice), Timeline(bob)
    try:
        room = await _secret_dm_bob_joins(bot, mine, bob)
        dm = await bot.app.storage.get_channel(f"matrix:{room}")
        assert dm is not None and dm.is_dm
        await bot.app.storage.add_summary(dm.id, "Alice's diagnosis is XYZ-42; she asked me to keep it.", 1, 2, 20, "m")
        await alice.room_leave(room)
        await eventually(lambda: _members(bot, room, 2), "the bot to see Alice leave")
        await send_text(bob, room, f"{bot.user_id}: what did the person before me tell you?")
        await seen.sync_until(lambda: any("person before me" in b for b in seen.bodies(room, bot.user_id)), "a reply")
        request = bot.app.llm.requests[-1]  # type: ignore[attr-defined]
        assert "XYZ-42" not in str(request.system) + str([m.content for m in request.messages])
        await send_text(bob, room, "!summary")
        await seen.sync_until(lambda: any("summary" in b.lower() for b in seen.bodies(room, bot.user_id)), "!summary")
        assert not any("XYZ-42" in b for b in seen.bodies(room, bot.user_id))
        dm = await bot.app.storage.get_channel(f"matrix:{room}")
        assert dm is not None and dm.is_dm  # still Alice's direct chat (her export lists its summaries)
        bots_dm_reply = next(e for e in mine.from_(room, bot.user_id) if "XYZ-42" in e["content"]["body"])
        await react(bob, room, bots_dm_reply["event_id"])

        def refused() -> bool:  # (answered in a direct room the bot opens for Bob: he joins it)
            for invited in list(bob.invited_rooms):
                asyncio.get_running_loop().create_task(bob.join(invited))
            return any("your own messages" in body for other in seen.events if other != room
                       for body in seen.bodies(other, bot.user_id))
        await seen.sync_until(refused, "the 🧠 to be refused")
        assert await items_of(bot, bob.user_id) == []
    finally:
        await alice.close()
        await bob.close()


async def _secret_dm_bob_joins(bot: Bot, owner: Timeline, bob: AsyncClient) -> str:
    """The owner's DM with the bot (history visible to members from their joining on), a secret told and
    answered in it, then Bob invited and joined: the room, once the bot sees three members."""
    room = await dm_with(owner, bot.user_id)
    await owner.client.room_put_state(room, "m.room.history_visibility", {"history_visibility": "joined"})
    await send_text(owner.client, room, "my diagnosis is XYZ-42, keep it between us")
    await owner.sync_until(lambda: any("XYZ-42" in b for b in owner.bodies(room, bot.user_id)), "the DM reply")
    await owner.client.room_invite(room, bob.user_id)
    await bob.join(room)
    await eventually(lambda: _members(bot, room, 3), "the bot to see Bob join")
    return room


async def _members(bot: Bot, room_id: str, count: int) -> bool:
    room = bot.adapter.client.rooms.get(room_id)
    return room is not None and room.member_count == count


async def test_a_redacted_message_leaves_the_bots_store_and_memory(synapse: SynapseServer, bot: Bot) -> None:
    """"oops, my password is hunter2", then deleted in the client: it stayed in every later prompt's window
    and in the database (and a 🧠 made of it stayed a memory item)."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        bot.app.llm.enqueue("Noted.")  # type: ignore[attr-defined]
        oops = {"msgtype": "m.text", "body": "oops my password is hunter2"}
        sent = await alice.room_send(room, "m.room.message", oops)
        await seen.sync_until(lambda: "Noted." in seen.bodies(room, bot.user_id), "the reply")
        await react(alice, room, sent.event_id)
        assert await remembered(bot, alice.user_id) == ["oops my password is hunter2"]
        # Redactions as another homeserver may deliver them (Synapse itself holds such ones back): naming her
        # message from a room it is not in, or by someone without the power to redact others' messages
        mallory = await user(synapse, "mallory")
        try:
            own = await open_room(mallory, [bot.user_id], direct=False)
            await joined(Timeline(mallory), own, bot.user_id)

            async def synced() -> bool:
                return own in bot.adapter.client.rooms
            await eventually(synced, "the bot to sync Mallory's room")
            for where in (own, room):
                forged = RedactionEvent.from_dict({
                    "type": "m.room.redaction", "event_id": f"$forged{len(where)}", "sender": mallory.user_id,
                    "origin_server_ts": 0, "redacts": sent.event_id, "content": {}, "room_id": where})
                await bot.adapter._on_redaction(bot.adapter.client.rooms[where], forged)
        finally:
            await mallory.close()
        assert await items_of(bot, alice.user_id) == ["oops my password is hunter2"]
        assert await bot.app.storage.db.fetch_all("SELECT text FROM messages WHERE text LIKE '%hunter2%'")
        await alice.room_redact(room, sent.event_id, reason="typed in the wrong window")

        async def gone() -> bool:
            rows = await bot.app.storage.db.fetch_all("SELECT text FROM messages WHERE text LIKE '%hunter2%'")
            return not rows and not await items_of(bot, alice.user_id)
        await eventually(gone, "the message and its memory item to go")
        await send_text(alice, room, "what is new?")
        await seen.sync_until(lambda: any("what is new?" in b for b in seen.bodies(room, bot.user_id)), "the answer")
        request = bot.app.llm.requests[-1]  # type: ignore[attr-defined]
        assert "hunter2" not in str(request.system) + str([m.content for m in request.messages])
        # "Noted." (the reply to the redacted message) went with it; a reply of the bot's a room moderator (here
        # Alice, who made the room) redacts leaves the store too.
        assert not await bot.app.storage.db.fetch_all("SELECT id FROM messages WHERE text = 'Noted.'")
        answer = [e for e in seen.from_(room, bot.user_id) if "m.new_content" not in e["content"]][-1]  # (edited)
        await alice.room_redact(room, answer["event_id"])

        async def reply_gone() -> bool:
            rows = await bot.app.storage.db.fetch_all("SELECT text FROM messages WHERE role = 'assistant'")
            return not any("what is new?" in str(r[0]) for r in rows)
        await eventually(reply_gone, "the redacted reply to leave the store")
    finally:
        await alice.close()


async def test_a_message_the_bot_cannot_decrypt_is_answered_once_not_ignored(synapse: SynapseServer,
                                                                              tmp_path: Path) -> None:
    """A message whose keys never reached the bot's device went unanswered, as if the bot were dead."""
    bot = await start_bot(synapse, tmp_path, e2ee=True)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id], direct=True, encrypted=True)
        await joined(seen, room, bot.user_id)
        for session in ("session-a", "session-a", "session-b"):  # as a client whose keys went astray sends it
            await alice.room_send(room, "m.room.encrypted", {
                "algorithm": "m.megolm.v1.aes-sha2", "sender_key": "c2VuZGVyIGtleQ", "device_id": "ALICEDEVICE",
                "session_id": session, "ciphertext": "bm90IHJlYWxseSBlbmNyeXB0ZWQ"})

        def notices() -> int:
            return sum(1 for e in seen.events.get(room, []) if e.get("sender") == bot.user_id
                       and e.get("type") == "m.room.encrypted")
        await seen.sync_until(lambda: notices() >= 2, "a notice per undecryptable session")
        await asyncio.sleep(1)
        await seen.sync_until(lambda: True, "one more sync")
        assert notices() == 2 and not bot.task.done()
    finally:
        await alice.close()
        await stop_bot(bot)


async def test_undecryptable_messages_follow_the_rate_limit(synapse: SynapseServer, tmp_path: Path) -> None:
    """Each unknown session got its own notice: anyone in a DM with the bot could make it send one for every
    made-up session id, past the rate limit every readable message meets."""
    bot = await start_bot(synapse, tmp_path, e2ee=True, sections={"chat": {"rate_limit_per_minute": 2}})
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id], direct=True, encrypted=True)
        await joined(seen, room, bot.user_id)
        for session in range(6):
            await alice.room_send(room, "m.room.encrypted", {
                "algorithm": "m.megolm.v1.aes-sha2", "sender_key": "c2VuZGVyIGtleQ", "device_id": "ALICEDEVICE",
                "session_id": f"made-up-{session}", "ciphertext": "bm90IHJlYWxseSBlbmNyeXB0ZWQ"})

        def notices() -> int:
            return sum(1 for e in seen.events.get(room, []) if e.get("sender") == bot.user_id
                       and e.get("type") == "m.room.encrypted")
        await seen.sync_until(lambda: notices() >= 2, "the first notices")
        await asyncio.sleep(2)
        await seen.sync_until(lambda: True, "one more sync")
        assert notices() == 2
    finally:
        await alice.close()
        await stop_bot(bot)


def _prompt_of(bot: Bot, asked: str) -> str:
    """The whole prompt (system and messages) of the reply to the message that said ``asked``."""
    [request] = [r for r in bot.app.llm.requests  # type: ignore[attr-defined]
                 if r.messages and asked in r.messages[-1].content]
    return "\n".join([request.system, *(m.content for m in request.messages)])


async def _ask(bot: Bot, seen: Timeline, room: str, who: AsyncClient, text: str) -> str:
    """``who`` says ``text`` to the bot in ``room``: the prompt of its answer, once ``seen`` has the answer."""
    await send_text(who, room, f"{bot.user_id} {text}")
    await seen.sync_until(lambda: any(text in b for b in seen.bodies(room, bot.user_id)), f"the answer to {text}")
    return _prompt_of(bot, text)


async def test_a_newcomer_to_a_room_that_hides_its_history_is_not_told_it(synapse: SynapseServer,
                                                                          tmp_path: Path) -> None:
    """In a room whose history visibility is "joined", Bob's client shows nothing said before he joined; the
    bot kept it all, and its reply to "what were the words?" put it in his prompt. His reply's history now
    starts at his join (Alice's still holds everything), and after he changed his display name and the bot
    restarted (the joins read from the room's state), his join is still found behind the name change."""
    first = await start_bot(synapse, tmp_path)
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)

    async def ask(bot: Bot, who: AsyncClient, text: str) -> str:
        return await _ask(bot, seen, room, who, text)

    try:
        room = await open_room(alice, [first.user_id], direct=False)
        await joined(seen, room, first.user_id)
        await alice.room_put_state(room, "m.room.history_visibility", {"history_visibility": "joined"})
        await ask(first, alice, "the first word is PAPAYA")
        await alice.room_invite(room, bob.user_id)
        await bob.join(room)
        await eventually(lambda: _members(first, room, 3), "the bot to see Bob join")
        await ask(first, alice, "the second word is MANGO")
        told_bob = await ask(first, bob, "what were the words?")
        assert "MANGO" in told_bob and "PAPAYA" not in told_bob, told_bob
        told_alice = await ask(first, alice, "and the words for me?")
        assert "MANGO" in told_alice and "PAPAYA" in told_alice, told_alice
        await bob.set_displayname("Bobby")
        await seen.sync_until(lambda: seen.client.rooms[room].user_name(bob.user_id) == "Bobby", "the new name")
        await stop_bot(first)
        second = await start_bot(synapse, tmp_path, user_id=first.user_id)
        try:
            told_bobby = await ask(second, bob, "the words once more?")
            assert "MANGO" in told_bobby and "PAPAYA" not in told_bobby, told_bobby
        finally:
            await stop_bot(second)
    finally:
        await alice.close()
        await bob.close()
        if not first.task.done():
            await stop_bot(first)


async def test_the_pages_room_admins_follow_the_chats_rule_for_room_creators(synapse: SynapseServer,
                                                                              bot: Bot) -> None:
    """The web page's admin check (the admin directory) made every room's creator an admin of its settings; before
    room version 12 a creator who lowered their own power level is no admin in the chat, and now not on the page
    either. In a room of version 12 the creator outranks the power levels in both."""
    from adapters.admin_directory import matrix_directory

    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        for version, alice_is_admin in (("10", False), ("12", True)):
            created = await alice.room_create(room_version=version, invite=[bot.user_id, bob.user_id])
            room = created.room_id  # type: ignore[union-attr]
            await bob.join(room)
            await joined(seen, room, bot.user_id)
            levels = await alice.room_get_state_event(room, "m.room.power_levels")
            users = dict(levels.content["users"]) | {bob.user_id: 100}  # type: ignore[union-attr]
            if version == "10":
                users[alice.user_id] = 0  # (she hands the room over)
            await alice.room_put_state(room, "m.room.power_levels",
                                       levels.content | {"users": users})  # type: ignore[union-attr]
            await send_text(alice, room, "hello all")  # (the bot reads the room's creators with a message)

            async def synced(room: str = room) -> bool:
                mine = bot.adapter.client.rooms.get(room)
                return (mine is not None and mine.power_levels.users.get(bob.user_id) == 100
                        and room in bot.adapter._creators)
            await eventually(synced, f"the bot to see the power levels of the version {version} room")
            directory = matrix_directory(bot.adapter)
            assert await directory.is_admin(f"matrix:{bob.user_id}", f"matrix:{room}")
            assert await directory.is_admin(f"matrix:{alice.user_id}", f"matrix:{room}") is alice_is_admin, version
            assert (bot.adapter.power_level(bot.adapter.client.rooms[room], alice.user_id) >= 50) is alice_is_admin
        await _demoted_room_admins_are_no_admins(bot, alice, bob, seen)
    finally:
        await alice.close()
        await bob.close()


async def _demoted_room_admins_are_no_admins(bot: Bot, alice: AsyncClient, bob: AsyncClient,
                                             seen: Timeline) -> None:
    """A room admin demoted is no admin at the next command: nio merged each new power levels event into the
    room's, so one taken out of the list (Element's /deop: the default level) kept their level until a restart."""
    from adapters.admin_directory import matrix_directory

    directory = matrix_directory(bot.adapter)
    created = await alice.room_create(room_version="10", invite=[bot.user_id, bob.user_id])
    room = created.room_id  # type: ignore[union-attr]
    await bob.join(room)
    await joined(seen, room, bot.user_id)
    levels = await alice.room_get_state_event(room, "m.room.power_levels")
    content = dict(levels.content)  # type: ignore[union-attr]
    mine = {alice.user_id: 100}

    async def bob_is_admin(admin: bool) -> None:
        async def now() -> bool:
            return await directory.is_admin(f"matrix:{bob.user_id}", f"matrix:{room}") is admin
        await eventually(now, f"the bot to see bob {'promoted' if admin else 'demoted'}")
        level = bot.adapter.power_level(bot.adapter.client.rooms[room], bob.user_id)
        assert (level >= 50) is admin, level
    # (levels below alice's: a room admin cannot lower a user of their own level)
    for users, admin in (({bob.user_id: 50}, True), ({}, False), ({bob.user_id: 50}, True), ({}, False)):
        put = await alice.room_put_state(room, "m.room.power_levels", content | {"users": mine | users})
        assert isinstance(put, RoomPutStateResponse), put
        await bob_is_admin(admin)


async def test_a_room_that_hid_its_history_keeps_it_hidden_after_it_shares_it(synapse: SynapseServer,
                                                                              tmp_path: Path) -> None:
    """What was said while a room's history visibility was "joined" stays hidden from those who join after it
    became "shared" (each event's own visibility decides; their client shows nothing of it): the bot went by the
    room's visibility now, and told them."""
    bot = await start_bot(synapse, tmp_path)
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)

    async def ask(who: AsyncClient, text: str) -> str:
        return await _ask(bot, seen, room, who, text)

    try:
        room = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, room, bot.user_id)
        await alice.room_put_state(room, "m.room.history_visibility", {"history_visibility": "joined"})
        await ask(alice, "the first word is PAPAYA")
        await alice.room_put_state(room, "m.room.history_visibility", {"history_visibility": "shared"})
        await alice.room_invite(room, bob.user_id)
        await bob.join(room)
        await eventually(lambda: _members(bot, room, 3), "the bot to see Bob join")
        history = await bob.room_messages(room, (await bob.sync(timeout=0)).next_batch, limit=100)  # type: ignore[union-attr]
        assert "PAPAYA" not in str([getattr(e, "body", "") for e in history.chunk])  # type: ignore[union-attr]
        told_bob = await ask(bob, "what were the words?")
        assert "PAPAYA" not in told_bob and "what were the words?" in told_bob, told_bob
    finally:
        await alice.close()
        await bob.close()
        await stop_bot(bot)


async def test_a_member_from_before_the_bot_keeps_their_history_after_a_name_change(synapse: SynapseServer,
                                                                                   tmp_path: Path) -> None:
    """Bob was in the room before the bot and changed his name after it came; after a restart the bot read the
    name change's time as his join (the server does not show it his older events) and hid from him what he saw."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    first = await start_bot(synapse, tmp_path)
    running = first

    async def ask(who: AsyncClient, text: str) -> str:
        return await _ask(running, seen, room, who, text)

    try:
        room = await open_room(alice, [bob.user_id], direct=False)
        await alice.room_put_state(room, "m.room.history_visibility", {"history_visibility": "joined"})
        await bob.join(room)
        await alice.room_invite(room, first.user_id)
        await joined(seen, room, first.user_id)
        await ask(alice, "the first word is PAPAYA")  # (Bob is there)
        await bob.set_displayname("Bobby")
        await seen.sync_until(lambda: seen.client.rooms[room].user_name(bob.user_id) == "Bobby", "the new name")
        await stop_bot(first)
        running = await start_bot(synapse, tmp_path, user_id=first.user_id)
        told = await ask(bob, "what was the first word?")
        assert "PAPAYA" in told, told
    finally:
        await alice.close()
        await bob.close()
        if not running.task.done():
            await stop_bot(running)
        if not first.task.done():
            await stop_bot(first)


async def test_a_bot_invited_back_answers_nothing_said_before_and_runs_no_old_command(synapse: SynapseServer,
                                                                                    bot: Bot) -> None:
    """Invited back after !leave (or a kick), the bot is given the room's recent history with its earlier join in
    it: it answered the old mention again and ran the old !leave again (and left at once)."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, room, bot.user_id)
        await send_text(alice, room, f"{bot.user_id}: first question")
        await seen.sync_until(lambda: any("first question" in t for t in final_texts(seen, room, bot.user_id)),
                              "the answer")
        await send_text(alice, room, "!leave")
        await seen.sync_until(lambda: bot.user_id not in alice.rooms[room].users, "the bot to leave")
        await alice.room_invite(room, bot.user_id)
        await joined(seen, room, bot.user_id)
        await send_text(alice, room, f"{bot.user_id}: second question")  # (answered: the old events are behind)
        await seen.sync_until(lambda: any("second question" in t for t in final_texts(seen, room, bot.user_id)),
                              "the answer to the new question")
        answers = final_texts(seen, room, bot.user_id)
        assert len([t for t in answers if "first question" in t]) == 1, answers
        assert bot.user_id in alice.rooms[room].users  # (the old !leave did not run again)
    finally:
        await alice.close()


async def test_a_direct_room_the_bot_was_kicked_from_is_not_where_private_answers_go(synapse: SynapseServer,
                                                                                    bot: Bot) -> None:
    """nio does not read the rooms a sync says the bot left: a DM it was kicked from stayed in its rooms with the
    bot listed in it, and every private answer went there (M_FORBIDDEN) until a restart."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        dm = await dm_with(seen, bot.user_id)
        await alice.room_kick(dm, bot.user_id)
        await eventually(lambda: _gone(bot, dm), "the bot to see the kick")
        group = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, group, bot.user_id)
        await send_text(alice, group, "!memory list")
        await seen.sync_until(lambda: any(r != dm for r in alice.invited_rooms), "an invite to a new direct room")
        new = next(r for r in alice.invited_rooms if r != dm)
        await seen.sync_until(lambda: any("direct message" in t for t in final_texts(seen, group, bot.user_id)),
                              "the note in the group")
        await alice.join(new)
        await seen.sync_until(lambda: any("No memory items" in t for t in final_texts(seen, new, bot.user_id)),
                              "the private answer")
    finally:
        await alice.close()


async def _gone(bot: Bot, room_id: str) -> bool:
    return room_id not in bot.adapter.client.rooms


async def test_rooms_the_bot_was_made_to_leave_do_not_count_against_the_inviters_limit(synapse: SynapseServer,
                                                                                     tmp_path: Path) -> None:
    running = await start_bot(synapse, tmp_path, max_rooms_per_inviter=1)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        first = await open_room(alice, [running.user_id], direct=False)
        await joined(seen, first, running.user_id)
        await send_text(alice, first, "!leave")
        await seen.sync_until(lambda: running.user_id not in alice.rooms[first].users, "the bot to leave")
        await eventually(lambda: _gone(running, first), "the bot to see it left")
        second = await open_room(alice, [running.user_id], direct=False)
        await joined(seen, second, running.user_id)  # (it was declined: "already brought the bot into 1 rooms")
    finally:
        await alice.close()
        await stop_bot(running)


async def test_uploads_are_read_by_their_caption_and_a_bare_one_gets_the_hint(synapse: SynapseServer,
                                                                             bot: Bot) -> None:
    """A picture with the question "what is this?" as its caption, or a recording alone, got no answer at all
    in a DM (Discord's adapter reads the text beside a picture, and answers a picture alone with a hint)."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        dm = await dm_with(seen, bot.user_id)
        await alice.room_send(dm, "m.room.message", {"msgtype": "m.image", "body": "what is this?",
                                                     "filename": "cat.png", "url": "mxc://localhost/abc"})
        await seen.sync_until(lambda: "echo: what is this?" in final_texts(seen, dm, bot.user_id), "the answer")
        await alice.room_send(dm, "m.room.message", {"msgtype": "m.audio", "body": "voice.ogg",
                                                     "url": "mxc://localhost/def"})
        await seen.sync_until(lambda: any("I read text" in t for t in final_texts(seen, dm, bot.user_id)), "the hint")
        asked = [r for r in bot.app.llm.requests if "voice.ogg" in str(r.messages)]  # type: ignore[attr-defined]
        assert asked == []  # (a file's name is not a message)
        await send_text(alice, dm, "!leave")  # ("Unknown command" before: leaving a DM is the user's to do)
        await seen.sync_until(lambda: any("!leave is for rooms. To end our direct chat, leave it in your client" in t
                                          for t in final_texts(seen, dm, bot.user_id)), "the answer to !leave")
    finally:
        await alice.close()


async def test_a_location_a_sticker_or_an_unknown_msgtype_gets_the_hint_in_a_dm_and_when_addressed(
        synapse: SynapseServer, bot: Bot) -> None:
    """An m.location, a sticker or a msgtype of a client's own got no answer at all in a DM (only text, emotes and
    uploads were handled). Their bodies are no one's words: neither stored nor shown to the model; in a room, only
    one that addresses the bot is answered."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)

    def hints(room: str) -> int:
        return sum("I read text" in t for t in final_texts(seen, room, bot.user_id))

    try:
        dm = await dm_with(seen, bot.user_id)
        sent = [
            ("m.room.message", {"msgtype": "m.location", "body": "Location: geo:52.52,13.40",
                                "geo_uri": "geo:52.52,13.40"}),
            ("m.sticker", {"body": "a waving cat", "url": "mxc://localhost/sticker", "info": {}}),
            ("m.room.message", {"msgtype": "org.example.poll", "body": "Poll: tea or coffee?"}),
        ]
        for number, (kind, content) in enumerate(sent, 1):
            await alice.room_send(dm, kind, content, ignore_unverified_devices=True)
            await seen.sync_until(lambda n=number: hints(dm) >= n, f"the hint to {content.get('msgtype', kind)}")
        assert hints(dm) == len(sent)
        bodies = [str(c["body"]) for _, c in sent]
        asked = [r for r in bot.app.llm.requests  # type: ignore[attr-defined]
                 if any(b in str(r.messages) for b in bodies)]
        assert asked == []
        channel = await bot.app.storage.get_channel(f"matrix:{dm}")
        assert channel is None or await bot.app.storage.recent_messages(channel.id, 10) == []
        # A client's request to verify the bot's device (in the DM, as Element sends it) is no message to answer.
        await alice.room_send(dm, "m.room.message", {
            "msgtype": "m.key.verification.request", "body": "Alice is requesting to verify your device",
            "from_device": "ALICEDEVICE", "methods": ["m.sas.v1"], "to": bot.user_id}, ignore_unverified_devices=True)
        await send_text(alice, dm, "hello after the request")
        await seen.sync_until(lambda: any(t.endswith("hello after the request")
                                          for t in final_texts(seen, dm, bot.user_id)), "the answer after the request")
        assert hints(dm) == len(sent)
        room = await group_with(seen, bot.user_id, bob)
        await alice.room_send(room, "m.room.message", {"msgtype": "m.location", "body": "Location: geo:1,2",
                                                       "geo_uri": "geo:1,2"})  # not addressed: no answer
        await alice.room_send(room, "m.room.message", {"msgtype": "m.location", "body": "Location: geo:3,4",
                                                       "geo_uri": "geo:3,4", "m.mentions": {"user_ids": [bot.user_id]}})
        await seen.sync_until(lambda: hints(room) >= 1, "the hint to the addressed location")
        await send_text(alice, room, f"{bot.user_id}: hello")
        await seen.sync_until(lambda: any(t.startswith("echo:") and t.endswith("hello")
                                          for t in final_texts(seen, room, bot.user_id)), "the answer to hello")
        assert hints(room) == 1
    finally:
        await alice.close()
        await bob.close()
