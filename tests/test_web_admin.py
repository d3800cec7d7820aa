"""The web page's admin routes, served by the real bot on 127.0.0.1: who may see and change what (bot admins
everything bot-wide, a server's admins that server's guidelines and settings, asked live through the
platform's admin directory), versions with history for souls, guidelines and rules, settings with their
sources, token spending per day, the job queue with retry, the users (counts, never text), 4xx for bad
input; and the Discord and Matrix admin directories over stand-ins of their clients."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import aiohttp
import discord
import pytest
from nio import MatrixRoom

from adapters.admin_directory import DiscordAdminDirectory, MatrixAdminDirectory
from bot.config import DiscordConfig, MatrixConfig
from bot.ports import ServerRef
from bot.storage.base import LLMCallRecord
from tests.web_support import Client, context, running_bot

pytestmark = pytest.mark.both_engines

ANN_SERVER = "discord:1"
OTHER_SERVER = "discord:2"


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_WEB_TEST_KEY", "test-key")


class FakeDirectory:
    """Discord as the web page sees it: discord:ann administers discord:1, nobody else anything."""

    platform = "discord"

    def __init__(self) -> None:
        self.admins = {"discord:ann": {ANN_SERVER}}
        self.asked: list[tuple[str, str]] = []

    async def is_admin(self, user_key: str, server_key: str) -> bool:
        self.asked.append((user_key, server_key))
        return server_key in self.admins.get(user_key, set())

    async def servers(self, user_key: str) -> list[ServerRef]:
        return [ServerRef(key, f"Server {key}") for key in sorted(self.admins.get(user_key, set()))]


def guidelines_path(server: str) -> str:
    return f"/api/admin/servers/{quote(server, safe='')}/guidelines"


BOT_WIDE_ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/api/admin/personas", None),
    ("PUT", "/api/admin/personas/Cora/sections/identity", {"text": "You are Cora."}),
    ("POST", "/api/admin/personas/Cora/sections/identity/revert", {"version": 1}),
    ("GET", "/api/admin/rules", None),
    ("POST", "/api/admin/rules", {"name": "kind", "text": "Be kind."}),
    ("PUT", "/api/admin/rules/kind", {"text": "Be kinder."}),
    ("GET", "/api/admin/settings?persona=Cora", None),
    ("PUT", "/api/admin/settings", {"persona": "Cora", "server": None, "key": "context_limit", "value": "40"}),
    ("GET", "/api/admin/budgets", None),
    ("GET", "/api/admin/jobs", None),
    ("POST", "/api/admin/jobs/1/retry", None),
    ("GET", "/api/admin/users", None),
    ("GET", guidelines_path("*"), None),
]


async def assert_refused(client: Client, routes: list[tuple[str, str, Any]]) -> None:
    for method, path, body in routes:
        status, answer = await client.call(method, path, body)
        assert status == 403, (method, path, answer)
        assert "admins" in answer["error"]


async def test_non_admins_get_403_on_every_admin_route(tmp_path: Path) -> None:
    directory = FakeDirectory()
    async with running_bot(tmp_path, directories=[directory]) as bot, bot.client("bob") as bob:
        status, overview = await bob.call("GET", "/api/admin/overview")
        assert status == 200
        assert overview["is_bot_admin"] is False and overview["servers"] == []
        assert overview["personas"] == ["Cora", "Vex"]
        server_routes: list[tuple[str, str, Any]] = [
            ("GET", guidelines_path(ANN_SERVER), None), ("PUT", guidelines_path(ANN_SERVER), {"text": "x"}),
            ("POST", guidelines_path(ANN_SERVER) + "/revert", {"version": 1}),
            ("GET", f"/api/admin/settings?persona=Cora&server={ANN_SERVER}", None),
            ("PUT", "/api/admin/settings", {"persona": "Cora", "server": ANN_SERVER, "key": "enabled", "value": "off"}),
        ]
        await assert_refused(bob, BOT_WIDE_ROUTES + server_routes)
        assert ("discord:bob", ANN_SERVER) in directory.asked  # asked live, not from the session
        assert (await bot.app.storage.personas.history("guidelines", ANN_SERVER, "")) == []
        async with aiohttp.ClientSession(base_url=bot.url) as anonymous:
            async with anonymous.get("/api/admin/overview") as response:
                assert response.status == 401


async def test_a_server_admin_edits_and_reverts_their_servers_guidelines_only(tmp_path: Path) -> None:
    async with running_bot(tmp_path, directories=[FakeDirectory()]) as bot, bot.client("ann") as ann:
        status, overview = await ann.call("GET", "/api/admin/overview")
        assert overview["servers"] == [{"key": ANN_SERVER, "name": f"Server {ANN_SERVER}"}]
        path = guidelines_path(ANN_SERVER)
        status, empty = await ann.call("GET", path)
        assert status == 200 and empty["text"] == "" and empty["version"] == 0 and empty["history"] == []
        status, first = await ann.call("PUT", path, {"text": "  Keep it friendly.  "})
        assert status == 200 and first["version"] == 1 and first["text"] == "Keep it friendly."
        status, second = await ann.call("PUT", path, {"text": "No spoilers."})
        assert second["version"] == 2 and [h["version"] for h in second["history"]] == [2, 1]
        assert second["history"][0]["author"] == "discord:ann" and "web page" in second["history"][0]["reason"]
        assert bot.app.personas.guidelines_for(ANN_SERVER) == ("No spoilers.", ANN_SERVER)  # the prompt follows
        status, back = await ann.call("POST", path + "/revert", {"version": 1})
        assert status == 200 and back["version"] == 3 and back["text"] == "Keep it friendly."
        assert back["history"][0]["reason"] == "reverted to version 1"
        status, _ = await ann.call("POST", path + "/revert", {"version": 99})
        assert status == 404
        status, error = await ann.call("PUT", path, {"text": "x" * 8001})
        assert status == 422 and "8,000" in error["error"]
        await assert_refused(ann, [("GET", guidelines_path(OTHER_SERVER), None),
                                   ("PUT", guidelines_path(OTHER_SERVER), {"text": "mine now"}),
                                   *BOT_WIDE_ROUTES])
        status, settings = await ann.call("GET", f"/api/admin/settings?persona=Vex&server={quote(ANN_SERVER)}")
        assert status == 200 and settings["persona"] == "Vex" and settings["server"] == ANN_SERVER


async def test_a_bot_admin_edits_a_soul_section_as_a_new_version(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        status, overview = await admin.call("GET", "/api/admin/overview")
        assert status == 200 and overview["is_bot_admin"] is True
        path = "/api/admin/personas/cora/sections/identity"
        status, saved = await admin.call("PUT", path, {"text": "You are Cora, a calm librarian. {mood}"})
        assert status == 200, saved
        assert saved["name"] == "identity" and saved["version"] >= 1 and saved["unknown_variables"] == ["{mood}"]
        assert saved["history"][0] | {"created_at": ""} == {
            "version": saved["version"], "author": "discord:999", "reason": "edited on the web page",
            "created_at": "", "enabled": True, "chars": len(saved["text"])}
        assert ("identity", "You are Cora, a calm librarian. {mood}") in bot.app.personas.persona("Cora").sections
        status, again = await admin.call("PUT", path, {"text": "You are Cora, a cheerful librarian."})
        assert again["version"] == saved["version"] + 1
        status, personas = await admin.call("GET", "/api/admin/personas")
        cora = next(p for p in personas["personas"] if p["name"] == "Cora")
        assert [p["language"] for p in personas["personas"]] == ["English", "German"]
        identity = next(s for s in cora["sections"] if s["name"] == "identity")
        assert identity["text"] == "You are Cora, a cheerful librarian." and len(identity["history"]) >= 2
        status, back = await admin.call("POST", path + "/revert", {"version": saved["version"]})
        assert status == 200 and back["text"] == saved["text"]
        for bad, expected in (("/api/admin/personas/Nobody/sections/identity", 404),
                              ("/api/admin/personas/Cora/sections/identiy", 422),  # a typo: not a section of its own
                              ("/api/admin/personas/Cora/sections/no%20such%20section!", 422)):
            status, _ = await admin.call("PUT", bad, {"text": "x"})
            assert status == expected, bad
        status, error = await admin.call("PUT", "/api/admin/personas/Cora/sections/identiy", {"text": "x"})
        assert "did you mean identity?" in error["error"]
        # a section of the admin's own, as !persona edit makes one (not without text)
        status, error = await admin.call("PUT", "/api/admin/personas/Cora/sections/backstory", {"text": " "})
        assert status == 422 and "a new section needs its text" in error["error"]
        status, own = await admin.call("PUT", "/api/admin/personas/Cora/sections/Backstory", {"text": "Born in Lyon."})
        assert status == 200 and own["name"] == "backstory" and own["version"] == 1
        status, listed = await admin.call("GET", "/api/admin/personas")
        cora = next(p for p in listed["personas"] if p["name"] == "Cora")
        assert any(sec["name"] == "backstory" and sec["text"] == "Born in Lyon." for sec in cora["sections"])
        status, error = await admin.call("POST", "/api/admin/personas/Cora/sections/hobbies/revert", {"version": 1})
        assert status == 404 and "backstory" in error["error"]  # (named among the persona's sections)
        # as long as a character card's field may be (a section imported from one is edited as it came)
        status, long = await admin.call("PUT", path, {"text": "Long. " + "y" * 19_994})
        assert status == 200 and len(long["text"]) == 20_000
        status, error = await admin.call("PUT", path, {"text": "y" * 20_001})
        assert status == 422 and "20,000" in error["error"]


async def test_a_bot_admin_adds_edits_and_switches_off_a_rule(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        status, added = await admin.call("POST", "/api/admin/rules", {"name": "Kind", "text": "Be kind."})
        assert status == 200 and added["name"] == "kind" and added["version"] == 1 and added["enabled"]
        status, _ = await admin.call("POST", "/api/admin/rules", {"name": "kind", "text": "Again."})
        assert status == 409
        status, edited = await admin.call("PUT", "/api/admin/rules/kind", {"text": "Be kind and brief."})
        assert status == 200 and edited["version"] == 2 and edited["text"] == "Be kind and brief."
        status, off = await admin.call("PUT", "/api/admin/rules/kind", {"enabled": False})
        assert off["version"] == 3 and off["enabled"] is False and off["text"] == "Be kind and brief."
        assert off["history"][0]["reason"] == "switched off on the web page"
        assert [(r.name, r.enabled) for r in bot.app.personas.rules()] == [("kind", False)]
        status, same = await admin.call("PUT", "/api/admin/rules/kind", {"enabled": False})
        assert same["version"] == 3 and same["changed"] is False
        status, listed = await admin.call("GET", "/api/admin/rules")
        assert [{k: r[k] for k in ("name", "text", "enabled", "position", "version")} for r in listed["rules"]] == [
            {"name": "kind", "text": "Be kind and brief.", "enabled": False, "position": 1, "version": 3}]
        status, back = await admin.call("POST", "/api/admin/rules/kind/revert", {"version": 1})
        # (a text comes back; the rule stays off, as the admin switched it: not back on unasked)
        assert back["text"] == "Be kind." and back["enabled"] is False and back["version"] == 4
        for body, expected in (({}, 422), ({"text": "   "}, 422), ({"text": "z" * 2001}, 422),
                               ({"enabled": "no"}, 422)):
            status, _ = await admin.call("PUT", "/api/admin/rules/kind", body)
            assert status == expected, body
        for name in ("nope", "NOT A NAME"):
            status, _ = await admin.call("PUT", f"/api/admin/rules/{quote(name)}", {"enabled": True})
            assert status == 404, name


def setting(view: dict[str, Any], key: str) -> dict[str, Any]:
    return next(s for s in view["settings"] if s["key"] == key)


async def test_a_model_the_llm_server_refuses_is_not_set_from_the_page(tmp_path: Path) -> None:
    from bot.llm.errors import LLMBadRequest, LLMOverloaded

    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        llm = bot.app.llm
        llm.enqueue(LLMBadRequest("HTTP 404: model: ghost-model", status_code=404))  # type: ignore[attr-defined]
        body = {"persona": "Cora", "key": "model", "value": "ghost-model"}
        status, error = await admin.call("PUT", "/api/admin/settings", body)
        assert status == 422 and "refused a request for ghost-model" in error["error"], error
        assert "it offers scripted-model" in error["error"]
        assert "model" not in await bot.app.cortex.store.settings("persona:cora")
        status, saved = await admin.call("PUT", "/api/admin/settings", body | {"value": "scripted-model"})
        assert status == 200 and saved["note"] == "" and setting(saved, "model")["value"] == "scripted-model"
        llm.enqueue(LLMOverloaded("HTTP 529"))  # type: ignore[attr-defined]
        status, saved = await admin.call("PUT", "/api/admin/settings", body | {"value": "an-alias"})
        assert status == 200 and saved["note"].startswith("not checked: a test request for an-alias failed")


async def test_settings_show_their_sources_and_a_server_override_changes_the_effective_value(
        tmp_path: Path) -> None:
    async with running_bot(tmp_path, directories=[FakeDirectory()]) as bot, \
            bot.client("999") as admin, bot.client("ann") as ann:
        status, view = await admin.call("GET", "/api/admin/settings?persona=Cora")
        assert status == 200 and view["server"] is None
        assert setting(view, "context_limit") | {"accepts": ""} == {
            "key": "context_limit", "value": 60, "shown": "60", "source": "config", "overridable": True,
            "accepts": ""}
        assert setting(view, "file_max_chars")["overridable"] is False
        assert view["tiers"] == [{"percent": 50, "at": 30}, {"percent": 75, "at": 45}, {"percent": 95, "at": 57}]
        change = {"persona": "Cora", "server": ANN_SERVER, "key": "context_limit", "value": "40"}
        status, error = await ann.call("PUT", "/api/admin/settings", change)  # more updates: on the operator's bill
        assert status == 403 and "context_limit at least 60 messages per cycle" in error["error"], error
        change["value"] = "80"
        status, changed = await ann.call("PUT", "/api/admin/settings", change)
        assert status == 200, changed
        assert setting(changed, "context_limit")["value"] == 80
        assert setting(changed, "context_limit")["source"] == f"server:{ANN_SERVER}"
        assert changed["tiers"][0] == {"percent": 50, "at": 40}
        effective = await bot.app.cortex.resolver.effective("Cora", ANN_SERVER)
        assert effective.settings.context_limit == 80
        assert (await bot.app.cortex.resolver.effective("Cora")).settings.context_limit == 60
        status, _ = await ann.call("PUT", "/api/admin/settings", change | {"server": OTHER_SERVER})
        assert status == 403
        for key, value in (("model", "the-most-expensive-model"), ("daily_token_budget", "0"), ("max_rounds", "50")):
            status, error = await ann.call("PUT", "/api/admin/settings", change | {"key": key, "value": value})
            assert status == 403 and "operator pays" in error["error"], key  # her server, the operator's bill
        status, _ = await admin.call("PUT", "/api/admin/settings", change | {"key": "max_rounds", "value": "5"})
        assert status == 200  # a bot admin may, also for one server
        status, _ = await ann.call("PUT", "/api/admin/settings", change | {"server": None})
        assert status == 403
        status, persona_wide = await admin.call("PUT", "/api/admin/settings",
                                                change | {"server": None, "key": "frequency", "value": "rare"})
        assert setting(persona_wide, "frequency")["source"] == "persona:cora"
        status, cleared = await ann.call("PUT", "/api/admin/settings", change | {"value": "default"})
        assert setting(cleared, "context_limit") | {"accepts": ""} == {
            "key": "context_limit", "value": 60, "shown": "60", "source": "config", "overridable": True,
            "accepts": ""}
        for bad, expected in (({"value": "2"}, 422), ({"key": "file_max_chars"}, 422), ({"key": "nope"}, 422),
                              ({"value": "lots"}, 422), ({"persona": "Nobody"}, 404), ({"server": "bogus"}, 400)):
            status, error = await admin.call("PUT", "/api/admin/settings", change | bad)
            assert status == expected, (bad, error)
        status, error = await admin.call("PUT", "/api/admin/settings", change | {"value": "2"})
        assert "at least 4" in error["error"]
        status, _ = await admin.call("GET", "/api/admin/settings?persona=Nobody")
        assert status == 404
        # Private memory in group channels: on for the persona, off for Ann's server by a bot admin; Ann may
        # not switch it on there, neither by "on" nor by going back to the default (which is on).
        privacy = change | {"key": "use_in_groups"}
        for server, value in ((None, "on"), (ANN_SERVER, "off")):
            status, _ = await admin.call("PUT", "/api/admin/settings", privacy | {"server": server, "value": value})
            assert status == 200
        for value in ("on", "default"):
            status, error = await ann.call("PUT", "/api/admin/settings", privacy | {"value": value})
            assert status == 403 and "only the bot's admins switch it on" in error["error"], value
        assert not (await bot.app.cortex.resolver.effective("Cora", ANN_SERVER)).settings.use_in_groups
        status, error = await ann.call("PUT", "/api/admin/settings", privacy | {"value": "maybe"})
        assert status == 422 and "use_in_groups" in error["error"]  # a value it does not take, not a refusal


async def test_jobs_are_listed_and_a_failed_one_is_retried(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        storage = bot.app.storage
        job = await storage.enqueue_job("test-kind", "pair:1", {"x": 1}, 3)
        assert job is not None
        claimed = await storage.claim_job("worker-1", ["test-kind"], 30)
        assert claimed is not None and claimed.id == job.id
        assert await storage.fail_job(job.id, "the model said no", "worker-1")
        waiting = await storage.enqueue_job("test-kind", "pair:2", {}, 3)
        assert waiting is not None
        status, listed = await admin.call("GET", "/api/admin/jobs?status=failed")
        assert status == 200 and listed["counts"]["failed"] == 1 and listed["counts"]["queued"] >= 1
        fields = ("id", "kind", "key", "status", "attempts", "last_error")
        assert [tuple(j[f] for f in fields) for j in listed["jobs"]] == [
            (job.id, "test-kind", "pair:1", "failed", 1, "the model said no")]
        assert "payload" not in listed["jobs"][0] and listed["jobs"][0]["created_at"] and listed["jobs"][0]["run_after"]
        status, retried = await admin.call("POST", f"/api/admin/jobs/{job.id}/retry")
        assert status == 200 and retried["status"] == "queued" and retried["attempts"] == 0
        stored = await storage.get_job(job.id)
        assert stored is not None and stored.status == "queued"
        for path, expected in ((f"/api/admin/jobs/{job.id}/retry", 409), (f"/api/admin/jobs/{waiting.id}/retry", 409),
                               ("/api/admin/jobs/99999/retry", 404), ("/api/admin/jobs/abc/retry", 400),
                               ("/api/admin/jobs/0/retry", 400)):
            status, error = await admin.call("POST", path)
            assert status == expected and "error" in error, path
        status, _ = await admin.call("GET", "/api/admin/jobs?status=lost")
        assert status == 400
        status, everything = await admin.call("GET", "/api/admin/jobs")
        assert {j["id"] for j in everything["jobs"]} >= {job.id, waiting.id} and everything["older"] is None


async def test_the_job_queue_is_shown_a_page_at_a_time(tmp_path: Path) -> None:
    """A queue of more than 100 jobs showed its newest 100 and nothing else: the older ones come a page at a time."""
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        storage = bot.app.storage
        made = [await storage.enqueue_job("test-kind", f"page:{n}", {}, 3, run_after=datetime.now(UTC) + timedelta(
            days=1)) for n in range(205)]
        ids = sorted((j.id for j in made if j is not None), reverse=True)
        assert len(ids) == 205
        status, first = await admin.call("GET", "/api/admin/jobs?status=queued")
        assert status == 200 and [j["id"] for j in first["jobs"]][:100] == ids[:100] and len(first["jobs"]) == 100
        status, second = await admin.call("GET", f"/api/admin/jobs?status=queued&before={first['older']}")
        assert status == 200 and [j["id"] for j in second["jobs"]] == ids[100:200]
        status, last = await admin.call("GET", f"/api/admin/jobs?status=queued&before={second['older']}")
        assert status == 200 and [j["id"] for j in last["jobs"]] == ids[200:] and last["older"] is None
        assert first["counts"]["queued"] == last["counts"]["queued"] >= 205  # (counts are of the whole queue)
        for bad in ("abc", "0", "-5", "1e3", "", "9" * 30):
            status, error = await admin.call("GET", f"/api/admin/jobs?before={bad}")
            assert status == 400 and "job id" in error["error"], bad


async def test_budgets_show_the_tokens_spent_per_day_and_purpose(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        storage = bot.app.storage
        for purpose, tokens in (("reply", 100), ("reply", 50), ("summary", 30)):
            await storage.record_llm_call(LLMCallRecord(purpose, "model-a", tokens, tokens // 10, 5))
        real = time.time
        for days_ago in (1, 30):
            monkeypatch.setattr(time, "time", lambda d=days_ago: real() - d * 86_400)
            await storage.record_llm_call(LLMCallRecord("cortex", "model-a", 7, 3, 5))
        monkeypatch.setattr(time, "time", real)
        status, spent = await admin.call("GET", "/api/admin/budgets")
        assert status == 200
        today = datetime.now(UTC).date()
        days = spent["days"]
        assert [d["date"] for d in days] == [(today - timedelta(days=i)).isoformat() for i in range(14)]
        assert days[0]["by_purpose"] == {"reply": {"input": 150, "output": 15, "calls": 2},
                                         "summary": {"input": 30, "output": 3, "calls": 1}}
        assert (days[0]["input"], days[0]["output"]) == (180, 18)
        assert days[1]["by_purpose"] == {"cortex": {"input": 7, "output": 3, "calls": 1}}
        assert sum(d["input"] for d in days) == 187  # 30 days ago is not on the page
        budgets = spent["budgets"]
        assert budgets["cortex"]["daily_token_budget"] == 200_000
        assert budgets["cortex"]["bot_daily_token_budget"] == 2_000_000
        assert budgets["cortex_spent_today"] == 0 and budgets["bot_remaining_today"] == 2_000_000
        assert budgets["reply_prompt"]["history_tokens"] == bot.app.config.history.history_tokens


async def test_the_users_list_has_counts_and_no_text(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        await bot.app.commands.dispatch("!memory remember Ann's cat is called Pixel", context("ann"))
        storage = bot.app.storage
        user = await storage.upsert_user("discord:ann", "Ann")
        channel = await storage.upsert_channel("discord:dm-ann", "dm", True)
        await storage.add_message(channel.id, user.id, "Cora", "user", "Ann", "my secret password is hunter2", 8)
        await storage.add_message(channel.id, user.id, "Cora", "assistant", "Cora", "noted", 1)
        status, raw = await admin.call("GET", "/api/admin/users")
        assert status == 200
        ann = next(u for u in raw["users"] if u["key"] == "discord:ann")
        assert {k: ann[k] for k in ("name", "messages", "items", "pairs")} == {
            "name": "Ann", "messages": 1, "items": 1, "pairs": 1}
        assert ann["last_seen"].startswith(str(datetime.now(UTC).year))
        assert raw["users"][0]["key"] == "discord:ann"  # the most recently seen first
        assert raw["total"] >= 2
        shown = str(raw)
        assert "hunter2" not in shown and "Pixel" not in shown


async def test_a_bot_admin_sees_servers_with_guidelines_and_may_edit_the_bot_wide_default(tmp_path: Path) -> None:
    async with running_bot(tmp_path, directories=[FakeDirectory()]) as bot, \
            bot.client("ann") as ann, bot.client("999") as admin:
        status, _ = await ann.call("PUT", guidelines_path(ANN_SERVER), {"text": "Be nice here."})
        assert status == 200
        status, overview = await admin.call("GET", "/api/admin/overview")
        assert {"key": ANN_SERVER, "name": ANN_SERVER} in overview["servers"]
        status, other = await admin.call("PUT", guidelines_path(OTHER_SERVER), {"text": "Admins go anywhere."})
        assert status == 200 and other["version"] == 1
        status, default = await admin.call("PUT", guidelines_path("*"), {"text": "Be polite."})
        assert status == 200 and bot.app.personas.guidelines_for("discord:3") == ("Be polite.", "*")
        status, cleared = await ann.call("PUT", guidelines_path(ANN_SERVER), {"text": ""})
        assert cleared["version"] == 2 and cleared["history"][0]["reason"] == "cleared on the web page"


async def test_bad_input_is_a_json_4xx(tmp_path: Path) -> None:
    async with running_bot(tmp_path, directories=[FakeDirectory()], max_body_kb=16) as bot, \
            bot.client("999") as admin:
        path = "/api/admin/personas/Cora/sections/identity"
        headers = {"X-CSRF-Token": admin.csrf, "Content-Type": "application/json"}
        for raw, expected in ((b"{not json", 400), (b"[1]", 400), (b'{"text": 5}', 422), (b"{}", 422),
                              (b'{"text": "x", "more": 1}', 422), (b'{"text": "' + b"a" * 20_000 + b'"}', 413)):
            async with admin.http.put(path, data=raw, headers=headers) as response:
                assert response.status == expected, (raw[:30], await response.text())
                assert "error" in await response.json()
        for method, bad, body, expected in (
                ("GET", "/api/admin/servers/not-a-key/guidelines", None, 400),
                ("GET", guidelines_path("discord:1 2"), None, 400),
                ("PUT", guidelines_path("matrix:!room\x07:example.org"), {"text": "Be kind."}, 400),  # a control char
                ("PUT", guidelines_path("matrix:!room\u0085:example.org"), {"text": "Be kind."}, 400),
                ("PUT", guidelines_path("matrix:!room\u202e:example.org"), {"text": "Be kind."}, 400),  # invisible
                ("POST", guidelines_path(ANN_SERVER) + "/revert", {"version": "1"}, 422),
                ("POST", guidelines_path(ANN_SERVER) + "/revert", {"version": 0}, 422),
                ("GET", f"/api/admin/settings?persona=Cora&server={quote('*')}", None, 400),
                ("PUT", "/api/admin/settings", {"persona": "Cora", "key": "enabled"}, 422),
                ("GET", "/api/admin/nothing", None, 404)):
            status, error = await admin.call(method, bad, body)
            assert status == expected and "error" in error, (method, bad, error)


# -- the directories over stand-ins of the platforms' clients -------------------------------------------


def member(user_id: int, *, manage: bool = False, administrator: bool = False) -> Any:
    return SimpleNamespace(id=user_id, guild_permissions=SimpleNamespace(manage_guild=manage,
                                                                         administrator=administrator))


class FakeGuild:
    def __init__(self, guild_id: int, name: str, cached: list[Any], remote: list[Any]) -> None:
        self.id, self.name = guild_id, name
        self.cached = {m.id: m for m in cached}
        self.remote = {m.id: m for m in remote}
        self.fetched: list[int] = []

    def get_member(self, user_id: int) -> Any:
        return self.cached.get(user_id)

    async def fetch_member(self, user_id: int) -> Any:
        self.fetched.append(user_id)
        if user_id not in self.remote:
            raise discord.NotFound(SimpleNamespace(status=404, reason="Not Found"), "Unknown Member")
        return self.remote[user_id]


async def test_the_discord_directory_asks_the_guilds_member_permissions() -> None:
    guilds = [FakeGuild(1, "Books", [member(10, manage=True)], [member(11, administrator=True), member(12)]),
              FakeGuild(2, "Games", [member(10)], [])]
    client = SimpleNamespace(guilds=guilds, get_guild=lambda gid: next((g for g in guilds if g.id == gid), None))
    directory = DiscordAdminDirectory(client, DiscordConfig(admin_ids=[77]))
    assert await directory.is_admin("discord:10", "discord:1")
    assert await directory.is_admin("discord:11", "discord:1")  # not cached: fetched from Discord
    for user, server in (("discord:12", "discord:1"), ("discord:13", "discord:1"), ("discord:10", "discord:2"),
                         ("discord:10", "discord:3"), ("discord:abc", "discord:1"), ("discord:10", "discord:x"),
                         ("matrix:@a:b", "discord:1"), ("discord:10", "matrix:b")):
        assert not await directory.is_admin(user, server), (user, server)
    assert await directory.servers("discord:10") == [ServerRef("discord:1", "Books")]
    assert await directory.servers("discord:77") == [ServerRef("discord:1", "Books"), ServerRef("discord:2", "Games")]
    assert await directory.servers("matrix:@x:y") == [] and await directory.servers("discord:") == []


async def test_the_matrix_directory_makes_a_room_admin_admin_of_that_room_only() -> None:
    group = MatrixRoom("!group:example.org", "@bot:example.org")
    other = MatrixRoom("!other:example.org", "@bot:example.org")  # eve made it: she is admin there only
    dm = MatrixRoom("!dm:example.org", "@bot:example.org")
    for user in ("@ann:example.org", "@bob:example.org", "@eve:other.net", "@bot:example.org"):
        group.add_member(user, None, None)
    for user in ("@eve:other.net", "@mal:other.net", "@bot:example.org"):
        other.add_member(user, None, None)
    for user in ("@cat:example.org", "@bot:example.org"):
        dm.add_member(user, None, None)
    group.power_levels.users.update({"@ann:example.org": 50})
    other.power_levels.users.update({"@eve:other.net": 100})
    dm.power_levels.users["@cat:example.org"] = 100
    client = SimpleNamespace(rooms={r.room_id: r for r in (group, other, dm)})
    def level(room: MatrixRoom, user_id: str) -> int:  # (the adapter's rule: bob made the group, of version 12)
        creator = room is group and user_id == "@bob:example.org"
        return 100 if creator else int(room.power_levels.get_user_level(user_id))

    directory = MatrixAdminDirectory(client, MatrixConfig(admin_ids=["@root:example.org"]), level)
    for user in ("@ann:example.org", "@bob:example.org", "@root:example.org"):  # power 50, creator, bot admin
        assert await directory.is_admin(f"matrix:{user}", "matrix:!group:example.org"), user
    assert await directory.is_admin("matrix:@eve:other.net", "matrix:!other:example.org")
    for user, server in (("matrix:@eve:other.net", "matrix:!group:example.org"),  # admin of her own room only
                         ("matrix:@eve:other.net", "matrix:other.net"),  # a homeserver is no server here
                         ("matrix:@ann:example.org", "matrix:example.org"),
                         ("matrix:@cat:example.org", "matrix:!dm:example.org"),  # power 100 in a DM only
                         ("matrix:@ann:example.org", "matrix:!unknown:example.org"),
                         ("matrix:@ann:example.org", "discord:1"), ("discord:1", "matrix:!group:example.org"),
                         ("matrix:ann", "matrix:!group:example.org"), ("matrix:@ann:example.org", "matrix:")):
        assert not await directory.is_admin(user, server), (user, server)
    assert [s.key for s in await directory.servers("matrix:@ann:example.org")] == ["matrix:!group:example.org"]
    assert [s.key for s in await directory.servers("matrix:@eve:other.net")] == ["matrix:!other:example.org"]
    assert await directory.servers("matrix:@cat:example.org") == []
    assert await directory.servers("discord:10") == []


async def test_saving_an_untouched_unset_model_leaves_it_unset(tmp_path: Path) -> None:
    """The page shows an unset model as "not set" and sends that text back on Save: it was stored as the
    model's name, and every cortex update of the persona then asked the provider for a model "not set"."""
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        for shown_value in ("not set", "", "Not Set"):
            status, saved = await admin.call("PUT", "/api/admin/settings", {
                "persona": "Cora", "server": None, "key": "model", "value": shown_value})
            assert status == 200, saved
            assert (await bot.app.cortex.resolver.effective("Cora")).settings.model is None


