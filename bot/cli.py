"""The ``cortexbot`` command line."""

from __future__ import annotations

import asyncio
import atexit
import getpass
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from bot.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_NAME,
    Config,
    ConfigError,
    MatrixConfig,
    check_storage_url,
    load_config,
    read_secret,
    resolve_config_path,
    shown_url,
    url_has_password,
)
from bot.errors import USER_TOLD
from bot.jobs import local_host, pid_alive
from bot.llm.errors import LLMError
from bot.storage import StorageError
from bot.storage.base import Job
from bot.storage.fleet import LIVE_SECONDS
from bot.text import NAME_CHARS, error_line, one_line_name, plural

FLEET_MIGRATION = 5  # the first with the processes table
STOPPED_UNSAID = (f"A process of another machine that stopped without a word counts as running until {LIVE_SECONDS:g} "
                  "s after it was last seen")

if TYPE_CHECKING:
    from bot.storage.copy import CopyReport

T = TypeVar("T")

# Loggers whose DEBUG lines hold secrets: request headers and URLs (the HTTP clients and SDKs; hpack and h2 are
# HTTP/2's, urllib3 requests'), every response nio parses (the login's access token, each sync's messages) and every
# statement peewee runs with its parameters (nio's key store: the E2EE account and the rooms' keys).
QUIET_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "anthropic", "openai", "aiosqlite", "asyncio",
                 "nio", "peewee", "hpack", "h2", "urllib3", "aiohttp.client")
# Loggers whose DEBUG lines hold what people wrote (Discord's gateway events and request bodies, MCP traffic) or an
# interaction's token (discord.webhook: each answer's URL): at DEBUG the bot logs its own steps, not the
# conversations passing through.
NO_DEBUG_LOGGERS = ("discord.gateway", "discord.http", "discord.client", "discord.webhook", "mcp")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # SDK and HTTP loggers can print request headers at DEBUG: keep them quiet so keys never reach logs.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in NO_DEBUG_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.INFO, getattr(logging, level)))
    # The scheduler logs every run of every periodic job at INFO (two lines every 5 s on an idle bot).
    logging.getLogger("apscheduler").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def _log_level(ctx: click.Context, config: Config, quiet: str) -> str:
    """``-v``: INFO (DEBUG when ``[bot] log_level`` or ``quiet`` says so); otherwise ``quiet``."""
    if ctx.obj.get("verbose"):
        return "DEBUG" if "DEBUG" in (config.bot.log_level, quiet) else "INFO"
    return quiet


def _start_refused(exc: Exception) -> click.ClickException:
    """A start refused for a config or storage problem, in one line; when no config file was found, that is
    said too: the built-in defaults are seldom what the person meant (a chat started from another folder)."""
    ctx = click.get_current_context(silent=True)
    no_file = ctx is not None and isinstance(ctx.obj, dict) and ctx.obj.get("resolved_config", "") is None
    note = (f" (no config file was found: neither --config, ${CONFIG_ENV} nor ./{DEFAULT_CONFIG_NAME}, so the "
            "built-in defaults are in use)") if no_file and isinstance(exc, ConfigError) else ""
    return click.ClickException(str(exc) + note)


def _load(ctx: click.Context) -> Config:
    path = resolve_config_path(ctx.obj["config_path"])
    try:
        config = load_config(path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    ctx.obj["resolved_config"] = path
    return config


STOPPED_BY_CTRL_C = 130  # (a shell's convention: 128 + SIGINT)
STOPPED_BY_SIGTERM = 128 + signal.SIGTERM  # a command that did not get to the end of its work


def _run_async(main: Callable[[], Awaitable[T]], *, stopped: str = "stopped.", service: bool = False) -> T:
    """Run ``main`` with Ctrl-C and SIGTERM cancelling it cleanly (its ``finally`` blocks still run); then
    ``stopped`` is said. Ctrl-C exits with 130. A ``service`` (the bot, a chat) told to stop by SIGTERM has done
    what was asked and exits with 0, as service managers expect (systemd showed a stopped bot as failed); any
    other command exits with 143 then, its work not done."""
    signals: list[int] = []

    async def runner() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None

        def stop(sig: int) -> None:
            signals.append(sig)
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop, sig)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
                pass
        return await main()

    try:
        return asyncio.run(runner())
    except (asyncio.CancelledError, KeyboardInterrupt):
        click.echo(stopped, err=True)
        if signals[:1] == [signal.SIGTERM]:
            sys.exit(0 if service else STOPPED_BY_SIGTERM)
        sys.exit(STOPPED_BY_CTRL_C)
    except Exception as exc:
        if (why := _refused_access(exc)) is None:
            raise
        raise click.ClickException(why) from None


REFUSED_WRITES = ("OperationalError", "InsufficientPrivilegeError", "ReadOnlySQLTransactionError")  # (the drivers')


def _refused_access(exc: BaseException) -> str | None:
    """A database that will not let this process write (a read-only file, a role without privileges) in one line
    with what to do; None for any other error (a traceback of the driver said it before)."""
    cause: BaseException | None = exc
    while cause is not None and type(cause).__name__ not in REFUSED_WRITES:
        cause = cause.__cause__
    if cause is None:
        return None
    text = " ".join(str(cause).split())
    if type(cause).__name__ == "ReadOnlySQLTransactionError":
        return (f"the database is read-only (a hot standby, or default_transaction_read_only) and refuses writes "
                f"({text}): a bot needs a writable primary: point [storage] url (copy-data: --to) at the primary. "
                "(status, the jobs list and a copy-data from it work on it)")
    if type(cause).__name__ == "InsufficientPrivilegeError":
        return (f"the database refuses this role ({text}): the bot's role must own its database (CREATE DATABASE … "
                "OWNER …, as README's Growing past one machine shows) or hold every privilege on it")
    if "readonly" in text or "read-only" in text:
        return (f"the database refuses writes ({text}): the account running the bot needs write access to the "
                "database file and its folder (SQLite writes its journal beside it)")
    return None


CONFIG_HELP = "Config file (TOML). Default: $CORTEXBOT_CONFIG, else ./config.toml, else built-in defaults."
VERBOSE_HELP = "Log progress to stderr (INFO; DEBUG with [bot] log_level)."


