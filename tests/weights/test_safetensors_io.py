"""Checkpoint reading: files written by safetensors/torch, sharded indexes, legacy names, corrupt headers."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from luminal_recipes.errors import CheckpointError
from luminal_recipes.weights.safetensors_io import Checkpoint, read_header


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(3, 16, generator=g).to(torch.float8_e4m3fn),
        "b.weight_scale": torch.tensor(0.25),
        "c.packed": torch.randint(0, 255, (5, 6), dtype=torch.uint8, generator=g),
        "d.bias": torch.randn(7, generator=g).half(),
    }


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).contiguous().view(torch.uint8).numpy()


def test_reads_what_torch_wrote_zero_copy(tmp_path):
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    save_file(
        tensors,
        path,
        metadata={
            "format": "pt",
            "_quantization_metadata": json.dumps(
                {"format_version": "1.0", "layers": {"b": {"format": "float8_e4m3fn"}}}
            ),
        },
    )
    ckpt = Checkpoint.open(tmp_path)
    assert ckpt.names == sorted(tensors)
    info = ckpt["a.weight"]
    assert (info.shape, info.dtype, info.file, info.nbytes) == ((4, 8), "BF16", path, 64)
    assert [ckpt[n].dtype for n in ("b.weight", "b.weight_scale", "c.packed", "d.bias")] == [
        "F8_E4M3",
        "F32",
        "U8",
        "F16",
    ]
    for name, t in tensors.items():
        array = ckpt.load(name)
        assert array.shape == tuple(t.shape)
        np.testing.assert_array_equal(array.reshape(-1).view(np.uint8), _bits(t))
        assert not array.flags.writeable and not array.flags.owndata  # a view of the mapped file
    np.testing.assert_array_equal(
        ckpt.load("a.weight").astype(np.float32), tensors["a.weight"].float().numpy()
    )
    assert ckpt.load("b.weight_scale") == np.float32(0.25)
    assert ckpt.metadata["format"] == "pt"
    assert ckpt.quantization_metadata["layers"] == {"b": {"format": "float8_e4m3fn"}}


def _write_raw(path, header: dict | bytes, data: bytes, header_len: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def _entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    "case,header,data,needle",
    [
        (
            "overlap",
            {"w1": _entry("F32", [4], 0, 16), "w2": _entry("F32", [4], 8, 24)},
            bytes(24),
            "'w2' overlap",
        ),
        ("past_end", {"w1": _entry("F32", [4], 0, 16), "w2": _entry("F32", [4], 16, 32)}, bytes(20), "'w2'"),
        ("byte_count", {"w1": _entry("F32", [2, 3], 0, 16)}, bytes(16), "'w1'"),
        ("dtype", {"w1": _entry("F128", [2], 0, 32)}, bytes(32), "'w1'"),
        ("gap", {"w1": _entry("F32", [2], 0, 8), "w2": _entry("F32", [2], 12, 20)}, bytes(20), "'w2'"),
        ("shape", {"w1": _entry("F32", [-2], 0, 8)}, bytes(8), "'w1'"),
    ],
)
def test_corrupt_headers_name_file_and_tensor(tmp_path, case, header, data, needle):
    path = _write_raw(tmp_path / f"{case}.safetensors", header, data)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(path)
    assert str(path) in str(e.value) and needle in str(e.value)


def test_truncated_file_names_file_and_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    whole = path.read_bytes()
    header = json.loads(whole[8 : 8 + struct.unpack("<Q", whole[:8])[0]])
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    path.write_bytes(whole[:-10])
    with pytest.raises(CheckpointError, match=rf"'{last}'.*truncated") as e:
        Checkpoint.open(path)
    assert str(path) in str(e.value)
    path.write_bytes(whole[:50])  # cut inside the header
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(path)
    path.write_bytes(whole[:5])
    with pytest.raises(CheckpointError, match="too short"):
        read_header(path)


def test_bad_json_and_absurd_header_length(tmp_path):
    bad = _write_raw(tmp_path / "bad.safetensors", b'{"w": {"dtype": "F32", ', bytes(8))
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON") as e:
        Checkpoint.open(bad)
    assert str(bad) in str(e.value)
    huge = _write_raw(tmp_path / "huge.safetensors", b"{}", b"", header_len=2**40)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        Checkpoint.open(huge)
    listed = _write_raw(tmp_path / "list.safetensors", b"[1, 2]", b"")
    with pytest.raises(CheckpointError, match="not an object"):
        Checkpoint.open(listed)


def test_trailing_bytes_are_rejected_like_the_library_does(tmp_path):
    path = _write_raw(tmp_path / "m.safetensors", {"w1": _entry("F32", [2], 0, 8)}, bytes(12))
    with pytest.raises(CheckpointError, match="after the last tensor"):
        Checkpoint.open(path)


def _shards(folder, index_name="diffusion_pytorch_model.safetensors.index.json"):
    tensors = _tensors()
    names = sorted(tensors)
    shards = {
        "diffusion_pytorch_model-00001-of-00002.safetensors": names[:2],
        "diffusion_pytorch_model-00002-of-00002.safetensors": names[2:],
    }
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, folder / file)
    weight_map = {n: f for f, members in shards.items() for n in members}
    (folder / index_name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return tensors, weight_map


def test_sharded_index(tmp_path):
    tensors, weight_map = _shards(tmp_path)
    # not a safetensors file, and ignored: the index says which files form the checkpoint
    (tmp_path / "unrelated.safetensors").write_bytes(b"garbage")
    ckpt = Checkpoint.open(tmp_path)
    assert ckpt.names == sorted(tensors) and len(ckpt.files) == 2
    assert ckpt.index == tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    for name, file in weight_map.items():
        assert ckpt[name].file.name == file
        np.testing.assert_array_equal(ckpt.load(name).reshape(-1).view(np.uint8), _bits(tensors[name]))
    assert Checkpoint.open(ckpt.index).names == ckpt.names


def test_sharded_index_errors(tmp_path):
    _, weight_map = _shards(tmp_path)
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    wrong = dict(
        weight_map, **{"a.weight": "diffusion_pytorch_model-00002-of-00002.safetensors", "ghost": "x.bin"}
    )
    index.write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(CheckpointError, match="x.bin"):
        Checkpoint.open(tmp_path)
    del wrong["ghost"]
    index.write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(CheckpointError, match="'a.weight'"):
        Checkpoint.open(tmp_path)
    index.write_text("{")
    with pytest.raises(CheckpointError, match="cannot read checkpoint index"):
        Checkpoint.open(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside its folder"):
        Checkpoint.open(tmp_path)


def test_folder_without_index_and_duplicates(tmp_path):
    save_file({"x": torch.zeros(2)}, tmp_path / "one.safetensors")
    save_file({"y": torch.zeros(2)}, tmp_path / "two.safetensors")
    assert Checkpoint.open(tmp_path).names == ["x", "y"]
    save_file({"x": torch.ones(2)}, tmp_path / "three.safetensors")
    with pytest.raises(CheckpointError, match="'x' is in both"):
        Checkpoint.open(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        Checkpoint.open(empty)
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path / "nowhere")


def test_legacy_comfy_scaled_fp8_names_map_onto_weight_scale(tmp_path):
    save_file(
        {
            "model.diffusion_model.scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn),
            "model.diffusion_model.l.weight": torch.ones(2, 16).to(torch.float8_e4m3fn),
            "model.diffusion_model.l.scale_weight": torch.tensor(0.5),
            "model.diffusion_model.l.scale_input": torch.tensor(1.0),
        },
        tmp_path / "legacy.safetensors",
    )
    ckpt = Checkpoint.open(tmp_path / "legacy.safetensors")
    assert ckpt.names == [
        "model.diffusion_model.l.input_scale",
        "model.diffusion_model.l.weight",
        "model.diffusion_model.l.weight_scale",
    ]
    assert ckpt["model.diffusion_model.l.weight_scale"].stored_name == "model.diffusion_model.l.scale_weight"
    assert ckpt.load("model.diffusion_model.l.weight_scale") == np.float32(0.5)
    assert ckpt.quantization_metadata == {"layers": {"model.diffusion_model.l": {"format": "float8_e4m3fn"}}}


def test_bad_quantization_metadata(tmp_path):
    save_file({"x": torch.zeros(2)}, tmp_path / "m.safetensors", metadata={"_quantization_metadata": "{oops"})
    with pytest.raises(CheckpointError, match="_quantization_metadata"):
        _ = Checkpoint.open(tmp_path).quantization_metadata
