"""The page itself: one HTML document and its script and style, all served from the package (no build
step, nothing fetched from elsewhere at run time)."""

from __future__ import annotations

from aiohttp import web

from adapters.web.server import WebContext, static_file

TYPES = {"app.js": "text/javascript", "app.css": "text/css"}


def routes(ctx: WebContext) -> list[web.RouteDef]:
    files = {name: static_file(name) for name in ("index.html", *TYPES)}

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=files["index.html"], content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in TYPES:
            raise web.HTTPNotFound()
        return web.Response(body=files[name], content_type=TYPES[name], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    return [web.get("/", index), web.get("/static/{name}", asset)]
