"""The platform-neutral command layer: parse a command line, check permission, run it, render text.

Adapters hand over the raw text (``!memory show`` in the terminal and on Matrix; Discord builds the
same line from a slash command) and a :class:`CommandContext` saying who asks where. Commands are
one word (``!help``) or a group and a subcommand (``!memory show``). A message's first line is the
command; any further lines are its *body* (the new content for ``!memory edit``). Handlers return a
:class:`CommandReply` (or plain text) and never touch a platform.

Words are split at white space and kept as typed (an apostrophe, a backslash, a quote inside a word stay);
a word opening with a quote runs to the matching quote (``--persona "Captain Nemo"``; typographic quotes
and dashes, which phones put in for ``"`` and ``--``, count as such). A command's free
text is handed over exactly as typed, from its first word to its last, with the lines after it: only the
flags and options before and after it are taken out, so "Use --pin wisely" stays a sentence.
"""

from __future__ import annotations

import bisect
import difflib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from itertools import takewhile
from typing import Literal

from bot.storage.engine import is_missing_reference
from bot.text import one_line_name, plural, shown, storable, without_surrogates

log = logging.getLogger(__name__)

TYPOGRAPHIC_DASHES = "\u2014\u2013"  # em and en dash: what "--" becomes with smart punctuation
_SWITCH = re.compile(r"--[A-Za-z][A-Za-z0-9_-]*")  # how an option is spelled on a command line
_ASSIGNED = re.compile(rf"(?:--|[{TYPOGRAPHIC_DASHES}])[A-Za-z][A-Za-z0-9_-]*=(?=.)")  # "--keys=" of --keys="a, b"
MAX_LINE_CHARS = 20_000  # of a command's first line (a long text goes on the lines below it)
QUOTES = {"'": "'", '"': '"', "\u201c": "\u201d", "\u2018": "\u2019", "\u201e": "\u201c", "\u00ab": "\u00bb"}
MAX_NUMBER = 2**31 - 1  # ids, versions and pages fit every engine's integer columns
TERMINAL = "console"  # the platform of the operator's terminal (which alone may name a file by its path)


def _misspelled_option(tokens: Sequence[Token], options: set[str]) -> None:
    """Refuse a text's last-but-one word when it is an option misspelled or in other case, with its value
    after it ("… --kyes mill", "… --Keys mill"): it would have gone into the text, silently. Any other
    dashed word there stays the text's ("takes --verbose output")."""
    for token in tokens:
        name = token.value
        if _SWITCH.fullmatch(name) and token.end - token.start == len(name) and name not in options:
            near = difflib.get_close_matches(name.lower(), sorted(options), n=1, cutoff=0.75)
            if near:
                raise CommandError(f"no option {shown(name)} (did you mean {near[0]}?); to keep it in the text, "
                                   "put the text in quotes")


def _option_near_the_end(tokens: Sequence[Token], options: set[str]) -> None:
    """Refuse a text whose third- or fourth-last word is, unquoted, one of the command's own options: its
    value had a space ("… --keys mill, wheel", "… --importance 8 extra"), and read as the text the option
    was lost, silently. Further in, an option's name stays the text's ("use --keys to set them")."""
    for number in range(max(len(tokens) - 4, 0), len(tokens) - 2):
        token = tokens[number]
        if token.value in options and token.end - token.start == len(token.value):
            rest = shown(" ".join(t.value for t in tokens[number + 1:]), 40)
            raise CommandError(f"more than a value after {token.value} ({rest}); a value with a space goes in "
                               f"quotes (e.g. {token.value} \"a, b\"), and so does a text that ends so")


def parse_number(text: str, what: str, *, prefix: str = "", minimum: int = 1) -> int:
    """A positive whole number a user typed (``12``, ``#12``, ``v3`` with ``prefix``), or a
    :class:`CommandError` saying what was expected: only ASCII digits (``²`` is not a number),
    and never so large that the database could not hold it."""
    digits = text.strip()
    if prefix and digits[:1].lower() == prefix:
        digits = digits[1:]
    if digits[:1] == "-" and digits[1:].isascii() and digits[1:].isdigit():  # a number, but below any allowed
        if int(digits[1:]) == 0:
            digits = "0"  # (-0 is 0)
        else:
            raise CommandError(f"{what} must be {minimum} or more, not {shown(text, 20)}")
    if not digits or not (digits.isascii() and digits.isdigit()):
        raise CommandError(f"{what} must be a number like 12, not {shown(text, 20)}")
    if len(digits) <= 10 and int(digits) < minimum:
        raise CommandError(f"{what} must be {minimum} or more, not {digits}")
    if len(digits) > 10 or int(digits) > MAX_NUMBER:
        typed = digits if len(digits) <= 20 else f"{digits[:12]}… ({len(digits)} digits)"  # (not silently cut)
        raise CommandError(f"{what} {typed} is out of range ({minimum} to {MAX_NUMBER:,})")
    return int(digits)


