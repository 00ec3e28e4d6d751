"""Structured outputs with the real SmolLM2 tokenizer: random walks through the token masks of
JSON schemas, any JSON object, regexes and choices give outputs that parse and match; specs and
grammars that are wrong are refused naming the field; masks cover padding and special tokens."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from replicas.engine.structured_output import GrammarCompiler, StructuredOutputs
from replicas.model import ByteTokenizer, Tokenizer, load_model_info
from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path
from tests.gpu.devices import CUDA

pytest.importorskip(
    "llguidance", reason="structured outputs need llguidance: pip install llguidance"
)

try:
    packaged_model_path(DEFAULT_MODEL)
except ValueError as missing:
    pytest.skip(str(missing), allow_module_level=True)

PADDING = 64  # logits rows past the tokenizer's vocabulary
MAX_TOKENS = 300


def short(**extra) -> dict:
    """A string short enough that a random walk closes it."""
    return {"type": "string", "maxLength": 8, **extra}


SCHEMAS = {
    "strings_integers": {
        "type": "object",
        "properties": {"name": short(), "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "numbers": {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
    },
    "booleans": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "done": {"type": "boolean"}},
        "required": ["ok", "done"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"enum": ["S", "M", 3, None, True]},
        },
        "required": ["color", "size"],
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": short()},
                "required": ["id", "name"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": short(), "minItems": 2, "maxItems": 3}},
        "required": ["tags"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": short(), "c": {"type": "boolean"}},
        "required": ["a"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "day": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        },
        "required": ["code", "day"],
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "point"}},
        "required": ["version", "kind"],
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, short(), {"type": "null"}]}},
        "required": ["value"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                },
            }
        },
        "required": ["points"],
    },
    "integer_ranges": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
            "m": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
        },
        "required": ["n", "m"],
    },
    "number_range": {
        "type": "object",
        "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["p"],
    },
    "nested_arrays": {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "minItems": 2,
                    "maxItems": 2,
                },
            }
        },
        "required": ["matrix"],
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "one_of": {
        "type": "object",
        "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}},
        "required": ["v"],
    },
    "string_lengths": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["word"],
    },
    "deep_nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "boolean"}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "nullable_types": {
        "type": "object",
        "properties": {"v": {"type": ["integer", "null"]}, "w": {"type": "null"}},
        "required": ["v", "w"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "status": {"enum": ["pending", "shipped"]},
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        "gift": {"type": "boolean"},
                    },
                    "required": ["sku", "qty"],
                },
            },
            "note": {"anyOf": [short(), {"type": "null"}]},
        },
        "required": ["id", "status", "items"],
    },
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch ops on 49k-wide rows are many times slower with two threads on a busy 2-core
    machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_info(DEFAULT_MODEL)[1]


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    """Logits ``PADDING`` rows wider than the vocabulary, as padded models have."""
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + PADDING)


def random_walk(
    compiler: GrammarCompiler,
    spec: StructuredOutputs,
    seed: int,
    bias: torch.Tensor | None = None,
) -> list[int]:
    """Tokens of a walk taking the allowed token of highest random logit (plus ``bias``) until
    the output is complete, EOS is picked or ``MAX_TOKENS``; EOS picked is the last token."""
    matcher = compiler.matcher(spec)
    generator = torch.Generator().manual_seed(seed)
    eos = list(compiler.eos_token_ids)
    tokens: list[int] = []
    while len(tokens) < MAX_TOKENS and not matcher.is_terminated:
        logits = torch.randn(compiler.vocab_size, generator=generator)
        if bias is not None:
            logits += bias
        matcher.apply_mask(logits)
        allowed = logits > float("-inf")
        assert allowed.any(), "the mask allows nothing"
        if allowed.sum() == allowed[eos].sum():  # complete: is_terminated should have said so
            pytest.fail("only EOS is allowed but the matcher is not terminated")
        token = int(logits.argmax())
        matcher.accept(token)
        tokens.append(token)
        if token in eos:
            break
    assert matcher.is_terminated or tokens[-1] in eos, f"incomplete after {len(tokens)} tokens"
    return tokens


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_walks_give_valid_json(name, compiler, tokenizer):
    schema = SCHEMAS[name]
    spec = StructuredOutputs(json=json.dumps(schema))
    for seed in range(3):
        text = tokenizer.decode(random_walk(compiler, spec, seed=seed))
        value = json.loads(text)
        jsonschema.validate(value, schema)


def closing_bias(tokenizer, width: int) -> torch.Tensor:
    """+4 for the tokens whose text has a quote or a closing bracket, so that random walks
    through unbounded strings and objects end."""
    bias = torch.zeros(width)
    for i in range(tokenizer.vocab_size):
        if any(c in tokenizer.decode([i]) for c in '"}]'):
            bias[i] = 4.0
    return bias


def test_json_object_gives_an_object(compiler, tokenizer):
    bias = closing_bias(tokenizer, compiler.vocab_size)
    for seed in range(4):
        tokens = random_walk(compiler, StructuredOutputs(json_object=True), seed, bias)
        assert isinstance(json.loads(tokenizer.decode(tokens)), dict)


@pytest.mark.parametrize(
    "regex",
    [
        r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)",
        r"(\+1 )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
        r"(ab|cd)+x?",
        r"[0-9]+(\.[0-9]{1,2})?",
    ],
)
def test_regex_output_fullmatches(regex, compiler, tokenizer):
    for seed in range(4):
        text = tokenizer.decode(random_walk(compiler, StructuredOutputs(regex=regex), seed))
        assert re.fullmatch(regex, text), text


CHOICES = ("positive", "negative", "neutral", "a.b|c", 'say "hi"', "ünï (x)", "two\nlines")


def test_choice_output_is_one_of_the_choices(compiler, tokenizer):
    spec = StructuredOutputs(choice=list(CHOICES))
    assert spec.choice == CHOICES and spec.kind == "choice"
    seen = {tokenizer.decode(random_walk(compiler, spec, seed)) for seed in range(12)}
    assert seen <= set(CHOICES) and len(seen) > 1
    for choice in CHOICES:  # the tokenizer's own spelling of each choice is accepted whole
        matcher = compiler.matcher(spec)
        for token in tokenizer.encode(choice):
            matcher.accept(token)
        assert matcher.is_terminated


def test_kind():
    assert StructuredOutputs(json="{}").kind == "json"
    assert StructuredOutputs(json_object=True).kind == "json_object"
    assert StructuredOutputs(regex="a+").kind == "regex"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({}, "none"),
        ({"json": "{}", "regex": "a"}, "json, regex"),
        ({"json_object": True, "choice": ["a"]}, "json_object, choice"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1, 2]"}, "structured_outputs.json"),
        ({"json": {"type": "object"}}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"regex": 5}, "structured_outputs.regex"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        StructuredOutputs(**fields)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(json='{"type": "foo"}'), "structured_outputs.json is not a valid JSON"),
        (
            StructuredOutputs(json='{"properties": {"a": {"$ref": "#/nope"}}}'),
            "structured_outputs.json is not a valid JSON schema",
        ),
        (
            StructuredOutputs(json='{"type": "object", "required": 5}'),
            "structured_outputs.json is not a valid JSON schema: Expected array for 'required'",
        ),
        (  # unsupported keywords are refused, not ignored
            StructuredOutputs(json='{"type": "array", "uniqueItems": true}'),
            "structured_outputs.json is not a valid JSON schema: Unimplemented keys",
        ),
        (
            StructuredOutputs(json='{"type": "string", "pattern": "a(?=b)"}'),
            "structured_outputs.json is not a valid JSON schema: look-around",
        ),
        (StructuredOutputs(regex="(ab"), "is not a valid regular expression: unclosed group"),
        (StructuredOutputs(regex="[a-"), "structured_outputs.regex is not a valid regular"),
    ],
)
def test_bad_grammars_are_refused_naming_the_field(spec, message, compiler):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.validate(spec)
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.matcher(spec)


def test_mask_width_padding_special_tokens_and_eos(compiler, tokenizer):
    spec = StructuredOutputs(json=json.dumps(SCHEMAS["strings_integers"]))
    matcher = compiler.matcher(spec)
    eos = set(tokenizer.eos_token_ids)
    specials = {tokenizer.backend.token_to_id(t) for t in ("<|im_start|>", "<repo_name>")}
    with pytest.raises(ValueError, match="one row of"):
        matcher.apply_mask(torch.zeros(tokenizer.vocab_size))
    for token in tokenizer.encode('{"name": "Zoë'):  # inside a string: any text may follow
        matcher.accept(token)
    logits = torch.randn(compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    matcher.apply_mask(logits)
    assert logits.shape == (tokenizer.vocab_size + PADDING,)
    assert torch.isinf(logits[tokenizer.vocab_size :]).all()  # padding rows
    assert all(logits[i] == float("-inf") for i in specials | eos)
    kept = torch.isfinite(logits)
    assert kept.sum() > 1000 and torch.equal(logits[kept], before[kept])
    with pytest.raises(ValueError):
        matcher.accept(next(iter(specials)))
    with pytest.raises(ValueError):
        matcher.accept(tokenizer.vocab_size)  # a padding row
    with pytest.raises(ValueError):
        matcher.accept(tokenizer.encode("\n")[0])  # a raw control character in a string
    for token in tokenizer.encode('", "age": 7}'):
        matcher.accept(token)
    assert matcher.is_terminated  # nothing but EOS can follow
    logits = torch.zeros(compiler.vocab_size)
    matcher.apply_mask(logits)
    assert set(torch.isfinite(logits).nonzero().view(-1).tolist()) == eos
    matcher.accept(tokenizer.eos_token_ids[-1])
    assert matcher.is_terminated
    with pytest.raises(ValueError):
        matcher.accept(tokenizer.eos_token_ids[0])
    logits = torch.zeros(compiler.vocab_size)
    matcher.apply_mask(logits)  # after EOS: still EOS only
    assert set(torch.isfinite(logits).nonzero().view(-1).tolist()) == eos


def test_unbounded_strings_take_escapes(compiler, tokenizer):
    text = '{"a": "x\\"y\\u00e9\\n\\\\", "b": ["\\t"]}'
    matcher = compiler.matcher(StructuredOutputs(json_object=True))
    for token in tokenizer.encode(text):
        matcher.accept(token)
    assert matcher.is_terminated
    assert json.loads(text) == {"a": 'x"yé\n\\', "b": ["\t"]}


def accepts(compiler, tokenizer, schema, text: str) -> bool:
    """Whether ``text`` is a complete output of ``schema``."""
    matcher = compiler.matcher(StructuredOutputs(json=json.dumps(schema)))
    try:
        for token in tokenizer.encode(text):
            matcher.accept(token)
    except ValueError:
        return False
    return matcher.is_terminated


def test_objects_take_the_listed_properties_only_unless_told(compiler, tokenizer):
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert accepts(compiler, tokenizer, point, '{"x": 1}')
    assert not accepts(compiler, tokenizer, point, '{"x": 1, "y": 2}')
    for key, value in [("additionalProperties", True), ("patternProperties", {"^y": {}})]:
        assert accepts(compiler, tokenizer, {**point, key: value}, '{"x": 1, "y": 2}')
    two = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert not accepts(compiler, tokenizer, two, '{"b": 1, "a": 2}')  # the listed order
    nested = {"type": "object", "properties": {"p": point}, "required": ["p"]}
    assert not accepts(compiler, tokenizer, nested, '{"p": {"x": 1, "z": 0}}')
    anything = {"type": "object", "properties": {"o": {"type": "object"}}, "required": ["o"]}
    assert accepts(compiler, tokenizer, anything, '{"o": {"k": [1]}}')  # no properties listed
    value = {"properties": {"q": 1}}  # a const is a value: it keeps its keys
    const = {"type": "object", "properties": {"c": {"const": value}}, "required": ["c"]}
    assert accepts(compiler, tokenizer, const, json.dumps({"c": value}))
    both = {"allOf": [point, {"type": "object", "properties": {"y": {"type": "integer"}}}]}
    assert accepts(compiler, tokenizer, both, '{"x": 1, "y": 2}')  # allOf members stay open


@pytest.mark.parametrize(
    ("device", "dtype", "strided"),
    [
        ("cpu", torch.float32, True),  # numpy, through the strides
        ("cpu", torch.float64, False),  # torch ops
        ("cpu", torch.bfloat16, True),
        pytest.param("cuda", torch.float32, False, marks=CUDA),
        pytest.param("cuda", torch.bfloat16, True, marks=CUDA),
    ],
)
def test_rows_of_any_layout_are_masked_alike(compiler, device, dtype, strided):
    """A contiguous float32 CPU row is the reference; +inf logits are masked too, and inference
    tensors (the sampler's) are masked in place."""
    matcher = compiler.matcher(StructuredOutputs(regex="[0-9]{2}"))
    width = compiler.vocab_size
    values = torch.randn(width, generator=torch.Generator().manual_seed(1))
    values[[0, 1]] = float("inf")  # two special tokens, never allowed
    values[torch.randint(width, (100,), generator=torch.Generator().manual_seed(2))] = 0.0
    reference = values.clone()
    matcher.apply_mask(reference)
    assert torch.isfinite(reference).sum() == 10 and torch.isinf(reference[[0, 1]]).all()
    with torch.inference_mode():
        storage = torch.zeros(2 * width, dtype=dtype, device=device)
        row = storage[::2] if strided else storage[:width]
        row.copy_(values.to(dtype))
        matcher.apply_mask(row)
    assert row.is_contiguous() is not strided and row.dtype == dtype
    assert torch.equal(row.cpu(), reference.to(dtype))
    if strided:
        assert not storage[1::2].any()  # the rows between are untouched


def test_eos_is_allowed_while_a_regex_can_still_continue(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputs(regex="[0-9]+"))
    matcher.accept(tokenizer.encode("7")[0])
    assert not matcher.is_terminated
    logits = torch.zeros(compiler.vocab_size)
    matcher.apply_mask(logits)
    allowed = set(torch.isfinite(logits).nonzero().view(-1).tolist())
    assert set(tokenizer.eos_token_ids) < allowed and tokenizer.encode("8")[0] in allowed
    matcher.accept(tokenizer.eos_token_ids[0])
    assert matcher.is_terminated


def test_accept_without_a_mask(compiler, tokenizer):
    """Without ``apply_mask`` first (a resumed sequence replays its tokens), ``accept`` asks
    the library; a refused token leaves the state as it was."""
    (a, b), x = tokenizer.encode("12"), tokenizer.encode("x")[0]
    matcher = compiler.matcher(StructuredOutputs(regex="1[0-9]"))
    for refused in (x, b, tokenizer.eos_token_ids[0], compiler.vocab_size - 1, -1):
        with pytest.raises(ValueError):
            matcher.accept(refused)
    matcher.accept(a)
    with pytest.raises(ValueError):
        matcher.accept(x)
    matcher.accept(b)
    assert matcher.is_terminated
    with pytest.raises(ValueError):
        matcher.accept(x)
    matcher.accept(tokenizer.eos_token_ids[1])  # both EOS ids end it
    assert matcher.is_terminated


def test_byte_tokenizer():
    tokenizer = ByteTokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size + 6)
    schema = SCHEMAS["string_pattern"]
    tokens = random_walk(compiler, StructuredOutputs(json=json.dumps(schema)), seed=0)
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)
    matcher = compiler.matcher(StructuredOutputs(choice=["yes", "no"]))
    logits = torch.zeros(compiler.vocab_size)
    matcher.apply_mask(logits)
    assert set(torch.isfinite(logits).nonzero().view(-1).tolist()) == {ord("y"), ord("n")}
    with pytest.raises(ValueError):
        matcher.accept(ByteTokenizer.BOS)


def test_compiled_grammars_are_cached_and_bounded(compiler, monkeypatch):
    import replicas.engine.structured_output as module

    monkeypatch.setattr(module, "CACHE_SIZE", 2)
    specs = [StructuredOutputs(regex=f"a{{{n}}}") for n in range(1, 4)]
    for spec in specs:
        compiler.validate(spec)
    assert list(compiler._cache)[-2:] == specs[1:] and len(compiler._cache) == 2
    cached = compiler._cache[specs[2]]
    compiler.validate(specs[2])
    assert compiler._cache[specs[2]] is cached


def test_unsupported_tokenizer_and_missing_library(tokenizer, monkeypatch):
    class Other(Tokenizer):
        encode = decode = apply_chat_template = ByteTokenizer.encode
        eos_token_ids = (0,)
        vocab_size = 10

    with pytest.raises(ValueError, match="Other"):
        GrammarCompiler(Other(), 300)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match="pip install llguidance"):
        GrammarCompiler(tokenizer, tokenizer.vocab_size)


def test_importing_the_module_does_not_import_the_library():
    code = "import sys, replicas.engine.structured_output; assert 'llguidance' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
