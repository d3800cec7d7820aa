"""The command declarations: usage, arity and the line a platform form turns into."""

from __future__ import annotations

import shlex

from bot.commands import (
    Command,
    CommandContext,
    CommandRegistry,
    flag,
    number,
    option,
    quote_word,
    split_words,
    text,
    word,
    words,
)


async def _handler(ctx: CommandContext, args: object) -> str:
    return f"args={list(args)!r} body={ctx.body!r}"  # type: ignore[call-overload]


REMEMBER = Command("memory remember", "store a fact", _handler, (
    text("text", required=True), option("category", choices=("fact", "event")), option("importance", minimum=1,
                                                                                         maximum=10), flag("pin")))
DIFF = Command("memory diff", "compare", _handler, (word("file", required=True), number("v1", required=True),
                                                     number("v2", required=True)))
PICK = Command("persona", "pick one", _handler, (words("name"),))
FORGET_ME = Command("memory forget-me", "delete all", _handler, (flag("confirm", token="confirm"),))


def test_usage_and_arity_come_from_the_parameters() -> None:
    assert REMEMBER.usage == "<text…> [--category CATEGORY] [--importance IMPORTANCE] [--pin]"
    assert DIFF.usage == "<file> <v1> <v2>" and DIFF.max_args == 3
    assert PICK.usage == "[name…]" and PICK.max_args is None
    assert FORGET_ME.usage == "[confirm]" and Command("x", "y", _handler).max_args == 0


def test_a_forms_values_become_the_commands_line() -> None:
    line = REMEMBER.line("!", {"text": "Ann's cat is \"Pixel\"", "category": "fact", "importance": 9, "pin": True})
    assert line == "!memory remember --category fact --importance 9 --pin\nAnn's cat is \"Pixel\""
    assert DIFF.line("!", {"file": "memory.md", "v1": 1, "v2": 3}) == "!memory diff memory.md 1 3"
    assert shlex.split(PICK.line("!", {"name": "Ada Lovelace"})) == ["!persona", "Ada", "Lovelace"]
    assert FORGET_ME.line("!", {"confirm": True}) == "!memory forget-me confirm"
    assert FORGET_ME.line("!", {"confirm": False}) == "!memory forget-me"
    assert DIFF.line("!", {"file": "my file; rm -rf", "v1": 1, "v2": 2}).startswith("!memory diff 'my file; rm -rf'")
    for value in ("Ann's Bot", "C:\\Users\\ann", "x' y\" z", '"q', "tab\there"):
        quoted = DIFF.line("!", {"file": value, "v1": 1, "v2": 2}).removeprefix("!memory diff ").rsplit(" ", 2)[0]
        assert [t.value for t in split_words(quoted)] == [value.replace("' ", '" ') if '" ' in value else value]


async def test_the_line_dispatches_to_the_same_arguments() -> None:
    registry = CommandRegistry()
    registry.register(REMEMBER)
    registry.register(DIFF)
    ctx = CommandContext("discord", "discord:1", "Ann", "discord:c", "Cora")
    reply = await registry.dispatch(REMEMBER.line("!", {"text": "two\nlines", "pin": True}), ctx)
    assert reply.text == "args=['--pin', 'two\\nlines'] body='two\\nlines'"  # the free text as one argument
    reply = await registry.dispatch(DIFF.line("!", {"file": "my file", "v1": 1, "v2": 2}), ctx)
    assert reply.text == "args=['my file', '1', '2'] body=''"
    assert "takes at most 3 arguments" in (await registry.dispatch("!memory diff a 1 2 3", ctx)).text


