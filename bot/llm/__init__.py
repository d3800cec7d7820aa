"""Language-model providers behind one neutral port.

``import bot.llm`` is cheap: the SDK-backed providers are imported only by :func:`create_provider`.
"""

from __future__ import annotations

from bot.llm.base import (
    ChatMessage,
    Completion,
    LLMProvider,
    LLMRequest,
    Role,
    StopReason,
    StreamEnd,
    StreamEvent,
    TextDelta,
    ToolCall,
    ToolSpec,
    Usage,
)
from bot.llm.errors import (
    LLMAuthError,
    LLMBadRequest,
    LLMBadResponse,
    LLMBrokenOff,
    LLMConnectionError,
    LLMDamagedResponse,
    LLMError,
    LLMOutOfCredit,
    LLMOverloaded,
    LLMPermanentError,
    LLMRateLimited,
    LLMServerError,
    LLMTimeout,
    LLMTransientError,
)

PROVIDERS = ("anthropic", "openai")

__all__ = [
    "PROVIDERS",
    "ChatMessage",
    "Completion",
    "LLMAuthError",
    "LLMBadRequest",
    "LLMBadResponse",
    "LLMDamagedResponse",
    "LLMBrokenOff",
    "LLMConnectionError",
    "LLMError",
    "LLMOutOfCredit",
    "LLMOverloaded",
    "LLMPermanentError",
    "LLMProvider",
    "LLMRateLimited",
    "LLMRequest",
    "LLMServerError",
    "LLMTimeout",
    "LLMTransientError",
    "Role",
    "StopReason",
    "StreamEnd",
    "StreamEvent",
    "TextDelta",
    "ToolCall",
    "ToolSpec",
    "Usage",
    "create_provider",
]


def create_provider(
    provider: str,
    *,
    api_key: str | None,
    base_url: str | None,
    timeout_seconds: float,
    connect_timeout_seconds: float,
    max_retries: int,
) -> LLMProvider:
    """Build the provider named ``provider`` (``"anthropic"`` or ``"openai"``).

    ``base_url=None`` means the SDK default. For ``"openai"`` it may point at any compatible server
    (DeepSeek, Ollama, vLLM, llama.cpp); ``api_key=None`` is then fine for servers that need none.
    Raises ``ValueError`` for an unknown provider and :class:`LLMAuthError` when ``api_key`` is None
    and the Anthropic SDK finds no credentials (a broken ``ANTHROPIC_CONFIG_DIR`` profile, say).
    """
    if provider == "anthropic":
        from bot.llm.anthropic import AnthropicProvider

        return AnthropicProvider(
            api_key=api_key,
            base_url=base_url,
            timeout_seconds=timeout_seconds,
            connect_timeout_seconds=connect_timeout_seconds,
            max_retries=max_retries,
        )
    if provider == "openai":
        from bot.llm.openai import OpenAICompatProvider

        return OpenAICompatProvider(
            api_key=api_key,
            base_url=base_url,
            timeout_seconds=timeout_seconds,
            connect_timeout_seconds=connect_timeout_seconds,
            max_retries=max_retries,
        )
    raise ValueError(f"unknown LLM provider {provider!r}; expected one of {', '.join(PROVIDERS)}")
