"""GGUFFile: metadata, tensor directory and error paths, on tiny synthetic files and the real models."""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from tokenmill.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from tokenmill.loading.gguf_file import GGUFFile

METADATA: dict[str, Any] = {
    "general.name": "tiny",
    "tiny.block_count": 2,
    "tiny.offset": -5,
    "tiny.big": 1 << 40,
    "tiny.rope.freq_base": 10000.0,
    "tiny.eps": 1e-300,
    "tiny.flag": True,
    "tiny.small": 255,
    "tiny.mask": [True, False, True],
    "tiny.nested": [[1, 2], [3]],
    "tokenizer.ggml.tokens": ["<s>", "▁hello", "é", "\n", "你好"],
    "tokenizer.ggml.token_type": [3, 1, 1, 6, 1],
    "tokenizer.ggml.scores": [0.0, -1.5, -2.25, 0.5, -3.0],
}


def write_tiny(
    path: Path, alignment: int | None = None, extra: dict[str, tuple[np.ndarray, Q]] | None = None
) -> dict[str, np.ndarray]:
    """A small valid GGUF (arch ``tiny``) with F32, F16 and Q8_0 tensors; returns their float values."""
    rng = np.random.default_rng(0)
    norm = rng.standard_normal(64).astype(np.float32)
    proj = rng.standard_normal((3, 64)).astype(np.float16)
    cube = rng.standard_normal((2, 3, 4)).astype(np.float32)
    emb = rng.standard_normal((4, 64)).astype(np.float32)
    emb_q = quants.quantize(emb, Q.Q8_0)

    w = GGUFWriter(path, arch="tiny")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny")
    w.add_uint32("tiny.block_count", 2)
    w.add_int32("tiny.offset", -5)
    w.add_uint64("tiny.big", 1 << 40)
    w.add_float32("tiny.rope.freq_base", 10000.0)
    w.add_float64("tiny.eps", 1e-300)
    w.add_bool("tiny.flag", True)
    w.add_uint8("tiny.small", 255)
    w.add_array("tiny.mask", METADATA["tiny.mask"])
    w.add_array("tiny.nested", METADATA["tiny.nested"])
    w.add_array("tokenizer.ggml.tokens", METADATA["tokenizer.ggml.tokens"])
    w.add_array("tokenizer.ggml.token_type", METADATA["tokenizer.ggml.token_type"])
    w.add_array("tokenizer.ggml.scores", METADATA["tokenizer.ggml.scores"])
    w.add_tensor("norm.weight", norm)
    w.add_tensor("proj.weight", proj)
    w.add_tensor("cube", cube)
    w.add_tensor("token_embd.weight", emb_q, raw_dtype=Q.Q8_0)
    for name, (raw, qtype) in (extra or {}).items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    emb_deq = quants.dequantize(emb_q, Q.Q8_0)
    return {"norm.weight": norm, "proj.weight": proj.astype(np.float32), "cube": cube, "token_embd.weight": emb_deq}


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    return path, write_tiny(path)