def _into_obj(key: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def keep(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value:  # given after the subcommand: wins over the group's (shared ctx.obj)
            ctx.ensure_object(dict)[key] = value
        return value
    return keep


class _Cli(click.Group):
    """The main options are also taken after the subcommand (``cortexbot doctor --config x.toml``), where
    people type them, not only before it."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        cmd.params += [
            click.Option(["--config", "sub_config"], type=click.Path(dir_okay=False, path_type=Path), default=None,
                         expose_value=False, callback=_into_obj("config_path"), help=CONFIG_HELP),
            click.Option(["-v", "--verbose", "sub_verbose"], is_flag=True, expose_value=False,
                         callback=_into_obj("verbose"), help=VERBOSE_HELP),
        ]
        super().add_command(cmd, name)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=CONFIG_HELP)
@click.option("-v", "--verbose", is_flag=True, help=VERBOSE_HELP)
@click.version_option(package_name="cortex-bot")
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None, verbose: bool) -> None:
    """cortex-bot: LLM personas with a long-term memory people can see, correct and trust."""
    ctx.ensure_object(dict)
    ctx.obj["config_path"] = config_path
    ctx.obj["verbose"] = verbose


@cli.command()
@click.option("--user", "user", default=None, help="Your name in the chat (default: [terminal] user, else login name).")
@click.option("--persona", default=None, help="Persona to talk to (default: the one you last chose with !persona, "
                                             "else [bot] default_persona, else the first).")
@click.pass_context
def chat(ctx: click.Context, user: str | None, persona: str | None) -> None:
    """Chat with a persona in the terminal (reads piped stdin too, one message per line)."""
    config = _load(ctx)
    # The chat shows failures itself, one line each; the log adds warnings (all progress with -v).
    setup_logging(_log_level(ctx, config, "WARNING"))
    if not ctx.obj.get("verbose"):  # a failed reply's warning repeats the error line the chat just showed
        for handler in logging.getLogger().handlers:
            handler.addFilter(lambda record: not getattr(record, USER_TOLD, False))
    name = terminal_user(config, user)
    picked = (persona or "").strip() or None  # (as !persona reads a name: " Cora" was unknown, said as `Cora`)
    status = _run_async(lambda: _chat(config, name, picked), service=True)
    sys.exit(status)


def terminal_user(config: Config, given: str | None = None) -> str:
    """The terminal chat's user (``chat``'s and ``run``'s alike): ``--user``, else ``[terminal] user``, else the login
    name, without the spaces around it and on one line."""
    typed = (given or "").strip() or config.terminal.user.strip() or getpass.getuser() or ""
    if len(typed) > NAME_CHARS:  # (cut, two long names alike at the start would be one user, with one memory)
        raise click.ClickException(f"the chat's user name (--user, or [terminal] user) takes at most {NAME_CHARS} "
                                   f"characters; got {len(typed)}")
    # A name typed in another encoding than the terminal's arrives with lone surrogates: no store takes them.
    return one_line_name(typed) or "you"


async def _chat(config: Config, user: str, persona: str | None) -> int:
    from adapters.terminal import TerminalAdapter
    from bot.app import App

    app = App(config)
    app.fleet_info = _fleet_info(config, ["terminal"])  # from the first heartbeat (`cortexbot status`)
    try:
        await app.start()
    except (ConfigError, StorageError) as exc:
        raise _start_refused(exc) from None
    web: Any = None
    status, grace = 1, {"spent": False}
    try:
        try:
            adapter = TerminalAdapter(app, user=user, persona=persona)
        except ConfigError as exc:  # --persona names no persona
            raise click.ClickException(str(exc)) from None
        try:
            web = await _start_web(app, {})
        except RuntimeError as exc:  # its port is taken: most likely by `cortexbot run` on this config, which serves it
            click.echo(f"note: this chat does not serve the web page: {exc}", err=True)
        status = await _converse(app, config, adapter, grace)
    finally:
        if web is not None:
            await web.stop()
        stopped = await _stop_quietly(app, grace["spent"])
    return status if stopped else 1


async def _converse(app: Any, config: Config, adapter: Any, grace: dict[str, bool]) -> int:
    """The terminal chat until the end of input, then the background jobs' grace (``grace["spent"]`` is set
    as it starts: a Ctrl-C during the wait must not wait again at the stop)."""
    status: int = await adapter.run()
    pending = await app.storage.count_jobs(("queued", "running"), app.workers.handlers)
    if not pending:
        return status
    seconds = config.jobs.shutdown_grace_seconds
    click.echo(f"waiting up to {seconds:.0f} s for {pending} background job(s)…", err=True)
    grace["spent"] = True
    await app.workers.drain(seconds)
    return status


async def _stop_quietly(app: Any, waited: bool) -> bool:
    """Stop the app; a failure (e.g. a full disk) is one line, never in place of an error before it."""
    try:
        # The grace was spent waiting already: jobs still running now are requeued at once, not waited for twice.
        await app.stop(0 if waited else None)
    except Exception as exc:
        logging.getLogger(__name__).info("shutdown failed", exc_info=True)
        click.echo(f"error: could not shut down cleanly: {error_line(exc)}", err=True)
        return False
    return True


@cli.command()
@click.pass_context
def run(ctx: click.Context) -> None:
    """Start the configured adapters and background workers until Ctrl-C or SIGTERM.

    With [discord] or [matrix] enabled it serves those; with neither, it is a terminal chat like
    `cortexbot chat` ([terminal] enabled).
    """
    config = _load(ctx)
    platforms = [name for name in ("discord", "matrix") if getattr(config, name).enabled]
    # A server logs its progress ([bot] log_level); a terminal chat only warnings between the replies.
    setup_logging(_log_level(ctx, config, config.bot.log_level if platforms else "WARNING"))
    if not platforms:
        if not config.terminal.enabled:
            raise click.ClickException(
                "no adapter is enabled: set [discord] enabled = true, [matrix] enabled = true "
                "or [terminal] enabled = true"
            )
        name = terminal_user(config)
        status = _run_async(lambda: _chat(config, name, None), service=True)
        sys.exit(status)
    status = _run_async(lambda: _serve(config, platforms), service=True)
    sys.exit(status)


async def _serve(config: Config, platforms: list[str]) -> int:
    """Run the platform adapters until one fails or the process is told to stop."""
    from bot.app import App

    app = App(config)
    app.fleet_info = _fleet_info(config, platforms)  # from the first heartbeat (`cortexbot status`)
    try:
        await app.start()
    except (ConfigError, StorageError) as exc:
        raise _start_refused(exc) from None
    closers: list[Callable[[], Awaitable[None]]] = []
    tasks: list[asyncio.Task[None]] = []
    connected: dict[str, Callable[[], bool]] = {}
    directories: list[Any] = []  # who administers which server, asked live by the web page
    try:
        try:
            from adapters.admin_directory import discord_directory, matrix_directory

            if "discord" in platforms:
                from adapters.discord import DiscordAdapter, read_token

                token = read_token(config.discord)
                discord_adapter = DiscordAdapter(app, config.discord)
                tasks.append(asyncio.create_task(discord_adapter.run(token), name="discord"))
                closers.append(discord_adapter.close)
                connected["discord"] = discord_adapter.bot.is_ready
                directories.append(discord_directory(discord_adapter))
            if "matrix" in platforms:
                from adapters.matrix import MatrixAdapter

                matrix_adapter = MatrixAdapter(app, config.matrix)
                tasks.append(asyncio.create_task(matrix_adapter.run(), name="matrix"))
                closers.append(matrix_adapter.close)
                connected["matrix"] = lambda: bool(matrix_adapter.client.logged_in)
                directories.append(matrix_directory(matrix_adapter))
            web = await _start_web(app, connected, directories)
            if web is not None:
                closers.insert(0, web.stop)
        except RuntimeError as exc:  # a missing token or password, named by the adapter; a port in use
            raise click.ClickException(str(exc)) from None
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                click.echo(f"error: {task.get_name()}: {task.exception()}", err=True)
                return 1
        return 0
    finally:
        for close in closers:
            try:
                await close()
            except Exception as exc:  # keep shutting the others down
                click.echo(f"error while stopping: {exc}", err=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await app.stop()


async def _start_web(app: Any, connected: dict[str, Callable[[], bool]], directories: Sequence[Any] = ()) -> Any:
    """The web page beside the adapters when ``[web] enabled``; None otherwise."""
    if not app.config.web.enabled:
        return None
    from adapters.web import WebServer

    server = WebServer(app, adapters=connected, directories=directories)
    await server.start()
    # (listed from what started, not from the config: a chat whose port was taken goes on without the page)
    await app.fleet.show("web", app.config.web.base_url)
    click.echo(f"web page: {app.config.web.base_url} (log in with !dashboard in a chat)", err=True)
    if server.metrics_url:
        click.echo(f"metrics: {server.metrics_url}/metrics", err=True)
    return server


def _fleet_info(config: Config, platforms: list[str]) -> dict[str, Any]:
    """What `cortexbot status` shows about this process."""
    info: dict[str, Any] = {"adapters": platforms}
    if "discord" in platforms:
        d = config.discord
        info["discord_shards"] = (
            "all (unsharded)" if d.shard_count is None else
            f"{', '.join(map(str, d.shard_ids)) if d.shard_ids else 'all'} of {d.shard_count}"
        )
    if "matrix" in platforms:
        info["matrix_account"] = config.matrix.user_id
    return info  # (the web page is added once it serves: _start_web)


@cli.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """List the bot processes running on the configured database, their shards, and the job queue."""
    config = _load(ctx)
    setup_logging(_log_level(ctx, config, "WARNING"))
    try:
        processes, queue, now = _run_async(lambda: _fleet_status(config))
    except (StorageError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    _print_status(processes, queue, now)


JOB_STATUSES = ("failed", "queued", "running", "done")


def _job_id(_ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A job's id (click's own integer range said "'abc' is not a valid integer range")."""
    if value is None:
        return None
    text = value.strip().lstrip("#")
    if not text.isascii() or not text.isdigit() or len(text) > 18 or int(text) < 1:
        raise click.BadParameter(f"{value!r} is no job id: give the number cortexbot jobs lists, e.g. 12", param=param)
    return int(text)


@cli.command()
@click.argument("action", required=False, metavar="[retry]")
@click.argument("job_id", required=False, callback=_job_id)
@click.option("--status", "wanted", type=click.Choice(JOB_STATUSES), default="failed", show_default=True,
              help="Which jobs to list.")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="How many, the most recently changed first.")
