"""The PostgreSQL engine's own behaviour on a real server: clear one-line errors at start, migrations
that run once when processes start together, the password kept out of files and messages."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from bot.config import ConfigError, parse_config
from bot.storage import MIGRATIONS, Storage, StorageError, open_storage
from tests.postgres import PostgresServer


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_refused_connection_says_where_and_what_to_check() -> None:
    with pytest.raises(StorageError, match=r"cannot reach PostgreSQL at postgresql://u@127\.0\.0\.1:\d+/db .*running"):
        await open_storage(f"postgresql://u@127.0.0.1:{_closed_port()}/db")


async def test_a_password_with_an_unencoded_slash_or_at_never_shows_in_part() -> None:
    """A URL given whole (``url_env``, ``copy-data --to``) may hold a password written with "/" or "@" unencoded:
    the URL parser took its tail for the host and path, and the error showed "…:***@ss/word@127.0.0.1…"."""
    with pytest.raises(StorageError) as caught:
        await open_storage(f"postgresql://u:p@ss/w0rd@127.0.0.1:{_closed_port()}/db")
    assert "ss/w0rd" not in str(caught.value) and "w0rd" not in str(caught.value), str(caught.value)
    assert "postgresql://u:***@127.0.0.1:" in str(caught.value)


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://cortex@127.0.0.1:{port}/cortex?password=hunter2", "?password=***"),
    ("postgresql://cortex@127.0.0.1:{port}/cortex?sslmode=disable&pass%77ord=hunter2", "&pass%77ord=***"),
    ("postgresql://cortex:it's-hunter2@127.0.0.1:{port}/cortex", "cortex:***@127.0.0.1"),
    ('postgresql://cortex:say"hunter2"@127.0.0.1:{port}/cortex', "cortex:***@127.0.0.1"),
    # An attacker's finding: a space in the password, a quote in the user's name, a space in ?password= (asyncpg
    # takes all three and logs in) showed the password whole, also on success (`migrate`, `doctor`).
    ("postgresql://cortex:s3cr3t hunter2@127.0.0.1:{port}/cortex", "cortex:***@127.0.0.1"),
    ("postgresql://o'neil:hunter2@127.0.0.1:{port}/cortex", "o'neil:***@127.0.0.1"),
    ("postgresql://cortex@127.0.0.1:{port}/cortex?password=s3cr3t hunter2&sslmode=disable", "?password=***&"),
])
async def test_a_password_in_the_query_or_with_a_quote_never_shows(url: str, shown: str) -> None:
    """``?password=`` (which asyncpg and libpq take) and a password holding a quote were shown whole in the
    errors of `doctor`, `status` and `migrate`."""
    with pytest.raises(StorageError) as caught:
        await open_storage(url.format(port=_closed_port()))
    assert "hunter2" not in str(caught.value) and shown in str(caught.value), str(caught.value)
    with pytest.raises(ConfigError, match="no place for it") as refused:
        parse_config({"storage": {"url": url.format(port=5432)}})
    assert "hunter2" not in str(refused.value)


async def test_a_missing_database_is_named(postgres_server: PostgresServer) -> None:
    with pytest.raises(StorageError, match=r"does not exist: create it \(createdb no_such_database\)"):
        await open_storage(postgres_server.url_for("no_such_database"))


async def test_a_wrong_password_is_refused_clearly_and_never_shown(postgres_server: PostgresServer, pg_url: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    postgres_server.psql("DROP ROLE IF EXISTS pwuser; CREATE ROLE pwuser LOGIN PASSWORD 'right-secret';")
    hba = postgres_server.directory / "data" / "pg_hba.conf"
    rules = hba.read_text()
    if "pwuser" not in rules:  # first match wins: only this role needs a password
        hba.write_text("host all pwuser 127.0.0.1/32 scram-sha-256\n" + rules)
        postgres_server.psql("SELECT pg_reload_conf();")
    url = pg_url.replace("//postgres@", "//pwuser@")
    with pytest.raises(StorageError, match="refused the login.*copy-data's target: in the variable named by "
                                           "--to-password-env") as caught:
        await open_storage(url, password="wrong-secret")
    assert "wrong-secret" not in str(caught.value) and "right-secret" not in str(caught.value)
    monkeypatch.setenv("CB_DB_PASSWORD", "right-secret")
    config = parse_config({"storage": {"url": url, "password_env": "CB_DB_PASSWORD"}})
    resolved, password = config.storage.resolve()
    storage = await open_storage(resolved, password=password)
    await storage.close()
    monkeypatch.setenv("PGPASSWORD", "right-secret")  # the standard variable works too
    storage = await open_storage(url)
    await storage.close()


def test_a_password_in_the_configured_url_is_refused() -> None:
    with pytest.raises(ConfigError, match="no place for it"):
        parse_config({"storage": {"url": "postgresql://cortex:hunter2@db:5432/cortex"}})


async def test_a_missing_vector_extension_is_created_or_explained(postgres_server: PostgresServer) -> None:
    name = postgres_server.unique_database_name("novector")
    url = postgres_server.create_database(name, extensions=())
    storage = await open_storage(url)  # the superuser may create it: it is created
    await storage.close()
    postgres_server.psql(f"DROP ROLE IF EXISTS plain; CREATE ROLE plain LOGIN; "
                         f"CREATE DATABASE {name}_b; GRANT ALL ON DATABASE {name}_b TO plain;")
    try:
        plain = f"postgresql://plain@127.0.0.1:{postgres_server.port}/{name}_b"
        with pytest.raises(StorageError, match="CREATE EXTENSION vector; as a superuser"):
            await open_storage(plain)
    finally:
        postgres_server.drop_database(f"{name}_b")
        postgres_server.drop_database(name)


async def test_a_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)
    with pytest.raises(StorageError, match=r"pip install 'cortex-bot\[postgres\]'"):
        await open_storage("postgresql://u@127.0.0.1:5432/db")


async def test_processes_starting_together_migrate_exactly_once(pg_url: str) -> None:
    stores = await asyncio.gather(*(open_storage(pg_url) for _ in range(4)))
    try:
        applied = await asyncio.gather(*(s.migrate() for s in stores))
        assert sorted(v for a in applied for v in a) == [m.version for m in MIGRATIONS]
        assert await stores[0].applied_migrations() == [m.version for m in MIGRATIONS]
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def test_a_database_newer_than_the_code_is_refused(storage: Storage) -> None:
    await storage.db.write("INSERT INTO schema_version (version, description, applied_at) VALUES (999, 'x', 0)")
    with pytest.raises(StorageError, match="upgraded by a newer cortex-bot .*version 999"):
        await storage.migrate()


async def test_every_pooled_connection_searches_vectors_with_iterative_scans(pg_url: str) -> None:
    """The settings are the connections' own, from their start: every use begins with them."""
    storage = await open_storage(pg_url)
    try:
        for _ in range(3):
            async with storage.db.transaction() as tx:
                await tx.execute("SET LOCAL hnsw.ef_search = 10")  # what one use changes for itself ...
            row = await storage.db.fetch_one("SELECT current_setting('hnsw.iterative_scan'),"
                                             " current_setting('hnsw.ef_search')")
            assert tuple(row) == ("relaxed_order", "100")  # ... the next use starts afresh
    finally:
        await storage.close()


