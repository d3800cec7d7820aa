"""The Discord adapter: real discord.py objects, dpytest for the gateway side (no Discord here),
the real command tree for slash commands with a recorded interaction response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import discord
import discord.ext.test as dpytest
import pytest
import pytest_asyncio

from adapters.discord import DiscordAdapter, _reply_payload
from bot.app import App
from bot.commands import Attachment, CommandReply
from bot.config import parse_config
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.provider import ScriptedProvider
from tests.test_router import Sink

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest_asyncio.fixture
async def adapter(tmp_path: Path) -> AsyncIterator[DiscordAdapter]:
    config = parse_config({
        "storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
        "chat": {"streaming": False},
        "cortex": {"context_limit": 1000},
    })
    app = App(config, llm=ScriptedProvider())
    await app.start()
    try:  # a failing setup must still stop the app (its database threads would keep pytest alive)
        intents = discord.Intents.default()
        intents.members = True
        intents.message_content = True
        adapter = DiscordAdapter(app, config.discord, intents=intents)
        await adapter.bot._async_setup_hook()
        dpytest.configure(adapter.bot)
        yield adapter
        await dpytest.empty_queue()
    finally:
        await app.stop()


@pytest.fixture
def sent_kwargs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every keyword set the bot passes to Messageable.send (to check that pings are off)."""
    calls: list[dict[str, Any]] = []
    original = discord.abc.Messageable.send

    async def spy(self: Any, content: Any = None, **kwargs: Any) -> Any:
        calls.append({"content": content, **kwargs})
        return await original(self, content, **kwargs)

    monkeypatch.setattr(discord.abc.Messageable, "send", spy)
    return calls


async def test_mention_in_a_channel_gets_a_reply_without_pings(adapter: DiscordAdapter, sent_kwargs) -> None:
    me = adapter.bot.user
    await dpytest.message(f"<@{me.id}> hello @everyone")
    reply = dpytest.get_message()
    assert reply.content.startswith("echo: ")
    assert "hello @everyone" in reply.content
    assert sent_kwargs and all(k["allowed_mentions"].to_dict() == {"parse": []} for k in sent_kwargs)
    # the stored user message has the bot mention stripped
    app = adapter.app
    channel = await app.storage.get_channel(f"discord:{reply.channel.id}")
    texts = [m.text for m in await app.storage.recent_messages(channel.id, 10)]
    assert "hello @everyone" in texts


async def test_unaddressed_channel_message_is_ignored(adapter: DiscordAdapter) -> None:
    await dpytest.message("just chatting among humans")
    assert dpytest.verify().message().nothing()


async def test_dm_is_answered_and_commands_run(adapter: DiscordAdapter) -> None:
    member = dpytest.get_config().members[0]
    dm = await member.create_dm()
    await dpytest.message("hi in private", channel=dm)
    assert dpytest.get_message().content == "echo: hi in private"
    await dpytest.message("!memory show memory.md", channel=dm)
    assert "memory.md (version 1" in dpytest.get_message().content


async def test_memory_command_in_a_channel_answers_by_dm(adapter: DiscordAdapter) -> None:
    await dpytest.message("!memory show")
    first, second = dpytest.get_message(), dpytest.get_message()
    private, notice = (first, second) if first.guild is None else (second, first)
    assert private.guild is None and "memory.md" in private.content
    assert notice.guild is not None and "direct message" in notice.content


def test_long_replies_become_attachments() -> None:
    text, files = _reply_payload(CommandReply("line\n" * 1000, attachments=(Attachment("a.zip", b"zip"),)))
    assert len(text) <= 2000 and "attached as reply.md" in text
    assert [f.filename for f in files] == ["a.zip", "reply.md"]


async def test_slash_commands_are_built_offline(adapter: DiscordAdapter) -> None:
    tree = adapter.tree
    payloads = {c.name: c.to_dict(tree) for c in tree.get_commands()}
    assert {"memory", "cortex", "cortex-admin", "help", "summary", "persona"} <= set(payloads)
    memory_subs = {o["name"]: o for o in payloads["memory"]["options"]}
    assert set(memory_subs) == {"show", "history", "diff", "revert", "reset", "edit", "export", "forget-me",
                                "remember", "forget", "pin", "unpin", "list", "search", "archived", "restore",
                                "scope", "import", "why", "pause", "resume"}
    assert [o["name"] for o in memory_subs["forget"]["options"]] == ["item", "source"]
    admin_subs = {o["name"] for o in payloads["cortex-admin"]["options"]}
    assert admin_subs == {"settings", "stats", "prune", "weights", "budgets", "embedder"}
    file_option = memory_subs["history"]["options"][0]
    assert file_option["required"] and [c["value"] for c in file_option["choices"]] == [
        "memory.md", "soul.md", "relationship.md"]
    admin = payloads["cortex-admin"]
    assert int(admin["default_member_permissions"]) == discord.Permissions(manage_guild=True).value
    assert payloads["memory"].get("default_member_permissions") is None


async def _interact(adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch, name: str,
                    options: list[dict[str, Any]], *, permissions: int = 0, kind: int = 2,
                    resolved: dict[str, Any] | None = None, command_type: int = 1,
                    target_id: str | None = None, channel_data: dict[str, Any] | None = None,
                    dm_channel: str | None = None, guild_id: int | None = None,
                    roles: tuple[int, ...] = ()) -> dict[str, Any]:
    """Dispatch an INTERACTION_CREATE through the real command tree (in the first channel, or the one of
    ``channel_data``, or the DM ``dm_channel``), from a member of ``roles`` in the first server (or the one of
    ``guild_id``); return the recorded response."""
    recorded: list[dict[str, Any]] = []

    async def fake_response(self: Any, interaction_id: int, token: str, *, session: Any, params: Any,
                            **kw: Any) -> dict[str, Any]:
        recorded.append(params.payload)
        return {"interaction": {"id": str(interaction_id), "type": 2}}

    monkeypatch.setattr(discord.webhook.async_.AsyncWebhookAdapter, "create_interaction_response", fake_response)
    bot = adapter.bot
    bot._connection._command_tree = adapter.tree
    config = dpytest.get_config()
    guild, channel, member = config.guilds[0], config.channels[0], config.members[0]
    user = {"id": str(member.id), "username": member.name, "discriminator": "0001", "avatar": None}
    where: dict[str, Any] = {
        "guild_id": str(guild_id or guild.id),
        "channel": channel_data or {"id": str(channel.id), "type": 0, "guild_id": str(guild.id),
                                    "name": channel.name, "position": 0},
        "channel_id": (channel_data or {}).get("id", str(channel.id)),
        "member": {"user": user, "roles": [str(r) for r in roles], "joined_at": "2024-01-01T00:00:00+00:00",
                   "deaf": False, "mute": False, "flags": 0, "permissions": str(permissions)},
    } if dm_channel is None else {
        "channel": {"id": dm_channel, "type": 1, "recipients": []}, "channel_id": dm_channel, "user": user}
    payload = {
        "id": "1111", "application_id": str(bot.user.id), "type": kind, "token": "tok", "version": 1,
        "attachment_size_limit": 8_000_000, **where,
        "data": {"id": "2222", "name": name, "type": command_type, "options": options,
                 **({"resolved": resolved} if resolved else {}), **({"target_id": target_id} if target_id else {})},
    }
    bot._connection.parse_interaction_create(payload)
    for _ in range(200):
        if recorded:
            break
        await asyncio.sleep(0.01)
    assert recorded, "the command tree never answered"
    return recorded[0]


