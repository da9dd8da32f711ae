"""The GGUF container reader (model/gguf_file.py) against gguf-py's reader on files written by gguf-py's writer:
every value type, nested and large arrays, a non-default alignment, and the tensor table and data."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from fluxion_lite.model.gguf_file import MAX_KEPT_ARRAY, GGUFFile, GGUFFormatError


def write_file(path: Path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5e-6)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 3.141592653589793)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.strs", ["a", "bc", ""])
    w.add_array("t.big_strs", [f"tok{i}" for i in range(MAX_KEPT_ARRAY + 10)])  # stepped over
    w.add_array("t.big_floats", [float(i) for i in range(MAX_KEPT_ARRAY + 1)])  # stepped over
    w.add_string("t.after", "still read")  # a key after the skipped arrays
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("c", rng.integers(0, 255, (4, 2 * 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_reads_what_gguf_py_reads(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "t.gguf"
    write_file(path, alignment)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF.") or key.startswith("t.big_"):
            continue
        want = field.contents()
        got = ours.metadata[key]
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert "t.big_strs" not in ours.metadata and "t.big_floats" not in ours.metadata
    assert ours.metadata["t.after"] == "still read"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.offset == int(ref.data_offset) and mine.n_bytes == int(ref.n_bytes)
        assert mine.shape == tuple(int(d) for d in reversed(ref.shape.tolist()))
        assert np.array_equal(mine.data.reshape(-1).view(np.uint8), np.asarray(ref.data).reshape(-1).view(np.uint8))
    assert ours.tensors[2].data.shape == (4, 68) and ours.tensors[2].type_name == "Q8_0"


def test_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_file(path)
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(bad)
    bad.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFFormatError, match="version 1"):
        GGUFFile(bad)
    last = GGUFFile(path).tensors[-1]
    for keep, part in ((30, "header"), (last.offset + 10, "tensor data")):
        bad.write_bytes(data[:keep])
        with pytest.raises(GGUFFormatError) as info:
            GGUFFile(bad)
        assert info.value.part == part