@dataclass(frozen=True, slots=True)
class Attachment:
    filename: str
    data: bytes


@dataclass(frozen=True, slots=True)
class CommandContext:
    platform: str
    user_key: str
    user_name: str
    channel_key: str
    persona: str
    is_admin: bool = False  # of this server or room (or of the whole bot)
    is_bot_admin: bool = False  # a configured admin id: may change what every server shares
    is_dm: bool = False
    server_key: str | None = None
    parent_channel_key: str | None = None  # a thread's or forum post's channel: its switches apply here too
    reply_to: str | None = None  # the message the command was sent in reply to (discord-message:ID)
    message_key: str | None = None  # the platform message the command was typed in (discord-message:ID)
    body: str = ""  # the lines after the command line
    attachments: tuple[Attachment, ...] = ()  # files sent with the command (a card to import)
    attachments_seen_by_all: bool = False  # those files were posted where everyone in the channel can open them
    # The command's own words were posted where everyone in the channel reads them (a typed command outside a DM;
    # a slash command is not: what it stores is private as in a DM).
    seen_by_all: bool = False
    sent_at: datetime | None = None  # when the platform says the command was sent (messages are stored by that)
    history_since_join: bool = False  # members see only what was said since they joined (bot.policy.Inbound)

    def __post_init__(self) -> None:  # the name as stores and prompts may take it (as IncomingMessage's)
        # (nothing left: the platform's id, as IncomingMessage falls back to its author_id)
        object.__setattr__(self, "user_name", one_line_name(self.user_name) or self.user_key.split(":", 1)[-1])


@dataclass(frozen=True, slots=True)
class CommandReply:
    text: str
    attachments: tuple[Attachment, ...] = ()
    private: bool = False  # about the user's own data: adapters answer only to them
    needs_body: str = ""  # set when the command waits for content: the prompt to show
    pipe_may_answer: bool = True  # piped input may give that content (else only a person at a prompt)
    preformatted: str = ""  # "": Markdown; else plain text in columns, a diff: a code block's language
    failed: bool = False  # the command did nothing: unknown, not allowed, bad arguments, or it failed
    # It failed, it takes a text, and none came below its line: where lines arrive one by one (a terminal's
    # piped input), the lines after it up to one holding only a dot were its text, not chat.
    text_refused: bool = False
    # Its text holds people's words escaped by bot.text.inert: shown unescaped where Markdown is not rendered (a
    # terminal); a reply not so marked is shown as it is (a file's own backslashes are its text).
    escaped: bool = False

    def markdown(self) -> str:
        """The text for a platform that renders Markdown: preformatted text in a code block (a diff's "-"
        line would make the one above it a heading, and columns would lose their spaces)."""
        if not self.preformatted or not self.text:
            return self.text
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", self.text)), default=0))
        return f"{fence}{self.preformatted}\n{self.text}\n{fence}"


def operators(ctx: CommandContext, text: str) -> CommandReply | str:
    """An answer holding what only the bot's admins may read (an MCP server's path, the whole bot's figures and
    spending): privately outside a DM, where everyone in the channel, a room's own admins too, would read it."""
    return text if ctx.is_dm else CommandReply(text, private=True)


Handler = Callable[[CommandContext, Sequence[str]], Awaitable["CommandReply | str"]]
ParamKind = Literal["word", "number", "words", "text", "flag", "option", "file"]


