"""Forget-me while work about the user is still running: a reply waiting on the model, a summary being
written. Nothing of theirs may come back once forget-me said it is gone."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.llm.base import Completion, LLMRequest, ToolCall, Usage
from bot.ports import IncomingMessage
from cortex.memory.embedders import HashEmbedder
from cortex.memory.vectors import VectorIndex
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider

pytestmark = pytest.mark.both_engines

SECRET = "zebraquokka"
ANN = CommandContext("discord", "discord:ann", "Ann", "discord:dm-ann", "Cora", is_dm=True)


class HeldProvider(ScriptedProvider):
    """Answers its first call only once ``release`` is set (``waiting`` says it is being asked)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting, self.release = asyncio.Event(), asyncio.Event()

    async def _next(self, request: LLMRequest) -> Completion:
        if len(self.requests) == 0:
            self.waiting.set()
            await self.release.wait()
        return await super()._next(request)


def _config(tmp_path: Path, **sections: dict) -> object:
    return parse_config({"storage": {"url": db_url_for(tmp_path)}, "personas": [{"name": "Cora"}], **sections})


async def _rows(app: App, table: str) -> list[dict]:
    return [dict(r) for r in await app.storage.db.fetch_all(f"SELECT * FROM {table}")]


async def test_a_reply_waiting_on_the_model_stores_nothing_after_forget_me(tmp_path: Path) -> None:
    """Its remember call made the user, a pair, the item and the audit row again (by the user's key)."""
    llm = HeldProvider()
    arguments = {"content": f"Ann's PIN is {SECRET}"}
    llm.enqueue(Completion("", (ToolCall("t1", "remember", arguments, json.dumps(arguments)),), Usage(0, 10),
                           stop_reason="tool_use"), "Noted.")
    async with App(_config(tmp_path), llm=llm) as app:
        message = IncomingMessage("discord", "dm-ann", "ann", "Ann", f"remember my PIN {SECRET}", is_dm=True)
        reply = asyncio.create_task(app.core.reply(message, "Cora").text())
        await asyncio.wait_for(llm.waiting.wait(), 10)
        assert "Done. Deleted 1 message" in (await app.commands.dispatch("!memory forget-me confirm", ANN)).text
        llm.release.set()
        assert await reply == "Noted."  # shown as usual (it was streaming), stored for nobody
        tool_result = str(llm.requests[-1].messages[-1].content)
        assert "asked to be forgotten" in tool_result
        for table in ("users", "cortex_pairs", "memory_items", "skill_executions", "messages"):
            assert await _rows(app, table) == [], table


async def test_a_summary_written_during_forget_me_is_dropped(tmp_path: Path) -> None:
    llm = HeldProvider()
    llm.enqueue(f"Ann told everyone {SECRET} is her secret.")
    config = _config(tmp_path, history={"history_tokens": 60, "min_exchanges": 0, "summary_trigger": 2})
    app = await App(config, llm=llm).start(workers=False)
    try:
        storage = app.storage
        ann, bob = await storage.upsert_user("discord:ann", "Ann"), await storage.upsert_user("discord:bob", "Bob")
        room = await storage.upsert_channel("discord:room", "room", False)
        for i in range(12):
            who = ann if i % 2 == 0 else bob
            said = SECRET if who is ann else "hello"
            await storage.add_message(room.id, who.id, "Cora", "user", who.display_name,
                                      f"{who.display_name} says {said} {i} " * 3, 20)
        job = await storage.enqueue_job("summary", f"channel:{room.id}", {"channel_id": room.id, "persona": "Cora"},
                                        5)
        running = asyncio.create_task(app.summaries.run_job(job))
        await asyncio.wait_for(llm.waiting.wait(), 10)
        assert "Done." in (await app.commands.dispatch("!memory forget-me confirm", ANN)).text
        llm.release.set()
        await running
        assert await _rows(app, "summaries") == []
        assert await storage.latest_summary(room.id) is None
        # Bob's messages are still there: a summary made of them alone is written as usual.
        llm.enqueue("Bob counted aloud.")
        await app.summaries.run_job(job)  # the same job run again (it is still queued: run here, not by workers)
        texts = [r["text"] for r in await _rows(app, "summaries")]
        assert texts == ["Bob counted aloud."] and SECRET not in str(llm.requests[-1].messages)
        assert "Bob says hello" in str(llm.requests[-1].messages)
    finally:
        await app.stop()


