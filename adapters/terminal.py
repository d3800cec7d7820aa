"""The terminal adapter: chat with a persona on stdin/stdout.

Works interactively (a prompt with line editing and history by prompt-toolkit, streamed replies; Ctrl-C
stops the reply being written, or clears the line at the prompt; Ctrl-D quits) and with piped input
(one message per line; at end of input it waits a bounded time for background jobs, then exits).
Lines starting with ``!`` are commands. Failures print one line to stderr, never a traceback; the
user's message stays stored.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import re
import signal
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import platformdirs
from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.patch_stdout import patch_stdout

from bot.app import App
from bot.commands import Attachment, CommandContext, CommandReply
from bot.errors import UserFacingError
from bot.llm.errors import LLMError
from bot.policy import Inbound, user_refusal
from bot.ports import IncomingMessage
from bot.privatefs import create_private, private_dir, private_file
from bot.router import INCOGNITO_MARK
from bot.text import PrintableStream, error_line, plural, printable, unescaped, visible

log = logging.getLogger(__name__)
PLATFORM = "console"
CUT = "\x00cut"  # (what _read_body returns when a command came before the text's dot line)
CANCELLED = "\x00cancelled"  # (... when Ctrl-C cancelled the text at a prompt)
NO_BODY = {"": "the input ended before the line holding only a dot; nothing changed",
           CANCELLED: "cancelled; nothing changed",
           CUT: "the next command came before the line holding only a dot that ends the text; nothing changed "
                "(that command runs now; the lines after it, up to a line holding only a dot, are taken as the rest "
                "of the text and skipped, never sent as chat)"}
THINKING_AFTER = 2.0  # seconds without a word of the reply before the prompt says the model is at work


async def prompt_text(default: str = "") -> str | None:
    """At a prompt, the text a command waits for, edited as one block (the arrow keys move between its
    lines, a paste keeps its lines): Enter on a last line holding only a dot ends it (or on an empty last
    line below one: a pasted text with its dot line), as does Alt-Enter; Ctrl-C, and Ctrl-D on an empty
    block, cancel it. Read as plain lines, Ctrl-C reached nothing (the terminal was in no prompt's hands)
    and the text could not be left. Its lines are never written to the history. ``default``: a text to
    correct (one the command refused)."""
    bindings = KeyBindings()

    @bindings.add("enter")
    def _enter(event: KeyPressEvent) -> None:
        document = event.current_buffer.document
        lines = document.lines
        ends = lines[-1].strip() == "." or (not lines[-1].strip() and len(lines) > 1 and lines[-2].strip() == ".")
        if document.on_last_line and ends:
            event.current_buffer.validate_and_handle()
        else:
            event.current_buffer.newline(copy_margin=False)

    session: PromptSession[str] = PromptSession(multiline=True, key_bindings=bindings)
    try:
        typed = await session.prompt_async("… ", prompt_continuation="… ", default=default)
    except (KeyboardInterrupt, EOFError):
        return CANCELLED
    lines = printable(typed).split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if lines and lines[-1].strip() == ".":  # (the dot line that ended it; Alt-Enter ends without one)
        lines.pop()
    return "\n".join(lines) if any(part.strip() for part in lines) else None


class _PrivateHistory(FileHistory):
    """The prompt's history file, one per user: a line typed during an incognito stretch is not written
    (``keep`` is off), and forget-me empties the file (:meth:`forget`), as it empties the database."""

    def __init__(self, filename: str) -> None:
        super().__init__(filename)
        self.keep = True

    def store_string(self, string: str) -> None:
        if self.keep:
            private_file(Path(str(self.filename)))  # (made again after a forget-me: still the user's alone)
            super().store_string(string)

    def forget(self) -> None:
        self._loaded_strings.clear()
        forget_history(Path(str(self.filename)))


def forget_history(path: Path) -> None:
    """Delete a user's history file (and the one all users shared before there was one per user)."""
    for stale in (path, path.with_name("terminal-history")):
        try:
            stale.unlink(missing_ok=True)
        except OSError as exc:  # the database is emptied all the same: say what is left behind
            log.warning("could not delete the terminal history %s: %s", stale, exc.strerror or exc)


def history_path(user: str) -> Path:
    """The user's own history file: a readable part of the name and a hash of all of it, so no two
    names share a file ("Иван" and "Петр" are both "____" when made readable)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", user)[:40] or "user"
    digest = hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return Path(platformdirs.user_data_dir("cortex-bot", appauthor=False)) / f"terminal-history-{safe}-{digest}"


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def logs_held() -> Iterator[None]:
    """While a reply is written, log records wait and are printed after it: a log line from a background
    job never lands in the middle of the persona's sentence."""
    root = logging.getLogger()
    handlers, held = root.handlers[:], _Held()
    root.handlers = [held]
    try:
        yield
    finally:
        root.handlers = handlers
        for record in held.records:
            for handler in handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)


