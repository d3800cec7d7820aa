"""The web page: the user's memory and the admin views in a browser, a JSON API under ``/api/``,
``/healthz`` and Prometheus ``/metrics``, served by the bot itself (aiohttp) in the adapters' event loop.

A browser is one more platform: like the chat adapters it turns requests into calls of the same
services the chat commands use (cortex files, memory store, personas, settings), and every request
is authorised on the server, as the chat commands are.
"""

from adapters.web.server import WebServer

__all__ = ["WebServer"]
