from __future__ import annotations

import random

import pytest

from bot.splitting import split_message


def _fences_balanced(piece: str) -> bool:
    return sum(1 for line in piece.split("\n") if line.strip().startswith("```")) % 2 == 0


def test_short_text_is_one_piece() -> None:
    assert split_message("hello", 2000) == ["hello"]
    assert split_message("", 2000) == []


def test_prefers_paragraphs_then_lines() -> None:
    text = ("first paragraph " * 10).strip() + "\n\n" + ("second paragraph " * 10).strip()
    pieces = split_message(text, 200)
    assert pieces[0] == ("first paragraph " * 10).strip()
    assert pieces[1] == ("second paragraph " * 10).strip()
    lines = "\n".join(f"line {i} with some words" for i in range(30))
    for piece in split_message(lines, 100):
        assert len(piece) <= 100 and piece.startswith("line ") and piece.split("\n")[-1].endswith("words")


def test_code_blocks_are_closed_and_reopened_with_their_language() -> None:
    code = "\n".join(f"    print({i})  # some comment here" for i in range(80))
    text = "Here is code:\n```python\n" + code + "\n```\nDone."
    pieces = split_message(text, 500)
    assert len(pieces) > 3
    for piece in pieces:
        assert len(piece) <= 500
        assert _fences_balanced(piece), piece
    for piece in pieces[1:-1]:
        assert piece.startswith("```python\n")
    joined = "".join(pieces)
    for i in range(80):
        assert f"print({i})" in joined


def test_hard_cut_for_a_long_word() -> None:
    pieces = split_message("x" * 4500, 2000)
    assert [len(p) for p in pieces] == [2000, 2000, 500]


@pytest.mark.parametrize("seed", range(20))
def test_random_texts_keep_every_character_and_the_limit(seed: int) -> None:
    rng = random.Random(seed)
    parts = []
    for _ in range(rng.randint(5, 40)):
        kind = rng.random()
        if kind < 0.2:
            parts.append("```js\n" + "\n".join(f"let a = {rng.randint(0, 99)};" for _ in range(rng.randint(1, 30)))
                         + "\n```")
        else:
            parts.append(" ".join(rng.choice(["word", "Satz.", "längeres", "🙂", "a" * rng.randint(1, 60)])
                                  for _ in range(rng.randint(1, 80))))
    text = "\n\n".join(parts)
    limit = rng.choice([100, 300, 2000])
    pieces = split_message(text, limit)
    assert all(len(p) <= limit for p in pieces)
    assert all(_fences_balanced(p) for p in pieces)
    stripped = "".join(text.split())
    rebuilt = "".join("".join(p.split()) for p in pieces).replace("```js", "").replace("```", "")
    assert rebuilt == stripped.replace("```js", "").replace("```", "")


def test_a_one_line_code_span_opens_no_block() -> None:
    """```ls -la``` alone on a line is inline code (CommonMark: a backtick fence's info string holds no
    backtick); read as a block, every later piece repeated it and the reply became dozens of messages."""
    one_liner = "```" + "ls -la /very/long/path " * 80 + "```"
    text = "Run this:\n" + one_liner + "\n\n" + "\n\n".join("Then a paragraph of text. " * 8 for _ in range(12))
    pieces = split_message(text, 2000)
    assert len(pieces) <= len(text) // 1500 + 1
    assert all(len(p) <= 2000 for p in pieces)
    assert sum(p.count("ls -la /very/long/path") for p in pieces) == 80  # nothing repeated


@pytest.mark.parametrize("seed", range(3))
def test_inline_code_is_not_cut_into_a_block_opening_the_next_piece(seed: int) -> None:
    """A cut at the space before an inline "```" (or "~~~") started the next piece with it: alone on its line it
    opens a code block, and the rest of that piece showed as code ("aa b… ```x… tail ``` more words" at 66)."""
    from bot.splitting import _open_fence_after

    rng = random.Random(seed)
    texts = ["aa " + "b" * 10 + " ```" + "x" * 40 + " tail ``` more words here to go on and on and on"]
    for _ in range(2000):
        words = [rng.choice(["```" + "x" * rng.randint(0, 12), "~~~", "w" * rng.randint(1, 15)])
                 for _ in range(rng.randint(5, 40))]
        texts.append("a " + " ".join(words))  # (no line starts with a marker: every one is inline)
    for text in texts:
        pieces = split_message(text, 66)
        assert "".join(pieces).replace(" ", "") == text.replace(" ", "")
        assert all(_open_fence_after(piece, None) is None for piece in pieces), (text, pieces)


def test_a_long_info_string_or_marker_is_not_repeated() -> None:
    code = "\n".join(f"x = {i}" for i in range(400))
    for opening in ("```" + "python " * 100, "`" * 200 + "py"):
        pieces = split_message(opening + "\n" + code + "\n```", 300)
        assert all(len(p) <= 300 for p in pieces)
        assert len(pieces) < 20, len(pieces)
    pieces = split_message("```python title=x\n" + code + "\n```", 300)
    assert all(p.startswith("```python title=x\n") for p in pieces)


def test_a_fence_line_with_a_long_info_string_inside_a_block_is_content() -> None:
    """Inside an open ```python block, ```typescript title="…long…" is code (a closing fence has no info
    string), so the block is still open at every cut and every piece renders as code."""
    code = "\n".join(f"line {i} of code" for i in range(200))
    inner = '```typescript title="src/components/a/very/long/Button.tsx"'
    pieces = split_message(f"```python\n{inner}\n{code}\n```", 300)
    assert all(p.startswith("```python\n") and p.rstrip().endswith("```") for p in pieces)
    assert all(len(p) <= 300 for p in pieces)


@pytest.mark.parametrize("seed", range(40))
def test_small_limits_end_and_keep_the_limit(seed: int) -> None:
    from bot.splitting import MIN_LIMIT

    rng = random.Random(seed)
    parts = [rng.choice(["`" * rng.randint(3, 30) + "x" * rng.randint(0, 40), "word " * rng.randint(1, 30),
                         "```", "~~~~", "a" * rng.randint(1, 200)]) for _ in range(rng.randint(5, 60))]
    text = "\n".join(parts)
    for limit in (MIN_LIMIT, MIN_LIMIT + 7, 100):
        pieces = split_message(text, limit)
        assert all(len(p) <= limit for p in pieces)
    with pytest.raises(ValueError, match="at least"):
        split_message(text, MIN_LIMIT - 1)


@pytest.mark.parametrize("opener", ["~~~ ~python", "~~~~ ~~x"])
def test_an_info_starting_with_the_markers_character_is_not_repeated(opener: str) -> None:
    """"~~~ ~python" reopened as "~~~~python": a longer marker, which the next piece's closing "~~~" cannot
    close, so every later piece showed its code block open to the end of the message."""
    from bot.splitting import _open_fence_after

    text = opener + "\n" + "\n".join(f"line {i}" for i in range(40)) + "\n" + opener.split()[0] + "\nafter the block"
    pieces = split_message(text, 100)
    assert len(pieces) > 2
    assert all(_open_fence_after(piece, None) is None for piece in pieces), pieces
    assert pieces[-1].endswith("after the block")
