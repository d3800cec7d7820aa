"""The Matrix adapter without end-to-end encryption (``e2ee = false``, the default) in encrypted rooms, on a real
Synapse with real nio clients (the users' encrypting): it cannot read them, says so once, and never sends them
anything else unencrypted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nio import AsyncClient

from adapters.matrix import UNDECRYPTABLE, UNREADABLE_ROOM
from tests.synapse import SynapseServer
from tests.test_matrix import Timeline, group_with, joined, open_room, send_text, start_bot, stop_bot, user

pytestmark = pytest.mark.slow


def said(seen: Timeline, room: str, bot_id: str) -> list[tuple[str, bool]]:
    """The bot's messages in the room (not their edits) as the user saw them: their text, and whether they came
    encrypted."""
    return [(e["content"].get("body", ""), bool(e.get("encrypted"))) for e in seen.from_(room, bot_id)
            if "m.new_content" not in e["content"]]


async def settle(seen: Timeline) -> None:
    """A few more seconds of syncing: time for a message the bot should not send."""
    await asyncio.sleep(2)
    await seen.sync_until(lambda: True, "one more sync")


async def test_an_encrypted_dm_is_told_once_that_the_bot_cannot_read_it(synapse: SynapseServer,
                                                                         tmp_path: Path) -> None:
    """Without e2ee the bot answered an encrypted DM's first message with "my device did not get its encryption
    keys ... verifying my device helps" (it has no encryption at all), then said nothing to the next ones."""
    first = await start_bot(synapse, tmp_path)
    (tmp_path / "alice").mkdir()
    alice = await user(synapse, "alice", tmp_path / "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [first.user_id], direct=True, encrypted=True)
        await joined(seen, room, first.user_id)
        for n in range(3):
            await send_text(alice, room, f"hello {n}")
        await seen.sync_until(lambda: bool(said(seen, room, first.user_id)), "the bot's notice")
        await settle(seen)
        await stop_bot(first)
        for n in range(12):  # (more than a sync holds: the restart reads the stretch back, and must not answer it)
            await send_text(alice, room, f"while down {n}")
        second = await start_bot(synapse, tmp_path, user_id=first.user_id)  # (it said so already: not again)
        try:
            await send_text(alice, room, "hello after a restart")
            await settle(seen)
        finally:
            await stop_bot(second)
        assert said(seen, room, first.user_id) == [(UNREADABLE_ROOM, False)]
        assert not any(UNDECRYPTABLE in body for body, _ in said(seen, room, first.user_id))
    finally:
        await alice.close()


async def test_a_dm_that_turns_encryption_on_is_told_once_at_its_first_unreadable_message(
        synapse: SynapseServer, tmp_path: Path) -> None:
    """A DM whose user turned encryption on after the bot joined got "my device did not get its encryption keys
    ... verifying my device helps" (the bot has no encryption at all) at its first encrypted message."""
    bot = await start_bot(synapse, tmp_path)
    (tmp_path / "alice").mkdir()
    alice = await user(synapse, "alice", tmp_path / "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id], direct=True)
        await joined(seen, room, bot.user_id)
        await send_text(alice, room, "hello")
        await seen.sync_until(lambda: any("hello" in b for b in seen.bodies(room, bot.user_id)), "an answer")
        await alice.room_put_state(room, "m.room.encryption", {"algorithm": "m.megolm.v1.aes-sha2"})
        await seen.sync_until(lambda: alice.rooms[room].encrypted, "the room to be encrypted")
        for n in range(2):
            await send_text(alice, room, f"secret {n}")
        await seen.sync_until(lambda: len(said(seen, room, bot.user_id)) > 1, "the bot's notice")
        await settle(seen)
        assert said(seen, room, bot.user_id)[1:] == [(UNREADABLE_ROOM, False)]
    finally:
        await alice.close()
        await stop_bot(bot)


async def test_an_encrypted_group_room_is_told_once_and_gets_no_answer(synapse: SynapseServer,
                                                                        tmp_path: Path) -> None:
    """Invited into an encrypted group room, the bot said nothing (a mention went unanswered, as if it were
    dead), and a message a client sent there unencrypted got an unencrypted answer in the encrypted room."""
    bot = await start_bot(synapse, tmp_path)
    (tmp_path / "alice").mkdir()
    alice = await user(synapse, "alice", tmp_path / "alice")
    bob = await user(synapse, "bob")  # (no encryption: nio sends his messages unencrypted)
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id, bob.user_id], direct=False, encrypted=True)
        await bob.join(room)
        await joined(seen, room, bot.user_id)
        await send_text(alice, room, f"{bot.user_id}: are you there?")
        await send_text(bob, room, f"{bot.user_id}: what do you remember of this room?")
        await seen.sync_until(lambda: bool(said(seen, room, bot.user_id)), "the bot's notice")
        await settle(seen)
        assert said(seen, room, bot.user_id) == [(UNREADABLE_ROOM, False)]
        assert not bot.app.llm.requests  # (nothing read, nothing answered)
    finally:
        await alice.close()
        await bob.close()
        await stop_bot(bot)