async def test_a_phones_smart_punctuation_still_reads_as_flags_and_quotes() -> None:
    """iOS and macOS turn ``--pin`` into ``—pin`` and ``"Captain Nemo"`` into ``“Captain Nemo”``: the flag was
    stored as part of the fact, and the quoted name read as two words."""
    registry = CommandRegistry()
    registry.register(REMEMBER)
    registry.register(Command("persona", "pick", _handler, (words("name"), option("for"))))
    ctx = CommandContext("discord", "discord:1", "Ann", "discord:c", "Cora")

    async def args_of(line: str) -> str:
        return (await registry.dispatch(line, ctx)).text

    assert await args_of("!memory remember I like tea \u2014pin") == "args=['I like tea', '--pin'] body='I like tea'"
    assert await args_of("!memory remember \u2013category fact I like tea") == (
        "args=['--category', 'fact', 'I like tea'] body='I like tea'")
    assert await args_of("!memory remember The \u2014 dash and \u2014tea stay") == (
        "args=['The \u2014 dash and \u2014tea stay'] body='The \u2014 dash and \u2014tea stay'")
    assert await args_of("!memory remember I like tea '\u2014pin'") == (  # quoted: a word as typed
        "args=[\"I like tea '\u2014pin'\"] body=\"I like tea '\u2014pin'\"")
    for opening, closing in ("\u201c\u201d", "\u2018\u2019", "\u201e\u201c", "\u00ab\u00bb"):
        assert await args_of(f"!persona --for {opening}Ann Lee{closing} Captain") == (
            "args=['--for', 'Ann Lee', 'Captain'] body=''")
        assert [t.value for t in split_words(f"{opening}x y{closing}")] == ["x y"]
    assert await args_of("!persona Ann\u2019s \u2018bot") == "args=['Ann\u2019s', '\u2018bot'] body=''"
    for value in ("\u201cq", "\u2014pin", "\u00abx y\u00bb z"):  # a form's value is read back as it is
        assert [t.value for t in split_words(quote_word(value))] == [value]


async def test_free_text_arrives_exactly_as_typed() -> None:
    """Apostrophes, backslashes, quotes and spacing of free text stay as typed; flags count only before
    or after the text; text on the command line and on the lines after it are one text."""
    registry = CommandRegistry()
    registry.register(REMEMBER)
    ctx = CommandContext("matrix", "matrix:@ann:x", "Ann", "matrix:!r:x", "Cora")

    async def args_of(line: str) -> str:
        return (await registry.dispatch(line, ctx)).text

    typed = "Ann's cat and Bob's dog are friends, see C:\\Users\\ann and \"carpe diem\"   (Horace)"
    assert await args_of(f"!memory remember {typed}") == f"args={[typed]!r} body={typed!r}"
    assert await args_of("!memory remember Use --pin wisely") == "args=['Use --pin wisely'] body='Use --pin wisely'"
    assert await args_of("!memory remember --pin I like tea --category fact") == (
        "args=['--pin', 'I like tea', '--category', 'fact'] body='I like tea'")
    assert await args_of("!memory remember My address is:\nBaker Street 5") == (
        "args=['My address is:\\nBaker Street 5'] body='My address is:\\nBaker Street 5'")
    assert await args_of("!memory remember 'it's quoted' and so 'is this'") == (
        "args=[\"'it's quoted' and so 'is this'\"] body=\"'it's quoted' and so 'is this'\"")
    assert await args_of('!memory remember "Ann likes tea"') == "args=['Ann likes tea'] body='Ann likes tea'"
    assert "needs the text" in await args_of("!memory remember ''")  # quotes around nothing: no text
    missing = await registry.dispatch("!memory remember --pin", ctx)
    assert "needs the text" in missing.text and missing.needs_body  # asked for at a prompt
    assert not missing.pipe_may_answer  # piped input goes on with its next line
    slow = "!memory remember " + "'a " * 6_000  # quotes that never close: still one pass over the line
    assert (await registry.dispatch(slow, ctx)).text.startswith("args=[\"'a 'a")
    longer = await registry.dispatch("!memory remember " + "'a " * 30_000, ctx)  # (not split: refused at once)
    assert longer.failed and longer.text.startswith("A command line is at most 20,000 characters; this one has 90,015")
    assert len(split_words("'a " * 30_000)) == 30_000
    registry.register(Command("rules add", "add", _handler, (word("name", required=True), text("text", required=True))))
    assert not (await registry.dispatch("!rules add", ctx)).needs_body  # the name first: a prompt would take the text
    assert (await registry.dispatch("!rules add kind", ctx)).needs_body
    registry.register(FORGET_ME)
    assert await args_of("!memory forget-me CONFIRM") == "args=['CONFIRM'] body=''"  # a flag's word in any case
    registry.register(Command("guidelines clear", "clear", _handler, (flag("default"),)))
    assert "takes no arguments" in await args_of("!guidelines clear --DEFAULT")  # not taken for --default
    assert "takes no arguments" in await args_of("!memory forget-me yes")


