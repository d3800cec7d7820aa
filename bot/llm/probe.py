"""Does a model answer? A request of a few tokens, for ``cortexbot doctor`` and for a model an admin sets in chat.

A server's model list is not the last word: Anthropic takes undated aliases (``claude-sonnet-4-5``) it does not
list, and some OpenAI-compatible servers list nothing. So a model the list holds is taken as it is, and any other
is asked for a short answer: refused only when the server rejects that request (an unknown model), not when it
is merely unreachable or busy at the time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from bot.llm.base import ChatMessage, LLMProvider, LLMRequest
from bot.llm.errors import LLMBadRequest, LLMError

PROBE_SECONDS = 30.0  # for the probe's answer (a hung server: not the reply's 120 s)
LIST_SECONDS = 15.0  # for the server's model list


def probe_request(model: str) -> LLMRequest:
    """A request of a few tokens (16: a reasoning model behind a proxy may refuse 1, or spend it thinking)."""
    return LLMRequest(system="", messages=(ChatMessage("user", "Say OK."),), model=model, max_tokens=16)


@dataclass(frozen=True, slots=True)
class ModelCheck:
    usable: bool  # False: the server rejected a request for the model (its name is wrong, or not offered there)
    checked: bool = True  # False: the server could not say (unreachable, busy): taken as usable
    note: str = ""  # why it was refused, or why it could not be checked ("": it answered, or is listed)


async def check_model(provider: LLMProvider, model: str, *, seconds: float = PROBE_SECONDS) -> ModelCheck:
    """Whether ``model`` answers on ``provider`` (see the module's description)."""
    listed: list[str] = []
    try:
        async with asyncio.timeout(LIST_SECONDS):
            listed = await provider.list_models()
    except (LLMError, TimeoutError):
        pass  # (a server that lists nothing: the probe decides)
    if model in listed:
        return ModelCheck(True)
    failure = await probe(provider, model, seconds)
    if isinstance(failure, LLMBadRequest):
        offers = f"; it offers {', '.join(listed[:10])}" + (" …" if len(listed) > 10 else "") if listed else ""
        return ModelCheck(False, note=f"the LLM server refused a request for {model}: {failure.user_message}{offers}")
    if isinstance(failure, LLMError):
        return ModelCheck(True, False, f"not checked: a test request for {model} failed ({failure.user_message})")
    if failure is not None:
        return ModelCheck(True, False, f"not checked: a test request for {model} had no answer within {seconds:g} s")
    return ModelCheck(True)


async def probe(provider: LLMProvider, model: str, seconds: float = PROBE_SECONDS) -> LLMError | TimeoutError | None:
    """Send ``model`` a request of a few tokens: None when it answered, else why not."""
    try:
        async with asyncio.timeout(seconds):
            await provider.complete(probe_request(model))
    except (LLMError, TimeoutError) as exc:
        return exc
    return None