async def test_a_setting_in_the_url_is_the_operators_and_kept(pg_url: str) -> None:
    """asyncpg sends a URL's unknown parameters as settings, but the bot's own defaults used to override them."""
    storage = await open_storage(pg_url + "?hnsw.ef_search=333")
    try:
        row = await storage.db.fetch_one("SELECT current_setting('hnsw.iterative_scan'),"
                                         " current_setting('hnsw.ef_search')")
        assert tuple(row) == ("relaxed_order", "333")
    finally:
        await storage.close()


async def test_another_programs_database_is_refused_and_left_untouched(postgres_server: PostgresServer) -> None:
    """A database holding another program's tables (a typo in the URL, a shared server) failed at the migration
    with asyncpg's traceback, after the bot had already added its schema_version table and the vector extension."""
    name = postgres_server.unique_database_name("theirs")
    url = postgres_server.create_database(name, extensions=())
    postgres_server.psql("CREATE TABLE users (id serial PRIMARY KEY, email text); CREATE TABLE orders (id int);",
                         database=name)
    try:
        with pytest.raises(StorageError, match=r"not a cortex-bot database: it holds another program's tables "
                                               r"\(orders, users\)\. It was left untouched"):
            await open_storage(url)
        left = postgres_server.psql(
            "SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_tables WHERE schemaname = 'public';"
            " SELECT count(*) FROM pg_extension WHERE extname = 'vector';", database=name)
        assert left.split() == ["orders,users", "0"]
    finally:
        postgres_server.drop_database(name)


