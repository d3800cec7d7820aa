"""Line diffs with bounded work (cortex/diff.py): exactly difflib's where the texts are small enough to weigh,
one changed block past that, never seconds of CPU on the event loop."""

from __future__ import annotations

import asyncio
import difflib
import random
import threading
from pathlib import Path

import pytest

from bot.app import App
from bot.config import parse_config
from cortex import diff
from cortex.diff import line_opcodes, unified
from tests.fakes.provider import ScriptedProvider
from tests.test_cortex_commands import ctx, run


def test_a_small_diff_is_difflibs_own() -> None:
    rng = random.Random(3)
    for _ in range(300):
        old = "".join(rng.choice("abcde\n") for _ in range(rng.randrange(0, 60)))
        new = "".join(rng.choice("abcdf\n") for _ in range(rng.randrange(0, 60)))
        if not old.endswith("\n") or not new.endswith("\n"):
            continue  # (difflib runs a last line without its line end into the next)
        expected = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a", "b"))
        assert unified(old, new, "a", "b") == expected, (old, new)
    assert unified("same\n", "same\n", "a", "b") == ""
    assert unified("x", "y", "a", "b") == "--- a\n+++ b\n@@ -1 +1 @@\n-x\n+y\n"  # (each line ends)


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
