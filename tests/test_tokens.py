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


def test_remembered_counts_match_the_tokenizer_below_and_above_the_cached_length() -> None:
    """Counts of short texts are remembered between replies; they must stay the tokenizer's own, and long
    texts (not remembered) are counted as well."""
    from bot.tokens import CACHED_CHARS, _encoding

    estimator = BPETokenEstimator()
    texts = ["Hallo Welt", "naïve café 東京 🙂" * 3, "x" * CACHED_CHARS, "word " * (CACHED_CHARS // 5 + 10)]
    for text in texts * 2:  # the second round is served from what the first remembered
        assert estimator.raw_count(text) == len(_encoding().encode(text, disallowed_special=()))
    assert estimator.raw_count("<|endoftext|>") == len(_encoding().encode("<|endoftext|>", disallowed_special=()))
