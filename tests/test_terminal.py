"""The terminal adapter in-process: what it prints, in which order (the tty behaviour is in test_terminal_tty)."""

from __future__ import annotations

import io
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prompt_toolkit.application import create_app_session
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from adapters.terminal import CANCELLED, TerminalAdapter, _PrivateHistory, history_path, prompt_text
from bot.app import App
from bot.config import parse_config
from bot.llm.base import LLMRequest, StreamEvent
from tests.fakes.provider import ScriptedProvider


def _config(tmp_path: Path) -> Any:
    return parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "personas": [{"name": "Cora"}]})


async def _run_piped(app: App, text: str, user: str = "ann") -> tuple[int, str]:
    """The chat with ``text`` piped in, to its end: its exit status, and what it printed (out and errors)."""
    screen = io.StringIO()
    status = await TerminalAdapter(app, user=user, stdin=io.StringIO(text), stdout=screen, stderr=screen).run()
    return status, screen.getvalue()


class ChattyProvider(ScriptedProvider):
    """Streams its answer while a background job logs, between every two words."""

    async def stream(self, request: LLMRequest) -> AsyncIterator[StreamEvent]:
        async for event in super().stream(request):
            logging.getLogger("cortex.jobs").warning("a background job finished")
            yield event


async def test_log_lines_wait_until_the_reply_is_written(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()  # stdout and the log handler write to the same terminal
    handler = logging.StreamHandler(screen)
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
                           "personas": [{"name": "Cora"}]})
    llm = ChattyProvider()
    llm.enqueue("Lyon is lovely in spring.")
    async with App(config, llm=llm) as app:
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO(), stdout=screen, stderr=screen)
        await terminal.handle_line("tell me about Lyon")
    lines = screen.getvalue().splitlines()
    assert lines[0] == "Cora: Lyon is lovely in spring."  # whole, not cut by log lines
    assert lines[1:6] == ["LOG a background job finished"] * 5 and len(lines) >= 6
    assert logging.getLogger().handlers == [handler]  # put back


async def test_persona_picked_in_the_terminal_is_the_one_that_answers(tmp_path: Path) -> None:
    """The terminal takes its persona and command context from the router, as Discord and Matrix do."""
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
                           "personas": [{"name": "Cora", "identity": "You are {char_name}."},
                                        {"name": "Max", "identity": "You are {char_name}."}]})
    llm = ScriptedProvider()
    screen = io.StringIO()
    async with App(config, llm=llm) as app:
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO(), stdout=screen, stderr=screen)
        await terminal.handle_line("hello")
        assert "You are Cora." in llm.requests[-1].system
        await terminal.handle_line("!persona Max")
        await terminal.handle_line("hello again")
        assert "You are Max." in llm.requests[-1].system
        assert "Max: echo: hello again" in screen.getvalue()
        await terminal.handle_line("!persona show")  # the operator is a bot admin here
        assert "Persona Max:" in screen.getvalue()


async def test_piped_lines_after_a_command_missing_its_text_are_not_taken_for_it(tmp_path: Path) -> None:
    """Piped: a forgotten text is an error (counted in the exit status) and the next lines go on as
    typed; a body asked for by the command itself (!memory edit) is read up to the dot line."""
    config = _config(tmp_path)
    llm = ScriptedProvider()
    llm.enqueue("Hi Ann.")
    async with App(config, llm=llm) as app:
        status, shown = await _run_piped(app, "!memory search\nhello there\n!memory edit memory\nAnn likes tea.\n.\n"
                                              "!memory show memory\n")
    assert status == 1
    assert "!memory search needs the words" in shown and "Cora: Hi Ann." in shown
    assert len(llm.requests) == 1 and "hello there" in str(llm.requests[0].messages[-1])  # sent as a message
    assert "Saved your memory.md as version" in shown and "Ann likes tea." in shown


async def test_piped_texts_of_several_lines_are_read_alike_for_every_command_that_edits_one(tmp_path: Path) -> None:
    """!memory edit and !persona edit read their text from the piped lines up to a dot; !guidelines set and
    !rules add did not: their text (and the dot) went to the model as chat messages, and were stored."""
    config = _config(tmp_path)
    llm = ScriptedProvider()
    screen = io.StringIO()
    piped = io.StringIO("!guidelines set\nBe kind.\nNo spoilers.\n.\n!rules add tone\nAnswer briefly.\n.\n"
                        "!lore add\nThe shop opens at nine.\n.\n!guidelines\n")
    async with App(config, llm=llm) as app:
        terminal = TerminalAdapter(app, user="root", stdin=piped, stdout=screen, stderr=screen)
        assert await terminal.run() == 0, screen.getvalue()
        stored = await app.storage.db.fetch_all("SELECT text FROM messages")
    shown = screen.getvalue()
    assert "Saved the bot-wide default guidelines as version 1." in shown
    assert shown.endswith("In force: the bot-wide default guidelines:\nBe kind.\nNo spoilers.\n")
    assert "Rule tone added (version 1)." in shown and "Lore #1 added to Cora" in shown
    assert llm.requests == [] and stored == []  # nothing of it reached the model or the conversation


