"""``/tokenizer_info``, ``/tokenize`` and ``/detokenize``, as clients that tokenize for
themselves (lm-evaluation-harness's remote tokenizer) call them."""

from tests.unit.api.test_errors import assert_error


def test_tokenize_and_detokenize_round_trip(client, engine):
    info = client.get("/tokenizer_info").json()
    assert {"eos_token", "bos_token", "chat_template"} <= set(info)
    assert info["model_max_length"] == engine.max_model_len
    with_bos = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert with_bos["tokens"] == engine.tokenizer.encode("héllo")
    plain = client.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False})
    assert plain.json()["tokens"] == list("héllo".encode())
    assert plain.json()["count"] == 6
    text = client.post("/detokenize", json={"tokens": plain.json()["tokens"]}).json()
    assert text == {"prompt": "héllo"}


def test_bad_tokenize_bodies_are_400(client):
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    assert_error(client.post("/detokenize", json={"tokens": [1, 99999]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model")
