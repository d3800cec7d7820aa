"""A stdio MCP server written by hand (JSON-RPC lines, no SDK), for what a real SDK server never does.

Run as ``python tests/fakes/raw_mcp_server.py``. Tools: ``ok()`` (answers "fine"), ``latin1()`` (answers "café" in
Latin-1, a byte that is no UTF-8), ``nested()`` (an answer nested deeper than the SDK reads), ``chatty()`` (a line
of log text on its output before its answer), ``strerror()`` (an error that is a bare string), ``jsonlog()`` (a JSON
log record there first), ``progress()`` (a notification nested deeper than the SDK reads first), ``leak()`` (writes
its ``TOKEN`` and a line of 100,000 characters on its stderr), ``tattle()`` (a log line with its ``TOKEN`` on its
output, then the answer), ``crash()`` (ends the process at once), ``daemon()``
(starts a ``sleep 30`` that outlives it, holding its stderr open; answers its pid), ``query(sql)``, whose
description, title and input schema quote the ``DSN`` of its environment (a careless server describing the database
it reaches, password and all), ``lookup()``, described by such a title alone, ``textual``, whose input schema is
no valid JSON schema (``"type": "text"``), ``forecast(city)``, whose result fails its own output schema,
quoting the city, ``fs.delete()`` (a name the model APIs do not take: offered as ``fs_delete``), ``pid()``,
``huge(mb)`` (an answer of that many megabytes, in one line), ``work(seconds)`` (sleeps, then answers "worked":
the server does one thing at a time, as many simple ones do, and answers no ping meanwhile) and
``freeze(seconds)`` (answers "frozen", then sleeps: hung while the bot waits for nothing). With ``PING=unknown``
in its environment it answers a ping with JSON-RPC's "Method not found".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

OUT = sys.stdout.buffer


def send(message: dict[str, Any]) -> None:
    OUT.write(json.dumps(message).encode() + b"\n")
    OUT.flush()


def tools() -> list[dict[str, Any]]:
    dsn = os.environ.get("DSN", "")
    return [
        {"name": "ok", "description": "Answers fine.", "inputSchema": {"type": "object", "properties": {}}},
        {"name": "query", "title": f"Query {dsn}", "description": f"Run a read-only SQL query against {dsn}.",
         "inputSchema": {"type": "object", "properties": {"sql": {"type": "string",
                                                                  "description": f"SQL for {dsn}"}}}},
        {"name": "lookup", "title": f"Look a row up in {dsn}", "inputSchema": {"type": "object"}},
        {"name": "textual", "description": "An input schema no JSON schema validator takes.",
         "inputSchema": {"type": "object", "properties": {"q": {"type": "text"}}}},
        {"name": "forecast", "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}},
         "outputSchema": {"type": "object", "properties": {"temp": {"type": "number"}}}},
        {"name": "fs.delete", "description": "Delete a file.", "inputSchema": {"type": "object"}},
        # (listed: the SDK lists the tools again for a result of one it does not know, and a server asleep after
        # its answer would not answer that)
        {"name": "freeze", "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}}}},
        {"name": "work", "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}}}},
    ]


def text(request_id: Any, said: str) -> None:
    send({"jsonrpc": "2.0", "id": request_id, "result": {"content": [{"type": "text", "text": said}]}})


def call(request_id: Any, name: str, arguments: dict[str, Any]) -> None:
    if name == "ok":
        text(request_id, "fine")
    elif name == "fs.delete":
        text(request_id, "deleted")
    elif name == "pid":
        text(request_id, str(os.getpid()))
    elif name == "work":
        time.sleep(float(arguments.get("seconds", 1)))
        text(request_id, "worked")
    elif name == "huge":  # a result of `mb` megabytes, written as it is made
        OUT.write(b'{"jsonrpc":"2.0","id":%d,"result":{"content":[{"type":"text","text":"' % request_id)
        for _ in range(int(arguments.get("mb", 1))):
            OUT.write(b"a" * (1 << 20))
        OUT.write(b'"}]}}\n')
        OUT.flush()
    elif name == "freeze":
        text(request_id, "frozen")
        time.sleep(float(arguments.get("seconds", 30)))
    elif name == "latin1":  # a file read in Latin-1 and passed on as it was: "café" with a raw 0xE9 byte
        OUT.write(b'{"jsonrpc":"2.0","id":%d,"result":{"content":[{"type":"text","text":"caf\xe9"}]}}\n' % request_id)
        OUT.flush()
    elif name == "nested":  # a structured answer nested 300 deep (a JSON tree from some API), past the SDK's limit
        deep: dict[str, Any] = {}
        for _ in range(300):
            deep = {"a": deep}
        send({"jsonrpc": "2.0", "id": request_id, "result": {"content": [], "structuredContent": deep}})
    elif name == "leak":  # a careless log line with its token on stderr, and a line of 100,000 characters
        sys.stderr.write(f"connecting to the upstream service with token={os.environ.get('TOKEN')}\n")
        sys.stderr.write("x" * 100_000 + "\n")
        sys.stderr.flush()
        text(request_id, "leaked")
    elif name == "tattle":  # the same careless log line on its output (not stderr), then the answer
        OUT.write(f"connecting to the upstream service with token={os.environ.get('TOKEN')}\n".encode())
        text(request_id, "tattled")
    elif name == "forecast":  # a result that fails its output schema, quoting the argument
        send({"jsonrpc": "2.0", "id": request_id, "result": {
            "content": [], "structuredContent": {"temp": f"unknown for {arguments.get('city')}"}}})
    elif name == "crash":
        os._exit(3)
    elif name == "daemon":  # a child in a session of its own (out of reach of the stop), holding stderr open
        text(request_id, str(subprocess.Popen(["sleep", "30"], start_new_session=True).pid))
    elif name == "chatty":  # a line of log on its output, then the answer
        OUT.write(b"connecting to the upstream service...\n")
        text(request_id, "chatted")
    elif name == "strerror":  # an error as a bare string, not the object JSON-RPC has
        send({"jsonrpc": "2.0", "id": request_id, "error": "upstream failed"})
    elif name == "jsonlog_err":  # a structured log record with an id and an error of its own, then the answer
        OUT.write(b'{"level": "warn", "id": "req-7", "error": "upstream timeout, retrying"}\n')
        OUT.flush()
        text(request_id, "logged")
    elif name == "jsonlog":  # a structured log record on its output, then the answer
        OUT.write(b'{"level": "info", "msg": "connecting to the upstream service"}\n')
        OUT.flush()
        text(request_id, "logged")
    elif name == "progress":  # a notification nested deeper than the SDK reads, then the answer
        deep_data: dict[str, Any] = {}
        for _ in range(300):
            deep_data = {"a": deep_data}
        send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": deep_data}})
        text(request_id, "notified")
    else:
        send({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32602, "message": f"no tool {name}"}})


def main() -> None:
    for line in sys.stdin.buffer:
        message = json.loads(line)
        request_id, method = message.get("id"), message.get("method")
        if request_id is None:
            continue  # a notification
        if method == "initialize":
            send({"jsonrpc": "2.0", "id": request_id, "result": {
                "protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                "serverInfo": {"name": "raw", "version": "1"}}})
        elif method == "tools/list":
            send({"jsonrpc": "2.0", "id": request_id, "result": {"tools": tools()}})
        elif method == "tools/call":
            call(request_id, message["params"]["name"], message["params"].get("arguments") or {})
        elif method == "ping" and os.environ.get("PING") == "unknown":
            send({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32601, "message": "Method not found: ping"}})
        else:
            send({"jsonrpc": "2.0", "id": request_id, "result": {}})


if __name__ == "__main__":
    main()
