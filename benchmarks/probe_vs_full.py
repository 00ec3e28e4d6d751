"""Does ``auto``'s probe rank the candidates as the whole model does? Times every candidate of a
checkpoint both ways on this machine and prints the two rankings and choices.

``python -m benchmarks.probe_vs_full [MODEL] [--threads 2] [--passes 2]``

``auto`` times its candidates on a probe of a few decoder layers (``replicas.model.streamed``)
instead of the whole model. Here each candidate is timed with ``autotune.time_model`` on the
whole model and on the probe, in passes that alternate the order of the candidates (each figure
the fastest of its passes, as ``auto``'s finalists are), and each set of timings is ranked by
the representative request's price and put through ``autotune.choose``.
"""

import argparse
import json
import sys

import torch

from replicas.dtypes import torch_dtype
from replicas.model import autotune
from replicas.model.autotune import Candidate, Timing
from replicas.model.loader import _model_info, _Request
from replicas.model.registry import build_model
from replicas.model.resolve import resolve_model
from replicas.model.streamed import build_streamed, probe_layers


def timings(model: str, passes: int) -> dict[str, dict[Candidate, Timing]]:
    """Every candidate's timing on the whole model (``full``) and on the probe (``probe``)."""
    from replicas.model.gguf import GGUFWeights, open_gguf

    path = resolve_model(model)
    args, _ = _model_info(path, model)
    weights = GGUFWeights(open_gguf(path), args, path)
    device = torch.device("cpu")
    with torch.device("meta"):
        shape = build_model(args)
    options = _Request("auto", "auto", "auto", "auto", "auto").options(shape, device, True)
    probe = probe_layers(args, weights.stored_bits)
    builds = list(dict.fromkeys((c.dtype, c.quantization, c.kernel) for c in options))
    found: dict[str, dict[Candidate, Timing]] = {"full": {}, "probe": {}, "priced": {}}
    for n in range(passes):
        for key in builds if n % 2 == 0 else builds[::-1]:
            for kind, layers in (("full", None), ("probe", probe)):
                net = build_streamed(
                    args, weights, Candidate(*key[:2], kernel=key[2]), device, layers
                )
                dtype = torch_dtype(key[0])
                if layers:  # as auto times a probe: without the head, timed on its own
                    body, head = autotune.rest_and_head(net, dtype)
                for candidate in (c for c in options if (c.dtype, c.quantization, c.kernel) == key):
                    net.use_native_stack(candidate.stack == "native")
                    t = Timing(candidate, *autotune.time_model(net, dtype, logits=not layers))
                    _keep(found[kind], t)
                    if layers:
                        priced = autotune.at_depth(t[1:], body, len(probe), args.num_layers, head)
                        _keep(found["priced"], Timing(candidate, *priced))
                del net
    return found


def _keep(found: dict[Candidate, Timing], t: Timing) -> None:
    """``t`` where nothing is kept for its candidate, else the faster of the two per phase."""
    old = found.get(t.candidate, t)
    found[t.candidate] = Timing(
        t.candidate,
        min(old.prefill_s_per_token, t.prefill_s_per_token),
        min(old.decode_s, t.decode_s),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    found = timings(args.model, args.passes)
    for kind, by_candidate in found.items():
        ranked = sorted(by_candidate.values(), key=lambda t: t.request_s)
        row = {
            "timed_on": kind,
            "chose": str(autotune.choose(ranked)),
            "ranking": [
                f"{t.candidate} {1e3 * t.prefill_s_per_token:.3f} ms/token "
                f"{1e3 * t.decode_s:.2f} ms/step"
                for t in ranked
            ],
        }
        print(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
