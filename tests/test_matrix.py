"""The Matrix adapter against a real Synapse on 127.0.0.1, with the real nio clients on both sides."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from nio import AsyncClient, AsyncClientConfig, RoomCreateResponse, SyncResponse

from adapters.matrix import MatrixAdapter, without_reply_fallback
from bot.app import App
from bot.config import parse_config
from tests.fakes.provider import ScriptedProvider
from tests.synapse import SynapseServer

pytestmark = pytest.mark.slow
PASSWORD = "correct horse battery staple"
DEADLINE = 25.0


def _unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@dataclass
class Bot:
    app: App
    adapter: MatrixAdapter
    task: asyncio.Task[None]
    user_id: str


async def start_bot(synapse: SynapseServer, store: Path, user_id: str | None = None,
                    sections: dict[str, dict[str, Any]] | None = None, **matrix: Any) -> Bot:
    """A bot on its own account; ``sections`` adds to the config's sections (``{"access": {...}}``)."""
    user_id = user_id or synapse.register(_unique("cortex"), PASSWORD)
    raw: dict[str, dict[str, Any]] = {
        "storage": {"url": f"sqlite:///{store / 'bot.db'}"},
        "matrix": {"enabled": True, "homeserver": synapse.url, "user_id": user_id, "password_env": "MX_PW",
                   "store_path": str(store / "matrix"), **matrix},
        "chat": {"edit_interval_seconds": 0.2, "typing_indicator": True},
        "cortex": {"context_limit": 1000},
    }
    for name, values in (sections or {}).items():
        raw[name] = raw.get(name, {}) | values
    config = parse_config(raw)
    app = App(config, llm=ScriptedProvider())
    await app.start()
    adapter = MatrixAdapter(app, config.matrix, env={"MX_PW": PASSWORD})
    task = asyncio.create_task(adapter.run())
    waiter = asyncio.create_task(adapter.ready.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=DEADLINE, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # raises the adapter's start-up error
    assert waiter in done, "the bot did not get ready"
    return Bot(app, adapter, task, user_id)


async def stop_bot(bot: Bot) -> None:
    await bot.adapter.close()
    bot.task.cancel()
    await asyncio.gather(bot.task, return_exceptions=True)
    await bot.app.stop()


async def user(synapse: SynapseServer, name: str, store: Path | None = None) -> AsyncClient:
    user_id = synapse.register(_unique(name), PASSWORD)
    config = AsyncClientConfig(encryption_enabled=store is not None, store_sync_tokens=True)
    client = AsyncClient(synapse.url, user_id, store_path=str(store) if store else "", config=config)
    await client.login(PASSWORD)
    if store is not None:
        await client.keys_upload()
    return client


class Timeline:
    """What one client has seen, room by room, as raw event dicts (decrypted where it could)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.events: dict[str, list[dict[str, Any]]] = {}

    async def sync_until(self, done: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        while loop.time() < end:
            response = await self.client.sync(timeout=500)
            assert isinstance(response, SyncResponse), response
            for room_id, room in response.rooms.join.items():
                for event in room.timeline.events:
                    source = dict(event.source)
                    if getattr(event, "decrypted", False):
                        source["encrypted"] = True  # it came as m.room.encrypted and was decrypted here
                    body = getattr(event, "body", None)
                    if body is not None and source.get("type") == "m.room.encrypted":
                        source = {"type": "m.room.message", "sender": event.sender, "event_id": event.event_id,
                                  "content": {"body": body, "msgtype": "m.text"}, "encrypted": True}
                    self.events.setdefault(room_id, []).append(source)
            if done():
                return
        seen = {room: [e["content"].get("body", "")[:80] for e in events if e.get("type") == "m.room.message"]
                for room, events in self.events.items()}
        raise AssertionError(f"timed out waiting for {what}; messages seen: {seen}")

    def from_(self, room_id: str, sender: str) -> list[dict[str, Any]]:
        return [e for e in self.events.get(room_id, []) if e.get("sender") == sender
                and e.get("type") == "m.room.message"]

    def bodies(self, room_id: str, sender: str) -> list[str]:
        return [e["content"].get("body", "") for e in self.from_(room_id, sender)]


async def send_text(client: AsyncClient, room_id: str, text: str, **extra: Any) -> None:
    await client.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": text, **extra},
                           ignore_unverified_devices=True)


async def open_room(client: AsyncClient, invite: list[str], *, direct: bool, encrypted: bool = False) -> str:
    state = [{"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}]
    response = await client.room_create(is_direct=direct, invite=invite, initial_state=state if encrypted else [])
    assert isinstance(response, RoomCreateResponse), response
    return str(response.room_id)


async def group_with(timeline: Timeline, bot_id: str, member: AsyncClient) -> str:
    """A group room of the timeline's user with the bot and ``member``, once both have joined it."""
    room = await open_room(timeline.client, [bot_id, member.user_id], direct=False)
    await member.join(room)
    await joined(timeline, room, bot_id)
    return room


async def dm_with(timeline: Timeline, bot_id: str) -> str:
    """A direct room of the timeline's user with the bot, once the bot has joined it."""
    room = await open_room(timeline.client, [bot_id], direct=True)
    await joined(timeline, room, bot_id)
    return room


async def joined(timeline: Timeline, room_id: str, user_id: str) -> None:
    def has_joined() -> bool:
        room = timeline.client.rooms.get(room_id)
        return room is not None and user_id in room.users and user_id not in room.invited_users
    await timeline.sync_until(has_joined, f"{user_id} to join {room_id}")


@pytest.fixture
async def bot(synapse: SynapseServer, tmp_path: Path) -> AsyncIterator[Bot]:
    running = await start_bot(synapse, tmp_path)
    yield running
    await stop_bot(running)


async def test_dm_conversation_streamed_edit_and_commands(synapse: SynapseServer, bot: Bot) -> None:
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        await send_text(alice, room, "hello bot, how are you?")
        await seen.sync_until(lambda: any(
            e["content"].get("m.new_content", {}).get("body") == "echo: hello bot, how are you?"
            for e in seen.from_(room, bot.user_id)), "the streamed reply's final edit")
        first = seen.from_(room, bot.user_id)[0]["content"]
        assert first["msgtype"] == "m.notice" and first["format"] == "org.matrix.custom.html"
        assert first["m.mentions"] == {} and "m.in_reply_to" in first["m.relates_to"]
        edit = next(e for e in seen.from_(room, bot.user_id) if "m.new_content" in e["content"])
        assert edit["content"]["m.relates_to"]["rel_type"] == "m.replace"
        await send_text(alice, room, "!memory show memory.md")
        await seen.sync_until(lambda: any("memory.md (version 1" in b for b in seen.bodies(room, bot.user_id)),
                              "the memory command's answer")
        # "/me waves": an emote is answered as the action it is (and "/me !memory …" is no command)
        await send_text(alice, room, "!memory pause", msgtype="m.emote")
        await send_text(alice, room, "waves hello", msgtype="m.emote")
        await seen.sync_until(lambda: any(
            e["content"].get("m.new_content", {}).get("body") == "echo: *waves hello*"
            for e in seen.from_(room, bot.user_id)), "the answer to an emote")
        assert not any("Incognito" in b for b in seen.bodies(room, bot.user_id))
    finally:
        await alice.close()


async def test_room_mentions_privacy_and_admin_checks(synapse: SynapseServer, bot: Bot) -> None:
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen, bob_seen = Timeline(alice), Timeline(bob)
    try:
        room = await group_with(seen, bot.user_id, bob)
        await joined(seen, room, bob.user_id)
        await send_text(alice, room, "just talking to bob here")
        await send_text(alice, room, f"{bot.user_id}: what is the weather?")
        await seen.sync_until(lambda: any("what is the weather?" in b for b in seen.bodies(room, bot.user_id)),
                              "an answer to the mention")
        assert not any("just talking" in b for b in seen.bodies(room, bot.user_id))
        await send_text(bob, room, "!cortex settings")
        await seen.sync_until(lambda: any("for admins only" in b for b in seen.bodies(room, bot.user_id)),
                              "the admin refusal for bob")
        await send_text(alice, room, "!cortex settings")  # alice created the room: power level 100
        await seen.sync_until(lambda: any("Cortex settings for persona" in b for b in seen.bodies(room, bot.user_id)),
                              "the admin answer for alice")
        await send_text(bob, room, "!memory show")
        await seen.sync_until(lambda: any("answered you in a direct message" in b
                                          for b in seen.bodies(room, bot.user_id)), "the privacy notice")
        assert not any("memory.md (version" in b for b in seen.bodies(room, bot.user_id))
        await bob_seen.sync_until(lambda: bool(bob.invited_rooms), "bob's DM invite")
        dm = next(iter(bob.invited_rooms))
        await bob.join(dm)
        await bob_seen.sync_until(lambda: any("memory.md (version" in b for b in bob_seen.bodies(dm, bot.user_id)),
                                  "bob's private answer")
    finally:
        await alice.close()
        await bob.close()


async def test_restart_does_not_replay_old_messages(synapse: SynapseServer, tmp_path: Path) -> None:
    first = await start_bot(synapse, tmp_path)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, first.user_id)
        await send_text(alice, room, "before the restart")
        await seen.sync_until(lambda: any("before the restart" in b for b in seen.bodies(room, first.user_id)),
                              "the first answer")
        def answers() -> int:  # new bot messages (not edits)
            return sum("m.new_content" not in e["content"] for e in seen.from_(room, first.user_id))

        before = answers()
        await stop_bot(first)
        second = await start_bot(synapse, tmp_path, user_id=first.user_id)
        try:
            await send_text(alice, room, "after the restart")
            await seen.sync_until(lambda: any("after the restart" in b for b in seen.bodies(room, first.user_id)),
                                  "the answer after the restart")
            await asyncio.sleep(1.0)
            await seen.sync_until(lambda: True, "a last sync")
            assert answers() == before + 1  # only the new message was answered
            channel = await second.app.storage.get_channel(f"matrix:{room}")
            assert channel is not None
            users = [m.text for m in await second.app.storage.recent_messages(channel.id, 20) if m.role == "user"]
            assert users == ["after the restart", "before the restart"]
        finally:
            await stop_bot(second)
    finally:
        await alice.close()


