"""Is a chat platform's server there? Waiting for it at start (a bot started before the network is up, or during
an outage), and the words for why it is not: shared by the Discord and Matrix adapters and ``doctor``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=15)
UNREACHABLE = (aiohttp.ClientError, OSError, TimeoutError)


def why(exc: BaseException) -> str:
    """Why a request got no answer, in a few words (its kind, and what it said)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def wait_until_answers(url: str, *, first: float, longest: float, down: Callable[[str], None],
                             back: Callable[[], None]) -> None:
    """GET ``url`` until the server answers below HTTP 500 (an outage counts as out of reach), waiting ``first``
    seconds after a failed try, doubling up to ``longest``. ``down`` is told why once, at the first failure;
    ``back`` once it answers after one."""
    wait, told = first, False
    while True:
        try:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session, session.get(url) as response:
                await response.read()
                problem = f"HTTP {response.status}" if response.status >= 500 else ""
        except UNREACHABLE as exc:
            problem = why(exc)
        if not problem:
            if told:
                back()
            return
        if not told:
            down(problem)
            told = True
        await asyncio.sleep(wait)
        wait = min(wait * 2, longest)
