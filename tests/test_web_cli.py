"""The web page served by ``cortexbot chat`` itself (a subprocess): the link !dashboard prints logs the
terminal's user in, and the page closes with the chat."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.fakes.llm_server import FakeLLMServer
from tests.test_cli import API_KEY, BIN, write_config
from tests.web_support import free_port


def read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 60) -> re.Match[str]:
    assert proc.stdout is not None
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"{pattern!r} not printed; output was: {''.join(seen)[-2000:]}")


async def log_in(port: int, token: str) -> dict[str, Any]:
    """What /api/me says after logging in with ``token``."""
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}",
                                     cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.post("/login", data={"token": token}, allow_redirects=False) as response:
            assert response.status == 303
        async with http.get("/api/me") as response:
            me: dict[str, Any] = await response.json()
            return me


def test_chat_serves_the_page_and_dashboard_logs_the_terminal_user_in(tmp_path: Path, fake_llm: FakeLLMServer
                                                                      ) -> None:
    port = free_port()
    config = write_config(tmp_path, fake_llm)
    config.write_text(config.read_text() + f"[web]\nenabled = true\nport = {port}\n")
    with subprocess.Popen(
        [str(BIN / "cortexbot"), "--config", str(config), "chat", "--user", "ann"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CB_TEST_API_KEY": API_KEY, "OPENBLAS_NUM_THREADS": "1"},
    ) as proc:
        try:
            assert proc.stdin is not None
            proc.stdin.write("!dashboard\n")
            proc.stdin.flush()
            token = read_until(proc, rf"http://127\.0\.0\.1:{port}/login/(\S+)").group(1)
            me = asyncio.run(log_in(port, token))
            assert me["user"]["key"] == "console:ann" and me["is_bot_admin"] is True  # the terminal runs the bot
            _, err = proc.communicate(timeout=30)  # end of input: the chat ends, and the page with it
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err


def config_with_page(tmp_path: Path, fake_llm: FakeLLMServer) -> tuple[Path, int]:
    """A config whose web page is enabled, on a free port (and that port)."""
    port = free_port()
    config = write_config(tmp_path, fake_llm)
    config.write_text(config.read_text() + f"[web]\nenabled = true\nport = {port}\n")
    return config, port


@contextlib.contextmanager
def taken(port: int) -> Iterator[None]:
    """``port`` on 127.0.0.1 held by a listening socket (as by a bot that serves the page there)."""
    with socket.socket() as page:
        page.bind(("127.0.0.1", port))
        page.listen()
        yield


def test_a_chat_beside_the_bot_that_serves_the_page_chats_without_it(tmp_path: Path, fake_llm: FakeLLMServer
                                                                     ) -> None:
    """README: chat beside `cortexbot run` with `cortexbot chat` on the same config. With [web] enabled, the
    chat refused to start, the page's port being taken by the running bot; now it says it does not serve the
    page, chats, and its !dashboard links to the page the bot serves."""
    config, port = config_with_page(tmp_path, fake_llm)
    with taken(port):  # the page `cortexbot run` serves
        result = subprocess.run(
            [str(BIN / "cortexbot"), "--config", str(config), "chat", "--user", "ann"], input="hello\n!dashboard\n",
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "CB_TEST_API_KEY": API_KEY, "OPENBLAS_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "this chat does not serve the web page" in result.stderr and "Traceback" not in result.stderr
    assert "Cora: " in result.stdout and f"http://127.0.0.1:{port}/login/" in result.stdout, result.stdout


def chat_status(config: Path, note: str) -> str:
    """What `cortexbot status` says while a `cortexbot chat` on ``config`` runs, once the chat printed ``note``
    (both of the checkout this test is in, whichever one the virtualenv's script was installed from)."""
    env = {**os.environ, "CB_TEST_API_KEY": API_KEY, "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with subprocess.Popen(
        [str(BIN / "cortexbot"), "--config", str(config), "chat", "--user", "ann"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    ) as chat:
        try:
            assert chat.stderr is not None
            seen = []
            while not any(note in line for line in seen):
                line = chat.stderr.readline()
                assert line, f"{note!r} not printed; stderr was: {''.join(seen)[-2000:]}"
                seen.append(line)
            status = subprocess.run([str(BIN / "cortexbot"), "--config", str(config), "status"],
                                    capture_output=True, text=True, timeout=60, env=env)
            assert status.returncode == 0, status.stderr
            chat.communicate(timeout=60)  # end of input: the chat ends
        finally:
            if chat.poll() is None:
                chat.kill()
    return status.stdout


def test_status_lists_the_web_page_of_a_chat_only_when_it_serves_it(tmp_path: Path, fake_llm: FakeLLMServer
                                                                   ) -> None:
    """A chat whose page's port was taken goes on without the page; `cortexbot status` listed it as serving the
    page all the same (what its config asked for, not what started). A `run` or chat serving it says so."""
    config, port = config_with_page(tmp_path, fake_llm)
    with taken(port):  # the page `cortexbot run` serves
        without = chat_status(config, "this chat does not serve the web page")
    assert "adapters: terminal" in without and "web page" not in without, without
    served = chat_status(config, f"web page: http://127.0.0.1:{port}")
    assert f"adapters: terminal  Discord shards: -  Matrix: -  web page: http://127.0.0.1:{port}" in served, served