@dataclass(frozen=True, slots=True)
class Param:
    """One typed parameter of a command, declared once: the ``!`` line's usage and arity, the help, and
    each platform's own form (Discord's slash-command options) are all made from it.

    ``word`` is one token, ``number`` a whole number (``minimum``/``maximum``), ``words`` the rest of the
    line as words (a persona's name), ``text`` free text (on the line or the lines after it; slash
    commands send it after the line), ``flag`` a switch spelled ``token`` (default ``--name``), ``option``
    a ``--name VALUE`` pair, ``file`` a file sent with the command (an attachment; in the terminal a
    path on the line). ``choices`` are the only values a platform offers; ``complete`` names a
    completer a platform may offer (``versions``: the caller's versions of the chosen file, ``personas``)."""

    name: str
    kind: ParamKind = "word"
    required: bool = False
    help: str = ""
    choices: tuple[str, ...] = ()
    complete: str = ""
    minimum: int | None = None
    maximum: int | None = None
    token: str = ""
    document: bool = False  # a text of several lines (guidelines, a rule): piped input may give it, up to a dot
    menu: bool = False  # filled in by a platform's message menu or reaction (a message reference): not in help

    @property
    def spelled(self) -> str:
        return self.token or f"--{self.name}"

    @property
    def usage(self) -> str:
        if self.kind == "flag":
            return f"[{self.spelled}]"
        if self.kind == "option":
            return f"[{self.spelled} {self.name.upper()}]"
        label = f"{self.name}…" if self.kind in ("words", "text") else self.name
        return f"<{label}>" if self.required else f"[{label}]"


def word(name: str, help: str = "", *, required: bool = False, choices: Sequence[str] = (),
         complete: str = "") -> Param:
    return Param(name, "word", required, help, tuple(choices), complete)


def number(name: str, help: str = "", *, required: bool = False, complete: str = "", minimum: int = 1,
           maximum: int | None = None) -> Param:
    return Param(name, "number", required, help, complete=complete, minimum=minimum, maximum=maximum)


def words(name: str, help: str = "", *, required: bool = False, complete: str = "") -> Param:
    return Param(name, "words", required, help, complete=complete)


def text(name: str, help: str = "", *, required: bool = False, document: bool = False) -> Param:
    return Param(name, "text", required, help, document=document)


def flag(name: str, help: str = "", *, token: str = "") -> Param:
    return Param(name, "flag", False, help, token=token)


def file(name: str, help: str = "", *, required: bool = False) -> Param:
    return Param(name, "file", required, help)


def option(name: str, help: str = "", *, choices: Sequence[str] = (), minimum: int | None = None,
           maximum: int | None = None, token: str = "", menu: bool = False) -> Param:
    return Param(name, "option", False, help, tuple(choices), minimum=minimum, maximum=maximum, token=token,
                 menu=menu)