async def test_a_quiet_restart_keeps_the_rooms_state(synapse: SynapseServer, tmp_path: Path) -> None:
    """A new user's finding: after a restart with nothing new on the homeserver, nio dropped the first (full state)
    sync, as its token was the one the bot had set itself: the bot knew no room, so a mention by display name
    went unanswered, people were named by their ids and private answers opened a new room each time."""
    bot_id = synapse.register(f"cortex-{uuid.uuid4().hex[:8]}", PASSWORD)  # (display name: its localpart)
    name = bot_id[1:].split(":")[0]
    first = await start_bot(synapse, tmp_path, user_id=bot_id)
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        room = await group_with(seen, bot_id, bob)
        await send_text(alice, room, f"{name}: before the restart")
        await seen.sync_until(lambda: any("before the restart" in b for b in seen.bodies(room, bot_id)), "an answer")
        await stop_bot(first)
        second = await start_bot(synapse, tmp_path, user_id=bot_id)  # (nothing happened meanwhile)
        try:
            for _ in range(100):
                if room in second.adapter.client.rooms:
                    break
                await asyncio.sleep(0.1)
            assert room in second.adapter.client.rooms, "the bot knows no room after the restart"
            await send_text(alice, room, f"{name}: after the restart")
            await seen.sync_until(lambda: any("after the restart" in b for b in seen.bodies(room, bot_id)),
                                  "the answer to a mention by display name")
        finally:
            await stop_bot(second)
    finally:
        await alice.close()
        await bob.close()


