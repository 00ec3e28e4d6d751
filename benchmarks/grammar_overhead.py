"""grammar-overhead: what constrained decoding costs with each candidate grammar library, on CPU.

With the real tokenizer of the default model (SmolLM2-135M-Instruct, read from its packaged GGUF
file) and a token mask as wide as the model's logits, for xgrammar, llguidance, outlines-core and
``strata`` (``replicas.engine.structured_output``: llguidance behind Strata's own calls, whose
per-token cost also covers writing the mask into a float32 logits row, ``apply_mask``'s whole work):

* setup: building the library's view of the tokenizer (once per model);
* compile: compiling each case (three JSON schemas, any JSON object, a regex, a choice list),
  cold (no library cache);
* per token: computing the next-token allowed mask (an int32 bitmask, one bit per logits row)
  and accepting the token, while walking a valid output token by token (the tokenizer's own
  encoding of a valid instance); mean microseconds per token, on the first walk after compiling
  (``cold``: masks the library builds lazily are built here) and on later walks (``warm``);
* checks that the library handles the tokenizer and JSON: every token of every walk is allowed
  by the mask before it and accepted; after a complete JSON value only the EOS tokens (all of
  them) are allowed; inside JSON strings (unbounded, and with ``maxLength``) and at the start of
  a regex, the tokenizer's other special tokens (``<|im_start|>``...), rows past its vocabulary
  (padding, here 64 of them) and, in JSON, tokens with raw control characters are never allowed;
* random walks: through the masks of a few schemas with bounded strings, each step taking the
  allowed token of highest random logit; the outputs must parse and match their schema.

JSON output is single-line with ``", "`` and ``": "`` separators where the library can be told
so (xgrammar, llguidance); outlines-core only offers optional spaces. outlines-core has no JSON
grammar, only regular expressions, so ``json_object`` is its schema regex for any object (nested
three deep at most).

A library that is not installed gets a row saying so. Run with
``python -m benchmarks.grammar_overhead [--out PATH] [--repeats N] [--seeds N]``; the JSON
report goes to ``benchmarks/out/grammar-overhead/results.json`` by default.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "out" / "grammar-overhead" / "results.json"
LIBRARIES = ("xgrammar", "llguidance", "outlines-core", "strata")
PADDING = 64  # logits rows past the tokenizer's vocabulary in the padding check
ITEM_SEP, KEY_SEP = ", ", ": "

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age"],
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered"]},
    },
    "required": ["id", "customer", "items", "status"],
}
EVENT = {
    "type": "object",
    "properties": {
        "kind": {"const": "event"},
        "when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "where": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "attendees": {"type": "integer"},
        "notes": {"type": "string"},
    },
    "required": ["kind", "when", "where"],
}
ADDRESS = "[A-Z][a-z]+, [0-9]{1,5} [A-Z][a-z]+ (Street|Avenue|Road)"
CHOICES = ("positive", "negative", "neutral", "mixed feelings")


def _closed(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """An object schema without additional properties (unbounded extra keys would keep a random
    walk going; xgrammar leaves them out anyway)."""
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


SHORT = {"type": "string", "maxLength": 8}
# Schemas of the random walks: every string bounded, so that walks end.
WALK_SCHEMAS = {
    "name_age": _closed({"name": SHORT, "age": {"type": "integer"}}, ["name", "age"]),
    "tags": _closed(
        {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}, ["tags"]
    ),
    "word_code": _closed(
        {
            "word": {"type": "string", "minLength": 2, "maxLength": 6},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        },
        ["word", "code"],
    ),
    "user_note": _closed(
        {
            "user": _closed(
                {"id": {"type": "integer"}, "name": SHORT, "vip": {"type": "boolean"}},
                ["id", "name", "vip"],
            ),
            "note": {"anyOf": [SHORT, {"type": "null"}]},
        },
        ["user", "note"],
    ),
}
WALK_TOKENS = 300


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEP, KEY_SEP))


# name -> (kind, spec, a valid output)
CASES: dict[str, tuple[str, Any, str]] = {
    "json:person": (
        "json",
        PERSON,
        _dumps({"name": "Zoë Durand", "age": 41, "email": "zoe.d@mail.fr", "tags": ["a", "b"]}),
    ),
    "json:order": (
        "json",
        ORDER,
        _dumps(
            {
                "id": 1042,
                "customer": {"name": "ACME Corp", "vip": True},
                "items": [
                    {"sku": "ABC-1234", "qty": 2, "price": 9.99},
                    {"sku": "XYZ-0001", "qty": 1, "price": 120.5},
                ],
                "status": "shipped",
            }
        ),
    ),
    "json:event": (
        "json",
        EVENT,
        _dumps({"kind": "event", "when": "2025-03-14", "where": None, "attendees": 12}),
    ),
    "json_object": (
        "json_object",
        None,
        _dumps({"title": "Notes", "count": 3, "items": [1, 2.5, {"ok": False}], "x": None}),
    ),
    "regex": ("regex", ADDRESS, "Paris, 221 Baker Street"),
    "choice": ("choice", CHOICES, "mixed feelings"),
}


def escape_regex(text: str) -> str:
    """``text`` as a regex matching exactly it; only the classic metacharacters are escaped, a
    subset every library's regex dialect accepts escaped."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