SETTINGS = "/api/admin/settings"


async def test_a_server_admin_cannot_undo_an_off_for_privacy_by_naming_another_persona(tmp_path: Path) -> None:
    """A server's override applies to every persona in it: clearing it (by whichever persona the request names)
    let Cora's persona-wide "on" through, where the bot's admins had switched DM memory off for that server."""
    async with running_bot(tmp_path, directories=[FakeDirectory()]) as bot, \
            bot.client("999") as admin, bot.client("ann") as ann:
        assert (await admin.call("PUT", SETTINGS, {"persona": "Cora", "key": "use_in_groups", "value": "on"}))[0] == 200
        assert (await admin.call("PUT", SETTINGS, {"persona": "Cora", "server": "discord:1",
                                                    "key": "use_in_groups", "value": "off"}))[0] == 200
        for persona in ("Cora", "Vex"):
            status, body = await ann.call("PUT", SETTINGS, {"persona": persona, "server": "discord:1",
                                                            "key": "use_in_groups", "value": "default"})
            assert status == 403 and "only the bot's admins switch it on" in body["error"]
        resolver = bot.app.cortex.resolver
        resolver._cache.clear()
        assert (await resolver.effective("Cora", "discord:1")).settings.use_in_groups is False


async def test_a_server_setting_change_counts_once_against_the_limit(tmp_path: Path) -> None:
    async with running_bot(tmp_path, directories=[FakeDirectory()]) as bot, bot.client("ann") as ann:
        per = bot.app.router.command_limiter.per_minute
        statuses = [(await ann.call("PUT", SETTINGS, {"persona": "Cora", "server": "discord:1",
                                                      "key": "context_limit", "value": str(60 + i)}))[0]
                    for i in range(per + 1)]
        assert statuses == [200] * per + [429]