async def test_a_room_prefix_of_its_own_is_the_only_one_and_the_answers_use_it(synapse: SynapseServer,
                                                                                tmp_path: Path) -> None:
    """A new user's finding: with `command_prefix = "?"` (to share rooms with a bot that uses "!"), "!help" still
    ran this bot's commands (both bots answered) and every answer told people to type "!memory …"."""
    bot = await start_bot(synapse, tmp_path, command_prefix="!!")  # (one that starts as the other bot's does)
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        room = await group_with(seen, bot.user_id, bob)
        await send_text(alice, room, "!help")  # (the other bot's)
        await send_text(alice, room, "!!help memory forget")
        await seen.sync_until(lambda: bool(seen.bodies(room, bot.user_id)), "the answer to !!help")
        await asyncio.sleep(1.0)
        await seen.sync_until(lambda: True, "a last sync")
        [answer] = seen.bodies(room, bot.user_id)
        assert "!!memory forget" in answer and " !memory" not in answer, answer
        await send_text(alice, room, "!!help")  # lists the adapter's own !!leave, with the room's prefix too
        await seen.sync_until(lambda: len(seen.bodies(room, bot.user_id)) == 2, "the answer to !!help")
        listing = seen.bodies(room, bot.user_id)[1]
        assert "!!leave" in listing and "!!memory" in listing and " !leave" not in listing, listing
    finally:
        await alice.close()
        await bob.close()
        await stop_bot(bot)


async def test_a_message_taken_back_while_the_bot_was_away_goes_after_a_limited_sync(
        synapse: SynapseServer, tmp_path: Path) -> None:
    """More events than a sync returns happened while the bot was stopped: the redaction of a message it
    stored was among those the sync skipped, and the stored message stayed. It is read back now."""
    first = await start_bot(synapse, tmp_path)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, first.user_id)
        sent = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "my PIN is 4821"})
        await send_text(alice, room, "and I like tea")
        await seen.sync_until(lambda: any("I like tea" in b for b in seen.bodies(room, first.user_id)), "the answers")
        await stop_bot(first)
        await alice.room_redact(room, sent.event_id)
        for n in range(15):  # more than a sync's timeline holds (10): the bot's next sync is limited
            await alice.room_put_state(room, "m.room.topic", {"topic": f"topic {n}"})
        second = await start_bot(synapse, tmp_path, user_id=first.user_id)
        try:
            channel = await second.app.storage.get_channel(f"matrix:{room}")
            assert channel is not None
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                said = [m.text for m in await second.app.storage.recent_messages(channel.id, 20) if m.role == "user"]
                if said == ["and I like tea"]:
                    break
                assert loop.time() < deadline, f"the taken-back message is still stored: {said}"
                await asyncio.sleep(0.2)
        finally:
            await stop_bot(second)
    finally:
        await alice.close()


async def test_a_reply_to_the_bots_message_from_before_a_restart_is_answered(
        synapse: SynapseServer, tmp_path: Path) -> None:
    """In a room, a reply to the bot addresses it; which events were the bot's was known only for what this
    process sent, so after a restart a reply to an earlier answer went unanswered."""
    first = await start_bot(synapse, tmp_path)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [first.user_id], direct=False)
        await joined(seen, room, first.user_id)
        await send_text(alice, room, f"{first.user_id} hello there")
        await seen.sync_until(lambda: any("hello there" in b for b in seen.bodies(room, first.user_id)), "the answer")
        answer = next(e for e in seen.from_(room, first.user_id) if "m.new_content" not in e["content"])
        await stop_bot(first)
        second = await start_bot(synapse, tmp_path, user_id=first.user_id)
        try:
            await send_text(alice, room, "no mention, only a reply", **{
                "m.relates_to": {"m.in_reply_to": {"event_id": answer["event_id"]}}})
            await seen.sync_until(lambda: any("only a reply" in b for b in seen.bodies(room, first.user_id)),
                                  "the answer to a reply")
        finally:
            await stop_bot(second)
    finally:
        await alice.close()


