"""Line diffs with bounded work (cortex/diff.py): exactly difflib's where the texts are small enough to weigh,
one changed block past that, never seconds of CPU on the event loop."""

from __future__ import annotations

import asyncio
import difflib
import random
import re
import threading
from pathlib import Path

import pytest

from bot.app import App
from bot.config import parse_config
from cortex import diff
from cortex.diff import line_opcodes, unified
from tests.fakes.provider import ScriptedProvider
from tests.test_cortex_commands import ctx, run


def _apply(old: str, patch: str) -> str:
    """``old`` with a unified diff applied (hunks in order; their context must match)."""
    lines, out, at = old.splitlines(True), [], 0
    for line in patch.splitlines(True)[2:]:
        if line.startswith("@@"):
            start = int(re.match(r"@@ -(\d+)", line).group(1))  # type: ignore[union-attr]
            start = start - 1 if start else 0  # (",0": the line before the insertion)
            if re.match(r"@@ -\d+,0 ", line):
                start += 1
            out += lines[at:start]
            at = start
        elif line[0] in " -":
            assert lines[at].rstrip("\n") == line[1:].rstrip("\n"), (line, lines[at])
            if line[0] == " ":
                out.append(lines[at])
            at += 1
        else:
            out.append(line[1:])
    return "".join(out + lines[at:])


def test_a_diff_turns_the_old_text_into_the_new_and_is_as_short_as_difflibs() -> None:
    rng = random.Random(3)
    for _ in range(400):
        old = "".join(rng.choice("abcde\n") for _ in range(rng.randrange(0, 60))).rstrip("\n") + "\n"
        new = "".join(rng.choice("abcdf\n") for _ in range(rng.randrange(0, 60))).rstrip("\n") + "\n"
        patch = unified(old, new, "a", "b")
        assert _apply(old, patch) == new, (old, new, patch)
        plain = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a", "b"))
        changed = [line for line in patch.splitlines() if line[:1] in "+-" and line[:4] not in ("--- ", "+++ ")]
        assert len(changed) == len([line for line in plain.splitlines() if line[:1] in "+-"]) - 2 * bool(plain)
    assert unified("same\n", "same\n", "a", "b") == ""
    assert unified("x", "y", "a", "b") == "--- a\n+++ b\n@@ -1 +1 @@\n-x\n+y\n"  # (each line ends)
    facts = [f"- fact number {i}: something about the garden" for i in range(250)]  # an ordinary file
    edited = list(facts)
    edited[5], edited[245] = "- changed", "- changed too"
    patch = unified("\n".join(facts), "\n".join(edited), "a", "b")
    assert [line for line in patch.splitlines() if line[:1] in "+-" and line[:4] not in ("--- ", "+++ ")] == [
        "-- fact number 5: something about the garden", "+- changed",
        "-- fact number 245: something about the garden", "+- changed too"]


def test_a_large_reordered_file_is_one_block_and_whole() -> None:
    """The attack: 7,900 one-character lines of 120 kinds, the second version the same lines reordered. difflib
    took 12 s of the event loop over it; past DIFF_WORK line pairs the middle is one replaced block."""
    kinds = [chr(0x4E00 + k) for k in range(120)]
    old_lines = [kinds[i % 120] for i in range(7900)]
    new_lines = [kinds[(i * 37 + 1) % 120] for i in range(7900)]
    codes = line_opcodes(["top", *old_lines, "end"], ["top", *new_lines, "end"])
    assert codes == [("equal", 0, 1, 0, 1), ("replace", 1, 7901, 1, 7901), ("equal", 7901, 7902, 7901, 7902)]
    assert 7900 * 7900 > diff.DIFF_WORK
    text = unified("\n".join(old_lines), "\n".join(new_lines), "a", "b").splitlines()
    assert [line[1:] for line in text if line.startswith("-") and line != "--- a"] == old_lines
    assert [line[1:] for line in text if line.startswith("+") and line != "+++ b"] == new_lines


async def test_the_chat_diff_runs_beside_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`!memory diff` is worked out on a thread: other messages are answered meanwhile."""
    import cortex.files

    release, entered = threading.Event(), threading.Event()
    real = cortex.files.unified

    def held(*args: str) -> str:
        entered.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(cortex.files, "unified", held)
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    async with App(config, llm=ScriptedProvider()) as app:
        await run(app, "!memory edit memory.md\n- one\n")
        await run(app, "!memory edit memory.md\n- two\n")
        diffing = asyncio.create_task(run(app, "!memory diff memory.md 2 3"))
        await asyncio.to_thread(entered.wait, 30)
        assert "- two" in (await run(app, "!memory show memory.md", ctx("ann"))).text  # answered while it diffs
        assert not diffing.done()
        release.set()
        assert "+- two" in (await diffing).text
