"""Line diffs of two texts that stay quick whatever the texts hold.

difflib weighs every pair of lines that could match: on a file of a few thousand lines repeated in another
order (lines of one character do it) that is seconds to minutes of CPU. Both diffs here, the chat's unified
diff and the web page's two columns, take the lines both texts start and end with as equal, and let difflib
weigh the rest while it has at most :data:`DIFF_WORK` pairs of equal lines; past that the rest is one changed
block."""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Sequence
from typing import Literal

DIFF_WORK = 50_000  # equal line pairs difflib may weigh: past that, one changed block
Tag = Literal["equal", "replace", "delete", "insert"]
Opcode = tuple[Tag, int, int, int, int]  # difflib's: how a[i1:i2] becomes b[j1:j2]
CONTEXT = 3  # unchanged lines around each change in a unified diff


def line_opcodes(a: Sequence[str], b: Sequence[str]) -> list[Opcode]:
    """How ``a`` becomes ``b``, as difflib's opcodes (no empty ones)."""
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    ends_a, ends_b = len(a) - tail, len(b) - tail
    if _matching_pairs(a[head:ends_a], b[head:ends_b]) <= DIFF_WORK:
        matcher = difflib.SequenceMatcher(a=a[head:ends_a], b=b[head:ends_b])
        middle: list[Opcode] = [(op, i1 + head, i2 + head, j1 + head, j2 + head)
                                for op, i1, i2, j1, j2 in matcher.get_opcodes()]
    else:
        middle = [("replace", head, ends_a, head, ends_b)]
    codes: list[Opcode] = [("equal", 0, head, 0, head), *middle, ("equal", ends_a, len(a), ends_b, len(b))]
    return [code for code in codes if code[1] < code[2] or code[3] < code[4]]


def _matching_pairs(a: Sequence[str], b: Sequence[str]) -> int:
    """How many (line of ``a``, equal line of ``b``) pairs there are: what difflib's search walks through, again
    and again. Distinct lines make few (an ordinary file: about one per line); a few lines repeated make
    them by the million."""
    counts = Counter(b)
    return sum(counts[line] for line in a)


class _Given(difflib.SequenceMatcher[str]):
    """A matcher that hands out opcodes computed already (for difflib's grouping into hunks)."""

    def __init__(self, codes: list[Opcode]) -> None:
        super().__init__(None, [], [])
        self._codes = codes

    def get_opcodes(self) -> list[Opcode]:
        return self._codes


def _span(start: int, stop: int) -> str:
    """A hunk header's range, as ``diff -u`` writes it."""
    length = stop - start
    if length == 1:
        return str(start + 1)
    return f"{start if not length else start + 1},{length}"


def unified(old: str, new: str, fromfile: str, tofile: str) -> str:
    """``diff -u`` of two texts; empty when they are the same."""
    a = [line if line.endswith("\n") else line + "\n" for line in old.splitlines(keepends=True)]
    b = [line if line.endswith("\n") else line + "\n" for line in new.splitlines(keepends=True)]
    out: list[str] = []
    for group in _Given(line_opcodes(a, b) or [("equal", 0, 0, 0, 0)]).get_grouped_opcodes(CONTEXT):
        if not out:
            out += [f"--- {fromfile}\n", f"+++ {tofile}\n"]
        out.append(f"@@ -{_span(group[0][1], group[-1][2])} +{_span(group[0][3], group[-1][4])} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [" " + line for line in a[i1:i2]]
                continue
            out += ["-" + line for line in a[i1:i2]] + ["+" + line for line in b[j1:j2]]
    return "".join(out)
