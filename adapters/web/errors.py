"""JSON errors: every API failure is ``{"error": message}`` with a 4xx status a client can act on."""

from __future__ import annotations

import json
from typing import NoReturn

from aiohttp import web

# A request whose rows went while it ran: a forget-me (from the chat or another tab) removed the user.
GONE = "what this request refers to was deleted meanwhile (a forget-me?): reload the page"


def json_error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": message}), content_type="application/json")


class ApiError(Exception):
    """Raised by handlers; the error middleware answers ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def fail(status: int, message: str) -> NoReturn:
    raise ApiError(status, message)


def not_found(what: str = "not found") -> NoReturn:
    fail(404, what)
