"""Strata's GGUF header reader (``replicas/model/gguf_file.py``) against gguf-py's
``GGUFReader`` on the same files: every metadata value and every tensor record; a malformed
header is a ValueError naming the problem."""

import gguf
import numpy as np
import pytest

from replicas.model.gguf import open_gguf
from replicas.model.gguf_file import GGUFFile
from tests.unit.model.test_gguf import smollm2_path


def written_file(path):
    """A file with every value type, nested and empty arrays, an alignment of 64 and tensors
    of value and quantized types."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -5)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.strs", ["a", "", "ü b"])
    writer.add_array("t.empty", [])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((4, 8)).astype(np.float16))
    q8 = gguf.quantize(
        rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf_py(path):
    mine, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert mine.values.keys() == expected.keys()
    for key, value in expected.items():
        assert mine.values[key] == value, key
        assert type(mine.values[key]) is type(value), key
    assert mine.data_offset == theirs.data_offset
    assert len(mine.tensors) == len(theirs.tensors)
    for a, b in zip(mine.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
        )
        assert a.data_offset == b.data_offset and np.array_equal(a.shape, b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8))


def test_every_value_type_and_tensor_as_gguf_py_reads_them(tmp_path):
    assert_same_as_gguf_py(written_file(tmp_path / "t.gguf"))


@pytest.mark.skipif(smollm2_path() is None, reason="SmolLM2 GGUF not installed")
def test_the_shipped_model_as_gguf_py_reads_it():
    assert_same_as_gguf_py(smollm2_path())


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda b: b"GGUX" + b[4:], "no GGUF magic"),
        (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "GGUF version 7"),
        (lambda b: b[:4] + (3).to_bytes(4, "big") + b[8:], "big-endian"),
        (lambda b: b[:200], "malformed GGUF header"),
        (lambda b: b[: len(b) - 100], "runs past the end of the file"),
    ],
)
def test_a_malformed_file_is_refused_by_name(tmp_path, damage, named):
    good = written_file(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good))
    with pytest.raises(ValueError, match=named) as error:
        open_gguf(bad)
    assert str(bad) in str(error.value)