def test_metadata_round_trips_as_plain_python(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    f = GGUFFile(tiny[0])
    assert f.metadata == {"general.architecture": "tiny", **METADATA}
    assert type(f.metadata["tiny.flag"]) is bool
    assert type(f.metadata["tiny.block_count"]) is int
    assert all(type(s) is float for s in f.metadata["tokenizer.ggml.scores"])
    assert f.architecture == "tiny"


def test_tensors_round_trip(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, values = tiny
    f = GGUFFile(path)
    assert f.tensor_names == ["norm.weight", "proj.weight", "cube", "token_embd.weight"]
    assert f.tensor_info("norm.weight") == (Q.F32, (64,))
    assert f.tensor_info("proj.weight") == (Q.F16, (3, 64))
    assert f.tensor_info("cube") == (Q.F32, (2, 3, 4))
    assert f.tensor_info("token_embd.weight") == (Q.Q8_0, (4, 64))
    for name, expected in values.items():
        got = f.load_tensor(name)
        assert got.dtype == torch.float32
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=name)


def test_load_tensor_converts_dtype(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, values = tiny
    got = GGUFFile(path).load_tensor("proj.weight", dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.from_numpy(values["proj.weight"]).bfloat16())


def test_raw_tensor_is_the_packed_bytes(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, values = tiny
    raw = GGUFFile(path).raw_tensor("norm.weight")
    assert raw.dtype == torch.uint8 and raw.numel() == 64 * 4
    np.testing.assert_array_equal(raw.view(torch.float32).numpy(), values["norm.weight"])


def test_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    values = write_tiny(path, alignment=256)
    f = GGUFFile(path)
    assert f.metadata["general.alignment"] == 256
    for name, expected in values.items():
        np.testing.assert_array_equal(f.load_tensor(name).numpy(), expected)


def test_close_after_loading(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    with GGUFFile(tiny[0]) as f:
        tensors = [f.load_tensor(n) for n in f.tensor_names]
    assert tensors[0].abs().sum() > 0  # loaded tensors outlive the mapping


def test_unknown_tensor_name(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    f = GGUFFile(tiny[0])
    with pytest.raises(ModelFormatError, match="no tensor named 'output.weight'"):
        f.load_tensor("output.weight")
    with pytest.raises(ModelFormatError, match="output.weight"):
        f.tensor_info("output.weight")


def test_truncated_data_is_reported(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf: file is truncated: tensor 'token_embd.weight'"):
        GGUFFile(cut)


@pytest.mark.parametrize("keep", [4, 12, 40, 300])
def test_truncated_header_is_reported(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, keep: int) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny[0].read_bytes()[:keep])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf.*truncated"):
        GGUFFile(cut)


def test_garbage_is_not_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelFormatError, match=r"junk\.gguf.*bad magic"):
        GGUFFile(junk)


def test_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="empty.gguf"):
        GGUFFile(empty)


def test_unsupported_version(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    data = bytearray(tiny[0].read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    old = tmp_path / "old.gguf"
    old.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="unsupported GGUF version 1"):
        GGUFFile(old)


def test_duplicate_metadata_key(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    dup = tmp_path / "dup.gguf"
    dup.write_bytes(tiny[0].read_bytes().replace(b"tiny.eps", b"tiny.big", 1))
    with pytest.raises(ModelFormatError, match="'tiny.big' appears twice"):
        GGUFFile(dup)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError):
        GGUFFile(tmp_path)


def test_unsupported_quant_type_fails_on_load(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    iq_bytes = np.zeros((2, 66), dtype=np.uint8)  # two IQ2_XXS blocks of 256 values
    write_tiny(path, extra={"blk.0.ffn_up.weight": (iq_bytes, Q.IQ2_XXS)})
    f = GGUFFile(path)
    assert f.tensor_info("blk.0.ffn_up.weight") == (Q.IQ2_XXS, (2, 256))
    with pytest.raises(UnsupportedModelError, match=r"iq\.gguf: tensor 'blk.0.ffn_up.weight'.*IQ2_XXS"):
        f.load_tensor("blk.0.ffn_up.weight")
    f.load_tensor("norm.weight")  # the other tensors stay readable


def test_missing_architecture(tmp_path: Path) -> None:
    path = tmp_path / "noarch.gguf"
    w = GGUFWriter(path, arch="x")
    w.kv_data[0].clear()  # drop general.architecture
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    assert f.tensor_names == []
    with pytest.raises(ModelFormatError, match="general.architecture"):
        _ = f.architecture


def assert_data_regions_tile(f: GGUFFile, file_size: int) -> None:
    """Tensor data regions, in offset order, are back to back (up to alignment) and end at the file end."""
    align = f.metadata.get("general.alignment", 32)
    entries = sorted(  # the directory is private; this test checks the header parse against the file layout
        (f._tensors[n].start, f._tensors[n].nbytes) for n in f.tensor_names
    )
    for (start, nbytes), (next_start, _) in pairwise(entries):
        assert next_start == (start + nbytes + align - 1) // align * align
    last_start, last_bytes = entries[-1]
    assert last_start + last_bytes <= file_size < last_start + last_bytes + align


@pytest.mark.real_model
def test_smollm2_directory_and_load_time(smollm2_gguf: Path) -> None:
    start = time.perf_counter()
    f = GGUFFile(smollm2_gguf)
    total = sum(f.load_tensor(n).numel() for n in f.tensor_names)
    elapsed = time.perf_counter() - start
    print(f"\nSmolLM2: opened and dequantized {len(f.tensor_names)} tensors ({total:,} values) in {elapsed:.2f} s")
    assert elapsed < 3.0
    assert f.architecture == "llama"
    assert len(f.tensor_names) == 272
    assert len(f.metadata["tokenizer.ggml.tokens"]) == f.metadata["llama.vocab_size"] == 49152
    assert f.tensor_info("token_embd.weight") == (Q.Q8_0, (49152, 576))
    assert f.tensor_info("blk.0.attn_norm.weight") == (Q.F32, (576,))
    assert f.tensor_info("blk.0.ffn_up.weight") == (Q.Q4_1, (1536, 576))
    assert_data_regions_tile(f, smollm2_gguf.stat().st_size)


@pytest.mark.real_model
def test_gemma3_metadata_is_fast(gemma3_gguf: Path) -> None:
    start = time.perf_counter()
    f = GGUFFile(gemma3_gguf)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"opening Gemma 3 took {elapsed:.2f} s"
    assert f.architecture == "gemma3"
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == len(f.metadata["tokenizer.ggml.scores"]) == 262144
    assert all(type(t) is str for t in tokens[:100])
    assert f.tensor_info("blk.0.attn_norm.weight") == (Q.F32, (640,))
    assert_data_regions_tile(f, gemma3_gguf.stat().st_size)
