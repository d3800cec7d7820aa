"""The cortex end to end: `cortexbot chat` as a subprocess, real SQLite, the real SDK, the fake server."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fakes.llm_server import FakeLLMServer, FakeResponse, RecordedRequest
from tests.test_cli import API_KEY, BIN, cortexbot, db_rows, is_cortex_update, is_reply, realistic_usage, write_config

pytestmark = pytest.mark.both_engines

MARKER = "Ann grows tomatoes on her balcony"
NEW_MEMORY = f"# My memories of Ann\n\n## What Ann told me about themselves\n- {MARKER}.\n"


def _tool_results(request: RecordedRequest) -> list[dict]:
    last = request.body["messages"][-1]
    content = last["content"] if isinstance(last["content"], list) else []
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


def cortex_script(hang_before_write: float = 0.0, hang_after_write: float = 0.0):
    """A persona that reads memory.md, rewrites it, then stops, judged from what the request holds."""

    def respond(request: RecordedRequest) -> FakeResponse:
        tokens = realistic_usage(request)
        if not is_cortex_update(request):
            return FakeResponse.text(f"echo: {request.last_user_text()}", input_tokens=tokens)
        results = _tool_results(request)
        if not results:
            return FakeResponse.tool_calls([("r1", "read_file", {"filename": "memory.md"})], input_tokens=tokens,
                                           delay=hang_before_write)
        if results[0]["tool_use_id"] == "r1":
            return FakeResponse.tool_calls(
                [("w1", "write_file", {"filename": "memory.md", "content": NEW_MEMORY})], input_tokens=tokens
            )
        return FakeResponse.text("", input_tokens=tokens, delay=hang_after_write)

    return respond


def cortex_config(tmp_path: Path, server: FakeLLMServer) -> Path:
    path = write_config(tmp_path, server)
    path.write_text(path.read_text() + "[cortex]\ncontext_limit = 8\ncooldown_seconds = 0\n")
    return path


def test_tier_fires_files_change_and_the_next_reply_carries_them(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    fake_llm.responder = cortex_script()
    config = cortex_config(tmp_path, fake_llm)
    lines = [f"line {i}: I spent the morning on the balcony with my plants" for i in range(12)]
    result = cortexbot("--config", str(config), "chat", "--user", "ann",
                       stdin="\n".join(lines) + "\n!memory history memory.md\n")
    assert result.returncode == 0, result.stderr
    requests = fake_llm.completion_requests
    cortex = [i for i, r in enumerate(requests) if is_cortex_update(r)]
    assert cortex, "no cortex update was requested"
    # tier 50 % of 8 messages fires after the second exchange (the update then runs beside the chat)
    first_update = requests[cortex[0]]
    assert sum(1 for r in requests[: cortex[0]] if is_reply(r)) >= 2
    job_seq = db_rows(tmp_path, "SELECT count(*) FROM messages WHERE created_at <= (SELECT min(created_at) FROM jobs"
                                " WHERE kind = 'cortex_update')")
    assert job_seq == [(4,)]
    assert "early in this conversation cycle" in first_update.body["system"]
    # every reply asked after the write was answered carries the new file; the chat is sequential, so at
    # most one reply (its prompt built just before the write landed) can arrive after it without it
    write_answered = next(i for i in cortex if any(b["tool_use_id"] == "w1" for b in _tool_results(requests[i])))
    later = [r for r in requests[write_answered + 1:] if is_reply(r)]
    assert len(later) >= 2 and all(MARKER in r.body["system"] for r in later[1:])
    assert not any(MARKER in r.body["system"] for r in requests[: cortex[0]] if is_reply(r))
    versions = db_rows(tmp_path, "SELECT filename, version, author, tier FROM cortex_versions WHERE author = 'model'")
    assert ("memory.md", 2, "model", "50") in versions
    runs = db_rows(tmp_path, "SELECT tier, status FROM cortex_runs ORDER BY id")
    assert ("50", "success") in runs
    assert "cortex update (tier 50%)" in result.stdout  # !memory history shows the model's version


@pytest.mark.slow
def test_killed_during_an_update_the_files_stay_whole_and_the_job_resumes(
    tmp_path: Path, fake_llm: FakeLLMServer
) -> None:
    fake_llm.responder = cortex_script(hang_after_write=120)  # the write lands, then the model hangs
    config = cortex_config(tmp_path, fake_llm)
    env = {**os.environ, "CB_TEST_API_KEY": API_KEY}
    proc = subprocess.Popen(
        [str(BIN / "cortexbot"), "--config", str(config), "chat", "--user", "ann"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert proc.stdin is not None
    proc.stdin.write("".join(f"line {i} about the balcony\n" for i in range(3)))
    proc.stdin.close()
    fake_llm.wait_for(lambda r: is_cortex_update(r) and any(b["tool_use_id"] == "w1" for b in _tool_results(r)),
                      timeout=60)
    # the third exchange reaches tier 75 while the update runs (it hangs after its write): killed once that
    # tier's skip is recorded (on a busy machine the third reply may still be on its way when the write lands)
    deadline = time.monotonic() + 60
    while ("75", "skipped") not in db_rows(tmp_path, "SELECT tier, status FROM cortex_runs"):
        assert time.monotonic() < deadline and proc.poll() is None, "tier 75 was never reached during the update"
        time.sleep(0.1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.stderr is not None
    proc.stderr.close()
    assert set(db_rows(tmp_path, "SELECT tier, status FROM cortex_runs")) == {("50", "running"), ("75", "skipped")}
    assert db_rows(tmp_path, "SELECT status FROM jobs WHERE kind = 'cortex_update'") == [("running",)]
    contents = dict(((f, v), c) for f, v, c in db_rows(
        tmp_path, "SELECT filename, version, content FROM cortex_versions"))
    assert contents[("memory.md", 2)] == NEW_MEMORY  # whole, never half-written
    assert len(contents) == 4  # three templates + the accepted write

    fake_llm.responder = cortex_script()
    result = cortexbot("--config", str(config), "chat", "--user", "ann", stdin="")
    assert result.returncode == 0, result.stderr
    runs = db_rows(tmp_path, "SELECT status, error FROM cortex_runs WHERE status != 'skipped' ORDER BY id")
    assert runs[0][0] == "failed" and "interrupted" in runs[0][1]
    assert runs[1][0] == "success"
    # the killed run lists the file it saved, and the answer its last round reserved (4,096 tokens) is not spent
    [(written, output)] = db_rows(tmp_path, "SELECT files_written, output_tokens FROM cortex_runs"
                                            " WHERE status = 'failed'")
    assert written == '["memory.md"]' and output < 4096
    assert db_rows(tmp_path, "SELECT status, attempts FROM jobs WHERE kind = 'cortex_update'") == [("done", 2)]
    # the resumed run read the file as the killed run left it, and found it already up to date
    assert db_rows(tmp_path, "SELECT count(*) FROM cortex_versions WHERE filename = 'memory.md'") == [(2,)]