async def test_a_skill_audit_written_while_forget_me_runs_is_not_kept(tmp_path: Path) -> None:
    """PostgreSQL: forget-me deletes the audit by key first; an audit row written while the rest of its
    transaction ran saw the user still there (not yet committed away) and stayed, with the call's words."""
    from bot.storage.skills import SkillExecution

    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        storage = app.storage
        ann = await storage.upsert_user("discord:ann", "Ann")
        channel = await storage.upsert_channel("discord:dm-ann", "dm", True)
        await storage.add_message(channel.id, ann.id, "Cora", "user", "Ann", "hello", 2)
        inside, release = asyncio.Event(), asyncio.Event()
        real = storage.cortex.delete_pairs

        async def held(*args: object) -> object:  # forget-me in the middle of its transaction
            inside.set()
            await release.wait()
            return await real(*args)

        storage.cortex.delete_pairs = held  # type: ignore[method-assign]
        forgetting = asyncio.create_task(storage.forget_user("discord:ann"))
        await asyncio.wait_for(inside.wait(), 10)
        audit = asyncio.create_task(storage.skills.record(SkillExecution(
            "remember", "Cora", "discord:ann", "discord:dm-ann", "", f'{{"content": "{SECRET}"}}', True, "", 3,
            "model", 1_700_000_000.0)))
        await asyncio.sleep(0.3)
        assert not audit.done()  # it waits for the forget-me to end
        release.set()
        assert await forgetting is not None
        await audit
        assert await _rows(app, "skill_executions") == [] and await _rows(app, "users") == []


