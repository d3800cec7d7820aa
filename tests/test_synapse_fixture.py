"""The ``synapse`` fixture against matrix-nio: a plain DM round trip and an end-to-end encrypted one.

Both talk to the real Synapse subprocess from ``tests/synapse.py``. Users get unique names because the
server is shared by the whole session. Every wait is a ``sync(timeout=...)`` loop with a deadline.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import nio
import pytest
from nio import AsyncClient, AsyncClientConfig, RoomMessageText, SyncResponse

from tests.synapse import SynapseServer

pytestmark = pytest.mark.slow

SYNC_DEADLINE_S = 20.0
PASSWORD = "correct horse battery staple"


def _unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def _sync_until(
    client: AsyncClient, done: Callable[[SyncResponse], bool], what: str, deadline_s: float = SYNC_DEADLINE_S
) -> SyncResponse:
    """Sync (long-polling at most 1 s per call) until ``done(response)`` holds; fail after *deadline_s*."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while (remaining := deadline - loop.time()) > 0:
        async with asyncio.timeout(remaining + 5.0):
            resp = await client.sync(timeout=1000)
        assert isinstance(resp, SyncResponse), f"sync failed for {client.user_id}: {resp}"
        if done(resp):
            return resp
    raise AssertionError(f"{client.user_id} did not see {what} within {deadline_s:.0f} s")


def _texts(resp: SyncResponse, room_id: str) -> list[RoomMessageText]:
    room = resp.rooms.join.get(room_id)
    if room is None:
        return []
    return [event for event in room.timeline.events if isinstance(event, RoomMessageText)]


async def _login(client: AsyncClient, password: str) -> None:
    resp = await client.login(password, device_name="cortexbot-test")
    assert isinstance(resp, nio.LoginResponse), resp


async def _dm_with_bob(alice: AsyncClient, bob: AsyncClient, **create_kwargs: object) -> str:
    """Alice opens a DM inviting Bob, Bob sees the invite and joins; returns the room id."""
    created = await alice.room_create(is_direct=True, invite=[bob.user_id], **create_kwargs)
    assert isinstance(created, nio.RoomCreateResponse), created
    room_id: str = created.room_id
    await _sync_until(bob, lambda r: room_id in r.rooms.invite, f"the invite to {room_id}")
    joined = await bob.join(room_id)
    assert isinstance(joined, nio.JoinResponse), joined
    return room_id


async def test_registration_and_login_helpers(synapse: SynapseServer) -> None:
    name = _unique("carol")
    assert synapse.register(name, PASSWORD) == f"@{name}:localhost"
    token, device_id = synapse.login_token(name, PASSWORD)
    assert token and device_id
    whoami = synapse.request("GET", "/_matrix/client/v3/account/whoami", token=token)
    assert whoami["user_id"] == synapse.user_id(name)
    assert synapse.url.startswith("http://127.0.0.1:") and synapse.server_name == "localhost"


async def test_dm_round_trip_with_nio(synapse: SynapseServer) -> None:
    alice_id = synapse.register(_unique("alice"), PASSWORD)
    bob_id = synapse.register(_unique("bob"), PASSWORD)
    alice = AsyncClient(synapse.url, alice_id)
    bob = AsyncClient(synapse.url, bob_id)
    try:
        await _login(alice, PASSWORD)
        await _login(bob, PASSWORD)
        await bob.sync(timeout=0)  # start bob's timeline before the room exists
        room_id = await _dm_with_bob(alice, bob)

        sent = await alice.room_send(room_id, "m.room.message", {"msgtype": "m.text", "body": "hello bob"})
        assert isinstance(sent, nio.RoomSendResponse), sent

        resp = await _sync_until(
            bob, lambda r: any(e.body == "hello bob" for e in _texts(r, room_id)), "alice's message"
        )
        [message] = [e for e in _texts(resp, room_id) if e.body == "hello bob"]
        assert message.sender == alice_id
        assert message.event_id == sent.event_id
    finally:
        await alice.close()
        await bob.close()


async def test_encrypted_dm_round_trip_with_nio(synapse: SynapseServer, tmp_path: Path) -> None:
    assert nio.crypto.ENCRYPTION_ENABLED, "matrix-nio[e2e] (vodozemac) is not installed"
    alice_id = synapse.register(_unique("alice"), PASSWORD)
    bob_id = synapse.register(_unique("bob"), PASSWORD)
    config = AsyncClientConfig(encryption_enabled=True, store_sync_tokens=True)
    clients: list[AsyncClient] = []
    for user_id, store in ((alice_id, "alice-store"), (bob_id, "bob-store")):
        (tmp_path / store).mkdir()
        clients.append(AsyncClient(synapse.url, user_id, store_path=str(tmp_path / store), config=config))
    alice, bob = clients
    try:
        for client in clients:
            await _login(client, PASSWORD)
            assert client.should_upload_keys
            uploaded = await client.keys_upload()
            assert isinstance(uploaded, nio.KeysUploadResponse), uploaded
        await bob.sync(timeout=0)

        encryption = {"type": "m.room.encryption", "state_key": "", "content": {"algorithm": "m.megolm.v1.aes-sha2"}}
        room_id = await _dm_with_bob(alice, bob, initial_state=[encryption])
        # alice must see bob's join so the megolm session is shared with his device
        await _sync_until(
            alice,
            lambda _: room_id in alice.rooms and bob_id in alice.rooms[room_id].users,
            "bob joining",
        )
        assert alice.rooms[room_id].encrypted

        sent = await alice.room_send(
            room_id,
            "m.room.message",
            {"msgtype": "m.text", "body": "secret hi"},
            ignore_unverified_devices=True,
        )
        assert isinstance(sent, nio.RoomSendResponse), sent

        resp = await _sync_until(
            bob, lambda r: any(e.body == "secret hi" for e in _texts(r, room_id)), "the decrypted message"
        )
        [message] = [e for e in _texts(resp, room_id) if e.body == "secret hi"]
        assert message.sender == alice_id
        assert message.decrypted, "bob's copy should have come through megolm"
        assert bob.rooms[room_id].encrypted
    finally:
        await alice.close()
        await bob.close()
