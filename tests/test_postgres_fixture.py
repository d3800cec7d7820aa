"""The PostgreSQL test fixtures start a real server with pgvector, on loopback only, one database per test."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import numpy as np
import pytest
from pgvector.asyncpg import register_vector

from tests.postgres import PostgresError, PostgresServer


async def test_pg_url_has_pgvector_and_answers_cosine_queries(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        version = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        assert version is not None
        assert tuple(int(part) for part in version.split(".")[:2]) >= (0, 8)
        assert conn.get_server_version().major >= 18

        await register_vector(conn)  # only after CREATE EXTENSION vector
        await conn.execute("CREATE TABLE items (id int PRIMARY KEY, embedding vector(3) NOT NULL)")
        rows = [(1, [1.0, 0.0, 0.0]), (2, [0.0, 1.0, 0.0]), (3, [0.9, 0.1, 0.0]), (4, [-1.0, 0.0, 0.0])]
        await conn.executemany(
            "INSERT INTO items (id, embedding) VALUES ($1, $2)", [(i, np.array(v, dtype=np.float32)) for i, v in rows]
        )
        query = np.array([1.0, 0.0, 0.0], dtype=np.float32)
        found = await conn.fetch(
            "SELECT id, embedding, embedding <=> $1 AS distance FROM items ORDER BY embedding <=> $1 LIMIT 3", query
        )
        assert [r["id"] for r in found] == [1, 3, 2]
        assert found[0]["distance"] == pytest.approx(0.0)
        assert found[2]["distance"] == pytest.approx(1.0)
        embedding = found[1]["embedding"]  # pgvector 0.5 decodes to pgvector.Vector, older versions to ndarray
        values = embedding.to_numpy() if hasattr(embedding, "to_numpy") else np.asarray(embedding)
        np.testing.assert_allclose(values, [0.9, 0.1, 0.0], rtol=1e-6)
        farthest = await conn.fetchval("SELECT id FROM items ORDER BY embedding <=> $1 DESC LIMIT 1", query)
        assert farthest == 4
    finally:
        await conn.close()


@pytest.mark.parametrize("run", [1, 2])
async def test_each_test_gets_its_own_empty_database(pg_url: str, run: int) -> None:
    name = urlsplit(pg_url).path.lstrip("/")
    conn = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT current_database()") == name
        tables = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        assert tables == []  # a shared database would still hold the other run's table
        await conn.execute("CREATE TABLE marker (run int)")
        await conn.execute("INSERT INTO marker VALUES ($1)", run)
        others = await conn.fetch(r"SELECT datname FROM pg_database WHERE datname LIKE 't\_%'")
        assert [r["datname"] for r in others] == [name]  # earlier tests' pg_url databases were dropped
    finally:
        await conn.close()


async def test_two_databases_are_isolated(pg_url: str, postgres_server: PostgresServer) -> None:
    other_name = postgres_server.unique_database_name("other")
    other_url = postgres_server.create_database(other_name)
    assert other_url != pg_url
    try:
        first = await asyncpg.connect(pg_url)
        second = await asyncpg.connect(other_url)
        try:
            await first.execute("CREATE TABLE notes (body text)")
            await first.execute("INSERT INTO notes VALUES ('only here')")
            assert await first.fetchval("SELECT count(*) FROM notes") == 1
            with pytest.raises(asyncpg.UndefinedTableError):
                await second.fetchval("SELECT count(*) FROM notes")
            assert await second.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'") is not None
        finally:
            await second.close()  # left open, drop_database(..., FORCE) would still succeed
            await first.close()
    finally:
        postgres_server.drop_database(other_name)
    assert postgres_server.psql(f"SELECT count(*) FROM pg_database WHERE datname = '{other_name}'").strip() == "0"


async def test_drop_database_terminates_open_connections(postgres_server: PostgresServer) -> None:
    name = postgres_server.unique_database_name("forced")
    conn = await asyncpg.connect(postgres_server.create_database(name))
    try:
        postgres_server.drop_database(name)
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError)):
            await conn.fetchval("SELECT 1")
    finally:
        conn.terminate()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on *port*, from ``/proc/net/tcp`` and ``tcp6``."""
    found = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A = LISTEN
                continue
            raw = bytes.fromhex(addr_hex)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            found.add(str(ipaddress.ip_address(raw)))
    return found


async def test_server_listens_on_loopback_only(postgres_server: PostgresServer) -> None:
    url = urlsplit(postgres_server.url)
    assert url.scheme == "postgresql" and url.hostname == "127.0.0.1" and url.username == "postgres"
    assert url.port == postgres_server.port and url.path == "/postgres"
    conn = await asyncpg.connect(postgres_server.url)
    try:
        assert await conn.fetchval("SHOW listen_addresses") == "127.0.0.1"
        assert str(await conn.fetchval("SELECT inet_server_addr()")) == "127.0.0.1"
    finally:
        await conn.close()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_no_socket_listens_beyond_loopback(postgres_server: PostgresServer) -> None:
    assert _listening_addresses(postgres_server.port) == {"127.0.0.1"}


@pytest.mark.slow
def test_start_stop_and_failure_messages() -> None:
    server = PostgresServer()
    with server:
        assert server.startup_seconds is not None and server.startup_seconds < 10
        directory, port = server.directory, server.port
        assert (directory / "data" / "postmaster.pid").exists()
    assert not directory.exists()
    with socket.socket() as sock, pytest.raises(OSError):
        sock.settimeout(2)
        sock.connect(("127.0.0.1", port))

    bad = PostgresServer(settings={"shared_buffers": "not-a-size"})
    with pytest.raises(PostgresError, match='invalid value for parameter "shared_buffers"'):
        bad.start()
    with pytest.raises(PostgresError):
        bad.directory  # noqa: B018 - cleaned up after the failure

    with pytest.raises(ValueError):
        PostgresServer(settings={"listen_addresses": "*"})
    with pytest.raises(ValueError):
        PostgresServer.drop_database(server, 'x"; DROP DATABASE postgres; --')
