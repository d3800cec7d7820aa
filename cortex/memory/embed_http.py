"""The OpenAI-compatible embedder's HTTP client: the SDK's own (with its defaults) whose answers are capped, so that
a broken or hostile server at the configured URL cannot fill the process's memory with one answer. Answers are asked
for uncompressed and a compressed one is refused unread (see :mod:`bot.httpcap`). The client closes itself when it is
dropped, as the one the SDK makes for itself does (a client handed to the SDK is not closed by it)."""

from __future__ import annotations

import httpx2
import openai

from bot.httpcap import PLAIN, CappedSyncBody, refuse_unread
from cortex.memory.embedders import EmbedderError

MAX_EMBEDDINGS_BYTES = 64 << 20
"""An embeddings answer's cap: 128 embeddings of 4,096 numbers, as JSON, take about 12 MB."""


class _SelfClosingClient(openai.DefaultHttpxClient):
    def __del__(self) -> None:
        if not self.is_closed:
            try:
                self.close()
            except Exception:  # (at interpreter exit its parts may be gone already)
                pass


def capped_client(where: str) -> httpx2.Client:
    """The client for the embeddings of the server ``where`` names (in errors)."""

    def too_large() -> EmbedderError:
        return EmbedderError(f"{where} answered with more than {MAX_EMBEDDINGS_BYTES:,} bytes of embeddings; the rest "
                             "was not read")

    def cap(response: httpx2.Response) -> None:
        refuse_unread(response, MAX_EMBEDDINGS_BYTES, too_large, lambda encoding: EmbedderError(
            f"{where} compressed its embeddings ({encoding}) although none was asked for; unpacked, their size could "
            "pass any cap, so they were not read"))
        if isinstance(response.stream, httpx2.SyncByteStream):
            response.stream = CappedSyncBody(response.stream, MAX_EMBEDDINGS_BYTES, too_large)

    return _SelfClosingClient(event_hooks={"response": [cap]}, headers=PLAIN)