@contextmanager
def logs_above_prompt() -> Iterator[None]:
    """While the prompt waits for a line, log lines are printed above it instead of through it."""
    with patch_stdout(raw=True):
        swapped = [(handler, handler.setStream(sys.stderr)) for handler in logging.getLogger().handlers
                   if type(handler) is logging.StreamHandler]
        try:
            yield
        finally:
            for handler, stream in swapped:
                handler.setStream(stream)


def _tolerant(stream: TextIO, errors: str) -> TextIO:
    """A standard stream that takes what its encoding cannot: under an ordinary locale (en_US.UTF-8) Python
    decodes stdin strictly, so one Latin-1 byte in piped input ended the chat. A byte that is not UTF-8
    arrives as a lone surrogate (shown and stored as U+FFFD), as it does under the C locale; a character a
    terminal that is not UTF-8 cannot show is printed as "?" (it failed the reply being written)."""
    if isinstance(stream, io.TextIOWrapper):
        stream.reconfigure(errors=errors)
    return stream


def _shown_text(reply: CommandReply) -> str:
    """A command's answer as the terminal shows it: as written, without the escapes that keep people's words
    inert in a platform's Markdown where it has them (``CommandReply.escaped``)."""
    return (unescaped(reply.text) if reply.escaped and not reply.preformatted else reply.text).rstrip()


