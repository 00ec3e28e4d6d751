"""Structured outputs: constrained decoding as a token mask applied to the logits at sampling.

A request's ``StructuredOutputs`` (a JSON schema, any JSON object, a regex, one of a list of
strings or a Lark grammar, which may embed JSON schemas written by ``lark_json``) is compiled
once per tokenizer by ``GrammarCompiler`` (cached); each sequence then gets a ``GrammarMatcher``,
whose ``apply_mask`` sets the logits of the tokens that cannot continue a valid output to -inf
before sampling and whose ``accept`` advances it by the sampled token.

The grammar library is llguidance, chosen by measurement (``python -m benchmarks.grammar_overhead
--repeats 10``; the figures, this module's cost per token among them, are in benchmarks/README.md,
"Grammar libraries"). xgrammar needs triton, transformers and apache-tvm-ffi at run time, which a
CPU serving install must not carry, and it emitted invalid JSON (raw control characters in
length-bounded strings) unless its grammar text was patched; outlines-core takes seconds to
compile. llguidance (no dependencies of its own) compiles fastest and produced no invalid
output.

Invariants:

* masks are as wide as the model's logits (``vocab_size``); logits rows past the tokenizer's
  vocabulary (padding) and the tokenizer's special tokens other than EOS are never allowed;
* EOS is allowed exactly when the output so far is complete; once nothing else can follow, only
  the EOS tokens are allowed (also after an EOS was accepted);
* JSON is generated on one line with ``", "`` and ``": "`` separators (``json.dumps``' layout)
  and no other whitespace, so a model cannot loop on whitespace; the properties of an object
  come in the listed order, and an object schema with ``properties`` that says nothing of other
  properties (``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``) takes
  no others; unsupported schema keywords (``uniqueItems``...) are refused, never ignored;
* regexes (and a schema's ``pattern``) are matched whole, in Rust's ``regex`` dialect (no
  lookaround, backreferences or word boundaries);
* the library is imported when a ``GrammarCompiler`` is created, never at module import.
"""

import copy
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replicas.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

