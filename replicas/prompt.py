"""Rules on a prompt that hold wherever it enters: the engine, the deployment and the HTTP API."""


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """Raise ``ValueError`` unless a prompt of ``num_tokens`` leaves room for one output token."""
    if num_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_tokens} tokens but max_model_len is {max_model_len}: "
            "it must be shorter, leaving room for one output token"
        )