async def test_a_typo_of_a_subcommand_is_not_taken_by_the_groups_own_command() -> None:
    """"!guidelines sett x" answered as "!guidelines show takes no arguments (not 'sett x')"; and a word
    after a command that takes none but a word-spelled flag ("confirm") was refused as if it took none."""
    registry = CommandRegistry()
    show = Command("guidelines", "show them", _handler, (flag("default"),))
    registry.register(show)
    registry.register(Command("guidelines set", "set them", _handler, (text("text", required=True),)))
    registry.register(FORGET_ME)
    ctx = CommandContext("discord", "discord:1", "Ann", "discord:c", "Cora")
    typo = (await registry.dispatch("!guidelines sett x", ctx)).text
    assert typo.startswith("Unknown command !guidelines `sett` (did you mean !guidelines set?); !guidelines has:")
    assert "!guidelines set" in typo
    far = (await registry.dispatch("!guidelines zzz", ctx)).text
    assert far.startswith("Unknown command !guidelines `zzz`; !guidelines has:")  # nothing near: the list alone
    assert (await registry.dispatch("!guidelines --default", ctx)).text == "args=['--default'] body=''"
    assert (await registry.dispatch("!guidelines", ctx)).text == "args=[] body=''"
    refused = (await registry.dispatch("!memory forget-me yes", ctx)).text
    assert refused.startswith("!memory forget-me takes no arguments besides confirm (not `yes`)"), refused


