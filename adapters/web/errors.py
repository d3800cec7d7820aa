"""JSON errors: every API failure is ``{"error": message}`` with a 4xx status a client can act on; outside
the API, a small page with a way back."""

from __future__ import annotations

import html
import json
from typing import NoReturn

from aiohttp import web

# A request whose rows went while it ran: a forget-me (from the chat or another tab) removed the user.
GONE = "what this request refers to was deleted meanwhile (a forget-me?): reload the page"


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>cortex-bot</title><link rel="icon" href="data:,"><link rel="stylesheet" href="/static/app.css"></head>
<body class="login"><main class="card">
<h1>cortex-bot</h1>
{body}
</main></body></html>
"""
BACK = '<p><a href="/">Go to your page</a> (if you are still logged in).</p>'


def page(body: str, status: int = 200) -> web.Response:
    """A small page of the site's look (``body`` is HTML: escape what is not the bot's own)."""
    return web.Response(text=PAGE.format(body=body), status=status, content_type="text/html")


def error_page(status: int, reason: str) -> web.Response:
    """What a browser shows for a wrong address or method outside the API, instead of aiohttp's bare text."""
    return page(f"<p>{status}: {html.escape(reason)}.</p>{BACK}", status)


def json_error(status: int, message: str, code: str = "") -> web.Response:
    """``{"error": message}``, with a ``code`` the page acts on where it can do better than show the message."""
    body = {"error": message, "code": code} if code else {"error": message}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


class ApiError(Exception):
    """Raised by handlers; the error middleware answers ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def fail(status: int, message: str, code: str = "") -> NoReturn:
    raise ApiError(status, message, code)


def not_found(what: str = "not found") -> NoReturn:
    fail(404, what)
