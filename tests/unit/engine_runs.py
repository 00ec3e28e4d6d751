"""Running one request alone on an in-process ``Engine``, as the engine-level cache tests do."""

from replicas.engine.engine import Engine
from replicas.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def run(
    engine: Engine,
    prompt: list[int],
    request_id: str = "r",
    params=GREEDY,
    cache_salt: str | None = None,
    cache_hints=None,
):
    """The last output of ``prompt`` run to its end alone on ``engine``, whose block
    bookkeeping is then checked."""
    engine.add_request(request_id, prompt, params, cache_salt=cache_salt, cache_hints=cache_hints)
    outputs = []
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        outputs = [o for o in engine.step() if o.request_id == request_id] or outputs
    else:
        raise AssertionError("the request did not finish")
    engine.check_integrity()
    return outputs[-1]
