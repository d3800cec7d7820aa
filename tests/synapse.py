"""A real Synapse homeserver on ``127.0.0.1`` for Matrix tests.

Synapse lives in its own virtualenv so the bot's dependencies stay lean. :func:`ensure_synapse_venv`
creates it on first use (about 15 s) and afterwards returns at once::

    python = ensure_synapse_venv()          # $CORTEXBOT_SYNAPSE_VENV or <repo>/.cache/synapse-venv

:class:`SynapseServer` is a synchronous context manager (usable from sync and async tests) that writes a
throw-away ``homeserver.yaml`` (server name ``localhost``, client listener only on a free loopback port,
SQLite, no federation, no presence, every ``rc_*`` rate limit raised), starts Synapse as a subprocess in
its own process group and stops it again::

    with SynapseServer() as hs:
        alice = hs.register("alice", "pw")          # "@alice:localhost" (shared-secret admin API)
        token, device_id = hs.login_token("alice", "pw")
        # point matrix-nio at hs.url

Every wait is bounded: the install, start-up, HTTP calls and shutdown all have timeouts.
Only the standard library is used, so this module imports cheaply from ``conftest.py``.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["SYNAPSE_REQUIREMENT", "SynapseError", "SynapseServer", "default_venv_path", "ensure_synapse_venv"]

SYNAPSE_REQUIREMENT = "matrix-synapse>=1.120,<2"
"""What gets installed into the Synapse venv; changing it rebuilds the venv on next use."""

REPO_ROOT = Path(__file__).resolve().parent.parent
_MARKER_NAME = ".cortexbot-synapse-installed"
_INSTALL_TIMEOUT_S = 900.0
_LOCK_TIMEOUT_S = _INSTALL_TIMEOUT_S + 120.0
_HTTP_TIMEOUT_S = 15.0
_RATE_UNLIMITED = {"per_second": 10000, "burst_count": 10000}


class SynapseError(RuntimeError):
    """Synapse could not be installed, started or talked to."""


def _log(message: str) -> None:
    print(f"[synapse] {message}", file=sys.stderr, flush=True)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def default_venv_path() -> Path:
    """``$CORTEXBOT_SYNAPSE_VENV`` if set, else ``<repo>/.cache/synapse-venv``."""
    env = os.environ.get("CORTEXBOT_SYNAPSE_VENV")
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "synapse-venv"


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _installed(venv: Path) -> bool:
    marker = venv / _MARKER_NAME
    try:
        return marker.read_text() == SYNAPSE_REQUIREMENT and _venv_python(venv).exists()
    except OSError:
        return False


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    """An exclusive ``fcntl.flock`` on *path*, waiting at most *timeout* seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise SynapseError(f"timed out after {timeout:.0f} s waiting for the lock {path}") from exc
                if not announced:
                    _log(f"waiting for another process installing Synapse (lock {path})")
                    announced = True
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def ensure_synapse_venv(venv: Path | None = None) -> Path:
    """Return the python of a virtualenv with :data:`SYNAPSE_REQUIREMENT` installed, creating it if needed.

    Safe for concurrent callers (an ``fcntl`` lock on ``<venv>.lock``) and idempotent: a marker file is
    written inside the venv only after a successful install, and a venv without it is rebuilt from scratch.
    Raises :class:`SynapseError` (a ``RuntimeError``) with pip's output tail if the install fails.
    """
    venv = (venv or default_venv_path()).resolve()
    if _installed(venv):
        return _venv_python(venv)
    with _file_lock(venv.with_name(venv.name + ".lock"), _LOCK_TIMEOUT_S):
        if _installed(venv):  # another process finished while we waited
            return _venv_python(venv)
        if venv.exists():
            _log(f"removing incomplete Synapse venv {venv}")
            shutil.rmtree(venv)
        started = time.monotonic()
        _log(f"creating a venv at {venv} and installing {SYNAPSE_REQUIREMENT!r} (about 15-40 s, once)")
        base_python = getattr(sys, "_base_executable", None) or sys.executable
        steps: list[list[str]] = [
            [base_python, "-m", "venv", str(venv)],
            [
                str(_venv_python(venv)),
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "--timeout",
                "60",
                SYNAPSE_REQUIREMENT,
            ],
        ]
        for cmd in steps:
            remaining = _INSTALL_TIMEOUT_S - (time.monotonic() - started)
            try:
                proc = subprocess.run(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=max(remaining, 1.0),
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                output = exc.output if isinstance(exc.output, str) else (exc.output or b"").decode(errors="replace")
                raise SynapseError(
                    f"installing Synapse timed out after {_INSTALL_TIMEOUT_S:.0f} s: {' '.join(cmd)}\n{_tail(output)}"
                ) from exc
            if proc.returncode != 0:
                raise SynapseError(
                    f"installing Synapse failed (exit {proc.returncode}): {' '.join(cmd)}\n{_tail(proc.stdout)}"
                )
        (venv / _MARKER_NAME).write_text(SYNAPSE_REQUIREMENT)
        _log(f"Synapse venv ready in {time.monotonic() - started:.1f} s")
    return _venv_python(venv)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def homeserver_config(
    directory: Path, port: int, *, server_name: str, shared_secret: str, log_config: Path
) -> dict[str, Any]:
    """The ``homeserver.yaml`` content (as a dict; written as JSON, which YAML accepts)."""
    rc = dict(_RATE_UNLIMITED)
    return {
        "server_name": server_name,
        "listeners": [
            {
                "port": port,
                "bind_addresses": ["127.0.0.1"],
                "type": "http",
                "tls": False,
                "x_forwarded": False,
                "resources": [{"names": ["client"], "compress": False}],
            }
        ],
        "database": {"name": "sqlite3", "args": {"database": str(directory / "homeserver.db")}},
        "log_config": str(log_config),
        "media_store_path": str(directory / "media_store"),
        "signing_key_path": str(directory / f"{server_name}.signing.key"),
        "registration_shared_secret": shared_secret,
        "macaroon_secret_key": "cortexbot-test-macaroon-secret",
        "form_secret": "cortexbot-test-form-secret",
        "report_stats": False,
        "enable_registration": False,
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "federation_domain_whitelist": [],
        "enable_metrics": False,
        "presence": {"enabled": False},
        "url_preview_enabled": False,
        "rc_message": rc,
        "rc_registration": rc,
        "rc_registration_token_validity": rc,
        "rc_login": {"address": rc, "account": rc, "failed_attempts": rc},
        "rc_joins": {"local": rc, "remote": rc},
        "rc_joins_per_room": rc,
        "rc_invites": {"per_room": rc, "per_user": rc, "per_issuer": rc},
        "rc_third_party_invite": rc,
        "rc_3pid_validation": rc,
        "rc_room_creation": rc,
        "rc_admin_redaction": rc,
        "rc_media_create": rc,
        "rc_profile": rc,
        "rc_user_directory": rc,
        "rc_key_requests": rc,
        "rc_delayed_event_mgmt": rc,
        "rc_reports": rc,
        "rc_presence": {"per_user": rc},
    }


def _log_config(log_file: Path, level: str) -> dict[str, Any]:
    return {
        "version": 1,
        "formatters": {"plain": {"format": "%(asctime)s %(name)s %(levelname)s %(message)s"}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "formatter": "plain",
                "filename": str(log_file),
                "encoding": "utf8",
            }
        },
        "root": {"level": level, "handlers": ["file"]},
        "disable_existing_loggers": False,
    }


