from __future__ import annotations

from bot.tokens import BPETokenEstimator


def test_counts_come_from_a_real_bpe_not_chars_over_four() -> None:
    est = BPETokenEstimator(margin=0.0)
    chinese = "我们今天讨论了很多关于记忆和人工智能的问题，非常有意思。"
    russian = "Сегодня мы долго говорили о памяти и искусственном интеллекте."
    assert est.raw_count(chinese) > 2 * (len(chinese) / 4)
    assert est.raw_count(russian) > 1.5 * (len(russian) / 4)
    assert est.raw_count("hello world") == 2
    assert est.raw_count("") == 0
    # special-token text is counted as text, not rejected
    assert est.raw_count("<|endoftext|>") > 1


def test_margin_and_calibration() -> None:
    est = BPETokenEstimator(margin=0.1)
    assert est.scale(100) == 110
    assert est.scale(0) == 0
    for _ in range(30):
        est.calibrate(1000, 1500)  # the provider keeps reporting 50 % more than the BPE says
    assert 1.45 < est.factor <= 1.5
    assert est.scale(100) >= 160
    est.calibrate(10, 1000)  # tiny requests are ignored
    assert est.factor <= 1.5
    est.calibrate(1000, 100_000)  # absurd reports are clamped
    assert est.factor <= BPETokenEstimator.MAX_FACTOR


def test_remembered_counts_match_the_tokenizer_keep_no_words_and_spare_the_bpe() -> None:
    """Counts of short texts are remembered between replies (every reply counted the same rules and soul
    sections again): they must stay the tokenizer's own, long texts are counted each time, and what is
    remembered holds no text (people's messages are counted too, and must not outlive a forget-me)."""
    import bot.tokens as tokens

    class Counting:
        def __init__(self) -> None:
            self.calls = 0

        def encode(self, text: str, disallowed_special: tuple[()] = ()) -> list[int]:
            self.calls += 1
            return tokens._encoding().encode(text, disallowed_special=disallowed_special)

    estimator = BPETokenEstimator()
    counting = Counting()
    estimator._encoding = counting  # type: ignore[assignment]
    texts = ["Hallo Welt, remembered?", "naïve café 東京 🙂" * 3, "x" * tokens.CACHED_CHARS, "<|endoftext|> secret"]
    long = "word " * (tokens.CACHED_CHARS // 5 + 10)
    tokens._counts.clear()
    first = [estimator.raw_count(t) for t in texts]
    assert first == [len(tokens._encoding().encode(t, disallowed_special=())) for t in texts]
    assert counting.calls == len(texts)
    assert [estimator.raw_count(t) for t in texts] == first and counting.calls == len(texts)  # remembered
    assert estimator.raw_count(long) == estimator.raw_count(long) and counting.calls == len(texts) + 2  # not
    assert all(isinstance(part, int) for key in tokens._counts for part in key)  # no text kept


def test_a_text_of_one_long_line_keeps_its_start() -> None:
    """A soul section, a card's description or memory.md written as one paragraph was left out whole when it
    did not fit: now its start comes, cut at a word, then the note."""
    from bot.tokens import fit_to_budget

    estimator = BPETokenEstimator(margin=0.0)
    paragraph = " ".join(f"word{i}" for i in range(3000))
    fitted = fit_to_budget(estimator, paragraph, 200, "\n(cut)")
    assert fitted.startswith("word0 word1") and fitted.endswith("…\n(cut)")
    assert estimator.count(fitted) <= 200 and estimator.count(fitted) > 150
    assert fit_to_budget(estimator, paragraph, 20, "\n(cut)") == "\n(cut)"  # too little room for a start
    lines = "short line\n" + paragraph
    assert fit_to_budget(estimator, lines, 100, "").startswith("short line\nword0 word1")