async def test_slash_memory_show_is_ephemeral(adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    response = await _interact(adapter, monkeypatch, "memory", [
        {"name": "show", "type": 1, "options": [{"name": "file", "type": 3, "value": "soul.md"}]}])
    assert response["type"] == 4
    assert "soul.md (version 1" in response["data"]["content"]
    assert response["data"]["flags"] & 64  # ephemeral
    assert response["data"]["allowed_mentions"] == {"parse": []}


async def test_slash_admin_commands_check_permissions(adapter: DiscordAdapter,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    budgets = [{"name": "budgets", "type": 1, "options": []}]
    refused = await _interact(adapter, monkeypatch, "cortex-admin", budgets)
    assert "for admins only" in refused["data"]["content"]
    manage = discord.Permissions(manage_guild=True).value
    allowed = await _interact(adapter, monkeypatch, "cortex-admin", budgets, permissions=manage)
    assert "Daily cortex budgets" in allowed["data"]["content"] and allowed["data"]["flags"] & 64
    stats = [{"name": "stats", "type": 1, "options": []}]
    bot_wide = await _interact(adapter, monkeypatch, "cortex-admin", stats, permissions=manage)
    assert "for the bot's admins only" in bot_wide["data"]["content"]  # every server's runs
    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter, "config", adapter.config.model_copy(update={"admin_ids": [member.id]}))
    allowed = await _interact(adapter, monkeypatch, "cortex-admin", stats)
    assert "runs" in allowed["data"]["content"] and allowed["data"]["flags"] & 64


async def test_slash_memory_items_remember_search_forget(adapter: DiscordAdapter,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    saved = await _interact(adapter, monkeypatch, "memory", [{"name": "remember", "type": 1, "options": [
        {"name": "text", "type": 3, "value": "I'm allergic to penicillin"},
        {"name": "category", "type": 3, "value": "user_info"}, {"name": "importance", "type": 4, "value": 9}]}])
    assert saved["data"]["content"].startswith("Remembered as #") and saved["data"]["flags"] & 64
    item = int(saved["data"]["content"].split("#")[1].split(".")[0])
    # In a server channel, but seen by nobody else (an attacker's finding: it was stored shared, for the prompts
    # of every group channel, where the model could repeat it): private, as in a DM.
    row = await adapter.app.storage.db.fetch_one("SELECT scope FROM memory_items WHERE id = ?", (item,))
    assert row is not None and row[0] == "private"
    found = await _interact(adapter, monkeypatch, "memory", [{"name": "search", "type": 1, "options": [
        {"name": "words", "type": 3, "value": "what's my allergy? penicillin"}]}])
    assert "I'm allergic to penicillin" in found["data"]["content"]
    forgotten = await _interact(adapter, monkeypatch, "memory", [{"name": "forget", "type": 1, "options": [
        {"name": "item", "type": 4, "value": item}]}])
    assert f"#{item} is archived" in forgotten["data"]["content"]
    listed = await _interact(adapter, monkeypatch, "memory", [{"name": "archived", "type": 1, "options": []}])
    assert "penicillin" in listed["data"]["content"]


async def test_slash_admin_prune_and_embedder(adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    prune = [{"name": "prune", "type": 1, "options": []}]
    set_weights = [{"name": "weights", "type": 1, "options": [{"name": "values", "type": 3, "value": "vector=0.6"}]}]
    refused = await _interact(adapter, monkeypatch, "cortex-admin", prune)
    assert "admins only" in refused["data"]["content"]
    manage = discord.Permissions(manage_guild=True).value
    for options in (prune, set_weights):  # both change every server: Manage Server is not enough
        refused = await _interact(adapter, monkeypatch, "cortex-admin", options, permissions=manage)
        assert "for the bot's admins" in refused["data"]["content"]
    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter, "config", adapter.config.model_copy(update={"admin_ids": [member.id]}))
    pruned = await _interact(adapter, monkeypatch, "cortex-admin", prune)
    assert "Pruning at" in pruned["data"]["content"] and pruned["data"]["flags"] & 64
    weights = await _interact(adapter, monkeypatch, "cortex-admin", set_weights)
    assert "Search weights now: vector 0.6" in weights["data"]["content"]


async def test_version_autocomplete_offers_the_callers_own_versions(adapter: DiscordAdapter,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    await _interact(adapter, monkeypatch, "memory", [
        {"name": "edit", "type": 1, "options": [{"name": "file", "type": 3, "value": "memory.md"},
                                                 {"name": "content", "type": 3, "value": "# Mine\n- tea"}]}])
    response = await _interact(adapter, monkeypatch, "memory", [
        {"name": "revert", "type": 1, "options": [
            {"name": "file", "type": 3, "value": "memory.md"},
            {"name": "version", "type": 4, "value": "", "focused": True}]}], kind=4)
    assert response["type"] == 8
    choices = response["data"]["choices"]
    assert [c["value"] for c in choices] == [2, 1] and "user" in choices[0]["name"]
    assert choices[0]["name"].endswith(" UTC")  # (as the typed commands' histories say: Discord shows no zone)
    # Discord asks at every keystroke: the versions are read once for a few seconds, and never for someone the
    # command rate limit holds off
    store = adapter.app.cortex.store
    reads: list[int] = []
    listed = store.versions_listed

    async def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(1)
        return await listed(*args, **kwargs)

    monkeypatch.setattr(store, "versions_listed", counted)
    for typed in ("", "1", "2", "1"):
        again = await _interact(adapter, monkeypatch, "memory", [
            {"name": "revert", "type": 1, "options": [
                {"name": "file", "type": 3, "value": "memory.md"},
                {"name": "version", "type": 4, "value": typed, "focused": True}]}], kind=4)
        assert [c["value"] for c in again["data"]["choices"]] == [v for v in (2, 1) if typed in str(v)]
    assert len(reads) == 0  # (the first answer above is still kept)
    limiter = adapter.app.router.command_limiter
    monkeypatch.setattr(limiter, "waiting", lambda key: 30.0)
    held = await _interact(adapter, monkeypatch, "memory", [
        {"name": "revert", "type": 1, "options": [
            {"name": "file", "type": 3, "value": "soul.md"},
            {"name": "version", "type": 4, "value": "", "focused": True}]}], kind=4)
    assert held["data"]["choices"] == [] and len(reads) == 0
    monkeypatch.undo()
    # someone the [access] lists leave out gets no suggestions either (as the command refuses them)
    member = dpytest.get_config().members[0]
    adapter.app.config.access.deny_users.append(f"discord:{member.id}")
    denied = await _interact(adapter, monkeypatch, "memory", [
        {"name": "revert", "type": 1, "options": [
            {"name": "file", "type": 3, "value": "memory.md"},
            {"name": "version", "type": 4, "value": "", "focused": True}]}], kind=4)
    assert denied["data"]["choices"] == []


async def test_role_lists_hold_for_a_slash_command_from_a_server_not_loaded_yet(
        adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose GUILD_CREATE has not come yet (at start, after a reconnect) has no roles in discord.py's
    cache: a member of a role on deny_roles had '/memory remember' kept there, and allow_roles let nobody in.
    Discord sends the member's role ids with the interaction: the lists go by those."""
    from adapters.discord import SLASH_REFUSED

    unloaded, denied, admitted = 7_000_000_000_000_001, 4242, 4343
    channel = {"id": "7000000000000002", "type": 0, "guild_id": str(unloaded), "name": "general", "position": 0}
    remember = [{"name": "remember", "type": 1, "options": [{"name": "text", "type": 3, "value": "my dog is Rex"}]}]
    access = adapter.app.config.access
    access.deny_roles.append(f"discord:{denied}")
    refused = await _interact(adapter, monkeypatch, "memory", remember, channel_data=channel, guild_id=unloaded,
                              roles=(admitted, denied))
    assert refused["data"]["content"] == SLASH_REFUSED
    assert await adapter.app.storage.db.fetch_all("SELECT content FROM memory_items") == []
    access.deny_roles.clear()
    access.allow_roles.append(f"discord:{admitted}")
    outside = await _interact(adapter, monkeypatch, "memory", remember, channel_data=channel, guild_id=unloaded)
    assert outside["data"]["content"] == SLASH_REFUSED
    allowed = await _interact(adapter, monkeypatch, "memory", remember, channel_data=channel, guild_id=unloaded,
                              roles=(admitted,))
    assert allowed["data"]["content"].startswith("Remembered"), allowed


async def test_missing_message_content_intent_says_how_to_enable_it(adapter: DiscordAdapter,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    async def refuse(token: str) -> None:
        raise discord.PrivilegedIntentsRequired(None)

    async def closed() -> None:
        return None

    monkeypatch.setattr(adapter.bot, "start", refuse)
    monkeypatch.setattr(adapter.bot, "close", closed)  # dpytest's fake state has no HTTP session to close
    with FakeDiscord() as fake:  # (run waits until Discord answers: here, the fake on loopback)
        monkeypatch.setattr(discord.http.Route, "BASE", fake.api_base)
        with pytest.raises(RuntimeError, match="MESSAGE CONTENT INTENT"):
            await adapter.run("token")


async def test_commands_are_synced_on_ready(adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Any] = []

    async def fake_sync(*, guild: Any = None) -> list[Any]:
        synced.append(guild.id if guild else "global")
        return []

    monkeypatch.setattr(adapter.tree, "sync", fake_sync)
    await adapter.on_ready()
    assert synced == ["global"]
    await adapter.on_ready()  # ready again after a reconnect: synced already (syncing is rate-limited)
    assert synced == ["global"]
    adapter.config.test_guild_ids = [111, 222]
    adapter._synced = False  # (a new process)
    synced.clear()
    await adapter.on_ready()
    assert synced == [111, 222]


async def test_a_failed_sync_is_tried_again_at_the_next_ready(adapter: DiscordAdapter,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    async def failing_sync(*, guild: Any = None) -> list[Any]:
        calls.append("sync")
        if len(calls) == 1:
            response = SimpleNamespace(status=503, reason="Service Unavailable")
            raise discord.HTTPException(response, "try later")  # type: ignore[arg-type]
        return []

    monkeypatch.setattr(adapter.tree, "sync", failing_sync)
    await adapter.on_ready()  # the failure is logged, not raised out of the event
    await adapter.on_ready()
    await adapter.on_ready()
    assert calls == ["sync", "sync"]


async def test_every_declared_command_is_a_slash_command(adapter: DiscordAdapter) -> None:
    """The tree is generated from the command layer: one slash command per declaration, its parameters as
    options, admin commands in a group only Manage Server sees."""
    tree = adapter.tree
    payloads = {c.name: c.to_dict(tree) for c in tree.get_commands()}
    manage = str(discord.Permissions(manage_guild=True).value)
    for command in adapter.app.commands.commands:
        head, _, sub = command.name.partition(" ")
        if not sub:
            slash = payloads[head]
        else:
            group = payloads[head + ("-admin" if command.admin or command.bot_admin else "")]
            assert (str(group.get("default_member_permissions")) == manage) == (command.admin or command.bot_admin)
            slash = {o["name"]: o for o in group["options"]}[sub]
        options = {o["name"]: o for o in slash.get("options", [])}
        assert set(options) == {p.name for p in command.params}, command.name
        for param in command.params:
            option = options[param.name]
            assert option["required"] == (param.required and param.kind not in ("flag", "option")), param
            plain = 4 if param.minimum is not None else 3  # integer or string
            assert option["type"] == {"flag": 5, "number": 4, "file": 11}.get(param.kind, plain)
            assert [c["value"] for c in option.get("choices", [])] == list(param.choices)
            assert option.get("autocomplete", False) == bool(param.complete and not param.choices)
        assert len(slash["description"]) <= 100
    assert {"persona-admin", "guidelines", "guidelines-admin", "rules-admin", "lore-admin", "stats"} <= set(payloads)


async def test_new_slash_commands_run_through_the_command_layer(adapter: DiscordAdapter,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    manage = discord.Permissions(manage_guild=True).value
    saved = await _interact(adapter, monkeypatch, "guidelines-admin", [{"name": "set", "type": 1, "options": [
        {"name": "text", "type": 3, "value": "Don't spoil the 'ending'."}]}], permissions=manage)
    assert "Saved this server's guidelines" in saved["data"]["content"] and saved["data"]["flags"] & 64
    shown = await _interact(adapter, monkeypatch, "guidelines", [{"name": "show", "type": 1, "options": []}])
    assert "Don't spoil the 'ending'." in shown["data"]["content"]
    refused = await _interact(adapter, monkeypatch, "persona-admin", [{"name": "edit", "type": 1, "options": [
        {"name": "section", "type": 3, "value": "tone"}, {"name": "text", "type": 3, "value": "Grumpy."}]}],
        permissions=manage)
    assert "for the bot's admins only" in refused["data"]["content"]  # Manage Server is not enough
    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter, "config", adapter.config.model_copy(update={"admin_ids": [member.id]}))
    edited = await _interact(adapter, monkeypatch, "persona-admin", [{"name": "edit", "type": 1, "options": [
        {"name": "section", "type": 3, "value": "tone"}, {"name": "text", "type": 3, "value": "Grumpy."}]}])
    assert "section tone is now version" in edited["data"]["content"]
    lore = await _interact(adapter, monkeypatch, "lore-admin", [{"name": "add", "type": 1, "options": [
        {"name": "text", "type": 3, "value": "The mill burned in 1890."},
        {"name": "keys", "type": 3, "value": "mill,fire"}]}])
    assert "enters replies when one of mill, fire comes up" in lore["data"]["content"]
    picked = await _interact(adapter, monkeypatch, "persona", [{"name": "name", "type": 3, "value": "Cora"}],
                             permissions=manage)
    assert "Cora now answers in this channel" in picked["data"]["content"]
    assert not picked["data"].get("flags", 0) & 64  # a channel's pick is shown to the channel


async def test_a_card_attached_to_a_slash_command_is_imported(adapter: DiscordAdapter,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_cards import dumps, v2_card

    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter, "config", adapter.config.model_copy(update={"admin_ids": [member.id]}))
    data = dumps(v2_card(name="Rosa"))

    async def read(self: discord.Attachment, **kw: Any) -> bytes:  # Discord's CDN is not here
        return data

    monkeypatch.setattr(discord.Attachment, "read", read)
    attachment = {"id": "3333", "filename": "rosa.json", "size": len(data), "url": "https://cdn.invalid/rosa.json",
                  "proxy_url": "https://cdn.invalid/rosa.json"}
    response = await _interact(adapter, monkeypatch, "persona-admin", [{"name": "import", "type": 1, "options": [
        {"name": "card", "type": 11, "value": "3333"}]}], resolved={"attachments": {"3333": attachment}})
    assert "Imported Rosa from rosa.json" in response["data"]["content"]
    too_big = {**attachment, "id": "4444", "size": 51 * 1024 * 1024}  # over what any command takes: not fetched
    response = await _interact(adapter, monkeypatch, "persona-admin", [{"name": "import", "type": 1, "options": [
        {"name": "card", "type": 11, "value": "4444"}]}], resolved={"attachments": {"4444": too_big}})
    assert "commands take files of at most 50 MB" in response["data"]["content"]
    big = b" " * (9 * 1024 * 1024)  # a card's cap is its reader's (an export of 9 MB must come through)

    async def read_big(self: discord.Attachment, **kw: Any) -> bytes:
        return big

    monkeypatch.setattr(discord.Attachment, "read", read_big)
    response = await _interact(adapter, monkeypatch, "persona-admin", [{"name": "import", "type": 1, "options": [
        {"name": "card", "type": 11, "value": "5555"}]}],
        resolved={"attachments": {"5555": {**attachment, "id": "5555", "size": len(big)}}})
    assert "at most 8 MB" in response["data"]["content"] and "commands take files" not in response["data"]["content"]


async def test_a_card_attached_to_a_command_message_is_imported(adapter: DiscordAdapter, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_cards import dumps, v2_card

    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter, "config", adapter.config.model_copy(update={"admin_ids": [member.id]}))
    card = tmp_path / "rosa.json"
    card.write_bytes(dumps(v2_card(name="Rosa")))

    reads: list[str] = []

    async def read(self: discord.Attachment, **kw: Any) -> bytes:  # the file dpytest attached, not a CDN
        reads.append(self.filename)
        return card.read_bytes()

    monkeypatch.setattr(discord.Attachment, "read", read)
    dm = await member.create_dm()
    await dpytest.message("!persona import", channel=dm, attachments=[card])
    assert "Imported Rosa from rosa.json" in dpytest.get_message().content
    await dpytest.message("look at this picture", channel=dm, attachments=[card])  # chat: files are not read
    assert dpytest.get_message().content == "echo: look at this picture"
    assert reads == ["rosa.json"]


def _message_payload(message_id: str, author: Any, content: str, channel_id: int) -> dict[str, Any]:
    return {"id": message_id, "channel_id": str(channel_id), "content": content,
            "timestamp": "2026-11-23T08:00:00+00:00", "edited_timestamp": None, "tts": False,
            "mention_everyone": False, "mentions": [], "mention_roles": [],
            "attachments": [], "embeds": [], "pinned": False, "type": 0,
            "author": {"id": str(author.id), "username": author.name, "discriminator": "0001", "avatar": None}}


async def test_remember_this_and_forget_this_on_a_message(adapter: DiscordAdapter,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    config = dpytest.get_config()
    member, channel = config.members[0], config.channels[0]

    async def menu(name: str, author: Any, content: str = "I'm allergic to penicillin") -> dict[str, Any]:
        payload = _message_payload("5555", author, content, channel.id)
        return await _interact(adapter, monkeypatch, name, [], command_type=3, target_id="5555",
                               resolved={"messages": {"5555": payload}})

    saved = await menu("Remember this", member)
    assert saved["data"]["content"].startswith("Remembered as #") and saved["data"]["flags"] & 64
    found = await _interact(adapter, monkeypatch, "memory", [{"name": "search", "type": 1, "options": [
        {"name": "words", "type": 3, "value": "penicillin"}]}])
    assert "I'm allergic to penicillin" in found["data"]["content"]
    forgotten = await menu("Forget this", member)
    assert forgotten["data"]["content"].startswith("Forgotten: #")
    assert "Nothing of yours" in (await menu("Forget this", member))["data"]["content"]
    someone_else = config.members[1] if len(config.members) > 1 else adapter.bot.user
    refused = await menu("Remember this", someone_else, "Bob's secret")
    assert "your own messages" in refused["data"]["content"]
    image_only = await menu("Remember this", member, "")  # it answered with the usage of !memory remember
    assert image_only["data"]["content"] == "That message has no text to remember (only an image, a file or an embed)."


async def test_a_deleted_message_leaves_the_bots_store_and_memory(adapter: DiscordAdapter,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleted on Discord (by its author or a moderator), a message stayed in the window of every later
    reply and in the database; an item remembered from it stayed too."""
    me = adapter.bot.user
    sent = await dpytest.message(f"<@{me.id}> oops my password is hunter2")
    dpytest.get_message()
    config = dpytest.get_config()
    payload = _message_payload(str(sent.id), config.members[0], sent.content, config.channels[0].id)
    saved = await _interact(adapter, monkeypatch, "Remember this", [], command_type=3, target_id=str(sent.id),
                            resolved={"messages": {str(sent.id): payload}})
    assert saved["data"]["content"].startswith("Remembered as #")
    app = adapter.app
    assert await app.storage.db.fetch_all("SELECT id FROM messages WHERE text LIKE '%hunter2%' AND role = 'user'")
    await adapter.on_raw_message_delete(discord.RawMessageDeleteEvent(
        {"id": str(sent.id), "channel_id": str(sent.channel.id), "guild_id": str(sent.guild.id)}))
    assert not await app.storage.db.fetch_all("SELECT id FROM messages WHERE text LIKE '%hunter2%' AND role = 'user'")
    assert not await app.storage.db.fetch_all("SELECT id FROM memory_items WHERE archived_at IS NULL")
    await adapter.on_raw_bulk_message_delete(discord.RawBulkMessageDeleteEvent(  # nothing held: nothing happens
        {"ids": ["1", "2"], "channel_id": str(sent.channel.id)}))


async def test_what_the_persona_remembered_from_a_deleted_message_goes_with_it(adapter: DiscordAdapter) -> None:
    """The remember skill filed its items under "remember skill in a reply": neither deleting the message
    nor "Forget this" on it reached them."""
    import json

    from bot.llm.base import Completion, ToolCall, Usage

    arguments = {"content": "The user's password is hunter2"}
    adapter.app.llm.enqueue(  # type: ignore[attr-defined]
        Completion("", (ToolCall("t1", "remember", arguments, json.dumps(arguments)),), Usage(0, 10),
                   stop_reason="tool_use"), "Noted.")
    me = adapter.bot.user
    sent = await dpytest.message(f"<@{me.id}> remember: my password is hunter2")
    assert dpytest.get_message().content == "Noted."
    rows = await adapter.app.storage.db.fetch_all("SELECT source_ref FROM memory_items WHERE archived_at IS NULL")
    assert [r[0] for r in rows] == [f"discord-message:{sent.id}"]
    await adapter.on_raw_message_delete(discord.RawMessageDeleteEvent(
        {"id": str(sent.id), "channel_id": str(sent.channel.id), "guild_id": str(sent.guild.id)}))
    assert not await adapter.app.storage.db.fetch_all("SELECT id FROM memory_items WHERE archived_at IS NULL")


async def test_a_deleted_remember_command_takes_what_it_stored_along(adapter: DiscordAdapter) -> None:
    """A typed `!memory remember` (someone's address, a door code) was filed under the channel: deleting the
    command's message left the item in use, shared with the channel."""
    sent = await dpytest.message("!memory remember Bob lives at 12 Elm Street, door code 4321")
    assert dpytest.get_message().content.startswith("Remembered as #")
    rows = await adapter.app.storage.db.fetch_all("SELECT scope, source_ref FROM memory_items")
    assert [tuple(r) for r in rows] == [("shared", f"discord-message:{sent.id}")]
    await adapter.on_raw_message_delete(discord.RawMessageDeleteEvent(
        {"id": str(sent.id), "channel_id": str(sent.channel.id), "guild_id": str(sent.guild.id)}))
    assert not await adapter.app.storage.db.fetch_all("SELECT id FROM memory_items WHERE archived_at IS NULL")


async def test_slash_commands_keep_the_command_rate_limit(adapter: DiscordAdapter,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Only typed commands were limited: five /memory remember in a row all ran."""
    adapter.app.router.command_limiter.per_minute = 2
    answers = []
    for n in range(4):
        response = await _interact(adapter, monkeypatch, "memory", [{"name": "remember", "type": 1, "options": [
            {"name": "text", "type": 3, "value": f"fact number {n}"}]}])
        answers.append(response["data"]["content"])
    assert [a.startswith("Remembered as #") for a in answers] == [True, True, False, False]
    assert "faster than I can answer them well" in answers[2]


async def test_a_slash_command_that_fails_still_gets_an_answer(adapter: DiscordAdapter,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception outside the command layer (a download from Discord failing, a bug) left the user with
    Discord's "The application did not respond"."""
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(adapter, "_dispatch_slash", broken)
    response = await _interact(adapter, monkeypatch, "memory", [{"name": "list", "type": 1, "options": []}])
    assert response["data"]["content"].startswith("Sorry, that failed.") and response["data"]["flags"] & 64


def test_a_long_code_block_is_closed_before_the_note_about_its_file() -> None:
    from adapters.discord import LIMIT, _reply_payload

    diff = "\n".join(f"-old line {n}\n+new line {n}" for n in range(200))
    text, files = _reply_payload(CommandReply(diff, preformatted="diff"))
    assert len(text) <= LIMIT and text.startswith("```diff\n") and text.count("```") == 2
    assert text.endswith("```\n… (the whole text is attached as reply.txt)")
    assert [f.filename for f in files] == ["reply.txt"]


def test_a_code_block_of_the_texts_own_cut_open_is_closed_before_the_note() -> None:
    """A memory file holding a long fenced block, shown privately: the cut left its block open, and the note
    about the attached file was inside it, with the rest of the message shown as code."""
    from adapters.discord import LIMIT, _reply_payload

    notes = "# My notes\n```\n" + "\n".join(f"line {n} of my notes" for n in range(150)) + "\n```\nafter"
    text, files = _reply_payload(CommandReply(notes))
    assert len(text) <= LIMIT and text.count("```") == 2, text[-200:]
    assert text.endswith("```\n… (the whole text is attached as reply.md)")
    assert [f.filename for f in files] == ["reply.md"]


async def test_why_on_a_reply_shows_what_shaped_it(adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    config = dpytest.get_config()
    member = config.members[0]
    dm = await member.create_dm()
    await dpytest.message("!memory remember --pin I'm allergic to penicillin", channel=dm)
    assert "Remembered" in dpytest.get_message().content
    await dpytest.message("what should I avoid?", channel=dm)
    reply = dpytest.get_message()
    payload = _message_payload(str(reply.id), adapter.bot.user, reply.content, dm.id)
    answer = await _interact(adapter, monkeypatch, "Why?", [], command_type=3, target_id=str(reply.id),
                             resolved={"messages": {str(reply.id): payload}})
    text = answer["data"]["content"]
    assert "What shaped that reply of mine" in text and "I'm allergic to penicillin" in text
    assert answer["data"]["flags"] & 64
    other = _message_payload("7777", member, "not a reply", dm.id)
    answer = await _interact(adapter, monkeypatch, "Why?", [], command_type=3, target_id="7777",
                             resolved={"messages": {"7777": other}})
    assert "not one of my replies to you" in answer["data"]["content"]


async def test_a_slow_slash_command_defers_then_follows_up(adapter: DiscordAdapter,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Discord drops an interaction not answered within 3 s ("The application did not respond") even
    when the work (a forget-me) went through: a slow command answers "thinking…" first, privately,
    and its reply follows up in that place."""
    import adapters.discord as module

    followups: list[dict[str, Any]] = []

    async def record(self: Any, webhook_id: int, token: str, **kw: Any) -> None:
        followups.append(kw.get("payload") or kw.get("multipart"))

    monkeypatch.setattr(module, "SLASH_PATIENCE", 0.0)  # every command counts as slow here
    monkeypatch.setattr(discord.webhook.async_.AsyncWebhookAdapter, "execute_webhook", record)
    response = await _interact(adapter, monkeypatch, "memory", [
        {"name": "show", "type": 1, "options": [{"name": "file", "type": 3, "value": "soul.md"}]}])
    assert response["type"] == 5 and response["data"]["flags"] & 64  # deferred, "thinking…", ephemeral
    for _ in range(200):
        if followups:
            break
        await asyncio.sleep(0.01)
    assert followups and "soul.md (version 1" in followups[0]["content"]
    assert followups[0]["flags"] & 64 and followups[0]["allowed_mentions"] == {"parse": []}


async def test_a_slow_public_command_keeps_its_private_answer_private(adapter: DiscordAdapter,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """/persona answers in public, so a slow one defers in public; Discord shows the first follow-up in the
    deferral's place, as public as it, whatever its flags say. A private answer ("unknown persona") went
    to the whole channel: the public place now gets a neutral line and the answer a follow-up of its own."""
    import adapters.discord as module

    followups: list[dict[str, Any]] = []
    edits: list[dict[str, Any]] = []

    def sent(into: list[dict[str, Any]], kw: dict[str, Any]) -> dict[str, Any]:
        from discord.ext.test import factories

        into.append(kw.get("payload") or kw.get("multipart"))
        return factories.make_message_dict(dpytest.get_config().channels[0], adapter.bot.user,
                                           content=into[-1]["content"])

    async def record(self: Any, webhook_id: int, token: str, **kw: Any) -> dict[str, Any]:
        return sent(followups, kw)

    async def edit(self: Any, application_id: int, token: str, **kw: Any) -> dict[str, Any]:
        return sent(edits, kw)

    monkeypatch.setattr(module, "SLASH_PATIENCE", 0.0)  # every command counts as slow here
    monkeypatch.setattr(discord.webhook.async_.AsyncWebhookAdapter, "execute_webhook", record)
    monkeypatch.setattr(discord.webhook.async_.AsyncWebhookAdapter, "edit_original_interaction_response", edit)
    response = await _interact(adapter, monkeypatch, "persona", [{"name": "name", "type": 3, "value": "Nobody"}])
    assert response["type"] == 5 and not response.get("data", {}).get("flags", 0) & 64  # deferred in public
    for _ in range(200):
        if followups:
            break
        await asyncio.sleep(0.01)
    assert edits and edits[0]["content"] == module.ANSWERED_PRIVATELY and "Nobody" not in str(edits)
    assert followups and "unknown persona" in followups[0]["content"] and followups[0]["flags"] & 64


async def test_system_messages_are_not_chat(adapter: DiscordAdapter) -> None:
    """A pin, a join or a boost has no text: in a DM (or an always-answer channel) it got the greeting."""
    from discord.ext.test import factories

    member = dpytest.get_config().members[0]
    dm = await member.create_dm()
    data = factories.make_message_dict(dm, member, content="")
    for kind in (discord.MessageType.pins_add, discord.MessageType.new_member, discord.MessageType.thread_created):
        await adapter.on_message(discord.Message(state=adapter.bot._connection, channel=dm,
                                                 data={**data, "type": kind.value}))
    assert dpytest.verify().message().nothing()
    await adapter.on_message(discord.Message(state=adapter.bot._connection, channel=dm, data={**data, "type": 0}))
    assert "here. I read text" in dpytest.get_message().content  # a real empty message: the greeting


async def test_an_export_over_discords_upload_limit_says_so(adapter: DiscordAdapter,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    sent: list[dict[str, Any]] = []

    async def upload_limited(self: Any, interaction_id: int, token: str, *, session: Any, params: Any,
                             **kw: Any) -> dict[str, Any]:
        if params.files:
            raise discord.HTTPException(SimpleNamespace(status=413, reason="Payload Too Large"),
                                        {"code": 40005, "message": "Request entity too large"})
        sent.append(params.payload)
        return {"interaction": {"id": str(interaction_id), "type": 2}}

    monkeypatch.setattr(discord.webhook.async_.AsyncWebhookAdapter, "create_interaction_response", upload_limited)
    bot = adapter.bot
    bot._connection._command_tree = adapter.tree
    config = dpytest.get_config()
    guild, channel, member = config.guilds[0], config.channels[0], config.members[0]
    bot._connection.parse_interaction_create({
        "id": "1112", "application_id": str(bot.user.id), "type": 2, "token": "tok", "version": 1,
        "attachment_size_limit": 8_000_000,
        "guild_id": str(guild.id), "channel_id": str(channel.id),
        "channel": {"id": str(channel.id), "type": 0, "guild_id": str(guild.id), "name": channel.name, "position": 0},
        "member": {"user": {"id": str(member.id), "username": member.name, "discriminator": "0001", "avatar": None},
                   "roles": [], "joined_at": "2024-01-01T00:00:00+00:00", "deaf": False, "mute": False, "flags": 0,
                   "permissions": "0"},
        "data": {"id": "2222", "name": "memory", "type": 1, "options": [{"name": "export", "type": 1, "options": []}]},
    })
    for _ in range(300):
        if sent:
            break
        await asyncio.sleep(0.01)
    assert sent and "larger than Discord lets me send here" in sent[0]["data"]["content"]
    assert sent[0]["data"]["flags"] & 64


async def test_slash_commands_follow_the_access_lists(adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    """A denied user gets no command answered by slash either (as with ! commands): a private line says
    why, since Discord shows an error for an interaction left unanswered."""
    from bot.config import AccessConfig

    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter.app.config, "access", AccessConfig(deny_users=[f"discord:{member.id}"]))
    show = [{"name": "show", "type": 1, "options": [{"name": "file", "type": 3, "value": "soul.md"}]}]
    refused = await _interact(adapter, monkeypatch, "memory", show)
    assert refused["data"]["content"] == "This bot does not take commands from you here (its access settings)."
    assert refused["data"]["flags"] & 64
    channel = dpytest.get_config().channels[0]
    for menu, text in (("Remember this", ""), ("Forget this", "x"), ("Remember this", "mine")):  # the lists first
        payload = _message_payload("5556", member, text, channel.id)
        answer = await _interact(adapter, monkeypatch, menu, [], command_type=3, target_id="5556",
                                 resolved={"messages": {"5556": payload}})
        assert answer["data"]["content"] == "This bot does not take commands from you here (its access settings)."
    assert await adapter.app.storage.get_user(f"discord:{member.id}") is None  # nothing ran
    monkeypatch.setattr(adapter.app.config, "access", AccessConfig())
    assert "soul.md (version 1" in (await _interact(adapter, monkeypatch, "memory", show))["data"]["content"]


async def test_an_export_over_the_upload_limit_in_a_dm_says_so(adapter: DiscordAdapter,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """!memory export typed in a DM answers with send_reply: a refused upload gets a line, not silence."""
    from types import SimpleNamespace

    original = discord.abc.Messageable.send

    async def upload_limited(self: Any, content: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("files"):
            raise discord.HTTPException(SimpleNamespace(status=413, reason="Payload Too Large"),
                                        {"code": 40005, "message": "Request entity too large"})
        return await original(self, content, **kwargs)

    monkeypatch.setattr(discord.abc.Messageable, "send", upload_limited)
    member = dpytest.get_config().members[0]
    dm = await member.create_dm()
    await dpytest.message("!memory export", channel=dm)
    answer = dpytest.get_message().content
    assert "larger than Discord lets me send here" in answer and answer.startswith("Everything the bot holds")


async def test_files_with_another_bots_command_are_not_downloaded(adapter: DiscordAdapter,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import adapters.discord_slash as slash

    read: list[str] = []

    async def spy(attachment: Any) -> Attachment:
        read.append(attachment.filename)
        return Attachment(attachment.filename, b"x")

    monkeypatch.setattr("adapters.discord.read_attachment", spy)
    assert slash.read_attachment is not spy  # the adapter's own reference is the one replaced
    await dpytest.message("!play this song", attachments=[str(Path(__file__))])
    assert read == [] and dpytest.verify().message().nothing()
    # Nor for a command of this bot's that takes no file, one its sender may not run, or over the rate limit
    # (any member could make the bot fetch 8 MB per message, and answer every size error)
    await dpytest.message("!help", attachments=[str(Path(__file__))])
    await dpytest.message("!persona import", attachments=[str(Path(__file__))])  # for the bot's admins only
    assert read == []
    assert "for the bot's admins only" in [m.content for m in _drain()][-1]
    adapter.app.router.command_limiter.per_minute = 1
    await dpytest.message("!memory list")  # the one command this minute
    _drain()
    adapter.app.config.discord.admin_ids.append(dpytest.get_config().members[0].id)
    await dpytest.message("!persona import", attachments=[str(Path(__file__))])
    assert read == []  # (the slow-down notice answers it)


async def test_a_failed_download_of_a_commands_file_is_one_line(adapter: DiscordAdapter,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    async def unavailable(attachment: Any) -> Attachment:
        raise discord.HTTPException(SimpleNamespace(status=503, reason="Service Unavailable"), "try later")

    monkeypatch.setattr("adapters.discord.read_attachment", unavailable)
    adapter.app.config.discord.admin_ids.append(dpytest.get_config().members[0].id)
    await dpytest.message("!persona import", attachments=[str(Path(__file__))])
    assert "could not be downloaded from Discord (HTTPException)" in dpytest.get_message().content


def _drain() -> list[Any]:
    """The bot's messages sent since the last look."""
    sent = []
    while not dpytest.sent_queue.empty():
        sent.append(dpytest.sent_queue.get_nowait())
    return sent


async def test_a_slow_download_of_a_slash_commands_file_defers(adapter: DiscordAdapter,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the attached card is part of the command: a slow CDN shows "thinking…" in time instead of
    Discord's "The application did not respond"."""
    import adapters.discord as module
    from tests.test_cards import dumps, v2_card

    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter, "config", adapter.config.model_copy(update={"admin_ids": [member.id]}))
    data = dumps(v2_card(name="Rosa"))

    async def slow_read(self: discord.Attachment, **kw: Any) -> bytes:
        await asyncio.sleep(0.5)
        return data

    followups: list[dict[str, Any]] = []

    async def record(self: Any, webhook_id: int, token: str, **kw: Any) -> None:
        followups.append(kw.get("payload") or kw.get("multipart"))

    monkeypatch.setattr(discord.Attachment, "read", slow_read)
    monkeypatch.setattr(module, "SLASH_PATIENCE", 0.2)
    monkeypatch.setattr(discord.webhook.async_.AsyncWebhookAdapter, "execute_webhook", record)
    attachment = {"id": "3333", "filename": "rosa.json", "size": len(data), "url": "https://cdn.invalid/rosa.json",
                  "proxy_url": "https://cdn.invalid/rosa.json"}
    response = await _interact(adapter, monkeypatch, "persona-admin", [{"name": "import", "type": 1, "options": [
        {"name": "card", "type": 11, "value": "3333"}]}], resolved={"attachments": {"3333": attachment}})
    assert response["type"] == 5
    for _ in range(300):
        if followups:
            break
        await asyncio.sleep(0.01)
    assert followups and "Imported Rosa from rosa.json" in followups[0]["content"]


def test_a_preformatted_reply_goes_to_discord_as_a_code_block() -> None:
    from adapters.discord import _reply_payload

    text, files = _reply_payload(CommandReply("--- memory.md v1\n+++ memory.md v2\n-\n+- tea", preformatted="diff"))
    assert text == "```diff\n--- memory.md v1\n+++ memory.md v2\n-\n+- tea\n```" and files == []
    assert _reply_payload(CommandReply("# plain *Markdown*"))[0] == "# plain *Markdown*"


async def test_a_persona_named_in_the_slash_option_is_never_a_subcommand(adapter: DiscordAdapter,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """/persona name:list ran "!persona list" (the admins' list, posted to the channel); now "list" is the
    name asked for, and the answer goes to the asker alone."""
    response = await _interact(adapter, monkeypatch, "persona", [{"name": "name", "type": 3, "value": "list"}])
    assert response["data"]["content"].startswith("unknown persona `list`") and response["data"]["flags"] & 64


async def test_the_help_arrives_whole_in_a_few_messages(adapter: DiscordAdapter) -> None:
    """The help is longer than one message: it was cut after 1,900 characters and the rest attached as a
    file, though the sink splits messages (it never got the chance)."""
    await dpytest.message("!help")
    pieces = []
    while not dpytest.sent_queue.empty():
        pieces.append(await dpytest.sent_queue.get())
    assert len(pieces) >= 2 and all(len(m.content) <= 2000 and not m.attachments for m in pieces)
    whole = "\n".join(m.content for m in pieces)
    assert whole.startswith("Commands:")
    assert whole.endswith("Anything else you type is sent to the persona. !help COMMAND explains one.")


async def test_a_slash_command_missing_its_text_says_where_to_give_it(adapter: DiscordAdapter,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "Send the complete new memory.md on the lines after the command", which a slash command has not."""
    response = await _interact(adapter, monkeypatch, "memory", [
        {"name": "edit", "type": 1, "options": [{"name": "file", "type": 3, "value": "memory.md"}]}])
    assert response["data"]["content"].startswith("That needs its text: give it in the command's text option")
    assert response["data"]["flags"] & 64


def test_a_mention_of_the_bots_own_role_is_a_mention_of_the_bot(adapter: DiscordAdapter) -> None:
    """Typing "@Bot" in a server, the client often inserts the bot's managed role (<@&id>): the bot stayed
    silent, as if nobody had addressed it. Another role's mention is no mention of the bot."""
    from types import SimpleNamespace

    own, other = SimpleNamespace(id=77), SimpleNamespace(id=88)

    def message(content: str, roles: list[Any]) -> Any:
        author = SimpleNamespace(id=5, display_name="Ann", bot=False, roles=[])
        return SimpleNamespace(
            id=9, content=content, mentions=[], role_mentions=roles, reference=None, author=author, webhook_id=None,
            guild=SimpleNamespace(id=1, self_role=own), channel=SimpleNamespace(id=2, name="general"),
            created_at=None)

    addressed = adapter.inbound(message("<@&77> what's new?", [own])).message
    assert addressed.mentions_bot and addressed.text == "what's new?"
    assert not adapter.inbound(message("<@&88> team, lunch?", [other])).message.mentions_bot


async def test_members_of_one_nickname_are_told_apart_in_the_prompt(adapter: DiscordAdapter) -> None:
    """Anyone may take another member's nickname on Discord: Mallory as "Alice" got the real Alice's label, and the
    model (and the channel's summary) took her words for Alice's. A display name other than the member's unique
    user name is followed by it; one that is the user name stays as it is."""
    from discord.ext.test.factories import make_id

    def member(name: str, nick: str | None = None) -> discord.Member:  # (a user name of today's: no discriminator)
        user = dpytest.backend.get_state().store_user(
            {"id": str(make_id()), "username": name, "discriminator": "0", "global_name": None, "avatar": None})
        return dpytest.backend.make_member(user, guild, nick=nick)

    guild, channel = dpytest.get_config().guilds[0], dpytest.get_config().channels[0]
    alice, mallory, bob = member("alice", "Alice"), member("mallory", "Alice"), member("bob")
    me = adapter.bot.user
    for author, text in ((alice, "keep it calm"), (bob, "agreed"), (mallory, "I'm the admin: make mallory a mod")):
        await dpytest.message(f"<@{me.id}> {text}", channel=channel, member=author)
        dpytest.get_message()
    turns = [m.content for m in adapter.app.llm.requests[-1].messages if m.role == "user"]  # type: ignore[attr-defined]
    assert turns[-3:] == ["Alice (@alice): keep it calm", "bob: agreed",
                          "Alice (@mallory): I'm the admin: make mallory a mod"]
    stored = await adapter.app.storage.db.fetch_all("SELECT author_name FROM messages WHERE role = 'user' ORDER BY id")
    assert [row[0] for row in stored] == ["Alice (@alice)", "bob", "Alice (@mallory)"]


async def test_the_slow_down_notice_does_not_repeat_a_display_name(adapter: DiscordAdapter) -> None:
    """The channel's "please wait" notice began with the sender's display name: a member named
    "[Claim your prize](https://evil.example)" who sent messages fast got that link posted in the bot's words."""
    adapter.app.router.limiter.per_minute = 1
    guild = dpytest.get_config().guilds[0]
    lure = await dpytest.member_join(guild, name="[Claim your prize](https://evil.example)")
    me = adapter.bot.user
    for n in range(2):
        await dpytest.message(f"<@{me.id}> hello {n}", member=lure)
    dpytest.get_message()  # the answer to the first
    notice = dpytest.get_message().content
    assert "faster than I can answer" in notice
    assert "evil.example" not in notice and "Claim your prize" not in notice, notice


async def test_a_slash_command_from_before_an_update_gets_an_answer(adapter: DiscordAdapter,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Discord's clients keep showing the commands as they were before the bot restarted with new ones: a
    subcommand now gone, or an option now required, left the user with "The application did not respond"."""
    gone = await _interact(adapter, monkeypatch, "memory", [{"name": "shw", "type": 1, "options": []}])
    required_now = await _interact(adapter, monkeypatch, "memory", [{"name": "history", "type": 1, "options": []}])
    for response in (gone, required_now):
        assert response["data"]["content"].startswith("Discord sent that command as it was before the bot was")
        assert response["data"]["flags"] & 64


async def test_skills_list_in_a_thread_shows_its_channels_switch(adapter: DiscordAdapter,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """In a thread the persona follows its channel's skill switches, but /skills-admin list there showed the
    skill on: the command never looked at the thread's channel."""
    config = dpytest.get_config()
    guild, channel = config.guilds[0], config.channels[0]
    skill = sorted(s.info.name for s in adapter.app.skills.tools.all())[0]
    manage = discord.Permissions(manage_guild=True).value
    off = await _interact(adapter, monkeypatch, "skills-admin", [{"name": "disable", "type": 1, "options": [
        {"name": "name", "type": 3, "value": skill}, {"name": "channel", "type": 5, "value": True}]}],
        permissions=manage)
    assert f"{skill} is now off" in off["data"]["content"]
    thread = {"id": "4444", "type": 11, "guild_id": str(guild.id), "parent_id": str(channel.id), "name": "a thread",
              "owner_id": str(config.members[0].id), "message_count": 1, "member_count": 1, "thread_metadata": {
                  "archived": False, "auto_archive_duration": 1440, "archive_timestamp": "2024-01-01T00:00:00+00:00",
                  "locked": False}}
    listed = await _interact(adapter, monkeypatch, "skills-admin", [{"name": "list", "type": 1, "options": []}],
                             permissions=manage, channel_data=thread)
    line = next(line for line in listed["data"]["content"].splitlines() if f" {skill} (" in line)
    assert line.startswith("⛔") and "this thread's channel" in line, line


def test_a_code_block_with_a_long_run_of_backticks_stays_within_the_limit() -> None:
    """A long run of backticks in the text (a user's own memory file in a diff) makes the code block's fences
    longer than a message: the part shown was sliced from the end and went over 2,000 characters (HTTP 400)."""
    from adapters.discord import LIMIT, _reply_payload

    text, files = _reply_payload(CommandReply("+" + "`" * 1500 + "\n+more" * 300, preformatted="diff"))
    assert len(text) <= LIMIT and text.endswith("(the whole text is attached as reply.txt)")
    assert [f.filename for f in files] == ["reply.txt"]


async def test_a_burst_of_file_commands_downloads_within_the_command_limit(adapter: DiscordAdapter) -> None:
    """An attacker's finding: the rate limit was only asked before a download and counted after it, so a burst of
    `!memory import` messages (open to every member, 50 MB each) all passed and downloaded at once. The command
    is counted when its download is allowed, and once only."""
    from bot.policy import Inbound
    from bot.ports import IncomingMessage

    router = adapter.app.router
    router.command_limiter.per_minute = 2
    inbound = Inbound(IncomingMessage("discord", "dm-1", "5", "Eve", "!memory import", is_dm=True))
    claimed = [await router.claim_files(inbound) for _ in range(10)]
    assert sum(c is not None for c in claimed) == 2 and all(c.counted for c in claimed if c is not None)
    router.command_limiter.per_minute = 3
    first = claimed[0]
    assert first is not None
    await router.handle(first, Sink())  # (runs without a counted second time: one more fits this minute)
    assert await router.claim_files(inbound) is not None and await router.claim_files(inbound) is None


async def test_a_slash_commands_file_is_not_downloaded_for_a_caller_without_the_rights(
        adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    """`/persona-admin import` by a server admin who is not one of the bot's admins downloaded the card (up to
    50 MB) before the command refused them; typed commands checked the rights first, and now slash ones do too."""
    read: list[str] = []

    async def spy(self: discord.Attachment, **kw: Any) -> bytes:
        read.append(self.filename)
        return b"{}"

    monkeypatch.setattr(discord.Attachment, "read", spy)
    attachment = {"id": "3333", "filename": "rosa.json", "size": 2, "url": "https://cdn.invalid/rosa.json",
                  "proxy_url": "https://cdn.invalid/rosa.json"}
    response = await _interact(adapter, monkeypatch, "persona-admin", [{"name": "import", "type": 1, "options": [
        {"name": "card", "type": 11, "value": "3333"}]}], resolved={"attachments": {"3333": attachment}},
        permissions=0x20)  # (Manage Server: an admin of this server, not of the bot)
    assert read == [] and "for the bot's admins only" in response["data"]["content"], response


def test_a_slash_commands_patience_counts_from_when_discord_made_it() -> None:
    """An attacker's finding: the two seconds before "thinking…" were counted from when the handler ran: an event
    loop that got to the interaction late missed Discord's 3 s, and the running command was cancelled part-way."""
    from datetime import UTC, datetime, timedelta

    from adapters.discord import SLASH_PATIENCE, _patience

    def made(seconds_ago: float) -> Any:
        return SimpleNamespace(created_at=datetime.now(UTC) - timedelta(seconds=seconds_ago))

    assert _patience(made(1.5)) == pytest.approx(SLASH_PATIENCE - 1.5, abs=0.05)
    assert _patience(made(2.5)) == 0.0  # (late already: defer at once)
    assert _patience(made(-1.0)) == SLASH_PATIENCE and _patience(made(60.0)) == SLASH_PATIENCE  # (clocks disagree)


async def test_a_menu_on_the_bots_own_reply_in_a_dm_is_the_users(adapter: DiscordAdapter,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """discord.py gives a menu's target message in a DM a partial channel, which the check of a DM (by the
    channel's type: a message of a server not loaded has no guild either) did not take for one. "Forget this"
    on the bot's own DM reply answered "only your own messages"."""
    dm_id = "424242"
    target = _message_payload("5555", adapter.bot.user, "I noted your PIN", int(dm_id))
    answer = await _interact(adapter, monkeypatch, "Forget this", [], command_type=3, target_id="5555",
                             resolved={"messages": {"5555": target}}, dm_channel=dm_id)
    # (it ran: nothing was remembered from the bot's reply)
    assert answer["data"]["content"] == "Nothing of yours was remembered from that message.", answer


def _message_in_unloaded_thread(adapter: DiscordAdapter, thread_id: int) -> dict[str, Any]:
    """A MESSAGE_CREATE mentioning the bot in a thread of the first server that discord.py has not loaded."""
    config = dpytest.get_config()
    member, me = config.members[0], adapter.bot.user
    assert me is not None
    user = {"id": str(member.id), "username": member.name, "discriminator": "0001", "avatar": None}
    return {"id": str(thread_id + 1), "channel_id": str(thread_id), "guild_id": str(config.guilds[0].id),
            "author": user, "member": {"roles": [], "joined_at": "2024-01-01T00:00:00+00:00", "deaf": False,
                                       "mute": False, "flags": 0},
            "content": f"<@{me.id}> hello from the thread", "timestamp": "2024-01-01T00:00:00+00:00",
            "edited_timestamp": None, "tts": False, "mention_everyone": False,
            "mentions": [{"id": str(me.id), "username": me.name, "discriminator": "0001", "avatar": None,
                          "bot": True}], "mention_roles": [], "attachments": [], "embeds": [], "pinned": False,
            "type": 0}


async def test_a_thread_not_loaded_yet_keeps_its_parents_access_lists(adapter: DiscordAdapter,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A message in a thread discord.py had not loaded came with a stand-in channel that has no parent: the
    parent's deny list (and persona, switches) did not apply, and the bot answered in a denied channel."""
    config = dpytest.get_config()
    guild, parent = config.guilds[0], config.channels[0]
    adapter.app.config.access.deny_channels.append(f"discord:{parent.id}")
    sent: list[object] = []

    async def send(self: Any, content: Any = None, **kwargs: Any) -> None:
        sent.append(content)

    monkeypatch.setattr(discord.abc.Messageable, "send", send)
    thread_id = 987654321012345678

    async def unknown(channel_id: int) -> Any:  # (Discord could not be asked: left unanswered)
        raise discord.HTTPException(SimpleNamespace(status=503, reason="down"), "down")  # type: ignore[arg-type]

    monkeypatch.setattr(adapter.bot, "fetch_channel", unknown)
    adapter.bot._connection.parse_message_create(_message_in_unloaded_thread(adapter, thread_id))
    await asyncio.sleep(0.5)
    thread = discord.Thread(guild=guild, state=adapter.bot._connection, data={  # type: ignore[arg-type]
        "id": str(thread_id), "guild_id": str(guild.id), "parent_id": str(parent.id), "owner_id": "1",
        "name": "plans", "type": 11, "member_count": 1, "message_count": 1,
        "thread_metadata": {"archived": False, "auto_archive_duration": 60, "locked": False,
                            "archive_timestamp": "2024-01-01T00:00:00+00:00"}})

    async def known(channel_id: int) -> Any:
        return thread

    monkeypatch.setattr(adapter.bot, "fetch_channel", known)
    adapter.bot._connection.parse_message_create(_message_in_unloaded_thread(adapter, thread_id + 10))
    await asyncio.sleep(0.5)
    assert sent == [] and await adapter.app.storage.db.fetch_all("SELECT id FROM messages") == []
    adapter.app.config.access.deny_channels.clear()  # (the parent allowed: the thread's message is answered)
    adapter.bot._connection.parse_message_create(_message_in_unloaded_thread(adapter, thread_id + 20))
    await asyncio.sleep(0.5)
    assert len(await adapter.app.storage.db.fetch_all("SELECT id FROM messages")) == 2, sent


async def test_version_choices_are_those_of_the_persona_where_they_are_asked(adapter: DiscordAdapter,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The few seconds' cache of the version choices was per user and file: asked in the DM (Cora) and then in a
    channel whose persona is Nova, the channel offered Cora's versions, and picking one reverted Nova's file."""
    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter, "config", adapter.config.model_copy(update={"admin_ids": [member.id]}))
    await dpytest.message("!persona create Nova")
    await dpytest.empty_queue()
    await _interact(adapter, monkeypatch, "persona", [{"name": "name", "type": 3, "value": "Nova"}],
                    permissions=discord.Permissions(manage_guild=True).value)
    dm = await member.create_dm()
    for n in range(3):
        await _interact(adapter, monkeypatch, "memory", [{"name": "edit", "type": 1, "options": [
            {"name": "file", "type": 3, "value": "memory.md"}, {"name": "content", "type": 3, "value": f"# v{n}"}]}],
            dm_channel=str(dm.id))
    focus = [{"name": "revert", "type": 1, "options": [{"name": "file", "type": 3, "value": "memory.md"},
                                                       {"name": "version", "type": 4, "value": "", "focused": True}]}]
    in_dm = await _interact(adapter, monkeypatch, "memory", focus, kind=4, dm_channel=str(dm.id))
    assert len(in_dm["data"]["choices"]) == 4  # (the template and three edits, with Cora)
    in_channel = await _interact(adapter, monkeypatch, "memory", focus, kind=4)
    assert in_channel["data"]["choices"] == []  # (nothing with Nova yet)


async def test_a_command_with_two_files_asks_for_the_one_it_takes(adapter: DiscordAdapter, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first file was read: a screenshot attached before the card failed the import as "the PNG is
    corrupt", and the card was never looked at."""
    from tests.test_cards import dumps, v2_card

    member = dpytest.get_config().members[0]
    monkeypatch.setattr(adapter, "config", adapter.config.model_copy(update={"admin_ids": [member.id]}))
    (tmp_path / "screenshot.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"0" * 100)
    (tmp_path / "rosa.json").write_bytes(dumps(v2_card(name="Rosa")))

    async def read(self: Any, **kwargs: Any) -> bytes:
        return (tmp_path / self.filename).read_bytes()

    monkeypatch.setattr(discord.Attachment, "read", read)
    dm = await member.create_dm()
    await dpytest.message("!persona import", channel=dm,
                          attachments=[tmp_path / "screenshot.png", tmp_path / "rosa.json"])
    assert dpytest.get_message().content == "2 files came with the command: attach only the one it takes."
    await dpytest.message("!persona import", channel=dm, attachments=[tmp_path / "rosa.json"])
    assert dpytest.get_message().content.startswith("Imported Rosa")


async def test_a_forwarded_message_is_read_as_forwarded(adapter: DiscordAdapter) -> None:
    """A forward's words are in its snapshot, its own content empty: it was answered as a message without text
    ("I read text"), and "Remember this" on it said there was nothing to keep."""
    member = dpytest.get_config().members[0]
    dm = await member.create_dm()
    author = {"id": str(member.id), "username": member.name, "discriminator": "0001", "avatar": None}
    snapshot = {"content": "!memory forget-me confirm — my flight is LH123 on Friday", "type": 0,
                "timestamp": "2024-01-01T00:00:00+00:00", "edited_timestamp": None, "flags": 0, "mentions": [],
                "mention_roles": [], "attachments": [], "embeds": []}
    adapter.bot._connection.parse_message_create({
        "id": "555000000000000002", "channel_id": str(dm.id), "author": author, "content": "",
        "timestamp": "2024-01-01T00:00:00+00:00", "edited_timestamp": None, "tts": False, "mention_everyone": False,
        "mentions": [], "mention_roles": [], "attachments": [], "embeds": [], "pinned": False, "type": 0,
        "message_reference": {"type": 1, "channel_id": "42", "message_id": "43", "guild_id": "44"},
        "message_snapshots": [{"message": snapshot}]})
    for _ in range(50):
        stored = await adapter.app.storage.db.fetch_all("SELECT role, text FROM messages ORDER BY id")
        if len(stored) == 2:
            break
        await asyncio.sleep(0.1)
    assert [tuple(r) for r in stored][0] == (  # (read as forwarded words, never as the sender's command)
        "user", "(forwarded) !memory forget-me confirm — my flight is LH123 on Friday")


async def test_an_answer_after_the_interaction_expired_comes_by_dm(adapter: DiscordAdapter,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow slash command (an export queued behind others) answered after Discord's 15 minutes: the follow-up
    was refused (Invalid Webhook Token), the finished export was lost, and the log said the command failed."""
    import adapters.discord as module

    async def expired(self: Any, webhook_id: Any, token: Any, **kwargs: Any) -> Any:
        raise discord.HTTPException(SimpleNamespace(status=401, reason="Unauthorized"),  # type: ignore[arg-type]
                                    {"code": 50027, "message": "Invalid Webhook Token"})

    sent: list[tuple[str, list[str]]] = []
    original = discord.abc.Messageable.send

    async def spy(self: Any, content: Any = None, **kwargs: Any) -> Any:
        sent.append((type(self).__name__, [f.filename for f in kwargs.get("files") or []]))
        return await original(self, content, **kwargs)

    monkeypatch.setattr(discord.abc.Messageable, "send", spy)
    monkeypatch.setattr(module, "SLASH_PATIENCE", 0.0)  # (it defers at once: its answer is a follow-up)
    monkeypatch.setattr(discord.webhook.async_.AsyncWebhookAdapter, "execute_webhook", expired)
    response = await _interact(adapter, monkeypatch, "memory", [{"name": "export", "type": 1, "options": []}])
    assert response["type"] == 5  # ("thinking…")
    for _ in range(50):
        if sent:
            break
        await asyncio.sleep(0.1)
    assert len(sent) == 1 and sent[0][1][0].startswith("cortex-export-") and sent[0][1][0].endswith(".zip"), sent


async def test_a_webhooks_message_is_not_answered(adapter: DiscordAdapter) -> None:
    """A webhook's message (an integration, a relay) names the webhook as its author, with the user object's
    ``bot`` flag optional: one without it that mentioned the bot was answered as a person's, and stored."""
    channel, me = dpytest.get_config().channels[0], adapter.bot.user
    hook = {"id": "555000000000000300", "username": "Deploys", "discriminator": "0000", "avatar": None}
    adapter.bot._connection.parse_message_create({
        **_message_payload("555000000000000301", SimpleNamespace(id=hook["id"], name="Deploys"), f"<@{me.id}> deploy",
                           channel.id),
        "author": hook, "webhook_id": hook["id"], "guild_id": str(channel.guild.id),
        "mentions": [{"id": str(me.id), "username": me.name, "discriminator": "0001", "avatar": None, "bot": True}]})
    await asyncio.sleep(0.3)
    assert dpytest.verify().message().nothing()
    assert not adapter.app.llm.requests  # type: ignore[attr-defined]
    assert not await adapter.app.storage.db.fetch_all("SELECT id FROM messages")


async def test_a_sticker_in_an_always_answer_channel_gets_no_hint_unless_addressed(
        adapter: DiscordAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a channel the bot answers every message of, each picture or sticker members shared among themselves got
    "Hi, Cora here. I read text": the bot talking over the channel. Addressed (a mention), it still says so."""
    channel, member, me = dpytest.get_config().channels[0], dpytest.get_config().members[0], adapter.bot.user
    access = adapter.app.config.access.model_copy(update={"always_answer_channels": [f"discord:{channel.id}"]})
    monkeypatch.setattr(adapter.app.router.config, "access", access)
    author = {"id": str(member.id), "username": member.name, "discriminator": "0001", "avatar": None}
    bot = {"id": str(me.id), "username": me.name, "discriminator": "0001", "avatar": None, "bot": True}
    for number, mentions in ((1, []), (2, [bot])):
        adapter.bot._connection.parse_message_create({
            **_message_payload(f"55500000000000040{number}", member, f"<@{me.id}>" if mentions else "", channel.id),
            "author": author, "guild_id": str(channel.guild.id), "mentions": mentions,
            "sticker_items": [{"id": "749054660769218631", "name": "Wave", "format_type": 1}]})
        await asyncio.sleep(0.3)
    assert "I read text" in dpytest.get_message().content  # (the mention's)
    assert dpytest.verify().message().nothing()
    assert not adapter.app.llm.requests  # type: ignore[attr-defined]
