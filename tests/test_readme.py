"""The README against the code: every command as declared (its flags, options, arguments and who may run it)."""

from __future__ import annotations

import re
from pathlib import Path

from bot.app import App
from bot.commands import Command
from bot.config import parse_config
from tests.fakes.provider import ScriptedProvider

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _command_table() -> list[tuple[str, str]]:
    """The rows of the README's command table as (its command cell, its "who" cell)."""
    lines = README.splitlines()
    start = lines.index("| command | who | what it does |")
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        assert line.startswith("|"), f"a row of the command table is broken across lines: {line[:80]!r}"
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append((cells[0], cells[1]))
    return rows


def _switches(command: Command) -> set[str]:
    return {p.spelled for p in command.params if p.kind in ("flag", "option") and not p.menu}


def _arguments(command: Command) -> int:
    return sum(1 for p in command.params if p.kind not in ("flag", "option"))


async def test_every_command_is_in_the_readme_table_as_declared(tmp_path: Path) -> None:
    """Each declared command is in the table with its flags and options, as many arguments as it takes, and the
    rights it needs; the table names no command the bot does not have. (`!memory edit <file>` left out the text
    the command takes on its line, `!lore add` its `--not-always`, and a row broken over two lines cut the
    table in two.)"""
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}, "memory": {"embedder": "none"}})
    async with App(config, llm=ScriptedProvider()) as app:
        declared = {c.name: c for c in app.commands.commands}
    documented: dict[str, list[tuple[str, str]]] = {}
    for cell, who in _command_table():
        for entry in re.findall(r"`(![^`]*)`", cell):
            entry = entry.replace("\\|", "|")
            words = entry[1:].split()
            pair = f"{words[0]} {words[1].strip('[]')}" if len(words) > 1 else ""
            name = pair if pair in declared else words[0]
            assert name in declared, f"the README documents {entry!r}, which the bot does not have"
            documented.setdefault(name, []).append((" ".join(words[len(name.split()):]), who))
    assert sorted(set(declared) - set(documented)) == [], "commands missing from the README's command table"
    for name, entries in documented.items():
        command = declared[name]
        flag_words = {p.spelled for p in command.params if p.kind == "flag" and not p.spelled.startswith("-")}
        given: set[str] = set()
        arguments = 0
        for rest, who in entries:
            given |= set(re.findall(r"--[a-z-]+", rest)) | {w.strip("[]") for w in rest.split()
                                                            if w.strip("[]") in flag_words}
            bare = re.sub(r"\[--[^\]]*\]|--[a-z-]+", "", rest).replace("[<", "[")
            bare = " ".join(w for w in bare.split() if w.strip("[]") not in flag_words)
            arguments = max(arguments, len(re.findall(r"[<\[]|(?<![\w\[<|])[a-z]+\|", bare)))
            level = "bot admin" if command.bot_admin else "admin" if command.admin else "all"
            assert who.split(" (")[0] in ({level} if level != "all" else {"all", "user"}), \
                f"!{name} is for {level}; the README says {who!r}"
        assert given == _switches(command), f"!{name}: the README gives {sorted(given)}, the command " \
                                            f"takes {sorted(_switches(command))}"
        assert arguments == _arguments(command), f"!{name}: the README shows {arguments} argument(s), the " \
                                                 f"command takes {_arguments(command)} ({command.usage})"


def _architecture() -> str:
    return README[README.index("## Architecture"):README.index("## Skills")]


def test_the_architecture_names_only_files_that_exist() -> None:
    named = []
    for path in re.findall(r"(?<![\w/])((?:bot|cortex|adapters)/[\w/.]*(?:\{[\w,]+\}[\w.]*)?)", _architecture()):
        path = path.rstrip(".")
        braces = re.search(r"\{([\w,]+)\}", path)
        named += [path[:braces.start()] + alt + path[braces.end():] for alt in braces.group(1).split(",")] \
            if braces else [path]
    assert len(named) > 30
    assert [p for p in named if not (ROOT / p).exists()] == []


def test_the_architecture_names_every_module_and_package() -> None:
    """Each module of bot/, cortex/ and adapters/ (and each package in them) is named in the architecture
    section, by its path or, in a list of one package's modules, by its file name. (Twenty-three were not:
    bot/cli.py, bot/config.py, cortex/settings.py, adapters/matrix_order.py and more.)"""
    text = _architecture()
    missing = []
    for package in ("bot", "cortex", "adapters"):
        listed = re.search(rf"`{package}/`:(.*?)\.(?:\s|$)", text, re.S)  # "`bot/`: `cli.py` (…), … ."
        own = listed.group(1) if listed else ""
        for path in sorted((ROOT / package).iterdir()):
            if path.name.startswith(("_", ".")) or not (path.suffix == ".py" or (path / "__init__.py").exists()):
                continue
            name = f"{package}/{path.name}"
            if not re.search(rf"(?<![\w/]){re.escape(name)}(?![\w.])", text) \
                    and f"`{path.name}`" not in own:
                missing.append(name)
    assert missing == [], "modules the README's architecture section does not name"


def test_every_cli_command_and_option_is_in_the_readme() -> None:
    """`cortexbot --help`'s subcommands, each with its options and arguments, are the README's CLI lines."""
    import click

    from bot.cli import cli

    block = README[README.index("## Commands"):].split("```", 2)[1]
    lines = {m.group(1): m.group(0) for m in re.finditer(r"^cortexbot \[--config PATH\](?: \[-v\])? ([a-z-]+)(.*)$",
                                                          block, re.M)}
    assert sorted(lines) == sorted(cli.commands)
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and param.name not in ("sub_config", "sub_verbose"):
                assert param.opts[0] in lines[name], f"cortexbot {name} {param.opts[0]} is not in the README"
            elif isinstance(param, click.Argument) and param.name:
                spelled = [param.metavar.strip("[]") if param.metavar else param.name.split("_")[-1].upper()]
                assert all(word in lines[name] for word in spelled), \
                    f"cortexbot {name}'s argument {param.name} is not in the README"
