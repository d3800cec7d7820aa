"""An in-process scripted provider for unit tests of the core (the SDKs are tested over HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from bot.llm.base import Completion, LLMRequest, StreamEnd, StreamEvent, TextDelta, Usage
from bot.llm.errors import LLMError

Script = Completion | LLMError | Callable[[LLMRequest], Completion]


@dataclass
class ScriptedProvider:
    name: str = "scripted"
    delay: float = 0.0
    script: list[Script] = field(default_factory=list)
    requests: list[LLMRequest] = field(default_factory=list)
    default: Callable[[LLMRequest], Completion] | None = None

    def enqueue(self, *items: Script | str) -> None:
        for item in items:
            self.script.append(Completion(text=item, usage=Usage(0, 10)) if isinstance(item, str) else item)

    async def _next(self, request: LLMRequest) -> Completion:
        self.requests.append(request)
        if self.delay:
            await asyncio.sleep(self.delay)
        item: Script
        if self.script:
            item = self.script.pop(0)
        elif self.default is not None:
            item = self.default
        else:
            last = request.messages[-1].content if request.messages else ""
            item = Completion(text=f"echo: {last}", usage=Usage(0, 10))
        if isinstance(item, LLMError):
            raise item
        return item(request) if callable(item) else item

    async def complete(self, request: LLMRequest) -> Completion:
        return await self._next(request)

    async def stream(self, request: LLMRequest) -> AsyncIterator[StreamEvent]:
        completion = await self._next(request)
        words = completion.text.split(" ")
        for i, word in enumerate(words):
            yield TextDelta(word if i == 0 else " " + word)
        yield StreamEnd(completion)

    async def list_models(self) -> list[str]:
        return ["scripted-model"]

    async def aclose(self) -> None:
        return None
