"""The MCP SDK's own log lines, each kept to one line without the servers' secrets.

The SDK logs what it cannot read with ``logger.exception``: a line a stdio server printed on its stdout that is no
JSON-RPC (a careless log line, ``token=...`` and all), an HTTP server's answer it could not parse. Pydantic's error
quotes its input, so the traceback carried that line, and the secret in it, into the bot's log at ERROR, where only
a server's stderr was redacted. The bot's own message handler gets the same exception and logs it itself, redacted
(see ``McpServer._on_message``).

:func:`guard` puts one filter on every logger of the SDK's: a record keeps its message, with every running server's
``env_from`` / ``headers_env`` values redacted and cut to one line, and loses its traceback. A filter rather than a
raised level: the SDK's own warnings (a tool dropped for an invalid header, a session that could not be ended) and
its line saying a server sent something it could not read still reach the log.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Protocol

from cortex.skills.base import redact_cut, redaction_values

LINE_CHARS = 1_000  # a line of the SDK's, logged at most


class _Secretive(Protocol):
    @property
    def secrets(self) -> tuple[str, ...]: ...


# (Weak: a server no longer used, and its secrets, leave with it; every record is redacted with all of them, as
# the SDK's loggers are shared and a record does not say which server it is about.)
_servers: weakref.WeakSet[_Secretive] = weakref.WeakSet()


class _SdkRecords(logging.Filter):
    """A record of the SDK's: its message redacted and on one line, its traceback and stack dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # (arguments its format does not take: the handler would print them whole)
            text = str(record.msg)
        values = redaction_values(tuple(secret for server in list(_servers) for secret in server.secrets))
        record.msg, record.args = redact_cut(text, values, LINE_CHARS), None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


_FILTER = _SdkRecords()


def guard(server: _Secretive) -> None:
    """From now on the SDK's log lines redact ``server``'s secrets (and every other guarded server's). The filter
    goes onto each logger of the SDK's there is now (a filter on a parent logger does not see its children's
    records); again on each call, for SDK modules imported since."""
    _servers.add(server)
    for logger in _sdk_loggers():
        logger.addFilter(_FILTER)  # (once: a filter already there is not added again)


def _sdk_loggers() -> list[logging.Logger]:
    """The loggers named ``mcp`` and ``mcp.…``, and the ``logger`` of each imported SDK module (its client session
    logs under the name ``client``)."""
    named = [logger for name, logger in list(logging.Logger.manager.loggerDict.items())
             if isinstance(logger, logging.Logger) and _of_sdk(name)]
    held = [getattr(module, "logger", None) for name, module in list(sys.modules.items()) if _of_sdk(name)]
    return named + [logger for logger in held if isinstance(logger, logging.Logger)]


def _of_sdk(name: str) -> bool:
    return name == "mcp" or name.startswith("mcp.")