async def test_a_rule_name_ending_in_a_newline_is_refused(tmp_path: Path) -> None:
    """"kind\\n" passed the name's pattern ("$" matches before a final newline): two rules that look alike."""
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        assert (await admin.call("POST", "/api/admin/rules", {"name": "kind", "text": "Be kind."}))[0] == 200
        assert (await admin.call("POST", "/api/admin/rules", {"name": "kind\n", "text": "Other text."}))[0] == 422
        assert (await admin.call("PUT", "/api/admin/rules/" + quote("kind\n"), {"enabled": False}))[0] in (400, 404,
                                                                                                        422)
        status, body = await admin.call("GET", "/api/admin/rules")
        assert [r["name"] for r in body["rules"]] == ["kind"]


async def test_two_admins_editing_the_same_version_of_a_text_get_a_conflict(tmp_path: Path) -> None:
    """Two tabs (or two admins) editing the same guidelines, section or rule: the second save silently replaced
    the first. An edit that names the version it started from is a 409 once another one landed."""
    async with running_bot(tmp_path, directories=[FakeDirectory()]) as bot, bot.client("ann") as ann, \
            bot.client("999") as admin:
        await admin.call("POST", "/api/admin/rules", {"name": "kind", "text": "Be kind."})
        for client, path in ((ann, guidelines_path(ANN_SERVER)), (admin, "/api/admin/personas/Cora/sections/identity"),
                             (admin, "/api/admin/rules/kind")):
            status, seen = await client.call("PUT", path, {"text": "Where both tabs start."})
            assert status == 200, seen
            status, first = await client.call("PUT", path, {"text": "First tab.", "version": seen["version"]})
            assert status == 200 and first["version"] == seen["version"] + 1, first
            status, error = await client.call("PUT", path, {"text": "Second tab.", "version": seen["version"]})
            assert status == 409 and "changed meanwhile" in error["error"], (path, error)
            status, again = await client.call("PUT", path, {"text": "Second tab.", "version": first["version"]})
            assert status == 200 and again["text"] == "Second tab.", again
        assert bot.app.personas.guidelines_for(ANN_SERVER) == ("Second tab.", ANN_SERVER)


async def test_concurrent_edits_based_on_one_version_of_a_text_land_once(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        texts = bot.app.storage.personas
        results = await asyncio.gather(*(texts.put_based_on(0, "guidelines", ANN_SERVER, "", f"text {n}",
                                                            author="discord:999") for n in range(6)))
        landed = [r for r in results if r is not None]
        assert len(landed) == 1 and landed[0].version == 1, results
        history = await texts.history("guidelines", ANN_SERVER, "")
        assert [v.content for v in history] == [landed[0].content]
        assert await texts.put_based_on(0, "guidelines", ANN_SERVER, "", "late", author="discord:999") is None
