"""OpenAI's Responses API (``/v1/responses``), served through chat completions."""

from cluster.api.responses.protocol import ResponsesRequest
from cluster.api.responses.service import ResponsesAPI
from cluster.api.responses.store import ResponseStore, ResponseStoreConfig

__all__ = ["ResponseStore", "ResponseStoreConfig", "ResponsesAPI", "ResponsesRequest"]