class TerminalAdapter:
    def __init__(
        self,
        app: App,
        *,
        user: str,
        persona: str | None = None,
        stdin: TextIO | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        export_dir: str | Path | None = None,
    ) -> None:
        self.app = app
        self.user = user
        self.persona = app.personas.persona(persona)
        self._chosen = persona is not None  # --persona wins until a !persona command picks another
        self.stdin = stdin or _tolerant(sys.stdin, "surrogateescape")
        self.stdout = stdout or _tolerant(sys.stdout, "replace")
        self.stderr = stderr or _tolerant(sys.stderr, "replace")
        self.interactive = self.stdin.isatty()
        self.export_dir = Path(export_dir) if export_dir else Path.cwd()
        self.failures = 0
        self._ahead: deque[str | None] = deque()  # piped lines read ahead and given back (None: the end)
        self._cut = False  # piped, a text was cut off by a command line: its rest, up to its dot line, is skipped
        self._cut_lines = 0  # lines of it skipped so far
        self._session: PromptSession[str] | None = None
        self._history: _PrivateHistory | None = None
        self._watch_forget()
        self._say_access()

    def _say_access(self) -> None:
        """The access lists close the platforms and the web page, not the operator's own console: a user the
        lists leave out is told so at start, instead of the list seeming to be ignored."""
        key = self._inbound("").message.author_key
        reason = user_refusal(self.app.config.access, key)
        if reason is not None:
            log.warning("%s is a %s in [access]: the lists keep them off the web page and the platforms, not off "
                        "this terminal (whoever runs it runs the bot)", key, reason)

    def _watch_forget(self) -> None:
        """A forget-me of this terminal's user, from a command typed here or from the web page this
        process serves, empties the history file too, as it empties the database."""
        key = self._inbound("").message.author_key

        def forget(user_key: str) -> None:
            if user_key != key:
                return
            if self._history is not None:
                self._history.forget()
            else:  # piped input keeps no history, but an earlier chat at a prompt may have left one
                forget_history(history_path(self.user))

        self.app.cortex.commands.on_forget.append(forget)

    @property
    def channel_id(self) -> str:
        return f"{self.user}/{self.persona.name}"

    def _inbound(self, text: str) -> Inbound:
        """This terminal's line as the router sees a platform's message: a DM of the person who runs the bot
        (admin everywhere). Its persona and command context come from the router, as on Discord and
        Matrix; the access lists and the rate limit are for platforms, not for the operator's console."""
        message = IncomingMessage(PLATFORM, self.channel_id, self.user, self.user, text, is_dm=True,
                                  channel_name=f"terminal chat of {self.user} with {self.persona.name}")
        return Inbound(message, is_admin=True, is_bot_admin=True)

    def _context(self) -> CommandContext:
        return self.app.router.context_for(self._inbound(""), self.persona.name)

    async def _read_line(self) -> str | None:
        if self.interactive and not self._ahead:
            return await self._prompt()
        return await self._next_line()

    async def _next_line(self) -> str | None:
        """The next line not typed at the prompt: one given back first, else read (None: the end of input)."""
        if self._ahead:
            return self._ahead.popleft()
        line = await self._readline_in_thread()  # (a file from a Windows editor starts with a BOM: not the line's)
        return None if line == "" else printable(line.rstrip("\r\n").lstrip("\ufeff"))

    async def _prompt(self) -> str | None:
        """One line typed at the prompt (editing, and arrow keys through the history); None on Ctrl-D."""
        if self._session is None:
            history: History = InMemoryHistory()
            path = history_path(self.user)
            try:
                private_dir(path.parent)  # (the file itself is made owner-only by the history as it writes)
                self._history = _PrivateHistory(str(path))
                history = self._history
            except OSError:
                pass
            self._session = PromptSession(history=history)
        if self._history is not None:
            self._history.keep = not await self.app.router.incognito(self._inbound("").message.author_key,
                                                                     self.persona.name)
        while True:
            try:
                with logs_above_prompt():
                    line = await self._session.prompt_async("you › ")
                return printable(line)
            except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as in a shell
                continue
            except EOFError:
                return None

    async def _prompt_body(self, default: str = "") -> str | None:
        with logs_above_prompt():
            return await prompt_text(default)

    async def _readline_in_thread(self) -> str:
        """Read one line without blocking the loop. A daemon thread, not the default executor: a
        read still waiting on an open terminal must not keep the process alive after Ctrl-C/SIGTERM."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()

        def deliver(line: str | None, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(line or "")

        def read() -> None:
            try:
                line, error = self.stdin.readline(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the loop
                line, error = None, exc
            try:
                loop.call_soon_threadsafe(deliver, line, error)
            except RuntimeError:
                pass  # the loop is already closed: nobody is waiting any more

        threading.Thread(target=read, name="stdin-reader", daemon=True).start()
        return await future

    def _error(self, text: str) -> None:
        self.stderr.write(f"error: {printable(text)}\n")
        self.stderr.flush()

    async def run(self) -> int:
        """Chat until end of input. Returns the exit status (1 if any message failed)."""
        await self._follow_router()
        if self.interactive:
            self.stdout.write(
                f"Chatting with {self.persona.name} as {self.user}. Type !help for commands, Ctrl-D to quit.\n"
            )
        while True:
            line = await self._read_line()
            if line is None:
                break
            if not visible(line):  # blank, or only zero-width characters: nothing to send
                continue
            if self._cut and self._rest_of_cut_text(line):
                continue
            await self.handle_line(line)
        if self._cut_lines:
            self.stdout.write(f"(skipped the last {plural(self._cut_lines, 'line')}: the rest of a text cut off "
                              "above)\n")
        if self.interactive:
            self.stdout.write("\n")
        # Piped input reports failed messages in the exit status; Ctrl-D at a prompt is simply "quit".
        return 1 if self.failures and not self.interactive else 0

    def _rest_of_cut_text(self, line: str) -> bool:
        """Piped, after a text a command line cut off: whether ``line`` was the rest of that text, up to its dot
        line, and is skipped (never sent as chat: it may be a private note); commands among it run."""
        if line.strip() == ".":
            self._cut = False
            skipped, self._cut_lines = self._cut_lines, 0
            self.stdout.write(f"(skipped {plural(skipped, 'line')} of text and the line holding only a dot: the "
                              "rest of a text cut off above)\n" if skipped else
                              "(skipped a line holding only a dot: the text it ends was cut off above)\n")
            return True
        if self.app.commands.is_command(line.lstrip()):
            return False
        self._cut_lines += 1
        return True

    async def run_command(self, line: str) -> None:
        reply = await self.app.commands.dispatch(line, self._context())
        if reply.needs_body and not (self.interactive or reply.pipe_may_answer):
            self.failures += 1  # a forgotten text: the next piped lines are not taken for it
            reply = replace(reply, needs_body="")
        if reply.needs_body:
            self.stdout.write(reply.needs_body + ("; Ctrl-C cancels" if self.interactive else "") + "\n")
            self.stdout.flush()
            with_body = await self._with_body(line)
            if with_body is None:
                return
            reply = with_body
        self.failures += reply.failed  # (piped: a script learns from the exit status that a command failed)
        self.stdout.write(printable(_shown_text(reply)) + "\n")
        for attachment in reply.attachments:
            try:
                path = self._save(attachment)
            except OSError as exc:  # a read-only folder, a full disk: the command failed, the chat goes on
                self.failures += 1
                self._error(f"cannot save {attachment.filename} in {self.export_dir}: {exc.strerror or exc}; "
                            "run the chat from a folder you can write to")
                continue
            self.stdout.write(f"saved {path}\n")
        self.stdout.flush()
        if reply.text_refused and not self.interactive:
            await self._skip_refused_text()

    async def _skip_refused_text(self) -> None:
        """Piped input, after a command that takes a text failed without one: the lines below it up to a line
        holding only a dot were that text (a misspelled file name must not send someone's private note to the
        model as chat, and store it): they are skipped. With no dot before the next command or the end, they
        are chat after all, and go as such."""
        ahead: list[str | None] = []
        while (line := await self._read_line()) is not None and not self.app.commands.is_command(line.lstrip()):
            if line.strip() == ".":  # (a dot right below it: an empty text, nothing to skip)
                if ahead:
                    self.stdout.write(f"(skipped the {plural(len(ahead), 'line')} below it, up to the dot: its text)\n")
                self.stdout.flush()
                return
            ahead.append(line)
        self._ahead.extendleft(reversed([*ahead, line]))  # in order, before anything read later

    async def _with_body(self, line: str) -> CommandReply | None:
        """The command run with the text it asked for, which is read now; None when none came. At a prompt, a
        text the command refuses (too long, read as instructions) is opened again to be corrected: it was lost,
        and the prompt's history keeps none of it."""
        at_prompt = self.interactive and not self._ahead
        body = await self._read_body()
        while True:
            if body in NO_BODY or body is None:
                self.failures += 1
                self._error("no content given; nothing changed" if body is None else NO_BODY[body])
                return None
            reply = await self.app.commands.dispatch(f"{line}\n{body}", self._context())
            if not (reply.failed and at_prompt):
                return reply
            self.stdout.write(printable(_shown_text(reply)) + "\nYour text, to correct (Ctrl-C drops it):\n")
            self.stdout.flush()
            body = await self._prompt_body(body)

    async def _read_body(self) -> str | None:
        """Lines up to one holding only a dot; None when nothing was typed, else the text or one of ``NO_BODY``'s
        keys: the input ended first (""), or a command came first (``CUT``: it is given back, and runs next; in
        piped setup scripts the text swallowed the commands after a missing dot, and stored them as a soul), or
        (at a prompt) Ctrl-C cancelled it (``CANCELLED``)."""
        if self.interactive and not self._ahead:
            return await self._prompt_body()
        lines: list[str] = []
        self._cut, self._cut_lines = False, 0
        while True:
            text = await self._next_line()
            if text is None:
                return "" if any(part.strip() for part in lines) else None
            if text.strip() == ".":
                return "\n".join(lines) if any(part.strip() for part in lines) else None
            if not self.interactive and self.app.commands.is_command(text) and self.app.commands.knows(text):
                self._ahead.appendleft(text)  # (a command's name at column 0: an indented one is text)
                self._cut, self._cut_lines = True, 0
                return CUT
            lines.append(text)

    def _save(self, attachment: Attachment) -> Path:
        """Write an attachment (an export, a long file) into the export folder, never overwriting."""
        folder = self.export_dir
        private_dir(folder)
        path = folder / Path(attachment.filename).name
        stem, suffix, n = path.stem, path.suffix, 1
        while True:
            try:
                with create_private(path) as out:  # created here or not at all: never another file overwritten
                    try:
                        out.write(attachment.data)
                    except OSError:  # a full disk: no half an archive left behind
                        path.unlink(missing_ok=True)
                        raise
                return path
            except FileExistsError:
                path = folder / f"{stem}-{n}{suffix}"
                n += 1

    async def _follow_router(self) -> None:
        """The persona as the router picks it for this user's DMs (the same as on Discord and Matrix)."""
        if self._chosen:
            return
        self.persona = self.app.personas.persona(await self.app.router.persona_for(self._inbound("")))

    async def handle_line(self, line: str) -> None:
        await self._follow_router()
        if self.app.commands.is_command(line.lstrip()):  # " !memory list" is a command, as on Discord and Matrix
            line = line.lstrip()
            await self.run_command(line)
            if line.split(maxsplit=1)[0].lower() == f"{self.app.commands.prefix}persona":
                self._chosen = False
                await self._follow_router()
            return
        try:
            stream = self.app.core.reply(self._inbound(line).message, self.persona.name, is_admin=True,
                                         is_bot_admin=True)
        except UserFacingError as exc:
            self.failures += 1
            self._error(exc.user_message)
            return
        if self.interactive:
            await self._interruptible(self._show_reply(stream))
        else:
            await self._show_reply(stream)

    async def _interruptible(self, work: Awaitable[None]) -> None:
        """Run ``work`` so that Ctrl-C stops it (the reply being written), not the whole chat."""
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        task = asyncio.ensure_future(work)
        try:
            loop.add_signal_handler(signal.SIGINT, task.cancel)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not Unix
            await task
            return
        try:
            await task
        except asyncio.CancelledError:
            if main is not None and main.cancelling():
                raise
            self.stdout.write("\n(reply stopped; your message was kept)\n")
            self.stdout.flush()
        finally:
            if main is not None:
                loop.add_signal_handler(signal.SIGINT, main.cancel)

    async def _show_reply(self, stream: Any) -> None:
        with logs_held():
            await self._write_reply(stream)

    async def _write_reply(self, stream: Any) -> None:
        started = False

        async def status(line: str) -> None:
            self.stdout.write(f"{'' if not started else chr(10)}({printable(line)})\n")
            self.stdout.flush()

        def thinking() -> None:  # at a prompt, a slow model's silence looked like a hang
            if not started:
                self.stdout.write(f"({self.persona.name} is thinking…)\n")
                self.stdout.flush()

        stream.on_status = status
        screen = PrintableStream()
        waiting = asyncio.get_running_loop().call_later(THINKING_AFTER, thinking) if self.interactive else None
        try:
            async for delta in stream:
                if not started:  # marked as on the platforms: this reply leaves nothing behind
                    self.stdout.write(f"{self.persona.name}: {INCOGNITO_MARK if stream.incognito else ''}")
                    started = True
                self.stdout.write(screen.feed(delta))
                self.stdout.flush()
        except LLMError as exc:
            self._failed(started, f"{exc.user_message} (your message was kept)")
            return
        except Exception as exc:  # a full disk, a damaged database, a bug: one line here, the details with -v
            log.info("the reply failed", exc_info=True)
            self._failed(started, f"could not answer: {error_line(exc)} (run with -v for the details)")
            return
        finally:
            if waiting is not None:
                waiting.cancel()
        self.stdout.write(screen.end() + "\n")
        self.stdout.flush()

    def _failed(self, started: bool, why: str) -> None:
        self.failures += 1
        if started:
            self.stdout.write("\n")
        self._error(why)