async def test_encrypted_dm(synapse: SynapseServer, tmp_path: Path) -> None:
    bot = await start_bot(synapse, tmp_path, e2ee=True)
    (tmp_path / "alice").mkdir()
    alice = await user(synapse, "alice", store=tmp_path / "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id], direct=True, encrypted=True)
        await joined(seen, room, bot.user_id)
        await seen.sync_until(lambda: True, "keys")
        await send_text(alice, room, "a secret hello")
        await seen.sync_until(lambda: any("a secret hello" in b for b in seen.bodies(room, bot.user_id)),
                              "the decrypted, encrypted answer")
        answer = next(e for e in seen.from_(room, bot.user_id) if "a secret hello" in e["content"]["body"])
        assert answer.get("encrypted") is True  # it came as m.room.encrypted and alice decrypted it
        channel = await bot.app.storage.get_channel(f"matrix:{room}")
        assert channel is not None
        assert [m.text for m in await bot.app.storage.recent_messages(channel.id, 5) if m.role == "user"] == [
            "a secret hello"]
    finally:
        await alice.close()
        await stop_bot(bot)


async def test_cortexbot_run_serves_matrix_and_stops_on_sigterm(
    synapse: SynapseServer, tmp_path: Path, fake_llm: Any
) -> None:
    import os
    import signal
    import subprocess
    import sys

    bot_id = synapse.register(_unique("cortex"), PASSWORD)
    config = tmp_path / "config.toml"
    config.write_text(
        f'[storage]\nurl = "sqlite:///{tmp_path / "bot.db"}"\n'
        f'[llm]\nbase_url = "{fake_llm.anthropic_url}"\napi_key_env = "CB_TEST_API_KEY"\nmax_retries = 0\n'
        f'[matrix]\nenabled = true\nhomeserver = "{synapse.url}"\nuser_id = "{bot_id}"\n'
        f'password_env = "MX_PW"\nstore_path = "{tmp_path / "mx"}"\n'
        '[terminal]\nenabled = false\n'
    )
    env = {**os.environ, "CB_TEST_API_KEY": "test-key", "MX_PW": PASSWORD}
    proc = subprocess.Popen(  # noqa: ASYNC220 - Popen only starts it; the waiting happens in a thread
        [str(Path(sys.executable).parent / "cortexbot"), "--config", str(config), "run"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    failure: AssertionError | None = None
    try:
        room = await dm_with(seen, bot_id)
        await send_text(alice, room, "hello through cortexbot run")
        await seen.sync_until(lambda: any("echo: hello through cortexbot run" in b
                                          for b in seen.bodies(room, bot_id)), "the answer from `cortexbot run`")
    except AssertionError as exc:
        failure = exc
    finally:
        await alice.close()
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.to_thread(proc.communicate, timeout=30)
    assert failure is None, f"{failure}\nstderr of cortexbot run:\n{err[-3000:]}"
    assert proc.returncode == 0, err[-3000:]  # (told to stop by SIGTERM, it did: a service manager sees no failure)
    assert "Traceback" not in err and "test-key" not in err + out and PASSWORD not in err + out


async def test_a_commands_file_asked_for_in_a_thread_stays_in_it(synapse: SynapseServer, bot: Bot) -> None:
    """`!memory export` in a thread: its text answered in the thread, its file landed outside it."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id], direct=True)
        await joined(seen, room, bot.user_id)
        root = (await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "a thread"})).event_id
        await seen.sync_until(lambda: bool(seen.from_(room, bot.user_id)), "the answer to the root")
        await send_text(alice, room, "!memory export", **{"m.relates_to": {"rel_type": "m.thread", "event_id": root}})
        await seen.sync_until(lambda: any(e["content"].get("msgtype") == "m.file"
                                          for e in seen.from_(room, bot.user_id)), "the export")
        file = next(e for e in seen.from_(room, bot.user_id) if e["content"].get("msgtype") == "m.file")
        assert file["content"].get("m.relates_to", {}).get("rel_type") == "m.thread"
        assert file["content"]["m.relates_to"]["event_id"] == root
    finally:
        await alice.close()


async def test_threads_are_kept_and_admins_can_make_the_bot_leave(synapse: SynapseServer, bot: Bot) -> None:
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        room = await group_with(seen, bot.user_id, bob)
        root = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "a thread starts"})
        await send_text(alice, room, f"{bot.user_id}: inside the thread", **{
            "m.relates_to": {"rel_type": "m.thread", "event_id": root.event_id}})
        await seen.sync_until(lambda: any(e["content"].get("m.relates_to", {}).get("rel_type") == "m.thread"
                                          for e in seen.from_(room, bot.user_id)), "a reply inside the thread")
        reply = next(e for e in seen.from_(room, bot.user_id)
                     if e["content"].get("m.relates_to", {}).get("rel_type") == "m.thread")
        assert reply["content"]["m.relates_to"]["event_id"] == root.event_id
        await send_text(bob, room, "!leave")  # bob is no admin: the bot stays, and says who may
        await seen.sync_until(lambda: any("!leave is for this room's admins" in b
                                          for b in seen.bodies(room, bot.user_id)), "the answer to bob's !leave")
        assert bot.user_id in alice.rooms[room].users
        await send_text(alice, room, "!leave")

        def bot_left() -> bool:
            return bot.user_id not in alice.rooms[room].users
        await seen.sync_until(bot_left, "the bot to leave")
    finally:
        await alice.close()
        await bob.close()


async def test_login_with_an_access_token(synapse: SynapseServer, tmp_path: Path) -> None:
    bot_id = synapse.register(_unique("cortex"), PASSWORD)
    token, _device = synapse.login_token(bot_id.split(":")[0][1:], PASSWORD)
    config = parse_config({
        "storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
        "matrix": {"enabled": True, "homeserver": synapse.url, "user_id": bot_id,
                   "access_token_env": "MX_TOKEN", "store_path": str(tmp_path / "mx")},
    })
    app = App(config, llm=ScriptedProvider())
    await app.start()
    adapter = MatrixAdapter(app, config.matrix, env={"MX_TOKEN": token})
    task = asyncio.create_task(adapter.run())
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        waiter = asyncio.create_task(adapter.ready.wait())
        done, _ = await asyncio.wait({task, waiter}, timeout=DEADLINE, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        room = await dm_with(seen, bot_id)
        await send_text(alice, room, "token login works?")
        await seen.sync_until(lambda: any("token login works?" in b for b in seen.bodies(room, bot_id)),
                              "an answer from the token-logged-in bot")
        assert not (tmp_path / "mx" / "session.json").exists() or "access_token" not in (
            tmp_path / "mx" / "session.json").read_text()
    finally:
        await alice.close()
        await adapter.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await app.stop()


@pytest.mark.parametrize("msgtype", ["m.file", "m.image"])
async def test_a_card_sent_with_a_command_caption_is_imported(synapse: SynapseServer, tmp_path: Path,
                                                              msgtype: str) -> None:
    """A file whose caption is a command (MSC2530) reaches the command as its attachment; plain files are
    not read, and only the bot's admins may import. Element sends a PNG as an image."""
    import io

    from nio import UploadResponse

    from tests.test_cards import png, text_chunk, v2_card

    alice, eve = await user(synapse, "alice"), await user(synapse, "eve")
    running = await start_bot(synapse, tmp_path, admin_ids=[alice.user_id])
    seen, eves = Timeline(alice), Timeline(eve)
    try:
        card = png(text_chunk("chara", v2_card(name="Rosa")))

        async def send_card(client: AsyncClient, room: str, caption: str) -> None:
            upload, _ = await client.upload(lambda *_: io.BytesIO(card), content_type="image/png",
                                            filename="rosa.png", filesize=len(card))
            assert isinstance(upload, UploadResponse), upload
            await client.room_send(room, "m.room.message", {
                "msgtype": msgtype, "body": caption, "filename": "rosa.png", "url": upload.content_uri,
                "info": {"size": len(card), "mimetype": "image/png"}}, ignore_unverified_devices=True)

        room = await dm_with(seen, running.user_id)
        await send_card(alice, room, "rosa.png")  # no caption: not a command, nothing read
        await send_card(alice, room, "!persona import")
        await seen.sync_until(lambda: any("Imported Rosa from rosa.png" in b
                                          for b in seen.bodies(room, running.user_id)), "the import's answer")
        assert len([b for b in seen.bodies(room, running.user_id) if "Imported" in b]) == 1
        assert "Rosa" in running.app.personas.names()
        eve_room = await open_room(eve, [running.user_id], direct=True)
        await joined(eves, eve_room, running.user_id)
        await send_card(eve, eve_room, "!persona import")  # power 100 in her own DM is not a bot admin
        await eves.sync_until(lambda: any("for the bot's admins only" in b
                                          for b in eves.bodies(eve_room, running.user_id)), "the refusal")
    finally:
        await alice.close()
        await eve.close()
        await stop_bot(running)


async def react(client: AsyncClient, room: str, event_id: str, key: str) -> None:
    """``client``'s reaction ``key`` to ``event_id``."""
    await client.room_send(room, "m.reaction", {"m.relates_to": {
        "rel_type": "m.annotation", "event_id": event_id, "key": key}}, ignore_unverified_devices=True)


def said_by(seen: Timeline, room: str, sender: str, text: str) -> list[dict[str, Any]]:
    """The messages of ``sender`` in ``room`` holding ``text``."""
    return [e for e in seen.from_(room, sender) if text in e["content"].get("body", "")]


async def remember_by_reaction(client: AsyncClient, seen: Timeline, room: str, bot_id: str, text: str) -> str:
    """``client`` says ``text`` in its DM ``room`` with the bot, and once answered, reacts 🧠 to it: returns the
    message's event id once the bot confirmed it remembered (its first confirmation there)."""
    sent = await client.room_send(room, "m.room.message", {"msgtype": "m.text", "body": text},
                                  ignore_unverified_devices=True)
    await seen.sync_until(lambda: bool(seen.from_(room, bot_id)), "the bot's reply")
    await react(client, room, sent.event_id, "🧠")
    await seen.sync_until(lambda: bool(said_by(seen, room, bot_id, "Remembered as #")), "the confirmation")
    return str(sent.event_id)


async def test_brain_reaction_remembers_and_cross_undoes(synapse: SynapseServer, bot: Bot) -> None:
    """🧠 on one's own message stores it as a memory item (answered in the DM); ❌ on that confirmation
    archives it again; 🧠 on someone else's message is refused."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)

    def answers(room: str, text: str) -> list[dict[str, Any]]:
        return said_by(seen, room, bot.user_id, text)

    try:
        room = await dm_with(seen, bot.user_id)
        sent = await remember_by_reaction(alice, seen, room, bot.user_id, "my cat is called Pixel")
        items, _ = await bot.app.cortex.memory.list_items(1)
        assert [i.content for i in items] == ["my cat is called Pixel"]
        assert items[0].source_ref == f"matrix-message:{sent}"
        confirmation = answers(room, "Remembered as #")[0]["event_id"]
        await react(alice, room, confirmation, "❌")
        await seen.sync_until(lambda: bool(answers(room, "Forgotten: #")), "the undo")
        assert (await bot.app.cortex.memory.list_items(1))[0] == []
        await react(alice, room, confirmation, "🧠")  # a confirmation is not remembered
        mine = seen.from_(room, bot.user_id)[0]["event_id"]
        await react(alice, room, mine, "🧠")  # the bot's reply in our DM: allowed
        await seen.sync_until(lambda: len(answers(room, "Remembered as #")) >= 2, "a second confirmation")
        items, _ = await bot.app.cortex.memory.list_items(1)
        assert [i.content for i in items] == ["echo: my cat is called Pixel"]
        # Incognito: refused, and no "React ❌ to undo" under a refusal (there is nothing to undo)
        await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "!memory pause"},
                              ignore_unverified_devices=True)
        await seen.sync_until(lambda: bool(answers(room, "Incognito with Cora since")), "the pause")
        said = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "my dog is Rex"},
                                     ignore_unverified_devices=True)
        await react(alice, room, said.event_id, "🧠")
        await seen.sync_until(lambda: bool(answers(room, "You are incognito with Cora")), "the refusal")
        [refusal] = answers(room, "You are incognito with Cora")
        assert refusal["content"]["body"] == "You are incognito with Cora: nothing new is remembered until " \
                                             "!memory resume."
        assert [i.content for i in (await bot.app.cortex.memory.list_items(1))[0]] == ["echo: my cat is called Pixel"]
    finally:
        await alice.close()


async def test_an_undo_offered_before_a_restart_still_undoes(synapse: SynapseServer, tmp_path: Path) -> None:
    """❌ on a confirmation sent before a restart did nothing, silently: which confirmation undid what was kept in
    the memory of the process that sent it. A forget-me leaves no offer behind."""
    first = await start_bot(synapse, tmp_path)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)

    def answers(room: str, text: str) -> list[dict[str, Any]]:
        return said_by(seen, room, first.user_id, text)

    try:
        room = await dm_with(seen, first.user_id)
        await remember_by_reaction(alice, seen, room, first.user_id, "my cat is called Pixel")
        confirmation = answers(room, "Remembered as #")[0]["event_id"]
        await stop_bot(first)
        second = await start_bot(synapse, tmp_path, user_id=first.user_id)
        try:
            await react(alice, room, confirmation, "❌")
            await seen.sync_until(lambda: bool(answers(room, "Forgotten: #")), "the undo after the restart")
            items, _ = await second.app.cortex.memory.list_items(1)
            assert items == []  # archived
            assert len(answers(room, "Forgotten: #")) == 1
            # An offer pruned since (older than its days) is told so, once, and undoes nothing.
            second_sent = await alice.room_send(room, "m.room.message", {"msgtype": "m.text", "body": "I love tea"},
                                                ignore_unverified_devices=True)
            await react(alice, room, second_sent.event_id, "🧠")
            await seen.sync_until(lambda: len(answers(room, "Remembered as #")) == 2, "the second confirmation")
            assert await second.app.storage.undo_offers.prune(kept_days=0) == 2  # (the one used above too)
            await react(alice, room, answers(room, "Remembered as #")[1]["event_id"], "❌")
            await seen.sync_until(lambda: bool(answers(room, "That undo has expired")), "the expired undo")
            items, _ = await second.app.cortex.memory.list_items(1)
            assert [i.content for i in items] == ["I love tea"]  # not archived
            await send_text(alice, room, "!memory forget-me confirm")
            await seen.sync_until(lambda: bool(answers(room, "Done. Deleted")), "the forget-me")
            assert await second.app.storage.db.fetch_all("SELECT * FROM undo_offers") == []
        finally:
            await stop_bot(second)
    finally:
        await alice.close()


async def test_memory_why_sent_as_a_reply_explains_that_reply(synapse: SynapseServer, bot: Bot) -> None:
    """`!memory why` sent as a reply to one of the bot's messages explains that one (not the last), also
    from a client that starts a reply's body with the quoted message."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        await send_text(alice, room, "first question")
        await seen.sync_until(lambda: len(seen.from_(room, bot.user_id)) >= 1, "the first reply")
        first = seen.from_(room, bot.user_id)[0]["event_id"]
        await send_text(alice, room, "second question")
        await seen.sync_until(lambda: any("echo: second question" in b for b in seen.bodies(room, bot.user_id)),
                              "the second reply")
        await send_text(alice, room, f"> <{bot.user_id}> echo: first question\n\n!memory why",
                        **{"m.relates_to": {"m.in_reply_to": {"event_id": first}}})
        await seen.sync_until(lambda: any("That reply of mine" in b for b in seen.bodies(room, bot.user_id)),
                              "why, for the first reply")
        await send_text(alice, room, "!memory why")
        await seen.sync_until(lambda: any("My last reply to you here" in b for b in seen.bodies(room, bot.user_id)),
                              "why, for the last reply")
    finally:
        await alice.close()


def test_only_a_real_reply_fallback_is_dropped() -> None:
    assert without_reply_fallback("> <@bot:x.org> echo: hi\n> more\n\n!memory why") == "!memory why"
    assert without_reply_fallback("> * <@ann:x.org> waves\n\n!help") == "!help"
    assert without_reply_fallback("> my own quote\n\nI disagree") == "> my own quote\n\nI disagree"
    assert without_reply_fallback("> <@bot:x.org> only a quote") == "> <@bot:x.org> only a quote"


async def test_a_group_room_down_to_two_members_stays_a_group_room(synapse: SynapseServer, bot: Bot) -> None:
    """A room the bot joined as a group (the invite was not direct) keeps group rules with only one user
    left in it: private answers go to a real DM, its creator stays its admin, the bot answers only when
    named as a word ("Coral reefs" does not call a bot shown as "Cora"); a reply to someone else's
    message with `!memory why` says that it is not one of the bot's replies."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    await bot.adapter.client.set_displayname("Cora")
    try:
        room = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, room, bot.user_id)
        await send_text(alice, room, "Coral reefs are dying")
        await send_text(alice, room, "!memory show")
        await seen.sync_until(lambda: any("answered you in a direct message" in b
                                          for b in seen.bodies(room, bot.user_id)), "the privacy notice")
        assert not any("memory.md (version" in b for b in seen.bodies(room, bot.user_id))
        await send_text(alice, room, "!cortex settings")  # she made the room: its admin
        await seen.sync_until(lambda: any("Cortex settings for persona" in b for b in seen.bodies(room, bot.user_id)),
                              "the admin answer")
        await send_text(alice, room, "Cora, what is the weather?")
        await seen.sync_until(lambda: any("what is the weather?" in b for b in seen.bodies(room, bot.user_id)),
                              "an answer to the name")
        assert not any("reefs" in b for b in seen.bodies(room, bot.user_id))
        own = next(e["event_id"] for e in seen.events[room] if e.get("sender") == alice.user_id
                   and e.get("content", {}).get("body") == "Coral reefs are dying")
        await send_text(alice, room, "!memory why", **{"m.relates_to": {"m.in_reply_to": {"event_id": own}}})
        await seen.sync_until(lambda: bool(alice.invited_rooms), "the invite to a real DM")
        dm = next(iter(alice.invited_rooms))
        assert dm != room
        await alice.join(dm)
        await seen.sync_until(lambda: any("not one of my replies to you" in b for b in seen.bodies(dm, bot.user_id)),
                              "why, for a message that is not a reply of the bot, in the DM")
    finally:
        await alice.close()


async def test_a_room_that_hides_its_history_from_newcomers_gets_no_summary_of_it(synapse: SynapseServer,
                                                                                   bot: Bot) -> None:
    """In a room whose history visibility is "joined", a member sees only what was said since they joined;
    `!summary` would post the bot's summary of everything before, for everyone in the room to read. What was
    said then stays hidden from newcomers after the room shares its history: so does the summary."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await open_room(alice, [bot.user_id], direct=False)
        await joined(seen, room, bot.user_id)
        await alice.room_put_state(room, "m.room.history_visibility", {"history_visibility": "joined"})
        await send_text(alice, room, "!summary")
        await seen.sync_until(lambda: any("only what was said since they joined" in b
                                          for b in seen.bodies(room, bot.user_id)), "the refusal")
        await alice.room_put_state(room, "m.room.history_visibility", {"history_visibility": "shared"})
        await send_text(alice, room, "!summary")
        await seen.sync_until(lambda: sum("only what was said since they joined" in b
                                          for b in seen.bodies(room, bot.user_id)) == 2, "the second refusal")
        shared = await open_room(alice, [bot.user_id], direct=False)  # (shared from its start: Synapse's default)
        await joined(seen, shared, bot.user_id)
        await send_text(alice, shared, "!summary")
        await seen.sync_until(lambda: any("no rolling summary yet" in b for b in seen.bodies(shared, bot.user_id)),
                              "the summary command's answer in a room that shares its history")
    finally:
        await alice.close()


async def test_doctor_asks_the_homeserver_whether_it_takes_the_bots_credentials(synapse: SynapseServer,
                                                                               tmp_path: Path) -> None:
    """doctor said "✓ Matrix: password read" and "All checks passed" for a homeserver nothing answers at, and for
    an access token the homeserver rejects."""
    import json

    from adapters.credentials import matrix_login
    from bot.config import MatrixConfig

    alice = await user(synapse, "alice")
    try:
        store = tmp_path / "store"
        config = MatrixConfig(enabled=True, homeserver=synapse.url, user_id=alice.user_id, access_token_env="MX_T",
                              password_env="MX_P", store_path=str(store))
        assert await matrix_login(config, {"MX_T": alice.access_token}) == (
            True, f"the access token in $MX_T signs in as {alice.user_id}")
        ok, said = await matrix_login(config, {"MX_T": "syt_not_a_token"})
        assert not ok and said == "the homeserver rejected the access token in $MX_T"
        someone_else = config.model_copy(update={"user_id": "@someone:localhost"})
        ok, said = await matrix_login(someone_else, {"MX_T": alice.access_token})
        assert not ok and said == f"the access token in $MX_T belongs to {alice.user_id}, not @someone:localhost"
        ok, said = await matrix_login(config, {"MX_P": "pw"})  # a password alone: no login (it makes a device)
        assert ok and said.endswith("(checked at the bot's first start: a login makes a device)")
        store.mkdir()
        (store / "session.json").write_text(json.dumps({"user_id": alice.user_id, "access_token": alice.access_token}))
        assert await matrix_login(config, {"MX_P": "pw"}) == (
            True, f"the access token in the saved session signs in as {alice.user_id}")
        (store / "session.json").write_text(json.dumps({"user_id": alice.user_id, "access_token": "syt_gone"}))
        assert await matrix_login(config, {"MX_P": "pw"}) == (
            True, "the saved session was signed out; the password logs in anew at start")
        # as the bot signs in: the saved session first while it holds, then the configured token
        assert await matrix_login(config, {"MX_T": alice.access_token}) == (
            True, f"the access token in $MX_T signs in as {alice.user_id}")  # (the saved one was signed out)
        (store / "session.json").write_text(json.dumps({"user_id": alice.user_id, "access_token": alice.access_token}))
        assert await matrix_login(config, {"MX_T": "syt_not_used_while_the_session_holds"}) == (
            True, f"the access token in the saved session signs in as {alice.user_id}")
        assert (await matrix_login(config, {}))[0] is False  # neither secret
        nowhere = config.model_copy(update={"homeserver": "http://127.0.0.1:9"})
        ok, said = await matrix_login(nowhere, {"MX_T": alice.access_token})
        assert not ok and said.startswith("cannot reach the homeserver at http://127.0.0.1:9 (")
    finally:
        await alice.close()


async def upgrade(client: AsyncClient, room_id: str) -> str:
    """Upgrade the room as a client's "Upgrade this room" does (the homeserver's upgrade endpoint): the id of
    the room that replaces it, made by ``client``, with a tombstone in the old one pointing at it."""
    response = await client.send(
        "POST", f"/_matrix/client/v3/rooms/{quote(room_id, safe='')}/upgrade", json.dumps({"new_version": "10"}),
        headers={"Authorization": f"Bearer {client.access_token}", "Content-Type": "application/json"})
    async with response:
        body = await response.json()
    assert response.status == 200, body
    return str(body["replacement_room"])


async def test_an_upgraded_dm_stays_its_users_dm(synapse: SynapseServer, bot: Bot) -> None:
    """A DM upgraded in a client (Element's "Upgrade this room"), the bot invited into the new room without
    is_direct, is still the user's DM: plain messages are answered with their private memory, and `!memory show`
    answers there. A room that only claims the DM as its predecessor (no tombstone points at it) is a group."""
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        await send_text(alice, room, "!memory remember I secretly love opera")
        await seen.sync_until(lambda: any("Remembered as" in b for b in seen.bodies(room, bot.user_id)), "remembered")
        claims = await alice.room_create(predecessor={"room_id": room, "event_id": "$x"}, invite=[bot.user_id])
        assert isinstance(claims, RoomCreateResponse), claims
        await joined(seen, claims.room_id, bot.user_id)
        new = await upgrade(alice, room)
        await alice.room_invite(new, bot.user_id)  # (not direct: a client's invite after an upgrade)
        await joined(seen, new, bot.user_id)
        llm = bot.app.llm
        assert isinstance(llm, ScriptedProvider)
        asked = len(llm.requests)
        await send_text(alice, new, "what do I love?")
        await seen.sync_until(lambda: len(llm.requests) > asked, "an answer to a plain message")
        assert "opera" in llm.requests[asked].system  # her private memory, as in her DM
        await send_text(alice, new, "!memory show")
        await seen.sync_until(lambda: any("memory.md (version" in b for b in seen.bodies(new, bot.user_id)),
                              "her memory, shown here")
        assert not any("direct message" in b for b in seen.bodies(new, bot.user_id))
        assert not alice.invited_rooms  # no room of a third kind opened for her
        assert bot.adapter._kinds[new] == "dm" and bot.adapter._kinds[claims.room_id] == "group"
    finally:
        await alice.close()


async def test_an_upgraded_room_keeps_its_guidelines(synapse: SynapseServer, bot: Bot) -> None:
    """A room's guidelines (as its cortex settings, persona and skill switches) are keyed by its id: the room that
    replaces it in an upgrade takes them over, and they are in force there."""
    alice, bob = await user(synapse, "alice"), await user(synapse, "bob")
    seen = Timeline(alice)
    try:
        room = await group_with(seen, bot.user_id, bob)
        await send_text(alice, room, "!guidelines set Always answer in haiku.")
        await seen.sync_until(lambda: len(seen.bodies(room, bot.user_id)) > 0, "the guidelines saved")
        new = await upgrade(alice, room)
        await alice.room_invite(new, bot.user_id)
        await joined(seen, new, bot.user_id)
        await send_text(alice, new, "!guidelines")
        await seen.sync_until(lambda: len(seen.bodies(new, bot.user_id)) > 0, "the guidelines shown")
        assert "Always answer in haiku." in seen.bodies(new, bot.user_id)[0]
        llm = bot.app.llm
        assert isinstance(llm, ScriptedProvider)
        asked = len(llm.requests)
        await send_text(alice, new, f"{bot.user_id}: how are you?")
        await seen.sync_until(lambda: len(llm.requests) > asked, "an answer to a mention")
        assert "Always answer in haiku." in llm.requests[asked].system
    finally:
        await alice.close()
        await bob.close()
