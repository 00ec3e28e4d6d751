"""The OpenAI-compatible HTTP API of a Strata deployment: ``create_app(backend)``."""

from cluster.api.app import create_app

__all__ = ["create_app"]