async def test_the_piped_text_of_a_refused_command_is_skipped_up_to_its_dot_not_sent_as_chat(tmp_path: Path) -> None:
    """A misspelled file name, option or a missing name refused the command, and the text piped below it
    went to the model line by line as chat, and was stored: a private note among it. Up to a line holding
    only a dot it was the command's text, and is skipped; lines with no dot before the next command or the
    end of the input are chat, as typed."""
    config = _config(tmp_path)
    llm = ScriptedProvider()
    llm.enqueue("Hello.")
    llm.enqueue("Noted.")
    piped = ("!memory edit memroy\nMy private notes: my diagnosis is X\nsecond line\n.\n"
             "!lore add --kyes a\nThe mill is old.\n.\n!rules add\nBe brief.\n.\n"
             "hello\n  !memory search\njust chat, no dot\n")  # (spaces before a command: a command still)
    async with App(config, llm=llm) as app:
        status, shown = await _run_piped(app, piped, user="root")
        stored = [r[0] for r in await app.storage.db.fetch_all("SELECT text FROM messages WHERE role = 'user'")]
    assert status == 1
    assert "unknown file" in shown and "did you mean --keys" in shown and "!memory search needs the words" in shown
    assert shown.count("(skipped the 2 lines below it, up to the dot: its text)") == 1
    assert shown.count("(skipped the 1 line below it, up to the dot: its text)") == 2
    assert stored == ["hello", "just chat, no dot"]  # nothing of the refused texts, nor their dots
    assert "diagnosis" not in str([r.messages for r in llm.requests])


async def test_a_forget_me_from_anywhere_in_the_process_empties_the_users_history_file(tmp_path: Path) -> None:
    """The typed command, and the web page this process serves (which calls the same forget_user): the
    terminal hears of it by the user's key, and only its own user's forget-me touches its file."""
    config = _config(tmp_path)
    llm = ScriptedProvider()
    llm.enqueue("Hello Ann.")
    async with App(config, llm=llm) as app:
        screen = io.StringIO()
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO(), stdout=screen, stderr=screen)
        terminal._history = _PrivateHistory(str(tmp_path / "history"))
        terminal._history.store_string("my secret is hunter2")
        await terminal.handle_line("hello")  # ann has a row now
        await app.cortex.commands.forget_user("console:bob")  # someone else: the file stays
        assert "hunter2" in (tmp_path / "history").read_text()
        await app.cortex.commands.forget_user("console:ann")  # as POST /api/me/forget-me does
        assert not (tmp_path / "history").exists() and await app.storage.get_user("console:ann") is None
        terminal._history.store_string("a new start")
        await terminal.run_command("!memory forget-me confirm")  # typed: the same way
        assert not (tmp_path / "history").exists()


async def test_a_piped_forget_me_deletes_the_history_an_earlier_prompt_left(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped input keeps no history of its own, so the file of an earlier interactive chat stayed, with
    everything typed there, after the forget-me said it deleted everything."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    left = history_path("ann")
    left.parent.mkdir(parents=True)
    left.write_text("\n# 2026-11-20\n+my secret is hunter2\n")
    bobs = history_path("bob")
    bobs.write_text("\n+bob's own line\n")
    config = _config(tmp_path)
    screen = io.StringIO()
    async with App(config, llm=ScriptedProvider()) as app:
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO("hello\n!memory forget-me confirm\n"),
                                   stdout=screen, stderr=screen)
        assert await terminal.run() == 0
    assert "Deleted" in screen.getvalue()
    assert not left.exists() and bobs.exists()


async def test_an_export_that_cannot_be_saved_is_one_line_and_the_chat_goes_on(tmp_path: Path) -> None:
    config = _config(tmp_path)
    not_a_folder = tmp_path / "exports"
    not_a_folder.write_text("a file where the folder should be")
    screen, errors = io.StringIO(), io.StringIO()
    piped = io.StringIO("!memory remember Ann grows figs\n!memory export\n!memory list\n")
    async with App(config, llm=ScriptedProvider()) as app:
        terminal = TerminalAdapter(app, user="ann", stdin=piped, stdout=screen, stderr=errors,
                                   export_dir=not_a_folder)
        assert await terminal.run() == 1  # the failed save counts in the exit status
    assert errors.getvalue().startswith("error: cannot save cortex-export-ann-")
    assert str(not_a_folder) in errors.getvalue()
    assert len(errors.getvalue().splitlines()) == 1 and "Traceback" not in screen.getvalue()
    assert "Ann grows figs" in screen.getvalue().split("Everything the bot holds")[1]  # !memory list still ran
    assert not_a_folder.read_text() == "a file where the folder should be"