async def test_a_connection_given_back_mid_transaction_is_rolled_back(pg_url: str) -> None:
    """The pool's reset of a released connection is asyncpg's rollback alone (no RESET ALL round trip): a
    transaction a cancelled task left open must still not leak into the next use."""
    storage = await open_storage(pg_url)
    try:
        await storage.migrate()
        pool = storage.db.pool  # type: ignore[attr-defined]
        conn = await pool.acquire()
        await conn.execute("BEGIN")
        await conn.execute("INSERT INTO settings (key, value, updated_at) VALUES ('half', 'done', 0)")
        await pool.release(conn)
        assert await storage.get_setting("half") is None
        for _ in range(3):  # and every connection of the pool is usable afterwards
            assert (await storage.db.fetch_one("SELECT 1"))[0] == 1
    finally:
        await storage.close()


@pytest.mark.parametrize("form", ["/?dbname=", "?dbname=", "/?database=", "?database="])
async def test_a_database_named_in_the_urls_query_is_the_one_opened(pg_url: str, form: str) -> None:
    """asyncpg reads ``?dbname=`` (or its own ``?database=``) only when the URL has no path at all: after
    "host/" it opened the database named like the user (here ``postgres``) instead."""
    from urllib.parse import urlsplit

    from bot.config import check_storage_url

    parts = urlsplit(pg_url)
    name = parts.path.strip("/")
    storage = await open_storage(check_storage_url(f"{parts.scheme}://{parts.netloc}{form}{name}"))
    try:
        assert (await storage.db.fetch_one("SELECT current_database()"))[0] == name
    finally:
        await storage.close()


async def test_a_read_only_database_answers_what_only_reads(pg_url: str) -> None:
    """An attacker's finding: every start asked for `CREATE TABLE IF NOT EXISTS schema_version`, so on a standby or
    with a role that may only read, even `status` ended in a traceback. A migrated database is only read."""
    storage = await open_storage(pg_url)
    await storage.migrate()
    await storage.close()
    read_only = await open_storage(pg_url + "?default_transaction_read_only=on")
    try:
        assert await read_only.pending_migrations() == []
        assert await read_only.count_jobs(["queued"]) == 0
    finally:
        await read_only.close()


async def test_a_missing_vector_adapter_says_how_to_install_it(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pgvector.asyncpg", None)
    with pytest.raises(StorageError, match=r"pgvector's adapter for the PostgreSQL driver is not installed: pip"):
        await open_storage(pg_url)


async def test_a_piece_of_a_password_never_shows_and_a_weak_one_hides_nothing_else() -> None:
    """A review's finding: a password with an unencoded "/" and no "@" after it made asyncpg's URL parser quote its
    first piece in the error ('s3cretpw'); and hiding a password equal to the user and database names ("postgres")
    wherever it appeared left `status` showing `***ql://***:***@db:5432/***`."""
    from bot.config import StorageConfig, hide_url_passwords

    with pytest.raises(StorageError) as caught:
        await open_storage(f"postgresql://cortex:s3cretpw/x@127.0.0.1:{_closed_port()}/db")
    assert "s3cretpw" not in str(caught.value) and "percent-encoded" in str(caught.value), str(caught.value)
    config = StorageConfig(url="sqlite:///unused.db", url_env="CB_TEST_URL")
    url, _ = config.resolve({"CB_TEST_URL": "postgresql://postgres:postgres@db:5432/postgres"})
    assert hide_url_passwords(f"opened {url}") == "opened postgresql://postgres:***@db:5432/postgres"
    url, _ = config.resolve({"CB_TEST_URL": "postgresql://cortex:cortex%402024@db:5432/cortex"})  # (in pieces)
    assert hide_url_passwords(f"opened {url}") == "opened postgresql://cortex:***@db:5432/cortex"


async def test_a_read_only_server_is_named_as_the_databases_trouble(pg_url: str) -> None:
    """A standby (or default_transaction_read_only) refuses writes: the reply path and the commands say so in one
    line rather than with asyncpg's traceback."""
    import asyncpg

    from bot.storage.unavailable import unavailable

    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("SET default_transaction_read_only = on")
        with pytest.raises(asyncpg.PostgresError) as refused:
            await conn.execute("CREATE TABLE t (x int)")
    finally:
        await conn.close()
    assert unavailable(refused.value) == (
        "the PostgreSQL server is read-only (a standby, or default_transaction_read_only)")
    assert unavailable(ValueError("a bug")) is None


class Relay:
    """A TCP relay on loopback in front of the test's PostgreSQL, to cut the bot off from it as a network would:
    ``stop`` ends the connections it carries and refuses new ones (the server stopped); with ``silent`` it takes
    new ones and answers nothing (packets dropped)."""

    def __init__(self, pg_url: str) -> None:
        from urllib.parse import urlsplit

        self.real = urlsplit(pg_url)
        self.silent = False
        self.links: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> int:
        from urllib.parse import urlunsplit

        self.server = await asyncio.start_server(self._carry, "127.0.0.1", 0)
        port = int(self.server.sockets[0].getsockname()[1])
        self.url = urlunsplit(self.real._replace(netloc=f"{self.real.username or 'postgres'}@127.0.0.1:{port}"))
        return port

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.links.append(writer)
        if self.silent:
            await reader.read()
            return
        upstream_reader, upstream = await asyncio.open_connection(self.real.hostname, self.real.port)
        self.links.append(upstream)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, upstream), pump(upstream_reader, writer), return_exceptions=True)

    def close_links(self) -> None:
        for link in self.links:
            link.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        self.close_links()


