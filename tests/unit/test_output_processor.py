"""The output processor against full decodes: incremental text, stop strings and streamed pieces
equal what decoding the whole output at every token gives."""

import random

import pytest

from replicas.engine.output_processor import OutputProcessor
from replicas.engine.request import Request, RequestStatus
from replicas.model import ByteTokenizer
from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path
from replicas.sampling_params import SamplingParams

EURO = list("€".encode())  # three bytes: a character split over three tokens
SNOWMAN_AND_INVALID = [*"☃".encode(), 0xFF, ord("a"), 0xE2, 0x82]  # invalid, then cut short


def _request(stop: list[str] | None = None) -> Request:
    params = SamplingParams(max_tokens=10_000, stop=stop or [], ignore_eos=True)
    return Request("r", [1, 2, 3], params, block_size=16)


def _run(processor: OutputProcessor, request: Request, token_ids: list[int], full_decode):
    """Feed tokens one by one, checking the text against a full decode at every token."""
    processor.add(request)
    pieces = []
    for token_id in token_ids:
        request.append_output_token(token_id)
        processor.update(request)
        full = full_decode(request.output_token_ids)
        output = processor.output(request)
        assert full.startswith(output.text)
        pieces.append(output.new_text)
    request.status = RequestStatus.FINISHED_LENGTH
    final = processor.output(request)
    pieces.append(final.new_text)
    return final, pieces


@pytest.mark.parametrize("seed", range(5))
def test_byte_tokenizer_text_equals_the_full_decode(seed: int):
    rng = random.Random(seed)
    text = "añ€☃ 𝄞 b\n"
    tokens = []
    for _ in range(60):
        choice = rng.random()
        if choice < 0.6:
            tokens.extend(rng.choice(text).encode())
        elif choice < 0.8:
            tokens.extend(SNOWMAN_AND_INVALID[: rng.randint(1, len(SNOWMAN_AND_INVALID))])
        else:
            tokens.append(ByteTokenizer.EOS)  # special: decodes to nothing
    tokenizer = ByteTokenizer()
    final, pieces = _run(OutputProcessor(tokenizer), _request(), tokens, tokenizer.decode)
    assert final.text == tokenizer.decode(tokens)
    assert "".join(pieces) == final.text


def test_split_character_is_held_back_until_complete():
    tokenizer = ByteTokenizer()
    processor = OutputProcessor(tokenizer)
    request = _request()
    processor.add(request)
    texts = []
    for token_id in [ord("x"), *EURO]:
        request.append_output_token(token_id)
        processor.update(request)
        texts.append(processor.output(request).new_text)
    assert texts == ["x", "", "", "€"]


@pytest.mark.parametrize("stop", [["€"], ["b€"], ["zz", "a€b"], ["€€"]])
def test_stop_string_cuts_where_a_full_decode_finds_it_first(stop: list[str]):
    tokenizer = ByteTokenizer()
    body = "xa€b€€ya€b"
    processor = OutputProcessor(tokenizer)
    request = _request(stop)
    processor.add(request)
    streamed = []
    for token_id in body.encode():
        request.append_output_token(token_id)
        processor.update(request)
        if processor.find_stop(request):
            request.status = RequestStatus.FINISHED_STOPPED
            streamed.append(processor.output(request).new_text)
            break
        streamed.append(processor.output(request).new_text)
    full = tokenizer.decode(request.output_token_ids)
    expected = full[: min(p for s in stop if (p := full.find(s)) >= 0)]
    assert request.is_finished
    assert processor.output(request).text == expected == "".join(streamed)
    assert body.startswith(expected)


def test_real_tokenizer_text_equals_the_full_decode():
    try:
        path = packaged_model_path(DEFAULT_MODEL)
    except ValueError as missing:
        pytest.skip(str(missing))
    from replicas.model.gguf import read_gguf_info

    _, tokenizer = read_gguf_info(path)
    rng = random.Random(0)
    words = [
        "Hello",
        "wörld,",
        "naïve",
        "café",
        "—",
        "東京",
        "🤗",
        "def",
        "f(x):\n",
        "",
        "",
        "",
        "return",
        "x",
        "",
        "",
    ]
    text = " ".join(rng.choice(words) for _ in range(200))
    tokens = tokenizer.encode(text)[1:]
    tokens[10:10] = list(tokenizer.eos_token_ids)  # a special token mid-output
    # single byte-level tokens that split multi-byte characters
    tokens.extend(rng.randrange(tokenizer.vocab_size) for _ in range(100))
    final, pieces = _run(OutputProcessor(tokenizer), _request(), tokens, tokenizer.decode)
    assert final.text == tokenizer.decode(tokens)
    assert "".join(pieces) == final.text
