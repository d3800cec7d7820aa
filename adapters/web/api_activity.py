"""(being written)"""

from __future__ import annotations

from aiohttp import web

from adapters.web.server import WebContext


def routes(ctx: WebContext) -> list[web.RouteDef]:
    return []