async def test_a_server_that_stopped_answering_is_named_as_the_databases_trouble(pg_url: str) -> None:
    """Once the server is gone (stopped, restarting), the pool's new connections are refused with a plain
    ``ConnectionRefusedError``: every reply got "something went wrong" and a traceback, and background jobs
    failed for good instead of waiting. The same error from another connection (an LLM's) is not the database's."""
    from bot.storage.unavailable import UNREACHABLE

    relay = Relay(pg_url)
    port = await relay.start()
    storage = await open_storage(relay.url)
    try:
        await storage.migrate()
        await storage.get_setting("x")
        await relay.stop()  # the server "stops": its connections end, new ones are refused
        said = []
        for _ in range(3):
            with pytest.raises(Exception) as failed:
                await storage.get_setting("x")
            said.append(storage.unavailable(failed.value))
        assert said[-1] == f"the database {storage.db.url} cannot be used right now: {UNREACHABLE}", said
        assert all(s is not None for s in said), said
    finally:
        await storage.close()
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2)
    except OSError as refused:
        assert storage.unavailable(refused) is None  # not raised by the driver: another connection's trouble
    else:
        raise AssertionError("the port still answers")


async def test_a_pool_whose_connections_are_all_busy_is_said_as_such_after_a_while(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pooled connection held by slow statements: every database call of the process, a reply's too, waited
    silently for them (up to the statements' timeout of 300 s)."""
    import time

    import bot.storage.postgres as postgres_module
    from bot.storage.unavailable import BUSY

    monkeypatch.setattr(postgres_module, "ACQUIRE_TIMEOUT", 0.5)
    storage = await open_storage(pg_url, pool_size=2)
    try:
        await storage.migrate()
        slow = [asyncio.create_task(storage.db.fetch_one("SELECT pg_sleep(4)")) for _ in range(2)]
        await asyncio.sleep(0.3)
        started = time.monotonic()
        with pytest.raises(StorageError) as busy:
            await storage.upsert_user("discord:1", "Ann")
        assert time.monotonic() - started < 3
        assert storage.unavailable(busy.value) == f"the database {storage.db.url} cannot be used right now: {BUSY}"
        await asyncio.gather(*slow)
        assert (await storage.upsert_user("discord:1", "Ann")).key == "discord:1"  # (free again)
    finally:
        await storage.close()


async def test_a_server_that_takes_connections_and_never_answers_is_unreachable_not_busy(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connect that timed out (the server cut off: a firewall dropping packets) was said as "every connection is
    busy" (the pool's wait ran out with it), pointing the operator at [storage] pool_size."""
    import bot.storage.postgres as postgres_module
    from bot.storage.unavailable import UNREACHABLE

    monkeypatch.setattr(postgres_module, "CONNECT_TIMEOUT", 0.5)
    relay = Relay(pg_url)
    await relay.start()
    storage = await open_storage(relay.url, pool_size=2)
    try:
        await storage.migrate()
        relay.silent = True  # the pool's connections end; new ones are taken and never answered
        relay.close_links()
        said: list[str | None] = []
        for _ in range(3):  # (the first finds its connection closed; then the pool's new ones time out)
            try:
                await storage.get_setting("x")
                said.append("answered")
            except Exception as exc:  # noqa: BLE001  (whatever it is, what the bot would say of it)
                said.append(storage.unavailable(exc))
        assert said[-1] == f"the database {storage.db.url} cannot be used right now: {UNREACHABLE}", said
    finally:
        await storage.close()
        await relay.stop()
        await asyncio.sleep(0.1)