async def joined_invites(client: AsyncClient) -> None:
    """Join the rooms the client is invited into (the DM the bot opens for a private answer)."""
    for room_id in list(client.invited_rooms):
        await client.join(room_id)


async def test_a_private_answer_never_goes_unencrypted_into_an_encrypted_dm(synapse: SynapseServer,
                                                                            tmp_path: Path) -> None:
    """Without e2ee, ``!memory show`` typed in a group room sent the memory file, unencrypted, into the user's
    encrypted DM with the bot: a room the user set up as end-to-end encrypted."""
    bot = await start_bot(synapse, tmp_path)
    (tmp_path / "alice").mkdir()
    alice = await user(synapse, "alice", tmp_path / "alice")
    bob = await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        encrypted_dm = await open_room(alice, [bot.user_id], direct=True, encrypted=True)
        await joined(seen, encrypted_dm, bot.user_id)
        group = await group_with(seen, bot.user_id, bob)
        await send_text(alice, group, "!memory show memory.md")

        def answered_in() -> list[str]:
            return [r for r in seen.events if any("memory.md (version" in b for b in seen.bodies(r, bot.user_id))]

        def answered() -> bool:
            return bool(answered_in())
        while not answered():
            await seen.sync_until(lambda: bool(alice.invited_rooms) or answered(), "the private answer or its DM")
            await joined_invites(alice)
        [answer_room] = answered_in()
        assert answer_room not in (encrypted_dm, group)
        assert not alice.rooms[answer_room].encrypted
        await settle(seen)
        assert said(seen, encrypted_dm, bot.user_id) == []  # (nothing, not even the notice: nobody wrote there)
    finally:
        await alice.close()
        await bob.close()
        await stop_bot(bot)


async def test_a_room_the_access_lists_keep_the_bot_silent_in_is_not_told(synapse: SynapseServer,
                                                                         tmp_path: Path) -> None:
    """The notice went out on joining, before anyone's message was weighed against the access lists: anyone
    allowed to invite the bot could make it speak in rooms (and DMs, with dms off) where it is to stay silent."""
    bot = await start_bot(synapse, tmp_path, sections={"access": {"dms": False,
                                                                  "allow_channels": ["matrix:!elsewhere:localhost"]}})
    (tmp_path / "alice").mkdir()
    alice = await user(synapse, "alice", tmp_path / "alice")
    seen = Timeline(alice)
    try:
        rooms = [await open_room(alice, [bot.user_id], direct=direct, encrypted=True) for direct in (True, False)]
        for room in rooms:
            await joined(seen, room, bot.user_id)
            await send_text(alice, room, f"{bot.user_id}: hello")
        await settle(seen)
        assert [said(seen, room, bot.user_id) for room in rooms] == [[], []]
    finally:
        await alice.close()
        await stop_bot(bot)