PACKAGE = "llguidance"  # pip name; pyproject pins the version
CACHE_SIZE = 256  # compiled grammars kept per GrammarCompiler (least recently used dropped)
_FIELDS = ("json", "json_object", "regex", "choice", "grammar")
# One line, json.dumps' separators; strings take every JSON escape ("\u00e9" too, not only "\n").
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", "}
_JSON_OPTIONS |= {"key_separator": ": ", "json_allow_general_unicode_escapes": True}
_PROBLEMS = {"json": "is not a valid JSON schema", "regex": "is not a valid regular expression"}
_PROBLEMS["grammar"] = "is not a valid Lark grammar"
_REGEX_META = set("\\.^$|?*+()[]{}")
_ERROR_PREFIX = re.compile(r"^(at \d+\(\d+\): |error: )")  # llguidance's "at 1(8): "
# Keywords whose value is a schema (or a list of schemas), and those mapping names to schemas.
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "unevaluatedItems", "contains")
_SUBSCHEMAS += ("anyOf", "oneOf", "allOf", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMAS += ("additionalProperties", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Byte k of a bitmask holds tokens 8k to 8k + 7 (bit i set: token 8k + i allowed); _BIAS[value]
# is a byte's 8 tokens as +inf (allowed) or -inf: a logit's minimum with it is the masked logit,
# computed with no branch per token.
_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
_BIAS = np.where(_BITS == 1, np.float32(np.inf), np.float32(-np.inf))


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What the output must match; exactly one field is set.

    ``json`` is a JSON schema as a JSON text (an object); ``json_object`` asks for any JSON
    object; ``regex`` must match the whole output; ``choice`` lists the strings the output may be
    (exactly); ``grammar`` is a grammar in llguidance's Lark dialect that the whole output must
    match (tool calls use it). Hashable, so it keys the compiled-grammar cache.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [f for f in _FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            got = ", ".join(given) or "none"
            raise ValueError(
                f"structured_outputs: exactly one of {', '.join(_FIELDS)} must be set (got {got})"
            )
        if self.json is not None:
            if not isinstance(self.json, str):
                raise ValueError("structured_outputs.json must be a JSON schema as a JSON text")
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a Lark grammar as a string")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must hold non-empty strings only")

    @property
    def kind(self) -> str:
        """``"json"``, ``"json_object"``, ``"regex"``, ``"choice"`` or ``"grammar"``: the field
        that is set."""
        return next(f for f in _FIELDS if getattr(self, f) not in (None, False))


def _choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of ``choices`` (only regex metacharacters escaped)."""
    escaped = ("".join("\\" + c if c in _REGEX_META else c for c in s) for s in choices)
    return "(" + "|".join(escaped) + ")"


def _closed(schema: Any, close: bool = True) -> Any:
    """A copy of ``schema`` where object schemas with ``properties`` and none of ``_OPEN`` get
    ``"additionalProperties": false`` (unless ``close`` is false: members of ``allOf``, which
    would exclude each other's properties). Only keywords holding schemas are walked, so values
    (``const``, ``enum``, ``default``) are left as they are."""
    if isinstance(schema, list):
        return [_closed(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = _closed(out[key], key != "allOf")
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


def lark_json(schema: dict[str, Any]) -> str:
    """``schema`` as a ``%json {...}`` item of a Lark grammar, generated with the same layout
    and object closing as a ``json`` constraint (see the invariants above)."""
    return "%json " + json.dumps({**_closed(schema), "x-guidance": _JSON_OPTIONS})


class _ByteVocabulary:
    """``ByteTokenizer``'s vocabulary as llguidance's ``TokenizerWrapper`` reads it: ids 0-255
    are their byte, the ids above are special tokens."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        size = tokenizer.vocab_size
        specials = [f"<[{i}]>".encode() for i in range(256, size)]
        self.tokens = [bytes([i]) for i in range(256)] + specials
        self.special_token_ids = list(range(256, size))
        self.bos_token_id = ByteTokenizer.BOS
        self.eos_token_id = tokenizer.eos_token_ids[0]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` for one tokenizer; compiled grammars are cached (an LRU of
    ``CACHE_SIZE``). ``vocab_size`` is the width of the model's logits (at least the tokenizer's
    vocabulary; the rows beyond are padding, never allowed). ``validate`` and ``matcher`` may be
    called from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
            )
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self._eos_set = frozenset(self.eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("structured outputs need a tokenizer with an EOS token")
        try:
            import llguidance as llg
        except ImportError as error:
            message = f"structured outputs need {PACKAGE}: pip install {PACKAGE}"
            raise ImportError(message) from error
        self._llg = llg
        self.vocab_size = vocab_size
        self._text_vocab_size = tokenizer.vocab_size  # ids from here on are padding
        self._tokenizer = self._ll_tokenizer(tokenizer)
        self._limits = llg.LLParserLimits(verbose_errors=False)  # errors without grammar dumps
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _ll_tokenizer(self, tokenizer: Tokenizer) -> Any:
        """llguidance's view of the vocabulary, ``vocab_size`` wide (it never allows the rows
        past the tokenizer's, nor special tokens as text; it allows the EOS ids when complete)."""
        llg, eos = self._llg, list(self.eos_token_ids)
        if isinstance(tokenizer, ByteTokenizer):
            source: Any = llg.TokenizerWrapper(_ByteVocabulary(tokenizer))
        elif isinstance(tokenizer, HFTokenizer):
            backend = copy.copy(tokenizer.backend)  # ours keeps its padding and truncation
            backend.no_padding()
            backend.no_truncation()
            source = backend.to_str()
        else:
            name = type(tokenizer).__name__
            raise ValueError(f"structured outputs need a ByteTokenizer or HFTokenizer, not {name}")
        try:
            return llg.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=eos)
        except (ValueError, RuntimeError, TypeError) as error:
            name = type(tokenizer).__name__
            raise ValueError(f"structured outputs cannot use this {name}: {error}") from None

    def _compiled(self, spec: StructuredOutputs) -> Any:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)  # outside the lock: compiles may take milliseconds
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> Any:
        """A matcher at the start of ``spec`` (never advanced: ``matcher`` copies it)."""
        lm, kind = self._llg.LLMatcher, spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = _closed(json.loads(spec.json)) if kind == "json" else {"type": "object"}
                grammar = lm.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
            elif kind == "grammar":
                grammar = lm.grammar_from_lark(spec.grammar)
            else:
                regex = spec.regex if spec.regex is not None else _choice_regex(spec.choice or ())
                grammar = lm.grammar_from_regex(regex)
            matcher = lm(self._tokenizer, grammar, log_level=0, limits=self._limits)
            error = matcher.get_error() if matcher.is_error() else ""
        except (ValueError, TypeError) as raised:
            error = str(raised) or type(raised).__name__
        if error:
            lines = error.strip().splitlines() or [""]
            reason = next((x for x in lines if x.startswith("error: ")), lines[0])
            what = _PROBLEMS.get(kind, "could not be compiled")
            raise ValueError(f"structured_outputs.{kind} {what}: {_ERROR_PREFIX.sub('', reason)}")
        return matcher

    def validate(self, spec: StructuredOutputs) -> None:
        """Compiles ``spec`` (and caches it); raises ``ValueError`` naming the field."""
        self._compiled(spec)

    def matcher(self, spec: StructuredOutputs) -> "GrammarMatcher":
        """A matcher at the start of an output of ``spec``."""
        return GrammarMatcher(self, self._compiled(spec).deep_copy())


class GrammarMatcher:
    """One sequence's state in a compiled grammar (not thread-safe: one sequence, one thread).
    The mask of a state is computed at most once, by the first ``bias`` (or ``apply_mask``)
    there."""

    def __init__(self, compiler: GrammarCompiler, matcher: Any) -> None:
        self._compiler = compiler
        self._matcher = matcher
        self._bitmask = np.zeros((compiler.vocab_size + 31) // 32, dtype=np.int32)
        self._bias: np.ndarray | None = None  # the current state's mask, +inf/-inf per token
        self._ended = False  # whether an EOS token was accepted

    def bias(self) -> np.ndarray:
        """The current state's mask as float32 [vocab_size]: +inf where a token may follow,
        -inf where it may not (the minimum with a logit is the masked logit). Read-only."""
        if self._bias is None:
            bitmask = self._bitmask  # after EOS, llguidance's mask allows the EOS ids only
            self._matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            bias = np.take(_BIAS, bitmask.view(np.uint8), axis=0)
            self._bias = bias.reshape(-1)[: self._compiler.vocab_size]
        return self._bias

    def apply_mask(self, logits: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to -inf, in place (allowed ones are unchanged).
        ``logits`` is one 1-D row of ``vocab_size`` floats, on any device and with any strides:
        float32 CPU rows are masked through numpy (a branch-free minimum with +inf/-inf), others
        by torch ops on their device. NaN logits stay NaN."""
        width = self._compiler.vocab_size
        if logits.dim() != 1 or logits.shape[0] != width:
            raise ValueError(f"logits must be one row of {width}, got shape {tuple(logits.shape)}")
        bias = self.bias()
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            row = logits.detach().numpy()
            np.minimum(row, bias, out=row)
        else:
            other = torch.from_numpy(bias).to(device=logits.device, dtype=logits.dtype)
            torch.minimum(logits, other, out=logits)

    def accept(self, token_id: int) -> None:
        """Advances by ``token_id``; raises ``ValueError`` (state unchanged) if it is not
        allowed here."""
        compiler, token_id = self._compiler, int(token_id)
        if self._ended:
            raise ValueError(f"token {token_id} follows a complete structured output")
        in_text = 0 <= token_id < compiler._text_vocab_size  # (llguidance errors past n_vocab)
        if self._bias is not None:  # this state's mask is known: its bit says
            allowed = in_text and bool(self._bitmask[token_id >> 5] >> (token_id & 31) & 1)
        elif token_id in compiler._eos_set:  # validate_tokens refuses EOS once stopped
            allowed = self._matcher.is_accepting()
        else:
            allowed = in_text and self._matcher.validate_tokens([token_id]) == 1
        if not allowed:
            raise ValueError(f"token {token_id} does not continue the structured output")
        if not self._matcher.consume_token(token_id):  # validated: only on a library fault
            raise ValueError(f"token {token_id} was refused: {self._matcher.get_error()}")
        self._bias = None
        self._ended = token_id in compiler._eos_set

    @property
    def is_terminated(self) -> bool:
        """Whether the output is complete: an EOS token was accepted, or the output matches and
        nothing but EOS can follow."""
        return self._ended or self._matcher.is_stopped()
