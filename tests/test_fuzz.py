"""Fuzzing, bounded in time: whatever a config file or a command line holds, the answer is a clear
error or a reply, never a crash."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bot.app import App
from bot.config import Config, ConfigError, load_config, parse_config
from tests.fakes.provider import ScriptedProvider
from tests.test_router import Sink, inbound

SECTIONS = ("bot", "storage", "llm", "history", "jobs", "cortex", "memory", "chat", "access", "discord", "matrix",
            "terminal")
FIELDS = sorted({name for s in SECTIONS for name in type(getattr(Config(), s)).model_fields})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["sqlite:///x.db", "postgresql://u@h/db", "http://localhost:1/v1", "", "\x00", "inf", "-1"]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=4), max_leaves=12)
sections = st.dictionaries(st.sampled_from(FIELDS), values, max_size=5)
raw_configs = st.dictionaries(st.sampled_from([*SECTIONS, "personas", "nope"]),
                              sections | st.lists(sections, max_size=3) | values, max_size=4)


@settings(max_examples=300, deadline=None)
@given(raw=raw_configs)
def test_any_config_is_accepted_or_refused_clearly(raw: dict[str, Any]) -> None:
    try:
        parse_config(raw)
    except ConfigError as exc:
        assert str(exc).strip()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("utf-8", "replace")))
def test_any_config_file_is_read_or_refused_clearly(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(exc).strip()


WORDS = ["memory", "cortex", "show", "history", "diff", "revert", "reset", "edit", "export", "forget-me", "remember",
         "forget", "restore", "pin", "unpin", "list", "archived", "search", "update", "settings", "stats", "prune",
         "weights", "budgets", "embedder", "help", "summary", "persona", "memory.md", "soul", "v1", "2", "0", "-1",
         "99999999999999999999", "²", "١٢", "--category", "--importance", "--pin", "fact", "default", "confirm",
         "vector=2", "text=-1", "'", '"', "\\", "\x00", "\ud800", "🙂", "a" * 300]
lines = st.lists(st.sampled_from(WORDS) | st.text(max_size=12), min_size=1, max_size=6).map(
    lambda words: "!" + " ".join(words))


def test_any_command_line_gets_an_answer_and_the_bot_goes_on(tmp_path: Path) -> None:
    config = parse_config({
        "storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
        "chat": {"rate_limit_per_minute": 0, "command_rate_limit_per_minute": 0},
        "memory": {"embedder": "none"}, "cortex": {"context_limit": 1000},
    })
    loop = asyncio.new_event_loop()
    app = loop.run_until_complete(App(config, llm=ScriptedProvider()).start(workers=False))
    try:
        @settings(max_examples=250, deadline=None)
        @given(line=lines, admin=st.booleans())
        def check(line: str, admin: bool) -> None:
            sink = Sink()
            loop.run_until_complete(app.router.handle(inbound(line, dm=True, is_admin=admin), sink))
            answers = [r.text for r in sink.public + sink.private] + sink.messages
            assert answers and all(isinstance(a, str) and a.strip() for a in answers)
            assert not any(a.startswith("Sorry, ") and "failed (" in a for a in answers), answers

        check()
        sink = Sink()
        loop.run_until_complete(app.router.handle(inbound("hello after all that", dm=True), sink))
        assert sink.messages  # the bot still answers
    finally:
        loop.run_until_complete(app.stop())
        loop.close()