async def test_an_unknown_switch_before_or_after_free_text_is_refused_not_stored() -> None:
    """``!memory remember --help`` stored the fact "--help", ``!memory remember I like tea --pinn`` stored
    "I like tea --pinn" unpinned, and ``!persona edit identity --persona Nemo`` made Cora's identity the text
    "--persona Nemo": a mistyped or foreign switch at either end of the text was taken as part of it."""
    registry = CommandRegistry()
    registry.register(REMEMBER)
    ctx = CommandContext("discord", "discord:1", "Ann", "discord:c", "Cora")

    async def args_of(line: str) -> str:
        return (await registry.dispatch(line, ctx)).text

    typo = await args_of("!memory remember I like tea --pinn")
    assert typo.startswith("!memory remember has no option `--pinn` (did you mean --pin?)"), typo
    assert "Usage: !memory remember" in typo and "args=" not in typo
    assert "has no option `--help`" in await args_of("!memory remember --help")
    assert "has no option `--persona`" in await args_of("!memory remember --persona Nemo I like tea")
    assert await args_of("!memory remember Use --pin wisely") == "args=['Use --pin wisely'] body='Use --pin wisely'"
    assert await args_of("!memory remember Use --pinn wisely") == (  # inside the text: the text's own
        "args=['Use --pinn wisely'] body='Use --pinn wisely'")
    assert await args_of('!memory remember "I always run make --verbose"') == (  # quoted: kept as typed
        "args=['I always run make --verbose'] body='I always run make --verbose'")
    assert await args_of("!memory remember a -- b --") == "args=['a -- b --'] body='a -- b --'"
    assert await args_of("!memory remember I like tea --pin") == "args=['I like tea', '--pin'] body='I like tea'"
    # An option with its value after "=" is the command's own.
    assert await args_of("!memory remember --category=preference Ann dances") == (
        "args=['--category', 'preference', 'Ann dances'] body='Ann dances'")
    typo = await args_of("!memory remember --categroy=preference Ann dances")
    assert typo.startswith("!memory remember has no option `--categroy=preference` (did you mean --category?)"), typo
    assert "has no option `--pin=yes`" in await args_of("!memory remember --pin=yes I like tea")  # a flag takes none
    assert await args_of("!memory remember '--category=x' is my password") == (  # quoted: kept as typed
        "args=[\"'--category=x' is my password\"] body=\"'--category=x' is my password\"")
    # An option misspelled or in other case with its value after it, at the text's end, went into the text:
    # "!lore add The mill is old. --kyes mill" stored the words "--kyes mill" and no keyword.
    for line, typed in (("I like tea --categroy preference", "--categroy"), ("I like tea --Category preference",
                                                                            "--Category")):
        said = await args_of(f"!memory remember {line}")
        assert said.startswith(f"!memory remember has no option `{typed}` (did you mean --category?)"), said
        assert "args=" not in said
    assert await args_of("!memory remember make takes --verbose output") == (  # no option of this command's
        "args=['make takes --verbose output'] body='make takes --verbose output'")
    assert await args_of('!memory remember "I like tea --categroy preference"') == (  # quoted: the text
        "args=['I like tea --categroy preference'] body='I like tea --categroy preference'")
    # An option whose value had a space, near the text's end, went into the text with it ("!lore add The mill
    # is old --keys mill, wheel" stored no keyword); further in, or quoted, an option's name is the text's.
    for line in ("I like tea --category food, drink", "I like tea --category food drink now"):
        said = await args_of(f"!memory remember {line}")
        assert said.startswith("!memory remember has more than a value after --category ("), said
        assert "args=" not in said
    assert await args_of("!memory remember use --category to sort them out") == (
        "args=['use --category to sort them out'] body='use --category to sort them out'")
    assert await args_of('!memory remember I like tea --category "food, drink"') == (
        "args=['I like tea', '--category', 'food, drink'] body='I like tea'")
    for typed in ('--category="food, drink"', "\u2014category=\u201cfood, drink\u201d"):  # as in shells
        assert await args_of(f"!memory remember I like tea {typed}") == (
            "args=['I like tea', '--category', 'food, drink'] body='I like tea'")
        assert await args_of(f"!memory remember {typed} I like tea") == (
            "args=['--category', 'food, drink', 'I like tea'] body='I like tea'")
    assert await args_of('!memory remember say x="a b" and --category=fact') == (  # no option: as typed
        """args=['say x="a b" and', '--category', 'fact'] body='say x="a b" and'""")
    assert [t.value for t in split_words('--keys="a b" c')] == ["--keys", "a b", "c"]
    assert [t.value for t in split_words('--keys="a b c')] == ['--keys="a', "b", "c"]  # never closed: words


async def test_a_quoted_switch_name_is_text_and_a_switch_in_capitals_is_named() -> None:
    """`!memory remember I said "--pin"` stored "I said" as a pinned item; `"--pin"` alone was taken for the
    flag (the text then missing); `x --PIN` was refused without naming --pin."""
    registry = CommandRegistry()
    registry.register(REMEMBER)
    ctx = CommandContext("matrix", "matrix:@ann:x", "Ann", "matrix:!r:x", "Cora")

    async def args_of(line: str) -> str:
        return (await registry.dispatch(line, ctx)).text

    assert await args_of('!memory remember I said "--pin"') == """args=['I said "--pin"'] body='I said "--pin"'"""
    assert await args_of('!memory remember "--pin" I said') == """args=['"--pin" I said'] body='"--pin" I said'"""
    assert await args_of('!memory remember "--pin"') == """args=['"--pin"'] body='"--pin"'"""  # (never the flag)
    assert await args_of('!memory remember "--help"') == "args=['--help'] body='--help'"  # no switch: what is inside
    assert await args_of("!memory remember I said --pin") == "args=['I said', '--pin'] body='I said'"
    assert "no option `--PIN` (did you mean --pin?)" in await args_of("!memory remember x --PIN")
    # a body that is a switch's name (a platform's "Remember this" on a message that says "--pin"): a text
    assert await args_of("!memory remember --category fact\n--pin") == (
        """args=['--category', 'fact', '"--pin"'] body='"--pin"'""")