class HeldEmbedder(HashEmbedder):
    """The test embedder, answering its first call only once ``release`` is set (it runs on a worker thread:
    threading events); ``waiting`` says it was called."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting, self.release = threading.Event(), threading.Event()

    def embed(self, texts):  # type: ignore[no-untyped-def]
        self.waiting.set()
        self.release.wait(10)
        return super().embed(texts)


async def test_a_neighbours_vector_embedded_while_forget_me_runs_keeps_none_of_her_words(tmp_path: Path) -> None:
    """Bob's "ok" is embedded with Ann's message before it as context. The backfill read both, forget-me deleted
    hers (and his vector: there was none yet), and the backfill then stored his vector made with her words:
    his search found her secret by meaning for good (a vector of the current model is never made again)."""
    embedder = HeldEmbedder()
    app = await App(_config(tmp_path), llm=ScriptedProvider(), embedder=embedder).start(workers=False)
    try:
        storage = app.storage
        ann, bob = await storage.upsert_user("discord:ann", "Ann"), await storage.upsert_user("discord:bob", "Bob")
        room = await storage.upsert_channel("discord:room", "room", False)
        await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "how was the doctor?", 5)
        await storage.add_message(room.id, ann.id, "Cora", "user", "Ann", f"my diagnosis is {SECRET}", 5)
        ok = await storage.add_message(room.id, bob.id, "Cora", "user", "Bob", "ok", 1)
        backfill = asyncio.create_task(app.cortex.embeddings.backfill())
        assert await asyncio.to_thread(embedder.waiting.wait, 10)
        assert "Done." in (await app.commands.dispatch("!memory forget-me confirm", ANN)).text
        embedder.release.set()
        await backfill
        await app.cortex.embeddings.backfill()  # the next run embeds what has no vector
        clean = embedder.embed(["Bob: how was the doctor?\nBob: ok"])[0]
        row = await storage.db.fetch_one("SELECT vector FROM message_vectors WHERE message_id = ?", (ok.id,))
        assert row is not None
        raw = row[0]  # SQLite: bytes; PostgreSQL: pgvector's Vector
        stored = np.frombuffer(raw, dtype=np.float32) if isinstance(raw, bytes) else np.asarray(raw.to_numpy())
        assert not np.allclose(stored, embedder.embed([f"Ann: my diagnosis is {SECRET}\nBob: ok"])[0], atol=1e-6)
        assert np.allclose(stored, clean, atol=1e-6)
        index = app.cortex.embeddings.index
        if isinstance(index, VectorIndex):  # SQLite: and as this process keeps it in memory
            block = await index.messages(bob.id, "Cora")
            assert np.allclose(block.matrix[block.ids.tolist().index(ok.id)], clean, atol=1e-6)
    finally:
        await app.stop()


async def test_a_message_deleted_on_the_platform_before_or_while_it_is_answered_is_not_kept(tmp_path: Path) -> None:
    """An attacker's finding: a message and its deletion arriving one right after the other (a reconnect replaying
    events, a moderation bot deleting within milliseconds) found nothing to delete, then stored the message and
    answered it for good. A deletion that comes first leaves it unanswered and unstored; one that comes while the
    model writes keeps neither the message nor the reply."""
    from bot.policy import Inbound
    from tests.test_router import Sink

    def sent(text: str, key: str) -> Inbound:
        return Inbound(IncomingMessage("discord", "room", "ann", "Ann", text, mentions_bot=True, message_key=key))

    llm = HeldProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        await app.core.withdraw("discord-message:1")  # (its deletion first)
        shown = Sink()
        await app.router.handle(sent(f"my card is {SECRET} 1", "discord-message:1"), shown)
        assert shown.messages == [] and await _rows(app, "messages") == []
        reply = asyncio.create_task(app.router.handle(sent(f"my card is {SECRET} 2", "discord-message:2"), Sink()))
        await asyncio.wait_for(llm.waiting.wait(), 10)
        await app.core.withdraw("discord-message:2")  # (while the model writes)
        llm.release.set()
        await reply
        assert await _rows(app, "messages") == []
        await app.router.handle(sent("hello", "discord-message:3"), Sink())  # (others are answered and kept)
        assert [r["text"] for r in await _rows(app, "messages")] == ["hello", "echo: Ann: hello"]


@pytest.mark.parametrize("step", ["ensure", "user_of"])
async def test_a_forget_me_just_before_an_update_starts_ends_it_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, step: str) -> None:
    """A forget-me between the update's read of its pair and its first write failed the job (a foreign key, or
    the user gone) with a traceback, and doctor reported a failed update for someone who asked to be forgotten."""
    import logging

    from cortex.tiers import JOB_KIND, job_key

    async with App(_config(tmp_path, cortex={"context_limit": 1000, "cooldown_seconds": 0},
                           jobs={"poll_seconds": 0.05}), llm=ScriptedProvider()) as app:
        for text in ("I adopted a cat called Pixel", "I work nights", "Tea, never coffee"):
            await app.core.reply(IncomingMessage("discord", "dm-ann", "ann", "Ann", text, is_dm=True), "Cora").text()
        user = await app.storage.get_user("discord:ann")
        assert user is not None
        pair = await app.cortex.store.count_messages(user.id, "Cora", 0)
        target = app.cortex.updater.files if step == "ensure" else app.cortex.updater.store
        real = getattr(target, step)

        async def forgotten_meanwhile(*args: object, **kwargs: object) -> object:
            await app.commands.dispatch("!memory forget-me confirm", ANN)
            return await real(*args, **kwargs)

        setattr(target, step, forgotten_meanwhile)
        caplog.set_level(logging.INFO)
        job = await app.queue.enqueue(JOB_KIND, job_key(pair.id), {"pair_id": pair.id, "tier": "50"})
        assert await app.workers.drain(10)
        finished = await app.storage.get_job(job.id)
        assert finished is not None and finished.status == "done", finished
        assert not [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert "the pair was forgotten meanwhile" in caplog.text
        assert await _rows(app, "cortex_pairs") == [] and await _rows(app, "cortex_versions") == []


@pytest.mark.parametrize("line", ["!memory edit memory.md\n# mine\n- zebraquokka two", "!memory reset"])
async def test_a_file_command_that_a_forget_me_overtook_says_so(tmp_path: Path, line: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A forget-me landing between an edit's (or reset's) look-up of the pair and its write: the write failed on
    the deleted pair, said as "failed (IntegrityError) ... tell an admin", with a traceback in the log."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        await app.commands.dispatch(f"!memory edit memory.md\n# mine\n- {SECRET} one", ANN)
        commands = app.cortex.commands
        real = commands._pair

        async def overtaken(ctx: CommandContext) -> object:
            found = await real(ctx)
            monkeypatch.setattr(commands, "_pair", real)
            await app.commands.dispatch("!memory forget-me confirm", ANN)
            return found

        monkeypatch.setattr(commands, "_pair", overtaken)
        reply = await app.commands.dispatch(line, ANN)
        assert reply.failed and reply.text.startswith(f"Sorry, {line.split(chr(10))[0].split(' memory.md')[0]} "
                                                      "failed: something it needed was deleted meanwhile"), reply.text
        assert not any(SECRET in str(r) for r in await _rows(app, "cortex_versions"))
