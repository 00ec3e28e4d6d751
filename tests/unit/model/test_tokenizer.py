"""The byte tokenizer of the built-in models and the Hugging Face tokenizer wrapper."""

import json

import pytest

from replicas.model import ByteTokenizer, HFTokenizer


def test_byte_round_trip_including_non_ascii():
    tok = ByteTokenizer()
    text = "naïve café — 你好 🙂"
    ids = tok.encode(text)
    assert ids[0] == ByteTokenizer.BOS and max(ids[1:]) < 256
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids + [ByteTokenizer.EOS]) == text


def test_byte_decode_replaces_a_split_character():
    tok = ByteTokenizer()
    ids = tok.encode("é")
    assert tok.decode(ids[:-1]) == "\ufffd"


def test_byte_chat_template_ends_with_assistant_header():
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == (
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    )
    assert (tok.vocab_size, tok.eos_token_ids) == (258, (257,))


def test_hf_tokenizer_encodes_with_one_bos(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    rust = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    rust.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}'
    )
    tok = HFTokenizer(tmp_path, eos_token_ids=(4,))
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.encode("<s>hello") == [1, 3]
    assert tok.decode([1, 3, 4, 2]) == "hello world"
    assert tok.eos_token_ids == (4, 2)
    assert tok.vocab_size == 5
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])


def test_hf_tokenizer_renders_chat_template(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json")
    )
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(tmp_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<s>[user] hi\n[assistant] "