class SynapseServer:
    """A Synapse subprocess on a free ``127.0.0.1`` port with a fresh SQLite database in a temp dir.

    Use it as a context manager (or call :meth:`start` / :meth:`stop`). ``python`` defaults to
    :func:`ensure_synapse_venv`'s interpreter.
    """

    def __init__(
        self,
        *,
        python: Path | None = None,
        server_name: str = "localhost",
        shared_secret: str = "cortexbot-test-shared-secret",
        startup_timeout: float = 60.0,
        log_level: str = "WARNING",
    ) -> None:
        self._python = python
        self._server_name = server_name
        self._shared_secret = shared_secret
        self._startup_timeout = startup_timeout
        self._log_level = log_level
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self.startup_seconds: float | None = None
        """Seconds from launching the process until ``/versions`` answered."""

    # -- properties ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The homeserver's base URL, ``http://127.0.0.1:PORT``."""
        if self._port is None:
            raise SynapseError("the server is not started")
        return f"http://127.0.0.1:{self._port}"

    @property
    def server_name(self) -> str:
        return self._server_name

    @property
    def directory(self) -> Path:
        """The temp dir with ``homeserver.yaml``, the database and the logs (gone after :meth:`stop`)."""
        if self._dir is None:
            raise SynapseError("the server is not started")
        return self._dir

    def user_id(self, localpart: str) -> str:
        return f"@{localpart}:{self._server_name}"

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of Synapse's stdout/stderr and of its log file, for failure messages."""
        if self._dir is None:
            return ""
        parts = []
        for name in ("synapse.out", "homeserver.log"):
            path = self._dir / name
            if path.exists():
                parts.append(f"--- {name} ---\n{_tail(path.read_text(errors='replace'), lines)}")
        return "\n".join(parts)

    # -- lifecycle ----------------------------------------------------------------------------------

    def __enter__(self) -> SynapseServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Install (if needed), configure, generate keys, launch and wait until the client API answers."""
        if self._proc is not None:
            raise SynapseError("the server is already started")
        python = self._python or ensure_synapse_venv()
        self._dir = Path(tempfile.mkdtemp(prefix="cortexbot-synapse-"))
        atexit.register(self.stop)
        try:
            for attempt in range(3):  # the free port can be taken between picking and binding it
                self._write_config(_free_port())
                if attempt == 0:
                    self._write_signing_key()
                if self._launch(python):
                    return
                _log(f"port {self._port} was taken; retrying with another one")
            raise SynapseError(f"Synapse could not bind a port after 3 attempts\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate Synapse (SIGTERM, SIGKILL after 10 s) and remove the temp dir. Safe to call twice."""
        atexit.unregister(self.stop)
        self._kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._port = None

    def _write_config(self, port: int) -> None:
        directory = self.directory
        self._port = port
        log_config = directory / "log.config"
        log_config.write_text(json.dumps(_log_config(directory / "homeserver.log", self._log_level), indent=2))
        config = homeserver_config(
            directory, port, server_name=self._server_name, shared_secret=self._shared_secret, log_config=log_config
        )
        (directory / "homeserver.yaml").write_text(json.dumps(config, indent=2))

    def _write_signing_key(self) -> None:
        """What ``--generate-keys`` writes (signedjson's format: an ed25519 seed), without a 2 s subprocess."""
        seed = base64.b64encode(os.urandom(32)).decode().rstrip("=")
        version = "a_" + secrets.token_hex(2)
        (self.directory / f"{self._server_name}.signing.key").write_text(f"ed25519 {version} {seed}\n")

    def _launch(self, python: Path) -> bool:
        """Start the process and wait for ``/versions``; False if it exited because the port was taken."""
        directory = self.directory
        cmd = [str(python), "-m", "synapse.app.homeserver", "-c", str(directory / "homeserver.yaml")]
        started = time.monotonic()
        with open(directory / "synapse.out", "wb") as out:
            self._proc = subprocess.Popen(
                cmd,
                cwd=directory,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = started + self._startup_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                self._proc = None
                if "Address already in use" in tail:
                    return False
                raise SynapseError(f"Synapse exited with code {code} during start-up\n{tail}")
            if self._versions_ok():
                self.startup_seconds = time.monotonic() - started
                return True
            if time.monotonic() >= deadline:
                tail = self.log_tail()
                self._kill()
                raise SynapseError(f"Synapse did not answer within {self._startup_timeout:.0f} s\n{tail}")
            time.sleep(0.1)

    def _versions_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/_matrix/client/versions", timeout=2.0) as resp:
                return resp.status == 200 and "versions" in json.loads(resp.read())
        except (OSError, ValueError):
            return False

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    # -- client-server helpers ----------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, token: str | None = None) -> Any:
        """A JSON request to the homeserver; raises :class:`SynapseError` with the body on HTTP errors."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=_HTTP_TIMEOUT_S) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise SynapseError(f"{method} {path} -> HTTP {exc.code}: {detail}") from exc

    def register(self, username: str, password: str, admin: bool = False) -> str:
        """Create a user with the shared-secret admin API; returns the full user id (``@name:localhost``)."""
        nonce = self.request("GET", "/_synapse/admin/v1/register")["nonce"]
        mac = hmac.new(self._shared_secret.encode(), digestmod=hashlib.sha1)
        mac.update(
            b"\x00".join([nonce.encode(), username.encode(), password.encode(), b"admin" if admin else b"notadmin"])
        )
        body = {"nonce": nonce, "username": username, "password": password, "admin": admin, "mac": mac.hexdigest()}
        return str(self.request("POST", "/_synapse/admin/v1/register", body)["user_id"])

    def login_token(self, user: str, password: str) -> tuple[str, str]:
        """Password login (``user`` is a localpart or a full id); returns ``(access_token, device_id)``."""
        body = {
            "type": "m.login.password",
            "identifier": {"type": "m.id.user", "user": user},
            "password": password,
            "initial_device_display_name": "cortexbot-tests",
        }
        resp = self.request("POST", "/_matrix/client/v3/login", body)
        return str(resp["access_token"]), str(resp["device_id"])