@dataclass(frozen=True, slots=True)
class Command:
    name: str  # "help" or "memory show"
    summary: str
    handler: Handler
    params: tuple[Param, ...] = ()
    admin: bool = False
    bot_admin: bool = False  # changes what every server shares (personas, global rules)
    private: bool = False  # about the caller's own data: answered only to them
    public: bool = False  # a slash command's answer is shown to the channel (else only to the caller)
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def usage(self) -> str:
        """The ``!`` line's arguments as help shows them (those a message menu fills in are nobody's to type, and
        what such an option stands in for is needed when typed: ``!memory forget <item>``)."""
        menu = any(p.menu for p in self.params)
        return " ".join(replace(p, required=True).usage if menu and p.kind not in ("flag", "option") else p.usage
                        for p in self.params if not p.menu)

    @property
    def max_args(self) -> int | None:
        """How many words may follow the name besides its flags and options: one per word, number or file
        parameter, or no limit when the command takes free words or text."""
        if any(p.kind in ("words", "text") for p in self.params):
            return None
        return sum(1 for p in self.params if p.kind in ("word", "number", "file"))

    def _switches(self) -> tuple[set[str], set[str]]:
        """How this command's flags and options are spelled on the line."""
        return ({p.spelled for p in self.params if p.kind == "flag"},
                {p.spelled for p in self.params if p.kind == "option"})

    def canonical(self, tokens: Sequence[Token]) -> list[Token]:
        """``tokens`` with this command's flags and options as spelled, where typed unquoted with a typographic
        dash (iOS and macOS turn ``--pin`` into ``—pin``) or with its value after "=" (``--category=fact`` is
        ``--category fact``); any other word, and a quoted one, stays as typed (a flag's case too: ``--PIN`` is
        not ``--pin``)."""
        flags, options = self._switches()
        spelled_as = {name: name for name in flags | options}
        out: list[Token] = []
        for token in tokens:
            value, unquoted = token.value, token.end - token.start == len(token.value)
            if not unquoted or not (value.startswith("--") or value[:1] in TYPOGRAPHIC_DASHES):
                out.append(token)
                continue
            name, equals, rest = value.partition("=")
            spelled = spelled_as.get("--" + name.lstrip("-" + TYPOGRAPHIC_DASHES))
            if spelled is None or (equals and spelled not in options):
                out.append(token)
            elif not equals:
                out.append(Token(spelled, token.start, token.end))
            else:  # "--category=fact": the option and its value
                split = token.start + len(name) + 1
                out += [Token(spelled, token.start, split - 1), Token(rest, split, token.end)]
        return out

    def free_text(self, tokens: Sequence[Token], line: str, body: str) -> tuple[list[str], str, list[str]] | None:
        """For a command with a ``text`` parameter: its arguments with the free text as one argument, exactly
        as typed (then the lines after the command line), that text (also the context's body), and the names
        of the required words before the text that were not given. The leading words the command takes come
        first; flags and options count only before the text or after it. None for a command without
        free text."""
        if not any(p.kind == "text" for p in self.params):
            return None
        flags, options = self._switches()
        # A quoted word is never a switch (`I said "--pin"` is a text, pinned nothing): it is looked up as "\0…".
        keys = [f"\0{t.value}" if line[t.start] in QUOTES and line[t.start:t.end] != t.value else t.value
                for t in tokens]
        before = [p for p in takewhile(lambda p: p.kind != "text", self.params) if p.kind in ("word", "number")]
        head: list[str] = []
        start = given = 0
        while start < len(tokens):  # options, flags and the leading words, up to the text
            value = keys[start]
            if value in options:
                head += [t.value for t in tokens[start:start + 2]]
                start += 2
            elif value in flags or given < len(before):
                given += value not in flags
                quoted_switch = value != tokens[start].value and tokens[start].value in flags | options
                # (a quoted switch name as a leading word keeps its quotes: the handler must not take it for one)
                head.append(line[tokens[start].start:tokens[start].end] if quoted_switch else tokens[start].value)
                start += 1
            else:
                break
        end = len(tokens)
        while end > start:  # options and flags after the text
            if end - 2 >= start and keys[end - 2] in options:
                end -= 2
            elif keys[end - 1] in flags or keys[end - 1] in options:  # an option's value missing:
                end -= 1  # the handler says so
            else:
                break
        for edge in [*tokens[start:end][:1], *tokens[start + 1:end][-1:]]:  # "--pinn", "--help": not the text's
            if _SWITCH.fullmatch(edge.value.partition("=")[0]) and edge.end - edge.start == len(edge.value):  # unquoted
                near = difflib.get_close_matches(edge.value.partition("=")[0].lower(), sorted(flags | options), n=1)
                raise CommandError(f"no option {shown(edge.value)}" + (f" (did you mean {near[0]}?)" if near else "")
                                   + "; a text that starts or ends with it goes in quotes")
        _misspelled_option(tokens[start + 1:end][-2:-1], options)
        _option_near_the_end(tokens[start:end], options)
        inline = line[tokens[start].start:tokens[end - 1].end] if end > start else ""
        if end - start == 1 and len(inline) == len(tokens[start].value) + 2 and inline[1:-1] not in flags | options:
            inline = tokens[start].value  # all of it in quotes: what is inside (a switch's name keeps its quotes)
        text = "\n".join(part for part in (inline, body) if part.strip())
        if text in flags | options:  # a text that is a switch's name (a "Remember this" on a message "--pin")
            text = _quoted(text)  # is a text: the handler must not take it for the switch
        missing = [p.name for p in before if p.required][given:]
        return head + ([text] if text else []) + [t.value for t in tokens[end:]], text, missing

    def takes_a_path(self, context: CommandContext) -> bool:
        """Whether the command's last argument is a file given by its path (at the terminal, with no file
        attached): the words after it are the path's, which may hold spaces."""
        last = [p for p in self.params if p.kind not in ("flag", "option")][-1:]
        return bool(last) and last[0].kind == "file" and context.platform == TERMINAL and not context.attachments

    def positional(self, args: Sequence[str]) -> list[str]:
        """``args`` without this command's flags and options (and the options' values)."""
        return self._sorted(args)[0]

    def given_twice(self, args: Sequence[str], text: str | None) -> str | None:
        """A flag or option given more than once in ``args`` (``--importance 5 --importance 6``), outside the
        free ``text``; an option's value is never one."""
        given = self._sorted(args, text)[1]
        return next((a for a in given if given.count(a) > 1), None)

    def _sorted(self, args: Sequence[str], text: str | None = None) -> tuple[list[str], list[str]]:
        """``args`` as (the words that are no switch, the flags and options as written), the options' values
        in neither; ``text`` (the free text) is a word, whatever it says."""
        flags, options = self._switches()
        left: list[str] = []
        given: list[str] = []
        skip = False
        for arg in args:
            if skip:
                skip = False
            elif arg != text and arg in options:
                given.append(arg)
                skip = True
            elif arg != text and arg in flags:
                given.append(arg)
            elif not (arg.lower() in flags and not arg.startswith("-")):
                left.append(arg)  # a flag that is a plain word ("confirm") counts in any case: "CONFIRM"
        return left, given

    def line(self, prefix: str, values: Mapping[str, object]) -> str:
        """The ``!`` line (and body) that runs this command with ``values`` by parameter name (what a
        platform's own form, e.g. a slash command, collected)."""
        parts, body = [f"{prefix}{self.name}"], ""
        for param in self.params:
            value = values.get(param.name)
            if value is None or value is False or value == "" or param.kind == "file":
                continue  # files travel beside the line (CommandContext.attachments)
            if param.kind == "flag":
                parts.append(param.spelled)
            elif param.kind == "option":
                parts += [param.spelled, quote_word(str(value))]
            elif param.kind == "text":
                body = str(value)
            elif param.kind == "words":  # its first word quoted: a value is never read as a subcommand
                first, _, rest = str(value).strip().partition(" ")
                parts.append(_quoted(first) + (f" {rest}" if rest else ""))
            else:
                parts.append(quote_word(str(value)))
        return " ".join(parts) + (f"\n{body}" if body else "")


