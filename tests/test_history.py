from __future__ import annotations

from bot.history import build_window, message_cost, with_late_answers
from bot.prompt import history_turns
from bot.storage import Storage
from bot.summary import transcript, transcript_cost
from bot.tokens import PER_MESSAGE_OVERHEAD, BPETokenEstimator

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


async def _fill(storage: Storage, estimator: BPETokenEstimator, texts: list[tuple[str, str]]) -> int:
    user = await storage.upsert_user("console:ann", "Ann")
    channel = await storage.upsert_channel("console:c", "c", is_dm=True)
    for role, text in texts:
        await storage.add_message(
            channel.id, user.id, "Cora", role, "Ann" if role == "user" else "Cora", text, estimator.raw_count(text)
        )
    return channel.id


def _exchanges(n: int, words: int = 20) -> list[tuple[str, str]]:
    out = []
    for i in range(n):
        out.append(("user", f"question {i} " + " ".join(WORDS[j % 10] for j in range(words))))
        out.append(("assistant", f"answer {i} " + " ".join(WORDS[(j + 3) % 10] for j in range(words))))
    return out


async def test_window_is_newest_first_whole_messages_within_budget(storage, estimator) -> None:
    channel = await _fill(storage, estimator, _exchanges(50))
    window = await build_window(storage, estimator, channel, budget=300, min_exchanges=1)
    assert window.tokens <= 300
    texts = [m.text for m in window.messages]
    assert texts[-1].startswith("answer 49")  # newest message last (chronological order)
    ids = [m.id for m in window.messages]
    assert ids == sorted(ids)
    # contiguous: no gaps between the oldest chosen and the newest
    all_recent = await storage.recent_messages(channel, len(ids))
    assert [m.id for m in reversed(all_recent)] == ids
    assert window.trimmed == 100 - len(ids)
    # Adding one more message (the next older one) would have broken the budget.
    older = await storage.recent_messages(channel, 1, before_id=ids[0])
    assert window.newest_evicted_id == older[0].id
    assert window.tokens + message_cost(older[0], estimator) > 300


async def test_size_hint_never_changes_the_window(storage, estimator) -> None:
    channel = await _fill(storage, estimator, _exchanges(80))
    reference = await build_window(storage, estimator, channel, budget=700, min_exchanges=2)
    for hint in (1, 5, len(reference.messages), 63, 64, 65, 200):
        hinted = await build_window(storage, estimator, channel, budget=700, min_exchanges=2, size_hint=hint)
        assert [m.id for m in hinted.messages] == [m.id for m in reference.messages]
        assert (hinted.tokens, hinted.trimmed, hinted.newest_evicted_id) == (
            reference.tokens, reference.trimmed, reference.newest_evicted_id
        )
    everything = await build_window(storage, estimator, channel, budget=10**6, min_exchanges=2, size_hint=3)
    assert len(everything.messages) == 160 and everything.trimmed == 0 and everything.newest_evicted_id is None


async def test_minimum_exchanges_kept_even_over_budget(storage, estimator) -> None:
    channel = await _fill(storage, estimator, _exchanges(10, words=200))
    window = await build_window(storage, estimator, channel, budget=100, min_exchanges=3)
    assert sum(1 for m in window.messages if m.role == "user") == 3
    assert len(window.messages) == 6
    assert window.over_budget


async def test_before_id_excludes_the_new_message(storage, estimator) -> None:
    channel = await _fill(storage, estimator, _exchanges(3))
    newest = (await storage.recent_messages(channel, 1))[0]
    window = await build_window(storage, estimator, channel, budget=10_000, min_exchanges=1, before_id=newest.id)
    assert newest.id not in [m.id for m in window.messages]
    assert len(window.messages) == 5


async def test_multilingual_text_is_budgeted_by_real_tokens(storage, estimator) -> None:
    # The same number of characters costs far more in Chinese than in English.
    chinese = "我们今天讨论了很多关于记忆和人工智能的问题非常有意思" * 4
    english = ("we talked a lot today about memory and ai, it was fun " * 4)[: len(chinese)]
    ch = await _fill(storage, estimator, [("user", chinese), ("assistant", chinese)] * 20)
    zh_window = await build_window(storage, estimator, ch, budget=600, min_exchanges=0)
    other = await storage.upsert_channel("console:en", "en", is_dm=True)
    for _ in range(20):
        for role in ("user", "assistant"):
            await storage.add_message(other.id, None, "Cora", role, "x", english, estimator.raw_count(english))
    en_window = await build_window(storage, estimator, other.id, budget=600, min_exchanges=0)
    assert zh_window.tokens <= 600 and en_window.tokens <= 600
    assert len(zh_window.messages) * 1.5 < len(en_window.messages)