def choice_regex(choices: tuple[str, ...]) -> str:
    return "(" + "|".join(escape_regex(c) for c in choices) + ")"


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of the 256 bytes, inverted."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_bytes(backend: Any) -> tuple[list[bytes | None], set[int]]:
    """The bytes of every token of a byte-level BPE ``tokenizers.Tokenizer`` (``None`` for its
    special tokens), and the ids of the special tokens."""
    decoder = _gpt2_byte_decoder()
    added = backend.get_added_tokens_decoder()
    special = {i for i, t in added.items() if t.special}
    vocab: list[bytes | None] = [None] * backend.get_vocab_size(with_added_tokens=True)
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i in special:
            continue
        if i in added:
            vocab[i] = token.encode("utf-8")
        else:
            vocab[i] = bytes(decoder[c] for c in token)
    return vocab, special


class Adapter:
    """One library behind the same calls: ``setup`` (tokenizer), ``compile`` (a case), ``start``
    (a matcher of a compiled case), ``fill`` (the bitmask of a matcher), ``accept``."""

    name = ""

    def setup(self, tokenizer: Any, width: int) -> None: ...
    def compile(self, kind: str, spec: Any) -> Any: ...
    def start(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...


class XGrammar(Adapter):
    name = "xgrammar"

    def setup(self, tokenizer: Any, width: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab, _ = token_bytes(tokenizer.backend)
        # Special tokens as empty strings: xgrammar treats those as special (never text).
        encoded = [b"" if v is None else v for v in vocab]
        info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=width,
            stop_token_ids=list(tokenizer.eos_token_ids),
        )  # fmt: skip
        threads = min(8, os.cpu_count() or 1)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        return c.compile_regex(spec if kind == "regex" else choice_regex(spec))

    def start(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance(Adapter):
    name = "llguidance"
    OPTIONS = {  # noqa: RUF012
        "whitespace_flexible": False,
        "item_separator": ITEM_SEP,
        "key_separator": KEY_SEP,
        "json_allow_general_unicode_escapes": True,
    }

    def setup(self, tokenizer: Any, width: int) -> None:
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=width, eos_token=list(tokenizer.eos_token_ids)
        )

    def compile(self, kind: str, spec: Any) -> Any:
        m = self.llg.LLMatcher
        if kind in ("json", "json_object"):
            schema = json.dumps(spec if kind == "json" else {"type": "object"})
            grammar = m.grammar_from_json_schema(schema, overrides=self.OPTIONS)
        else:
            grammar = m.grammar_from_regex(spec if kind == "regex" else choice_regex(spec))
        matcher = m(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def start(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


class OutlinesCore(Adapter):
    """outlines-core's vocabulary has one EOS token: the others are added to the mask by hand."""

    name = "outlines-core"

    def setup(self, tokenizer: Any, width: int) -> None:
        import outlines_core

        self.oc = outlines_core
        vocab, _ = token_bytes(tokenizer.backend)
        self.eos = tokenizer.eos_token_ids
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b is not None and i not in self.eos:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(self.eos[0], by_bytes)

    def compile(self, kind: str, spec: Any) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        if kind in ("json", "json_object"):
            regex = build_regex_from_schema(
                json.dumps(spec if kind == "json" else {"type": "object"})
            )
        else:
            regex = spec if kind == "regex" else choice_regex(spec)
        return self.oc.Index(regex, self.vocabulary)

    def start(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)
        first = self.eos[0]
        if (int(bitmask[first // 32]) >> (first % 32)) & 1:
            for e in self.eos[1:]:
                word = (int(bitmask[e // 32]) & 0xFFFFFFFF) | (1 << (e % 32))
                bitmask[e // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(self.eos[0] if token in self.eos else token, return_tokens=False)
        except ValueError:
            return False
        return True


class Strata(Adapter):
    """``replicas.engine.structured_output`` (llguidance): its compiler and matcher; ``fill`` is
    ``apply_mask`` on a float32 logits row, with the matcher's bitmask being the walk's."""

    name = "strata"

    def setup(self, tokenizer: Any, width: int) -> None:
        from replicas.engine.structured_output import GrammarCompiler

        self.compiler = GrammarCompiler(tokenizer, width)
        self.row = torch.randn(width, generator=torch.Generator().manual_seed(0))

    def compile(self, kind: str, spec: Any) -> Any:
        from replicas.engine.structured_output import StructuredOutputs

        if kind == "json":
            spec = StructuredOutputs(json=json.dumps(spec))
        elif kind == "json_object":
            spec = StructuredOutputs(json_object=True)
        else:
            spec = StructuredOutputs(**{kind: spec})
        self.compiler.validate(spec)  # compiles (a cache miss: each case compiles once)
        return spec

    def start(self, compiled: Any) -> Any:
        return self.compiler.matcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        if matcher._bitmask.ctypes.data != bitmask.data_ptr():  # the matcher's mask goes there
            matcher._bitmask, matcher._bias = bitmask.numpy(), None
        matcher.apply_mask(self.row)  # a branch-free minimum: the row's values do not matter

    def accept(self, matcher: Any, token: int) -> bool:
        try:
            matcher.accept(token)
        except ValueError:
            return False
        return True


ADAPTERS: dict[str, Callable[[], Adapter]] = {
    "xgrammar": XGrammar,
    "llguidance": LLGuidance,
    "outlines-core": OutlinesCore,
    "strata": Strata,
}
MODULES = {  # what each row imports, and the distribution whose version it reports
    "xgrammar": ("xgrammar", "xgrammar"),
    "llguidance": ("llguidance", "llguidance"),
    "outlines-core": ("outlines_core", "outlines-core"),
    "strata": ("llguidance", "llguidance"),
}


def allowed(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """The ids whose bit is set in ``bitmask`` (int32 words, bit ``i % 32`` of word ``i // 32``)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:width].nonzero().reshape(-1)


def walk(
    adapter: Adapter, compiled: Any, tokens: list[int], width: int, check: bool
) -> tuple[list[float], list[str], torch.Tensor]:
    """Per-token seconds of mask + accept over ``tokens``, problems found (``check``: whether
    each token was allowed) and the mask after the last token."""
    matcher = adapter.start(compiled)
    bitmask = torch.zeros((width + 31) // 32, dtype=torch.int32)
    times, problems = [], []
    for i, token in enumerate(tokens):
        start = time.perf_counter()
        adapter.fill(matcher, bitmask)
        ok = adapter.accept(matcher, token)
        times.append(time.perf_counter() - start)
        if check and not (int(bitmask[token // 32]) >> (token % 32)) & 1:
            problems.append(f"token {i} ({token}) not in the mask")
        if not ok:
            problems.append(f"token {i} ({token}) rejected")
            break
    adapter.fill(matcher, bitmask)
    return times, problems, bitmask.clone()


def random_walks(adapter: Adapter, tokenizer: Any, width: int, seeds: int) -> dict[str, Any]:
    """Walks through the masks of ``WALK_SCHEMAS``, each step taking the allowed token of highest
    random logit, until only EOS is allowed, EOS is taken or ``WALK_TOKENS``; counts outputs that
    are not JSON matching the schema (``jsonschema`` checks them when it is installed)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    eos = set(tokenizer.eos_token_ids)
    counts: dict[str, Any] = {"walks": 0, "invalid": 0, "unfinished": 0, "examples": []}
    for name, schema in WALK_SCHEMAS.items():
        compiled = adapter.compile("json", schema)
        for seed in range(seeds):
            generator = torch.Generator().manual_seed(seed)
            matcher = adapter.start(compiled)
            bitmask = torch.zeros((width + 31) // 32, dtype=torch.int32)
            tokens: list[int] = []
            finished = False
            while len(tokens) < WALK_TOKENS:
                adapter.fill(matcher, bitmask)
                ids = allowed(bitmask, width)
                if set(ids.tolist()) <= eos:
                    finished = True
                    break
                logits = torch.randn(width, generator=generator)
                token = int(ids[logits[ids].argmax()])
                if token in eos:
                    finished = True
                    break
                if not adapter.accept(matcher, token):
                    break
                tokens.append(token)
            counts["walks"] += 1
            text = tokenizer.decode(tokens)
            if not finished:
                counts["unfinished"] += 1
                continue
            try:
                value = json.loads(text)
                if jsonschema is not None:
                    jsonschema.validate(value, schema)
            except Exception as error:  # json's and jsonschema's errors
                counts["invalid"] += 1
                reason = str(error).splitlines()[0][:80]
                counts["examples"].append(f"{name}/{seed}: {text[:80]!r}: {reason}")
    return counts


def bench_library(
    name: str, tokenizer: Any, width: int, repeats: int, seeds: int
) -> dict[str, Any]:
    module, distribution = MODULES[name]
    try:
        __import__(module)
    except ImportError:
        return {"library": name, "installed": False}
    row: dict[str, Any] = {
        "library": name,
        "installed": True,
        "version": importlib.metadata.version(distribution),
        "cases": {},
        "problems": [],
    }
    adapter = ADAPTERS[name]()
    start = time.perf_counter()
    adapter.setup(tokenizer, width)
    row["setup_ms"] = (time.perf_counter() - start) * 1e3
    eos = set(tokenizer.eos_token_ids)
    _, special = token_bytes(tokenizer.backend)
    forbidden = torch.tensor(sorted(special - eos), dtype=torch.int64)
    for case, (kind, spec, text) in CASES.items():
        tokens = tokenizer.encode(text)
        try:
            start = time.perf_counter()
            compiled = adapter.compile(kind, spec)
            compile_ms = (time.perf_counter() - start) * 1e3
        except Exception as error:  # a library's own error types
            row["cases"][case] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            row["problems"].append(f"{case}: does not compile")
            continue
        cold, problems, last = walk(adapter, compiled, tokens, width, check=True)
        warm: list[float] = []
        for _ in range(repeats):
            warm += walk(adapter, compiled, tokens, width, check=False)[0]
        after = set(allowed(last, width).tolist())
        if not eos <= after:
            problems.append(f"EOS {sorted(eos - after)} not allowed at the end")
        if kind != "regex" and after - eos:
            problems.append(f"{len(after - eos)} tokens besides EOS allowed at the end")
        row["problems"] += [f"{case}: {p}" for p in problems]
        row["cases"][case] = {
            "tokens": len(tokens),
            "compile_ms": compile_ms,
            "cold_us_per_token": statistics.mean(cold) * 1e6,
            "warm_us_per_token": statistics.mean(warm) * 1e6 if warm else None,
            "warm_max_us": max(warm) * 1e6 if warm else None,
        }
    row["problems"] += tokenizer_checks(name, tokenizer, width, forbidden)
    walks = random_walks(adapter, tokenizer, width, seeds)
    row["random_walks"] = walks
    if walks["invalid"] or walks["unfinished"]:
        row["problems"].append(
            f"random walks: {walks['invalid']} invalid, {walks['unfinished']} unfinished "
            f"of {walks['walks']}"
        )
    done = [c for c in row["cases"].values() if "error" not in c]
    row["mean_cold_us_per_token"] = statistics.mean(c["cold_us_per_token"] for c in done)
    row["mean_warm_us_per_token"] = statistics.mean(c["warm_us_per_token"] for c in done)
    row["mean_compile_ms"] = statistics.mean(c["compile_ms"] for c in done)
    return row


def tokenizer_checks(name: str, tokenizer: Any, width: int, forbidden: torch.Tensor) -> list[str]:
    """Special tokens, padding rows and tokens with raw control characters (invalid in JSON) in
    the masks of a JSON string, unbounded (any text may go there) and length-bounded, and of the
    start of a regex, with logits ``PADDING`` rows wider than ``width``."""
    adapter = ADAPTERS[name]()
    padded = width + PADDING
    adapter.setup(tokenizer, padded)
    vocab, _ = token_bytes(tokenizer.backend)
    control = torch.tensor([i for i, b in enumerate(vocab) if b and min(b) < 0x20])
    problems = []
    checks = (
        ("json_object", None, '{"notes": "', "an unbounded JSON string"),
        ("json", WALK_SCHEMAS["name_age"], '{"name": "', "a length-bounded JSON string"),
        ("regex", ".*", "", "a regex"),
    )
    for kind, spec, prefix, where in checks:
        compiled = adapter.compile(kind, spec)
        tokens = tokenizer.encode(prefix) if prefix else []
        _, walk_problems, mask = walk(adapter, compiled, tokens, padded, check=True)
        ids = allowed(mask, padded)
        problems += [f"{where}: {p}" for p in walk_problems]
        if bool((ids >= tokenizer.vocab_size).any()):
            problems.append(f"{where}: padding rows allowed")
        if bool(torch.isin(ids, forbidden).any()):
            problems.append(f"{where}: special tokens allowed as text")
        if kind != "regex" and bool(torch.isin(ids, control).any()):
            problems.append(f"{where}: raw control characters allowed")
    return problems


def load_tokenizer() -> tuple[Any, int]:
    """The default model's tokenizer and the width of its logits, without loading weights."""
    from replicas.model.loader import load_model_info
    from replicas.model.resolve import DEFAULT_MODEL

    args, tokenizer = load_model_info(DEFAULT_MODEL)
    return tokenizer, args.vocab_size


def table(rows: list[dict[str, Any]]) -> str:
    cases = list(CASES)
    head = ["library", "setup ms", "compile ms (mean)", "µs/token cold", "µs/token warm"]
    lines = [" | ".join(head + [f"{c} warm µs (compile ms)" for c in cases] + ["problems"])]
    for r in rows:
        if not r["installed"]:
            lines.append(f"{r['library']} | not installed")
            continue
        cells = [
            f"{r['library']} {r['version']}",
            f"{r['setup_ms']:.0f}",
            f"{r['mean_compile_ms']:.1f}",
            f"{r['mean_cold_us_per_token']:.1f}",
            f"{r['mean_warm_us_per_token']:.1f}",
        ]
        for c in cases:
            got = r["cases"].get(c, {})
            if "error" in got:
                cells.append("error")
            else:
                cells.append(f"{got['warm_us_per_token']:.1f} ({got['compile_ms']:.1f})")
        cells.append("; ".join(r["problems"]) or "none")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grammar_overhead", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    parser.add_argument("--repeats", type=int, default=5, help="warm walks per case")
    parser.add_argument("--seeds", type=int, default=8, help="random walks per walk schema")
    parser.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=LIBRARIES)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer, width = load_tokenizer()
    rows = [
        bench_library(name, tokenizer, width, args.repeats, args.seeds) for name in args.libraries
    ]
    print(table(rows))
    report = {
        "benchmark": "grammar-overhead",
        "command": "python -m benchmarks.grammar_overhead",
        "model": "smollm2-135m",
        "logits_width": width,
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "repeats": args.repeats,
        "walk_seeds": args.seeds,
        "walk_schemas": WALK_SCHEMAS,
        "cases": {name: {"kind": k, "spec": s, "output": t} for name, (k, s, t) in CASES.items()},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