async def test_a_text_cut_off_by_the_end_of_input_says_so(tmp_path: Path) -> None:
    config = _config(tmp_path)
    screen, errors = io.StringIO(), io.StringIO()
    async with App(config, llm=ScriptedProvider()) as app:
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO("!memory edit memory\nAnn likes tea.\n"),
                                   stdout=screen, stderr=errors)
        assert await terminal.run() == 1
        rows = await app.storage.db.fetch_all("SELECT content FROM cortex_versions")
        assert not any("Ann likes tea" in str(r[0]) for r in rows)  # nothing saved
    assert errors.getvalue() == "error: the input ended before the line holding only a dot; nothing changed\n"


async def test_a_text_without_its_dot_line_does_not_swallow_the_commands_after_it(tmp_path: Path) -> None:
    """Piped, a text ran to the next dot line whatever came first: `!memory edit soul` without one stored the
    commands below it as the soul (and none of them ran). A command line at the start of a line ends the
    text unsaved, and runs; an indented one, or a word that is no command, is text."""
    config = _config(tmp_path)
    screen, errors = io.StringIO(), io.StringIO()
    piped = ("!memory edit soul\n!memory remember Ann grows figs\nAnn's PIN is 4711, keep it private.\n"
             "!memory list\n.\n"
             "!memory edit memory\nAnn likes tea.\n  !memory list is how she checks\n!important, she says\n.\n"
             "!persona edit backstory\n.\n")
    async with App(config, llm=ScriptedProvider()) as app:
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO(piped), stdout=screen, stderr=errors)
        assert await terminal.run() == 1  # the cut text counts as a failure
        souls = await app.storage.db.fetch_all("SELECT content FROM cortex_versions WHERE filename = 'soul.md'")
        assert not any("!memory" in str(r[0]) for r in souls)
        memory = await app.storage.db.fetch_all(
            "SELECT content FROM cortex_versions WHERE filename = 'memory.md' ORDER BY version DESC LIMIT 1")
        assert memory[0][0] == "Ann likes tea.\n  !memory list is how she checks\n!important, she says\n"
    assert errors.getvalue().startswith("error: the next command came before the line holding only a dot")
    assert "Ann grows figs" in screen.getvalue().split("Your memory items")[1]  # both commands ran
    assert "Cora:" not in screen.getvalue() and "4711" not in screen.getvalue()  # the rest went to nobody as chat
    assert "(skipped 1 line of text and the line holding only a dot: the rest of a text cut off above)" in \
        screen.getvalue()
    assert errors.getvalue().splitlines()[1] == "error: no content given; nothing changed"  # (a dot alone)


async def test_a_failure_that_is_no_outage_is_one_line_and_the_chat_goes_on(tmp_path: Path) -> None:
    """A full disk or a damaged database while answering: one error line (no traceback), the exit status
    says it, and the next line is answered."""
    from bot.llm.base import Completion

    def broken(request: LLMRequest) -> Completion:
        raise OSError("database or disk is full")

    config = _config(tmp_path)
    llm = ScriptedProvider()
    llm.enqueue(broken, "Still here.")  # type: ignore[arg-type]
    async with App(config, llm=llm) as app:
        status, shown = await _run_piped(app, "first\nsecond\n")
    assert status == 1
    assert "error: could not answer: OSError: database or disk is full (run with -v for the details)" in shown
    assert "Traceback" not in shown and "Cora: Still here." in shown


async def test_a_byte_order_mark_before_the_piped_input_is_not_part_of_its_first_line(tmp_path: Path) -> None:
    """A file saved by a Windows editor starts with a BOM: its first line, a command, went to the model as a
    message (and was stored) instead of running."""
    config = _config(tmp_path)
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        status, shown = await _run_piped(app, "\ufeff!memory remember Ann grows figs\n\ufeffhello\n")
        assert status == 0, shown
        stored = await app.storage.db.fetch_all("SELECT text FROM messages WHERE role = 'user'")
        items = await app.storage.db.fetch_all("SELECT content FROM memory_items")
    assert "Remembered as #" in shown
    assert [tuple(row) for row in items] == [("Ann grows figs",)]
    assert [tuple(row) for row in stored] == [("hello",)] and len(llm.requests) == 1


