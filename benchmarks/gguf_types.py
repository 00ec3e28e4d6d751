"""What each GGUF type llama.cpp writes costs Strata in accuracy, on real weights: the shipped
SmolLM2-135M requantized by llama.cpp's own quantizer to each type, then Strata's perplexity on
the shipped text (``tests/data/perplexity.txt``, 512-token windows) with the weights kept as
floats (``none``: the file's values), at ``int8`` and at ``int4`` (Strata's kernels), and each
ratio to ``none``.

``python -m benchmarks.gguf_types [--types Q2_K IQ4_XS ...] [--output DIR]``

The random-weight files of ``benchmarks.write_gguf`` measure speed and memory at real sizes but
not accuracy (a random model's perplexity is near its vocabulary's size whatever its weights);
this measures what a second rounding of a type's values costs on a trained model. Needs
``llama-cpp-python`` (the ``peers`` extra). llama.cpp requantizes from the shipped ``Q4_1``
file (``allow_requantize``), so a type's own error is on top of ``Q4_1``'s; the ratios to
``none`` are what Strata adds.
"""

import argparse
import collections
import ctypes
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.report import Report
from benchmarks.write_gguf import source_gguf

TYPES = ("Q2_K", "Q3_K_M", "IQ4_NL", "IQ4_XS", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
SCHEMES = ("none", "int8", "int4")
TEXT = Path(__file__).parents[1] / "tests" / "data" / "perplexity.txt"
WINDOW = 512


def requantize(source: Path, kind: str, out: Path, threads: int) -> Path:
    """``source`` requantized by llama.cpp to its file type ``kind`` (``LLAMA_FTYPE_MOSTLY_*``)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads
    params.allow_requantize = True
    paths = str(source).encode(), str(out).encode()
    if llama_cpp.llama_model_quantize(*paths, ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")
    return out


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type ``path`` holds."""
    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)
    return dict(sorted(counts.items()))


def perplexities(path: Path) -> dict[str, float]:
    """Strata's perplexity on ``TEXT`` for each of ``SCHEMES`` (float32; int4 with Strata's
    kernel, natively)."""
    from replicas.model import load_model
    from replicas.model.perplexity import perplexity

    text = TEXT.read_text()
    results = {}
    for scheme in SCHEMES:
        options = {"dtype": "float32", "quantization": scheme, "decoder_stack": "eager"}
        if scheme == "int4":
            options |= {"decoder_stack": "native", "int4_kernel": "strata"}
        loaded = load_model(str(path), torch.device("cpu"), **options)
        results[scheme] = perplexity(loaded.model, loaded.tokenizer.encode(text), WINDOW)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/out/gguf-types"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.types:
            path = requantize(source_gguf(), kind, Path(folder) / f"{kind}.gguf", args.threads)
            ppl = perplexities(path)
            results[kind] = {"tensor_types": tensor_types(path), "perplexity": ppl}
            ratios = [f"{ppl[s] / ppl['none']:.4f}" for s in SCHEMES[1:]]
            rows.append([kind, str(tensor_types(path)), ppl["none"], *ratios])
            path.unlink()
    report = Report(
        "gguf-types",
        "GGUF types on real weights: Strata's perplexity against the file's values",
        "python -m benchmarks.gguf_types " + " ".join(argv or sys.argv[1:]),
        False,
        __doc__.split("\n\n")[0],
        results={"types": results},
    )
    report.add_table(
        "Perplexity on the shipped text (float32; ratios to the file's float values)",
        ["type", "tensors", "none", "int8 / none", "int4 / none"],
        rows,
    )
    report.write(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
