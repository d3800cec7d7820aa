"""Why a database could not be used for a statement, when the cause is the database's state rather than the
statement: a write lock another process holds, a full disk, a file the bot may not write, a PostgreSQL server
gone or full. The reply path and the commands say such a failure in one line an operator can act on (a
traceback of ``sqlite3.OperationalError: database is locked`` named neither the file nor what may hold it),
and tell the person that the database, not their message, is the trouble."""

from __future__ import annotations

import sqlite3

from bot.storage.engine import ConnectionsBusy

HELD = ("another process holds its write lock: a bot process, or a program such as the sqlite3 shell with a "
        "transaction open")
_SQLITE = {
    sqlite3.SQLITE_BUSY: HELD,
    sqlite3.SQLITE_LOCKED: HELD,
    sqlite3.SQLITE_FULL: "the disk is full",
    sqlite3.SQLITE_READONLY: ("it refuses writes: the account running the bot needs write access to the database "
                              "file and its folder"),
    sqlite3.SQLITE_IOERR: "the disk could not read or write it (an I/O error: a full disk gives one too)",
    sqlite3.SQLITE_CANTOPEN: "its file cannot be opened (moved, deleted, or its folder not writable)",
}
# asyncpg's errors by class name (the driver is an extra: not imported here)
_POSTGRES = {
    "DiskFullError": "the PostgreSQL server's disk is full",
    "ReadOnlySQLTransactionError": "the PostgreSQL server is read-only (a standby, or default_transaction_read_only)",
    "TooManyConnectionsError": "the PostgreSQL server has no connection left (max_connections)",
    "CannotConnectNowError": "the PostgreSQL server is starting or shutting down",
    "PostgresConnectionError": "the connection to the PostgreSQL server broke",
    "ConnectionDoesNotExistError": "the connection to the PostgreSQL server broke",
    "AdminShutdownError": "the PostgreSQL server was shut down",
}


UNREACHABLE = "the PostgreSQL server cannot be reached (is it running, and listening where the URL says?)"


BUSY = "every connection to it is busy with slow statements (the pool's size: [storage] pool_size)"


def unavailable(exc: BaseException) -> str | None:
    """The database's trouble behind ``exc`` (or its causes), in words; None when it is none of those."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionsBusy):
            return BUSY
        if isinstance(seen, sqlite3.Error):
            code = getattr(seen, "sqlite_errorcode", None)
            return None if code is None else _SQLITE.get(code & 0xFF)
        for kind in type(seen).__mro__:
            if kind.__module__.startswith("asyncpg") and kind.__name__ in _POSTGRES:
                return _POSTGRES[kind.__name__]
        if isinstance(seen, OSError | TimeoutError) and _raised_in_driver(seen):
            return UNREACHABLE  # (a server stopped or restarting: the pool's new connections are refused)
        seen = seen.__cause__ or seen.__context__
    return None


def _raised_in_driver(exc: BaseException) -> bool:
    """Whether the error came up through asyncpg's code (a connection it was opening): the same error from an
    LLM's or a platform's connection is not the database's."""
    frame = exc.__traceback__
    while frame is not None:
        if str(frame.tb_frame.f_globals.get("__name__", "")).startswith("asyncpg"):
            return True
        frame = frame.tb_next
    return False


def read_only(exc: BaseException) -> bool:
    """Whether ``exc`` is a PostgreSQL server refusing every write: a hot standby, or a read-only session
    (``default_transaction_read_only``)."""
    return any(kind.__module__.startswith("asyncpg") and kind.__name__ == "ReadOnlySQLTransactionError"
               for kind in type(exc).__mro__)
