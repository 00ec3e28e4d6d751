"""The prompt-length rule and its one error text.

A replica checks it where a request enters it (``replicas.engine.request_checks``), which every
request of the HTTP server, the offline ``LLM`` and a Ray deployment passes. The HTTP API also
reads it before it sizes ``max_tokens`` from the room a prompt leaves (``cluster.api.serving``)."""


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """Raise ``ValueError`` unless a prompt of ``num_tokens`` leaves room for one output token."""
    if num_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_tokens} tokens but max_model_len is {max_model_len}: "
            "it must be shorter, leaving room for one output token"
        )