@click.pass_context
def jobs(ctx: click.Context, action: str | None, job_id: int | None, wanted: str, limit: int) -> None:
    """List background jobs (the failed ones by default), or try a failed job again: cortexbot jobs retry ID.

    A failed job's error is shown whole: a model server's error may quote what it was sent (people's words)."""
    config = _load(ctx)
    setup_logging(_log_level(ctx, config, "WARNING"))
    if action is not None and action != "retry":
        raise click.UsageError(f"did you mean: cortexbot jobs retry {action}?" if action.isdigit()
                               else f"unknown action {action!r}: cortexbot jobs lists, cortexbot jobs retry ID "
                                    "tries a failed job again")
    if action == "retry" and job_id is None:
        raise click.UsageError("say which job: cortexbot jobs retry ID (cortexbot jobs lists the failed ones)")
    try:
        for line in _run_async(lambda: _jobs(config, wanted, limit, job_id if action == "retry" else None)):
            click.echo(line)
    except (StorageError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None


async def _jobs(config: Config, status: str, limit: int, retry: int | None) -> list[str]:
    async with _configured_storage(config) as storage:
        if retry is not None:
            return [await _retry_job(storage, retry)]
        found = await storage.list_jobs(cast(Any, status), limit=limit, by_change=True)
        if not found:
            return [f"no {status} jobs"]
        now = await storage.now()  # (jobs' times are on the database's clock)
        return [f"job {j.id}  {j.kind}  {j.key}  {j.status} {_ago(now - j.updated_at.timestamp())} ago"
                + (f" (again; made {_ago(now - j.created_at.timestamp())} ago)"
                   if j.status == "queued" and j.attempts else "")
                + f", {j.attempts}/{j.max_attempts} attempts" + _job_error(j) for j in found]


def _job_error(job: Job) -> str:
    """A job's last error, for its line: a done job's is an earlier attempt's (it did not stop the job)."""
    if not job.last_error:
        return ""
    error = one_line(job.last_error, 200)
    return f" (an earlier attempt failed: {error})" if job.status == "done" else f": {error}"


async def _retry_job(storage: Any, number: int) -> str:
    """A failed job queued again (as the web page's retry does), or why not."""
    job = await storage.get_job(number)
    if job is None:
        raise StorageError(f"there is no job {number}")
    if job.status != "failed":
        raise StorageError(f"job {number} is {job.status}: only failed jobs are tried again")
    from bot.storage.copy import note_use

    await note_use(storage, f"cortexbot jobs retry (pid {os.getpid()} on {local_host()})")  # (a copy would undo it)
    if not await storage.admin.requeue_failed_job(number):
        raise StorageError(f"job {number} was not queued again: a job of the same kind and key is queued already, "
                           "or it changed meanwhile")
    logging.getLogger(__name__).info("job %d (%s, %s) queued again from the command line", number, job.kind,
                                        job.key)
    return f"job {number} ({job.kind}, {job.key}) is queued again: a running bot takes it within seconds"


async def _fleet_status(config: Config) -> tuple[list[Any], Any, float]:
    """The live processes, the queue, and the database's time (the fleet's marks are on its clock)."""
    async with _configured_storage(config) as storage:
        now = await storage.now()
        return (_running(await storage.fleet.live_processes()),
                await storage.fleet.queue_stats(since=now - RECENT_SECONDS), now)


def _running(processes: list[Any]) -> list[Any]:
    """The live processes, less those of this machine whose pid is gone (a kill -9, a crash: their last heartbeat
    is still recent)."""
    here = local_host()
    return [p for p in processes if p.host != here or pid_alive(p.pid)]


@asynccontextmanager
async def _configured_storage(config: Config) -> AsyncIterator[Any]:
    """The configured database, open and migrated, for a command that reads it (``status``, ``jobs``): one that
    is not there or not migrated yet is refused in words, not made or upgraded."""
    from bot.storage import open_storage

    url, password = config.storage.resolve()
    _require_configured_database(url)
    storage = await open_storage(url, password=password, pool_size=2)
    try:
        if await storage.pending_migrations():
            raise StorageError(f"{storage.db.url} is not migrated yet: run cortexbot migrate (or start the bot)")
        yield storage
    finally:
        await storage.close()


def _require_configured_database(url: str) -> None:
    """A command that reads the configured database refuses a SQLite file that is not there (opening it would
    make an empty one, and its folders)."""
    if (missing := _missing_sqlite(url)) is not None:
        raise ConfigError(f"the configured database {missing} does not exist yet: the bot makes it at its first start "
                          "(cortexbot run or chat); if it ran before, check [storage] url (or --config)")


def _missing_sqlite(url: str) -> Path | None:
    """The file a SQLite URL names when it does not exist (opening it would make it, and its folders)."""
    from bot.storage.sqlite import sqlite_path

    if not url.startswith("sqlite:") or (path := sqlite_path(url)).exists():
        return None
    return path.absolute()


def _print_status(processes: list[Any], queue: Any, now: float) -> None:
    click.echo(f"{len(processes)} live process(es)")
    for p in processes:
        info = p.info
        click.echo(
            f"  {p.id}  adapters: {', '.join(info.get('adapters', [])) or 'workers only'}"
            f"  Discord shards: {info.get('discord_shards', '-')}  Matrix: {info.get('matrix_account', '-')}"
            + (f"  web page: {info['web']}" if info.get("web") else "")
            + f"  up {_ago(now - p.started_at)}, seen {now - p.last_seen:.0f} s ago"
        )
    oldest = "none" if queue.oldest_queued_at is None else f"queued {_ago(now - queue.oldest_queued_at)} ago"
    click.echo(f"jobs: {queue.queued} queued, {queue.running} running, {queue.failed} failed "
               f"({queue.failed_recently} in the last 24 h); oldest queued: {oldest}"
               + (f"; {queue.lapsed} left running by a stopped process" if queue.lapsed else ""))


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@cli.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Apply pending database migrations (they also run automatically at start)."""
    config = _load(ctx)
    setup_logging(_log_level(ctx, config, "WARNING"))

    async def main() -> tuple[list[int], str]:
        from bot.storage import open_storage

        url, password = config.storage.resolve()
        storage = await open_storage(url, password=password, pool_size=config.storage.pool_size)
        try:
            return await storage.migrate(), storage.db.url  # the URL opened (url_env's), without a password
        finally:
            await storage.close()

    try:
        applied, where = _run_async(main)
    except (StorageError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    if applied:
        click.echo(f"applied migration(s) {', '.join(map(str, applied))} to {where}")
    else:
        click.echo(f"{where} is up to date")


@cli.command("copy-data")
@click.option("--to", "to_url", required=True, metavar="URL",
              help="The database to copy into: postgresql://user@host:5432/dbname or sqlite:////abs/path/bot.db "
                   "(four slashes: absolute; three: relative to this folder; its folder must exist).")
@click.option("--to-password-env", default="", metavar="NAME",
              help="Environment variable holding the target's PostgreSQL password (default: PGPASSWORD).")
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1, 100_000),
              help="Rows per page (each page is one transaction in the target).")
@click.option("--while-running", is_flag=True,
              help="Copy although a bot process is running on the source (rows it changes after they are "
                   "copied stay old in the target).")
@click.pass_context
def copy_data_command(ctx: click.Context, to_url: str, to_password_env: str, batch: int,
                      while_running: bool) -> None:
    """Copy the configured database ([storage]) into another one, SQLite <-> PostgreSQL.

    Every table goes over with its ids; running it again resumes an interrupted copy and copies nothing
    twice, and deletes from the target what was deleted here since (a forget-me). A database holding another
    bot's data is refused. Exits with 1 when row counts differ."""
    config = _load(ctx)
    setup_logging(_log_level(ctx, config, "WARNING"))
    try:
        to_url = check_storage_url(to_url.strip())
    except ValueError as exc:
        raise click.ClickException(f"--to: {exc}") from None
    if url_has_password(to_url):
        raise click.ClickException(
            "--to: the URL holds a password, which a command line shows to every account of the machine (ps) and "
            "leaves in the shell's history: remove it, and put it in an environment variable named by "
            "--to-password-env (or in PGPASSWORD)")
    password = _target_password(to_password_env)
    try:
        report = _run_async(lambda: _copy_data(config, to_url, password, batch, while_running),
                            stopped="stopped. Nothing copied is lost: run copy-data again to go on where it stopped.")
    except (StorageError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    _print_copy_report(report)
    if not report.ok:
        sys.exit(1)


def _target_password(env_name: str) -> str | None:
    """The target's password: from the variable ``--to-password-env`` names, else PGPASSWORD (or none)."""
    if not env_name:
        return os.environ.get("PGPASSWORD") or None
    try:
        value = read_secret(env_name)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if not value:
        raise click.ClickException(f"--to-password-env names {env_name}, but that environment variable is not set")
    return value


async def _copy_data(config: Config, to_url: str, password: str | None, batch: int,
                     while_running: bool) -> CopyReport:
    from bot.storage import open_storage
    from bot.storage.copy import copy_data

    _check_target_folder(to_url)
    url, source_password = config.storage.resolve()
    _require_configured_database(url)
    source = await open_storage(url, password=source_password, pool_size=2)
    try:
        # (a source without the processes table lacks migrations, which copy_data names in one line)
        live = await _live_on(source) if not await source.pending_migrations() else ""
        if live and not while_running:
            raise ConfigError(f"a bot is running on the source database ({live}): stop it first, so nothing "
                              "changes while it is copied (or give --while-running). " + STOPPED_UNSAID)
        target = await open_storage(to_url, password=password, pool_size=2)
        try:
            if FLEET_MIGRATION in await target.applied_migrations() and (there := await _live_on(target)):
                raise ConfigError(f"a bot is running on the target database {target.db.url} ({there}): stop it first "
                                  "(what it writes there would mix with the copy under the same ids), or copy into a "
                                  "fresh database. " + STOPPED_UNSAID)
            with _CopyProgress() as progress:
                return await copy_data(source, target, progress=progress.update, batch=batch,
                                       source_running=bool(live))
        finally:
            await target.close()
    finally:
        await source.close()


async def _live_on(storage: Any) -> str:
    """The bot processes running on ``storage``, in words ("" when none)."""
    live = _running(await storage.fleet.live_processes())
    now = await storage.now()
    return ", ".join(f"pid {p.pid} on {p.host}, seen {now - p.last_seen:.0f} s ago" for p in live[:5])


def _check_target_folder(to_url: str) -> None:
    """A SQLite target's folder must be there: opening would make every missing folder of a typo in --to (or of
    a path written with three slashes where four were meant) without a word."""
    from bot.storage.sqlite import sqlite_path

    if not to_url.startswith("sqlite:"):
        return
    path = sqlite_path(to_url)
    folder = path.absolute().parent
    if folder.exists():
        return
    relative = "" if path.is_absolute() else (
        f" ({to_url} is relative to this folder; an absolute path takes four slashes: sqlite:////{path})")
    raise ConfigError(f"the folder {folder} does not exist: create it first (mkdir -p {folder}), or fix --to"
                      + relative)


class _CopyProgress:
    """A rich progress bar per table (on stderr), fed by ``copy_data``'s progress callback."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

        self._tasks: dict[str, TaskID] = {}
        self._bar = Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=Console(stderr=True))

    def __enter__(self) -> _CopyProgress:
        return self  # (started by the first table: a copy refused before it left an empty line above its error)

    def __exit__(self, *exc: object) -> None:
        if self._tasks:
            self._bar.stop()

    def update(self, table: str, done: int, total: int) -> None:
        if not self._tasks:
            self._bar.start()
        if table not in self._tasks:
            self._tasks[table] = self._bar.add_task(table, total=total)
        self._bar.update(self._tasks[table], completed=done, total=total)


def _print_copy_report(report: CopyReport) -> None:
    from rich.console import Console
    from rich.table import Column, Table

    table = Table(Column("table", no_wrap=True), "source rows", "target rows", "copied now", "deleted", "",
                  title=f"{report.source} → {report.target}")
    for row in report.tables:
        mark = "[green]✓[/green]" if row.matches else "[red]✗ differs[/red]"
        table.add_row(row.table, str(row.source_rows), str(row.target_rows), str(row.copied), str(row.removed), mark)
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    if report.ok:
        deleted = (f", deleted {report.removed} row(s) the source no longer has (deleted there since the earlier "
                   "copy)") if report.removed else ""
        console.print(f"copied {report.copied} row(s){deleted} in {report.seconds:.1f} s; every table's row count "
                      f"matches (bot.instance_id {report.instance_id}).")
    else:
        console.print(f"[red]row counts differ for: {', '.join(t.table for t in report.mismatches)}[/red]")
        for line in _mismatch_advice(report):
            console.print(line)


def _mismatch_advice(report: CopyReport) -> list[str]:
    """What a difference means: fewer rows in the target, a copy the bot wrote into meanwhile; more, rows
    deleted here while the copy ran (a bot running on this database: the next copy deletes them there too)."""
    short = [t.table for t in report.mismatches if t.target_rows < t.source_rows]
    extra = [t.table for t in report.mismatches if t.target_rows > t.source_rows]
    advice = []
    if short:
        advice.append(f"The target lacks rows of {', '.join(short)}: was the bot running during the copy? Stop it "
                      "and run copy-data again (it goes on where it stopped).")
    if extra:
        advice.append(f"The target holds rows of {', '.join(extra)} that this database no longer has: rows deleted "
                      "here while the copy ran (a forget-me, expired messages: was the bot running?). Run copy-data "
                      "again once the bot is stopped: it deletes them there too.")
    return advice


@cli.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """Check the config, the chat platforms' credentials, the database, the job queue and failed work, the skills
    (HTTP secrets, MCP servers), the tokenizer, the embedder and the LLM (each model), and say what is wrong."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    problems = 0

    def report(ok: bool, what: str, detail: str = "") -> None:
        nonlocal problems
        problems += 0 if ok else 1
        mark = "[green]✓[/green]" if ok else "[red]✗[/red]"
        console.print(f"{mark} {escape(what)}" + (f": {escape(detail)}" if detail else ""))  # "[llm]" is text

    path = resolve_config_path(ctx.obj["config_path"])
    try:
        config = load_config(path)
    except ConfigError as exc:
        report(False, "config", str(exc))
        sys.exit(1)
    setup_logging(_log_level(ctx, config, "ERROR"))  # the checks report for themselves
    report(True, "config", str(path) if path else "no file, built-in defaults")
    _run_async(lambda: _doctor_checks(config, report))
    if problems:
        console.print(f"[red]{problems} problem(s) found.[/red]")
        sys.exit(1)
    console.print("[green]All checks passed.[/green]")


def _doctor_file_modes(path: Path | None, report: Callable[..., None]) -> None:
    """An SQLite file (and its WAL) other accounts of this machine may read: everyone's words are in it."""
    from bot.privatefs import readable_by_others

    if path is None:
        return
    exposed = [p for p in (path, path.with_name(path.name + "-wal")) if readable_by_others(p)]
    if exposed:
        report(False, "database file", f"other accounts of this machine may read {', '.join(map(str, exposed))}: "
                                       f"chmod 600 {' '.join(map(str, exposed))}")


async def _doctor_skills(config: Config, report: Callable[..., None]) -> None:
    """The configured HTTP skills (their secrets set) and MCP servers (their secrets set; each started, as the bot
    would, and asked for its tools within its connect timeout)."""
    from cortex.skills.http import HttpSkill, needs_allow_internal

    if not config.skills.enabled or not (config.skills.http or config.skills.mcp):
        return
    for entry in config.skills.http:
        try:
            await HttpSkill(entry).aclose()
        except ValueError as exc:  # a missing secret variable, a bad schema or URL: what stops the bot at start
            report(False, f"http skill {entry.name}", str(exc))
            continue
        inside = await needs_allow_internal(entry)
        report(inside is None, f"http skill {entry.name}", inside or shown_url(entry.url))
    if config.skills.mcp:
        await _doctor_mcp(config, report)


async def _doctor_mcp(config: Config, report: Callable[..., None]) -> None:
    """Each MCP server's secret variables set, then the server started and asked for its tools."""
    from cortex.skills.mcp import McpServer, McpSkills

    startable = []
    for server_config in config.skills.mcp:
        try:
            McpServer(server_config)  # (reads its env_from / headers_env variables, as the bot's start does)
        except ValueError as exc:  # a missing secret variable: what stops the bot at start
            report(False, f"mcp server {server_config.name}", str(exc))
            continue
        startable.append(server_config)
    servers = McpSkills(startable)  # (a stdio server's stderr is logged, as in the bot)
    try:
        await servers.start()
        down = dict(servers.down())
        for server in servers.servers:
            reason = down.get(server.name)
            report(reason is None, f"mcp server {server.name}",
                   f"{len(server.tools)} tool(s)" if reason is None else f"not reachable: {reason}")
    finally:
        await servers.aclose()


async def _doctor_embedder(config: Config, report: Callable[..., None]) -> str | None:
    """Load the memory embedder and embed one text, as the backfill would; returns its name."""
    from cortex.memory.embedders import EmbedderError
    from cortex.memory.embedding import build_embedders

    if config.memory.embedder == "none":
        report(True, "embedder", "none: memory search uses full text only")
        return None
    try:
        embedders = build_embedders(config.memory)
        assert embedders is not None
        started = time.monotonic()
        vectors = await asyncio.wait_for(asyncio.to_thread(embedders[0].embed, ["doctor probe"]), timeout=60)
        took = (time.monotonic() - started) * 1000
        report(True, "embedder", f"{embedders[0].name}, {vectors.shape[1]} dimensions, first text in {took:.0f} ms")
        return embedders[0].name
    except (EmbedderError, ConfigError, ValueError, TimeoutError, OSError) as exc:
        report(False, "embedder", str(exc) or "no answer (timed out)")
        return None


async def _doctor_backlog(config: Config, embedder: str, report: Callable[..., None]) -> None:
    """How much memory is still waiting to be embedded (searchable by meaning only once it is)."""
    from bot.storage import open_storage
    from cortex.memory.embedding import message_model

    url, password = config.storage.resolve()
    storage = await open_storage(url, password=password, pool_size=1)
    try:
        items, items_done, messages, messages_done = await storage.memory.embedding_counts(
            embedder, message_model(embedder), config.memory.embed_messages)
    finally:
        await storage.close()
    total, waiting = items + messages, (items - items_done) + (messages - messages_done)
    if not waiting:
        report(True, "embedding backlog", f"none: all {plural(total, 'text')} are embedded")
        return
    report(True, "embedding backlog",
           f"{plural(waiting, 'text')} of {total:,} waiting ({items - items_done:,} memory items, "
           f"{messages - messages_done:,} messages); a running bot embeds them in the background "
           "(progress: !cortex embedder)")


STUCK_AFTER_SECONDS = 600.0


def one_line(text: str, limit: int = 300) -> str:
    """A server's answer for one report line: HTML tags and runs of whitespace gone, cut at ``limit``."""
    plain = " ".join(re.sub(r"<[^>]*>", " ", text).split())
    return plain if len(plain) <= limit else plain[: limit - 1] + "…"


RECENT_SECONDS = 24 * 3600.0  # doctor's "lately": failures older than a day are history, not a problem now


async def _doctor_queue(storage: Any, report: Callable[..., None]) -> None:
    """The job queue: stuck (the oldest queued job waits long), jobs left running by a stopped process, live
    processes; jobs and cortex updates that failed in the last day."""
    now = await storage.now()  # (jobs' and processes' times are on the database's clock)
    queue = await storage.fleet.queue_stats(since=now - RECENT_SECONDS)
    live = _running(await storage.fleet.live_processes())
    waited = now - queue.oldest_queued_at if queue.oldest_queued_at is not None else 0.0
    detail = (f"{queue.queued} queued, {queue.running} running, {queue.failed} failed; "
              f"{len(live)} live bot process(es)")
    if waited > STUCK_AFTER_SECONDS:
        detail += f"; the oldest queued job has waited {_ago(waited)}" + (
            " and no bot process is running to take it" if not live else "")
    if queue.lapsed:
        detail += (f"; {plural(queue.lapsed, 'job')} left running by a process that stopped mid-job (its lease ran "
                   "out): " + ("a running bot takes it over" if live else "the next start takes it over"))
    report(waited <= STUCK_AFTER_SECONDS, "job queue", detail)
    _doctor_failures(queue, now, report)
    runs = await storage.cortex.run_stats(since=now - RECENT_SECONDS)
    failed, done = runs.by_status.get("failed", 0), runs.by_status.get("success", 0)
    if failed:
        last = runs.last_errors[0]
        report(False, "cortex updates", f"{failed} of {failed + done} failed in the last 24 h; the newest "
                                        f"(run {last.id}, {_ago(now - last.started_at.timestamp())} ago): "
                                        f"{one_line(last.reason, 200) or _error_class(last.error)} "
                                        "(more: !cortex stats)")
    else:
        report(True, "cortex updates", f"{done} in the last 24 h, none failed")


def _doctor_failures(queue: Any, now: float, report: Callable[..., None]) -> None:
    """Jobs that failed for good in the last day (older failures are counted in the queue line only)."""
    newest = queue.newest_failure
    if not queue.failed_recently or newest is None:
        report(True, "failed jobs", "none in the last 24 h" + (f" ({queue.failed} older)" if queue.failed else ""))
        return
    report(False, "failed jobs",
           f"{queue.failed_recently} in the last 24 h; the newest, job {newest.id} ({newest.kind}, {newest.key}, "
           f"{_ago(now - newest.failed_at)} ago): {_error_class(newest.error)}. See them with their errors: "
           f"cortexbot jobs; once the cause is fixed, try one again: cortexbot jobs retry ID")


def _error_class(error: str) -> str:
    """An error's kind without its text (``LLMOverloaded: …``: a model server's text may quote its request,
    and doctor's output is what people paste into a question)."""
    kind = error.split(":", 1)[0].strip()
    return kind if kind.isidentifier() else ("an error (see cortexbot jobs)" if error else "no error recorded")


async def _doctor_adapters(config: Config, report: Callable[..., None]) -> None:
    """The enabled chat platforms: their secrets, read as ``run`` reads them, and whether the platform answers and
    takes them (see adapters.credentials)."""
    if config.discord.enabled:
        from adapters.credentials import discord_login

        ok, detail = await discord_login(config.discord, os.environ)
        report(ok, "Discord", detail)
    if config.matrix.enabled:
        from adapters.credentials import matrix_login

        ok, detail = await matrix_login(config.matrix, os.environ)
        report(ok, "Matrix", detail)
        _doctor_matrix_store(config.matrix, report)


def _doctor_matrix_store(config: MatrixConfig, report: Callable[..., None]) -> None:
    """The Matrix store (the login, with e2ee the account's and rooms' keys) when other accounts may read it."""
    from adapters.matrix import store_dir
    from bot.privatefs import exposed_in

    store = store_dir(config)
    if exposed := exposed_in(store):
        report(False, "Matrix store", f"other accounts of this machine may read {', '.join(map(str, exposed))}: "
                                      f"chmod 700 {store} (the bot makes it its own at start)")


def _doctor_personas(config: Config, report: Callable[..., None]) -> None:
    """The [[personas]] names `chat` and `run` refuse at start: one starting with a !persona subcommand."""
    from bot.app import check_persona_names
    from bot.commands import CommandRegistry
    from cortex.personas.card_commands import CardCommands
    from cortex.personas.commands import PersonaCommands
    from cortex.personas.registry import unknown_placeholders

    commands = CommandRegistry()
    for group in (PersonaCommands, CardCommands):  # only the commands' names are read: no handler runs
        group(cast(Any, None), cast(Any, None)).register(commands)
    try:
        check_persona_names(config, commands)
    except ConfigError as exc:
        report(False, "personas", str(exc))
        return
    report(True, "personas", ", ".join(p.name for p in config.personas))
    for where, note in unknown_placeholders(config):  # (the prompt shows them as written: a typo, most likely)
        report(False, where, note.strip())


async def _doctor_database(config: Config, report: Callable[..., None]) -> bool:
    """The database: reachable, writable, migrated, private, its job queue; whether it is ready for the backlog
    check. A SQLite file that is not there yet is said so, not made."""
    from bot.storage import open_storage
    from bot.storage.copy import unfinished_copy

    try:
        url, password = config.storage.resolve()
        if (missing := _missing_sqlite(url)) is not None:
            report(True, "database", f"{missing} does not exist yet: the bot makes it at its first start (if it "
                                     "ran before, check [storage] url)")
            return False
        storage = await open_storage(url, password=password, pool_size=config.storage.pool_size)
        try:
            pending = await storage.pending_migrations()
            await storage.check_writable()
            report(True, "database",
                   f"{storage.db.url}" + (f" ({len(pending)} migration(s) to apply at start)" if pending else ""))
            _doctor_file_modes(getattr(storage.db, "path", None), report)
            if not pending and (unfinished := await unfinished_copy(storage)) is not None:
                report(False, "database", unfinished)
            if not pending:
                await _doctor_queue(storage, report)
        finally:
            await storage.close()
        return not pending
    except Exception as exc:
        report(False, "database", _refused_access(exc) or str(exc))  # (a read-only server: what it needs)
        return False


async def _doctor_checks(config: Config, report: Callable[..., None]) -> None:
    from bot.app import build_provider
    from bot.tokens import BPETokenEstimator

    await _doctor_adapters(config, report)
    _doctor_personas(config, report)
    database_ready = await _doctor_database(config, report)
    try:
        BPETokenEstimator().raw_count("probe")
        report(True, "tokenizer", "offline cl100k BPE loaded")
    except Exception as exc:
        report(False, "tokenizer", str(exc))
    await _doctor_skills(config, report)
    embedder = await _doctor_embedder(config, report)
    if embedder is not None and database_ready:
        await _doctor_backlog(config, embedder, report)

    llm = config.llm
    if not _doctor_llm_key(config, report):
        return
    try:
        provider = build_provider(config)
    except ConfigError as exc:
        report(False, "LLM", str(exc))
        return
    where = f"LLM {llm.provider} at {shown_url(llm.base_url) if llm.base_url else 'default URL'}"
    try:
        models = await asyncio.wait_for(provider.list_models(), timeout=llm.connect_timeout_seconds + 5)
    except LLMError as exc:
        if exc.status_code in (404, 405, 501):  # servers that chat fine but do not list their models
            with_v1 = await _doctor_base_url_with_v1(config) if exc.status_code == 404 else None
            if with_v1 is not None:
                report(False, where, f'nothing answers there, but {with_v1} does: write [llm] base_url = '
                                     f'"{with_v1}" (OpenAI-compatible servers serve their API under /v1)')
                return
            report(True, where, f"reachable; it does not list its models (HTTP {exc.status_code}), so the model "
                                "names were not checked")
            await _doctor_answer(config, report, _answering_models(config))
            if database_ready:
                await _doctor_stored_models(config, report, set(_answering_models(config)))
            return
        report(False, where, one_line(f"{exc.user_message} ({exc.detail})"))
        return
    except TimeoutError:
        report(False, where, "no answer (timed out)")
        return
    finally:
        await provider.aclose()
    report(True, where, f"reachable, {len(models)} model(s)")
    for model in sorted(_answering_models(config)):
        if models and model not in models:
            report(False, f"model {model}", f"not offered by the server (it offers: {', '.join(models[:10])})")
        else:
            report(True, f"model {model}", "available")
    await _doctor_answer(config, report, [m for m in _answering_models(config) if not models or m in models])
    if database_ready:
        await _doctor_stored_models(config, report, set(_answering_models(config)))


def _doctor_llm_key(config: Config, report: Callable[..., None]) -> bool:
    """Whether the LLM's key is there (or not needed), as the bot reads it; said either way."""
    llm = config.llm
    try:
        key = read_secret(llm.key_env_name)
    except ConfigError as exc:  # (a line break inside it)
        report(False, "LLM API key", str(exc))
        return False
    if key is None and llm.key_required:
        report(False, "LLM API key", f"environment variable {llm.key_env_name} is not set")
        return False
    report(True, "LLM API key", f"read from ${llm.key_env_name}" if key else "not needed")
    return True


async def _doctor_stored_models(config: Config, report: Callable[..., None], checked: set[str]) -> None:
    """The cortex models bot admins set in chat (``!cortex settings model``), per persona or server: the config's
    are checked above, and an override with a wrong name made every update of its pairs fail."""
    from bot.app import build_provider
    from bot.llm.probe import PROBE_SECONDS, check_model
    from bot.storage import open_storage

    url, password = config.storage.resolve()
    storage = await open_storage(url, password=password, pool_size=1)
    try:
        overrides = await storage.cortex.overrides_of("model")
    finally:
        await storage.close()
    where: dict[str, list[str]] = {}
    for scope, model in overrides:
        if isinstance(model, str) and model and model not in checked:
            where.setdefault(model, []).append(scope)
    provider = build_provider(config)
    try:
        for model, scopes in where.items():
            found = await check_model(provider, model, seconds=min(config.llm.timeout_seconds, PROBE_SECONDS))
            report(found.usable and found.checked,
                   f"model {model} (set in chat for {', '.join(scopes)})", found.note or "answers")
    finally:
        await provider.aclose()


def _answering_models(config: Config) -> list[str]:
    """The chat model, then the summaries', the cortex updates' and the personas' own where they differ, each once."""
    configured = (config.llm.model, config.llm.summary_model, config.cortex.model, *(p.model for p in config.personas))
    return list(dict.fromkeys(m for m in configured if m))


async def _doctor_answer(config: Config, report: Callable[..., None], models: Sequence[str]) -> None:
    """One real request of a few tokens to each of ``models`` (the chat model, the summaries' and the cortex
    updates' and the personas' where they differ): a server may list its models and still answer no request (overloaded,
    rate-limited, out of credit), and doctor said "All checks passed" while every reply, or every background
    update, failed."""
    from bot.app import build_provider
    from bot.llm.probe import PROBE_SECONDS, probe

    llm = config.llm
    provider = build_provider(config)
    seconds = min(llm.timeout_seconds, PROBE_SECONDS)
    try:
        for model in models:
            failure = await probe(provider, model, seconds)
            if isinstance(failure, LLMError):
                report(False, f"an answer from {model}", one_line(f"{failure.user_message} ({failure.detail})"))
            elif failure is not None:
                report(False, f"an answer from {model}", f"none within {seconds:g} s")
            else:
                report(True, f"an answer from {model}", "a request of a few tokens was answered")
    finally:
        await provider.aclose()


async def _doctor_base_url_with_v1(config: Config) -> str | None:
    """The base_url with /v1 added when that one lists models where the configured one answers 404 (an
    OpenAI-compatible server's address written without its /v1, such as http://localhost:11434): None otherwise."""
    from bot.app import build_provider

    llm = config.llm
    if llm.provider != "openai" or not llm.base_url or llm.base_url.rstrip("/").endswith("/v1"):
        return None
    candidate = llm.base_url.rstrip("/") + "/v1"
    provider = build_provider(config.model_copy(update={"llm": llm.model_copy(update={"base_url": candidate})}))
    try:
        await asyncio.wait_for(provider.list_models(), timeout=llm.connect_timeout_seconds + 5)
    except (LLMError, TimeoutError):
        return None
    finally:
        await provider.aclose()
    return candidate


def main(argv: list[str] | None = None) -> Any:
    try:
        return cli.main(args=argv, prog_name="cortexbot")
    except SystemExit as exc:
        _leave_now_if_threads_run(exc.code)
        raise


def _leave_now_if_threads_run(code: Any) -> None:
    """End the process at once when worker threads still run after the command finished (an embedding: seconds of
    CPU, a minute at the backfill's lower priority on a busy machine). Everything was stopped and saved; the
    interpreter's exit would join them (a chat stopped by SIGTERM ran on for tens of seconds) and then tear down
    onnxruntime under a thread still in it. The exit handlers (logging's flush, temporary files) still run."""
    main_thread = threading.main_thread()
    if not any(t.is_alive() and not t.daemon and t is not main_thread for t in threading.enumerate()):
        return
    if code is None or isinstance(code, int):
        status = code or 0
    else:
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(status)


if __name__ == "__main__":  # pragma: no cover
    main()