async def test_a_message_of_many_lines_costs_what_its_labelled_turn_sends(storage, estimator) -> None:
    """A labelled turn's further lines are indented (so none reads as another speaker's label): the window counted
    the text without the indentation, and a group's many-lined messages went over its budget."""
    lines = ["\n".join(f"line {i}" for i in range(60)), "\n".join("日本語のテキスト" for _ in range(40)),
             "- one\r\n- two\r\n- three\u2028- four"]
    channel = await storage.upsert_channel("console:room", "room", is_dm=False)
    ann = await storage.upsert_user("console:ann", "Ann")
    for text in lines:
        for role, persona in (("user", "Cora"), ("assistant", "Bea"), ("assistant", "Cora")):
            await storage.add_message(channel.id, ann.id, persona, role, "Ann" if role == "user" else persona, text,
                                      estimator.raw_count(text))
    window = await build_window(storage, estimator, channel.id, budget=10**6, min_exchanges=0, persona="Cora")
    assert len(window.messages) == 9
    for message, turn in zip(window.messages, history_turns(window.messages, label_speakers=True, persona="Cora"),
                             strict=True):
        sent = estimator.scale(estimator.raw_count(turn.content) + PER_MESSAGE_OVERHEAD)
        assert message_cost(message, estimator, "Cora") >= sent, (message.role, message.persona, message.text[:20])


async def test_a_dms_many_lined_message_costs_what_its_unlabelled_turn_sends(storage, estimator) -> None:
    """A DM's turns are sent as written (no label, no indentation), but the window counted the indentation of a
    labelled turn's further lines: a pasted list of 400 lines cost an eighth more than it was, and older messages
    left the window early."""
    text = "\n".join(f"- item number {i}" for i in range(400))
    channel = await storage.upsert_channel("console:dm-ann", "dm", is_dm=True)
    ann = await storage.upsert_user("console:ann", "Ann")
    await storage.add_message(channel.id, ann.id, "Cora", "user", "Ann", text, estimator.raw_count(text))
    window = await build_window(storage, estimator, channel.id, budget=10**6, min_exchanges=0, persona="Cora",
                                labelled=False)
    [turn] = history_turns(window.messages, label_speakers=False, persona="Cora")
    sent = estimator.scale(estimator.raw_count(turn.content) + PER_MESSAGE_OVERHEAD)
    assert turn.content == text and sent <= window.tokens <= sent + estimator.scale(8), (sent, window.tokens)
    group = await build_window(storage, estimator, channel.id, budget=10**6, min_exchanges=0, persona="Cora")
    assert group.tokens > window.tokens + estimator.scale(300)  # (labelled: every further line indented)


async def test_a_message_costs_what_its_entry_in_a_summarys_transcript_sends(storage, estimator) -> None:
    """A summary's input counted 9 tokens for the time before each entry, which takes 13, and a reply's further
    lines without their indentation: a batch of short or many-lined messages went over summary_input_tokens."""
    channel = await storage.upsert_channel("console:room", "room", is_dm=False)
    ann = await storage.upsert_user("console:ann", "Ann")
    texts = ["ok", "\n".join(f"line {i}" for i in range(60)), "\n".join("日本語のテキスト" for _ in range(40))]
    for text in texts:
        for role in ("user", "assistant"):
            await storage.add_message(channel.id, ann.id, "Cora", role, "Ann" if role == "user" else "Cora", text,
                                      estimator.raw_count(text))
    for message in await storage.recent_messages(channel.id, 10):
        sent = estimator.scale(estimator.raw_count(transcript([message])) + PER_MESSAGE_OVERHEAD)
        assert transcript_cost(message, estimator) >= sent, (message.role, message.text[:20])


async def test_empty_channel(storage, estimator) -> None:
    channel = await storage.upsert_channel("console:none", "none", is_dm=True)
    window = await build_window(storage, estimator, channel.id, budget=100, min_exchanges=3)
    assert window.messages == [] and window.tokens == 0 and window.oldest_id is None


async def test_late_answers_push_the_oldest_messages_out(storage, estimator) -> None:
    """Answers stored after a waiting message join its window; over the budget they took tokens and pushed nothing
    out. The oldest go now, counted as trimmed (the summary folds them in), as a window built later would."""
    channel = await _fill(storage, estimator, _exchanges(20))
    user = await storage.upsert_user("console:ann", "Ann")
    asked = await storage.add_message(channel, user.id, "Cora", "user", "Ann", "one more question", 5)
    waiting = await storage.add_message(channel, user.id, "Cora", "user", "Ann", "and a quick second one", 6)
    text = "the answer " + " ".join(WORDS * 4)
    await storage.add_message(channel, user.id, "Cora", "assistant", "Cora", text, estimator.raw_count(text),
                              reply_to=asked.id)
    window = await build_window(storage, estimator, channel, budget=400, min_exchanges=1, before_id=waiting.id)
    late = await with_late_answers(storage, estimator, window, channel, waiting.id, (user.id, "Cora"), 1)
    assert late is not None and late.messages[-1].text == text and late.messages[-2].id == asked.id
    assert late.tokens <= 400 and late.tokens == sum(message_cost(m, estimator) for m in late.messages)
    assert late.messages[0].id > window.messages[0].id and late.newest_evicted_id == late.messages[0].id - 1
    assert late.trimmed == late.messages[0].seq - 1