async def test_a_line_of_only_invisible_characters_is_skipped_as_a_blank_one_is(tmp_path: Path) -> None:
    """A blank piped line is skipped; one of zero-width spaces or word joiners (as blank to read) printed an
    error and made the exit status 1."""
    config = _config(tmp_path)
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        status, shown = await _run_piped(app, "   \n\u200b\u200b\n\u2060 \u200b\nhello\n")
    assert status == 0 and shown == "Cora: echo: hello\n" and len(llm.requests) == 1, shown


async def test_at_a_prompt_a_slow_model_is_said_to_be_thinking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """A model that took long to start showed nothing at all at the prompt until its timeout: it looked
    hung. Past a moment without a word, the prompt says it is thinking; a quick reply (and piped input)
    shows no such line."""
    import adapters.terminal as terminal_module

    monkeypatch.setattr(terminal_module, "THINKING_AFTER", 0.05)
    async with App(_config(tmp_path), llm=ScriptedProvider(delay=0.3)) as app:
        screen = io.StringIO()
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO(""), stdout=screen, stderr=screen)
        terminal.interactive = True
        await terminal.handle_line("hello")
        assert screen.getvalue() == "(Cora is thinking…)\nCora: echo: hello\n"
        terminal.interactive = False
        await terminal.handle_line("again")
        assert screen.getvalue().endswith("hello\nCora: echo: again\n")
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        screen = io.StringIO()
        terminal = TerminalAdapter(app, user="ann", stdin=io.StringIO(""), stdout=screen, stderr=screen)
        terminal.interactive = True
        await terminal.handle_line("hello")
        assert screen.getvalue() == "Cora: echo: hello\n"


async def test_a_terminal_user_the_access_lists_leave_out_is_told_they_do_not_close_the_terminal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`deny_users = ["console:mallory"]` keeps mallory off the web page; the terminal is the operator's own
    console, which the lists do not close: said at start, where it seemed to be ignored in silence."""
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "personas": [{"name": "Cora"}],
                           "access": {"deny_users": ["console:mallory"]}})
    async with App(config, llm=ScriptedProvider()) as app:
        with caplog.at_level(logging.WARNING, logger="adapters.terminal"):
            status, shown = await _run_piped(app, "hello\n", user="ann")
            assert status == 0 and not [r for r in caplog.records if "[access]" in r.getMessage()]
            status, shown = await _run_piped(app, "hello\n", user="mallory")
    [said] = [r.getMessage() for r in caplog.records if "[access]" in r.getMessage()]
    assert said.startswith("console:mallory is a denied user in [access]"), said
    assert "not off this terminal" in said and "echo: hello" in shown


async def test_an_incognito_reply_is_marked_in_the_terminal_and_remember_waits_for_the_resume(tmp_path: Path) -> None:
    """As on Discord and Matrix, a reply that leaves nothing behind says so; and `!memory remember` while
    paused is refused (the pause promised that nothing from it reaches the memory items: the item outlived it)."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        status, shown = await _run_piped(app, "!memory pause\npsst\n!memory remember secret fact\n"
                                              "!memory resume\nhi\n!memory list\n")
        lines = shown.splitlines()
        assert "Cora: 🕶️ echo: psst" in lines and "Cora: echo: hi" in lines, shown
        assert "You are incognito with Cora: nothing new is remembered until !memory resume." in shown, shown
        assert await app.storage.db.fetch_one("SELECT 1 FROM memory_items WHERE content LIKE '%secret%'") is None


@pytest.mark.parametrize(("keys", "text"), [
    ("Be kind.\rAlways.\r.\r", "Be kind.\nAlways."),  # typed, ended by the dot line
    ("Be kind.\rAlways.\x1b\r", "Be kind.\nAlways."),  # Alt-Enter ends it as it is: no line lost
    ("Be kind.\x1b\r", "Be kind."),
    ("\x1b[200~Be kind.\nAlways.\n.\n\x1b[201~\r", "Be kind.\nAlways."),  # pasted with its dot line, then Enter
    (".\r", None),  # nothing typed
    ("Be kind.\r\x03", CANCELLED),  # Ctrl-C
    ("\x04", CANCELLED),  # Ctrl-D on an empty text
])
async def test_a_text_at_a_prompt_ends_at_its_dot_line_or_alt_enter(keys: str, text: str | None) -> None:
    """The text a command asks for at a prompt is edited as one block: Alt-Enter (prompt_toolkit's end of a
    multi-line text) cut its last line off as if it were the dot line, and a pasted text ending in its dot line
    kept the dot once another was typed below it."""
    with create_pipe_input() as keyboard, create_app_session(input=keyboard, output=DummyOutput()):
        keyboard.send_text(keys)
        assert await prompt_text() == text
