"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the
OpenAI-compatible server's chat pipeline; the routes are registered by ``openai.api_server``."""
from halserve.entrypoints.anthropic.errors import anthropic_error_response, anthropic_route
from halserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from halserve.entrypoints.anthropic.serving_messages import AnthropicServingMessages

__all__ = [
    "AnthropicServingMessages",
    "CountTokensRequest",
    "MessagesRequest",
    "anthropic_error_response",
    "anthropic_route",
]