@dataclass(frozen=True, slots=True)
class Token:
    value: str  # the word, without the quotes it was typed in
    start: int  # where it was typed in the line (quotes included)
    end: int


def split_words(line: str) -> list[Token]:
    """The words of a command line as typed (see the module's docstring): unlike ``shlex``, an apostrophe
    or a backslash is just a character ("Ann's", "C:\\Users"); a word that starts with a quote ends at the
    same quote where a word ends, and an unmatched quote is a character too. ``--keys="mill, wheel"`` is two
    words, ``--keys`` and the quoted ``mill, wheel``, as if typed with a space for the "=". Linear in the line's length
    (each quoted word finds its end by bisection, never by scanning again)."""
    n = len(line)
    ends = {opening: [j for j in range(n) if line[j] == closing and (j + 1 == n or line[j + 1].isspace())]
            for opening, closing in QUOTES.items()}
    tokens: list[Token] = []
    i = 0
    while i < n:
        if line[i].isspace():
            i += 1
            continue
        if line[i] in ends:
            candidates = ends[line[i]]
            at = bisect.bisect_right(candidates, i)
            if at < len(candidates):
                close = candidates[at]
                tokens.append(Token(line[i + 1:close], i, close + 1))
                i = close + 1
                continue
        assigned = _ASSIGNED.match(line, i)
        if assigned and line[assigned.end()] in ends:  # --keys="mill, wheel": the option, then its quoted value
            candidates = ends[line[assigned.end()]]
            at = bisect.bisect_right(candidates, assigned.end())
            if at < len(candidates):
                close, opening = candidates[at], assigned.end()
                tokens += [Token(line[i:opening - 1], i, opening - 1),
                           Token(line[opening + 1:close], opening, close + 1)]
                i = close + 1
                continue
        end = i
        while end < n and not line[end].isspace():
            end += 1
        tokens.append(Token(line[i:end], i, end))
        i = end
    return tokens


def place_word(server_key: str) -> str:
    """What a reply calls the server a command was sent in: a room on Matrix (its unit of administration),
    a server elsewhere; a reply says "this server" rather than showing the key."""
    return "room" if server_key.startswith("matrix:") else "server"


def _quoted(word: str) -> str:
    """``word`` in quotes whatever it holds (a quoted word is never taken as a subcommand)."""
    quoted = quote_word(word)
    return quoted if quoted[:1] in ("'", '"') else f'"{word}"'


def quote_word(value: str) -> str:
    """``value`` as one word of a command line, read back by :func:`split_words` as it is (a value with
    both a ``' `` and a ``" `` inside, which no quote can hold, has its ``" `` made ``' ``)."""
    plain = value[:1] not in QUOTES and value[:1] not in TYPOGRAPHIC_DASHES
    if value and plain and not any(c.isspace() for c in value):
        return value
    for quote in "'\"":
        if not re.search(quote + r"\s", value):
            return f"{quote}{value}{quote}"
    return "'" + re.sub(r"'(?=\s)", '"', value) + "'"


@dataclass(frozen=True, slots=True)
class PlatformCommand:
    """A command one platform's adapter handles itself (Matrix's ``!leave``), declared there and listed by
    ``help`` where it works: that platform, outside direct messages."""

    platform: str
    name: str
    summary: str


class CommandError(Exception):
    """A command was used wrongly; the message tells the user how to use it."""


class CommandRegistry:
    def __init__(self, prefix: str = "!", *,
                 unavailable: Callable[[BaseException], str | None] = lambda _exc: None) -> None:
        self.prefix = prefix
        self.unavailable = unavailable  # the storage's word on a failure that is the database's (Storage.unavailable)
        self._commands: dict[str, Command] = {}
        self._order: list[str] = []
        self._platform_commands: list[PlatformCommand] = []
        self.register(Command("help", "list the commands, or explain one or a group (help memory)", self._help,
                              (words("command", "a command or group, e.g. memory or memory remember"),)))

    def register(self, command: Command) -> None:
        for name in (command.name, *command.aliases):
            self._commands[name] = command
        self._order.append(command.name)

    def note_platform_command(self, command: PlatformCommand) -> None:
        """List an adapter's own command in ``help`` (once, however often the adapter is made)."""
        if command not in self._platform_commands:
            self._platform_commands.append(command)

    @property
    def commands(self) -> list[Command]:
        return [self._commands[name] for name in self._order]

    def first_words(self) -> set[str]:
        """Every word a command can start with: the registered groups and commands, and the adapters' own."""
        return {c.name.split(" ")[0] for c in self.commands} | {c.name for c in self._platform_commands}

    def is_command(self, text: str) -> bool:
        return text.startswith(self.prefix) and len(text.strip()) > len(self.prefix)

    def subcommands(self, group: str) -> set[str]:
        """The second words of a group's commands (``persona`` → list, show, create, …)."""
        return {c.name.split(" ")[1] for c in self.commands if c.name.startswith(f"{group} ")}

    def knows(self, text: str) -> bool:
        """Whether a command line's first word names one of these commands or command groups. In a
        channel shared with other bots their commands (``!play``) are not this bot's to answer."""
        first = without_surrogates(text).strip()[len(self.prefix):].split(None, 1)
        return bool(first) and first[0].lower() in {c.name.split(" ")[0] for c in self.commands}

    def file_command(self, text: str) -> Command | None:
        """The command a line runs when it takes a file (``!persona import``), else None: what an adapter may
        download for."""
        _, command, _ = self._parse(storable(text).strip().partition("\n")[0][len(self.prefix):])
        return command if command is not None and any(p.kind == "file" for p in command.params) else None

    def takes_files_from(self, text: str, context: CommandContext) -> bool:
        """Whether the line runs a command that takes a file and ``context``'s caller may run it (its admin
        rights): what an adapter may download for, before the command runs."""
        command = self.file_command(text)
        return command is not None and self._may_run(command, context)

    def _parse(self, line: str) -> tuple[list[Token], Command | None, list[str]]:
        """A command line (without its prefix) as typed words, the command they name and its arguments (of a
        line over MAX_LINE_CHARS, which dispatch refuses, its start: enough to name the command)."""
        tokens = split_words(line[:MAX_LINE_CHARS])
        if not tokens:
            return tokens, None, []
        command, args = self._find([t.value for t in tokens],
                                   quoted_second=len(tokens) > 1 and line[tokens[1].start] in QUOTES)
        return tokens, command, args

    def usage(self, command: Command) -> str:
        return f"{self.prefix}{command.name}" + (f" {command.usage}" if command.usage else "")

    async def dispatch(self, text: str, context: CommandContext) -> CommandReply:
        reply = await self._dispatch(text, context)
        if reply.failed:
            first, _, body = storable(text).strip().partition("\n")
            _, command, _ = self._parse(first[len(self.prefix):])
            if command is not None and not body.strip() and any(p.kind == "text" for p in command.params):
                return replace(reply, text_refused=True)
        return reply

    async def _dispatch(self, text: str, context: CommandContext) -> CommandReply:
        first, _, body = storable(text).strip().partition("\n")
        line = first[len(self.prefix):]
        if len(line) > MAX_LINE_CHARS:  # (split into words, a pasted megabyte held the event loop for a second)
            return CommandReply(f"A command line is at most {MAX_LINE_CHARS:,} characters; this one has "
                                f"{len(line):,}. A long text goes on the lines below the command.", failed=True)
        tokens, command, args = self._parse(line)
        words = [t.value for t in tokens]
        if not words:
            return CommandReply(f"Type {self.prefix}help for the list of commands.")
        if command is not None:  # its switches as spelled, whatever dash a phone put in front of them
            named = len(tokens) - len(args)  # the command's own name (one option's "=" may make two of a token)
            tokens = command.canonical(tokens)
            words, args = [t.value for t in tokens], [t.value for t in tokens[named:]]
            if len(args) > 1 and command.takes_a_path(context):  # a path of several words: as typed, its spaces too
                args = [line[tokens[named].start:tokens[-1].end]]
        if command is None:
            group = [c for c in self.commands if c.name.split(" ")[0] == words[0].lower()]
            if group:
                head = f"{self.prefix}{words[0].lower()}"
                offered = [c for c in group if self._may_run(c, context)]
                if not offered:  # (a list of them would be empty: said as a command of theirs would say it)
                    return CommandReply(_admins_only(head, group), failed=True)
                near = difflib.get_close_matches(words[1].lower(), [c.name.split(" ", 1)[-1] for c in offered],
                                                 n=1) if len(words) > 1 else []
                hint = f" (did you mean {head} {near[0]}?)" if near else ""
                lines = [f"Unknown command {head} {shown(words[1], 40)}{hint}; {head} has:" if len(words) > 1
                         else f"{head} needs a subcommand:"]
                lines += [f"  {self.usage(c)} — {c.summary}" for c in offered]
                return CommandReply("\n".join(lines), failed=True)
            typed = shown(self.prefix + " ".join(words[:2]), 40)
            heads = sorted({c.name.split(" ")[0] for c in self.commands})
            near = difflib.get_close_matches(words[0].lower(), heads, n=1)
            hint = f" (did you mean {self.prefix}{near[0]}?)" if near else ""
            return CommandReply(f"Unknown command {typed}{hint}. Type {self.prefix}help.", failed=True)
        if command.bot_admin and not context.is_bot_admin:
            return CommandReply(f"{self.prefix}{command.name} is for the bot's admins only (it concerns every "
                                "server, not just this one).", failed=True)
        if command.admin and not context.is_admin:
            return CommandReply(f"{self.prefix}{command.name} is for admins only.", failed=True)
        limit, positional = command.max_args, command.positional(args)
        if limit is not None and command.takes_a_path(context):  # "/tmp/my card.json": one path, with its space
            limit = None
        if limit is not None and len(positional) > limit:
            extra = " ".join(positional[limit:])
            takes = "no arguments" if limit == 0 else "at most " + plural(limit, "argument")
            switches = [p.spelled for p in command.params if p.kind in ("flag", "option")]
            if switches:  # "[confirm]" in its usage reads like an argument: say what may come instead
                takes += f" besides {' / '.join(switches)}"
            return CommandReply(f"{self.prefix}{command.name} takes {takes} (not {shown(extra)}). "
                                f"Usage: {self.usage(command)}", private=command.private, failed=True)
        try:
            free = command.free_text(tokens[len(words) - len(args):], line, body)
        except CommandError as exc:  # a switch it does not have, at an end of the text
            return CommandReply(f"{self.prefix}{command.name} has {exc}\nUsage: {self.usage(command)}",
                                private=command.private, failed=True)
        words_missing: list[str] = []
        if free is not None:
            args, body, words_missing = free
        if twice := command.given_twice(args, body if free is not None else None):  # (before asking for a text)
            return CommandReply(f"{twice} is given twice; give it once. Usage: {self.usage(command)}",
                                private=command.private, failed=True)
        missing = next((p for p in command.params if p.kind == "text" and p.required and not body), None)
        if missing is not None:  # at a prompt, asked for (once the words before it are there)
            needed = " and the ".join([*words_missing, missing.name])
            return CommandReply(
                f"{self.prefix}{command.name} needs the {needed}: "
                + ("after the command, or on the lines below it" if not words_missing else "after the command")
                + f". Usage: {self.usage(command)}", private=command.private,
                pipe_may_answer=missing.document,  # a forgotten short text: never the next piped line
                needs_body="" if words_missing else f"Type the {missing.name}; end with a line holding only a dot (.)",
                failed=bool(words_missing))  # (words missing before it: nothing can be asked for)
        ctx = context if not body else _with_body(context, body)
        try:
            result = await command.handler(ctx, args)
        except CommandError as exc:
            return CommandReply(f"{exc}\nUsage: {self.usage(command)}", private=command.private, failed=True)
        except Exception as exc:  # a command may fail; the bot may not
            if (trouble := self.unavailable(exc)) is not None:
                log.error("command %s%s failed: %s", self.prefix, command.name, trouble)
                return CommandReply(f"Sorry, {self.prefix}{command.name} failed: the bot's database cannot be used "
                                    "right now (the admins can see why in the bot's log). Try again in a few minutes.",
                                    private=command.private, failed=True)
            if is_missing_reference(exc):  # (a row it wrote beside went meanwhile: a forget-me, a deleted persona)
                log.warning("command %s%s failed: a row it needed was deleted meanwhile", self.prefix, command.name)
                return CommandReply(f"Sorry, {self.prefix}{command.name} failed: something it needed was deleted "
                                    "meanwhile (a forget-me?), so nothing was saved. Try again if you still want it.",
                                    private=command.private, failed=True)
            log.exception("command %s%s failed", self.prefix, command.name)
            return CommandReply(
                f"Sorry, {self.prefix}{command.name} failed ({type(exc).__name__}). "
                "Try again, or tell an admin (the details are in the bot's log).",
                private=command.private, failed=True,
            )
        if isinstance(result, str):
            return CommandReply(result, private=command.private)
        return result

    def _find(self, words: list[str], *, quoted_second: bool = False) -> tuple[Command | None, list[str]]:
        """The command the words name, and its arguments. A second word typed in quotes is an argument, not
        a subcommand (``/persona name:list`` is the persona called "list")."""
        if len(words) >= 2 and not quoted_second:
            two = f"{words[0].lower()} {words[1].lower()}"
            if two in self._commands:
                return self._commands[two], words[2:]
        one = self._commands.get(words[0].lower())
        if one is not None and one.max_args == 0 and one.positional(words[1:]) \
                and self.subcommands(words[0].lower()):
            # "!guidelines sett x": a group's own command taking no words got a typo of a subcommand
            return None, words[1:]
        return one, words[1:]

    async def _help(self, context: CommandContext, args: Sequence[str]) -> str:
        shown_here = [c for c in self.commands if self._may_run(c, context)]
        own = [c for c in self._platform_commands if c.platform == context.platform and not context.is_dm]
        if args:
            topic = " ".join(args).lower().removeprefix(self.prefix)
            for handled in own:
                if handled.name == topic:
                    return f"{self.prefix}{handled.name} — {handled.summary}"
            hidden = [c for c in self.commands if c.name.split(" ")[0] == topic.split(" ")[0]]
            if hidden and not any(c in shown_here for c in hidden):  # (a group of admins' commands only)
                return _admins_only(f"{self.prefix}{topic.split(' ')[0]}", hidden)
            return self._explain(topic, shown_here)
        lines = ["Commands:"]
        groups = list(dict.fromkeys(c.name.split(" ")[0] for c in shown_here))  # in order of first use
        for command in sorted(shown_here, key=lambda c: groups.index(c.name.split(" ")[0])):
            lines.append(f"  {self.usage(command)} — {command.summary}")
        lines += [f"  {self.prefix}{c.name} — {c.summary}" for c in own]
        lines.append(f"Anything else you type is sent to the persona. {self.prefix}help COMMAND explains one.")
        return "\n".join(lines)

    @staticmethod
    def _may_run(command: Command, context: CommandContext) -> bool:
        return not ((command.admin and not context.is_admin) or (command.bot_admin and not context.is_bot_admin))

    def _explain(self, topic: str, commands: Sequence[Command]) -> str:
        """``!help memory remember``: the command (or every command of a group) with what each part means."""
        found = [c for c in commands if c.name == topic or c.name.startswith(topic + " ")]
        if not found:
            names = sorted({c.name for c in commands} | {c.name.split(" ")[0] for c in commands})
            near = difflib.get_close_matches(topic, names, n=1)
            return (f"No command {shown(self.prefix + topic, 40)}"
                    + (f" (did you mean {self.prefix}{near[0]}?)" if near else "") + f". Type {self.prefix}help.")
        lines = []
        for command in found:
            lines.append(f"{self.usage(command)} — {command.summary}")
            lines += [f"    {p.usage} {p.help}" for p in command.params if p.help and not p.menu]
        return "\n".join(lines)


def _admins_only(head: str, group: Sequence[Command]) -> str:
    """What a person told no command of ``group`` is theirs reads."""
    who = "the bot's admins" if all(c.bot_admin for c in group) else "admins"
    return f"The {head} commands are for {who} only."


def _with_body(context: CommandContext, body: str) -> CommandContext:
    return replace(context, body=body)
