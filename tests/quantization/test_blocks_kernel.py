"""lucidlm's own int4 CPU kernel (quantization/blocks_kernel.py, kernels/blocks32.c) against an
independent NumPy reference of its arithmetic, against the exact product, and inside Int4Linear."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lucidlm.quantization import Int4Linear, Int8Linear, blocks_kernel
from lucidlm.quantization.int4 import pack_nibbles


def test_the_kernel_is_available_here():
    # CI's machines have AVX-512 VNNI (Intel Xeon) or AVX2 (AMD EPYC) and a C compiler
    # (scripts/install.sh installs gcc): the kernel must build there, or every other test here would be measuring torch's kernel.
    assert blocks_kernel.available(), blocks_kernel.unavailable_reason()


def random_int4(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    zeros = (torch.randn(N, K // 32, generator=g) * 0.01).to(torch.bfloat16)
    return codes, scales, zeros


def input_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's quantization of its input, from its definition: each group of 32 values
    becomes a * r1 + (a / 254) * r2 with a = max|x| / 127, r1 = round(x / a) and r2 the rounded
    remainder in units of a / 254 (all in float32, ties to even). Returns r1, r2 (M, G, 32) and
    a, a / 254 (M, 1, G) as float64."""
    x = x.astype(np.float32)
    M, K = x.shape
    xg = x.reshape(M, K // 32, 32)
    amax = np.abs(xg).max(-1, keepdims=True)  # (M, G, 1) float32
    a = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    r1 = np.rint((xg * inv).astype(np.float32))
    miss = (xg.astype(np.float64) - r1 * a.astype(np.float64)).astype(np.float32)
    r2 = np.rint((miss * (inv * np.float32(254)).astype(np.float32)).astype(np.float32))
    a254 = (a[..., 0] / np.float32(254)).astype(np.float32)
    return r1.astype(np.float64), r2.astype(np.float64), a[..., 0].astype(np.float64)[:, None], \
        a254.astype(np.float64)[:, None]


def reference_int8(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """W = s q in groups of 32, against the quantized input; integer dots exact, the rest float64."""
    r1, r2, a, a254 = input_codes(x)
    q = codes.astype(np.float64).reshape(codes.shape[0], -1, 32)  # (N, G, 32)
    s = scales.astype(np.float64)
    return (s * a * np.einsum("mgj,ngj->mng", r1, q) + s * a254 * np.einsum("mgj,ngj->mng", r2, q)).sum(-1)


def reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """The int4 kernel's arithmetic in NumPy: W = (q - 8) s + z, so the product is
    s * (q . x) + (z - 8 s) * sum(x) per group, q . x taken against the quantized input (the
    integer dot products exact), sum(x) on the input itself; float64 elsewhere (the kernel's
    float32 sums differ by rounding)."""
    r1, r2, a, a254 = input_codes(x)
    q = codes.astype(np.float64).reshape(codes.shape[0], -1, 32)  # (N, G, 32)
    s, z = scales.astype(np.float64), zeros.astype(np.float64)  # (N, G)
    xsum = x.astype(np.float32).astype(np.float64).reshape(x.shape[0], 1, -1, 32).sum(-1)  # (M, 1, G)
    return (s * a * np.einsum("mgj,ngj->mng", r1, q) + s * a254 * np.einsum("mgj,ngj->mng", r2, q)
            + (z - 8 * s) * xsum).sum(-1)  # (M, N)


def run_kernel(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return blocks_kernel.blocks_mm(x, blocks_kernel.blocks_from_codes(codes), blocks_kernel.lanes_from_rows(scales),
                                   blocks_kernel.lanes_from_rows(zeros))


def test_scales_and_zeros_of_the_wrong_size_are_refused():
    # The C loops read one scale and one zero per row and group: a short tensor would be read past its end.
    codes, scales, zeros = random_int4(32, 64, seed=2)
    blocks, x = blocks_kernel.blocks_from_codes(codes), torch.randn(1, 64)
    lanes, zero_lanes = blocks_kernel.lanes_from_rows(scales), blocks_kernel.lanes_from_rows(zeros)
    with pytest.raises(RuntimeError, match="need 64 scales and 64 zeros .* got 32 and 64"):
        blocks_kernel.blocks_mm(x, blocks, lanes[:1], zero_lanes)
    with pytest.raises(RuntimeError, match="got 64 and 48"):
        blocks_kernel.blocks_mm(x, blocks, lanes, zero_lanes.flatten()[:48].contiguous())


def test_layout_round_trips():
    codes, scales, _ = random_int4(48, 96, seed=1)
    blocks = blocks_kernel.blocks_from_codes(codes)
    assert blocks.shape == (3, 3, 256) and blocks.dtype == torch.uint8
    assert torch.equal(blocks_kernel.codes_from_blocks(blocks), codes)
    assert torch.equal(blocks_kernel.rows_from_lanes(blocks_kernel.lanes_from_rows(scales)), scales)
    # the documented byte: lane i of vector t of group g holds columns 4t+j (low) and 16+4t+j (high)
    b, g, t, i, j = 1, 2, 3, 5, 2
    byte = int(blocks[b, g, 64 * t + 4 * i + j])
    row = 16 * b + i
    assert byte & 0x0F == int(codes[row, 32 * g + 4 * t + j])
    assert byte >> 4 == int(codes[row, 32 * g + 16 + 4 * t + j])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_gets_the_same_bits_as_in_a_batch(dtype):
    # One row of input takes its own loop on AVX2 (both halves of a row block in one pass);
    # batch 1 and batch 8 decoding must still see the same logits, to the bit.
    N, K = 64, 576
    codes, scales, zeros = random_int4(N, K, seed=5)
    x = (torch.randn(8, K, generator=torch.Generator().manual_seed(6)) * 2).to(dtype)
    batch = run_kernel(x, codes, scales, zeros)
    for i in range(8):
        assert torch.equal(run_kernel(x[i:i + 1], codes, scales, zeros), batch[i:i + 1]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_row_alone_gets_the_same_bits_as_in_a_batch(dtype):
    # The int8 weights (the embedded model's unembedding) have a one-row loop on AVX2 too.
    N, K = 64, 576
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, K // 32, generator=g) * 0.01 + 1e-4
    operands = (blocks_kernel.int8_blocks_from_codes(codes), blocks_kernel.lanes_from_rows(scales),
                blocks_kernel.int8_code_sums(codes))
    x = (torch.randn(8, K, generator=g) * 2).to(dtype)
    batch = blocks_kernel.blocks_mm(x, *operands)
    for i in range(8):
        assert torch.equal(blocks_kernel.blocks_mm(x[i:i + 1], *operands), batch[i:i + 1]), i


@pytest.mark.parametrize("M", [1, 3, 8, 9, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_numpy_reference(M, dtype):
    N, K = 48, 160
    codes, scales, zeros = random_int4(N, K, seed=M)
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(100 + M)) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero group: scale 0, codes 0
    if M > 1:
        x[1, 40] = 50.0  # an outlier dominating its group
    got = run_kernel(x, codes, scales, zeros)
    assert got.dtype == dtype and got.shape == (M, N)
    want = reference(x.float().numpy(), codes.numpy(), scales.float().numpy(), zeros.float().numpy())
    if dtype == torch.float32:
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    else:  # the float32 result rounded once to bfloat16
        np.testing.assert_allclose(got.float().numpy(), want, rtol=2 ** -8, atol=1e-3 * np.abs(want).max())


def test_kernel_is_as_close_to_the_exact_product_as_bfloat16_inputs():
    N, K, M = 64, 576, 8
    codes, scales, zeros = random_int4(N, K, seed=7)
    W = Int4Linear.dequantize_plain({"weight_int4": pack_nibbles(codes), "scales": scales, "zeros": zeros}, 32)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(8))
    exact = x.double() @ W.double().t()
    ours = run_kernel(x, codes, scales, zeros).double()
    bf16_inputs = x.bfloat16().double() @ W.double().t()  # what rounding the inputs to bfloat16 costs
    ours_err = ((ours - exact).norm() / exact.norm()).item()
    bf16_err = ((bf16_inputs - exact).norm() / exact.norm()).item()
    assert ours_err < 1e-4 < bf16_err  # two int8 codes per input: about 16 bits, well under bfloat16's 8


def make_pair(N: int = 64, K: int = 192, bias: bool = False) -> tuple[Int4Linear, Int4Linear]:
    linear = torch.nn.Linear(K, N, bias=bias)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(3))
    ours = Int4Linear.from_float(linear)  # lucidlm's kernel is the default where it fits
    with blocks_kernel.prefer(False):
        theirs = Int4Linear.from_float(linear)
    return ours, theirs


def test_int4linear_uses_it_unless_told_not_to_and_keeps_the_scheme():
    ours, theirs = make_pair()
    assert ours.uses_blocks_kernel and not ours.uses_cpu_kernel
    assert theirs.uses_cpu_kernel and not theirs.uses_blocks_kernel
    for name, tensor in theirs.plain_state().items():  # same codes and scales, whatever the kernel
        assert torch.equal(ours.plain_state()[name], tensor), name
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(4))
    exact = x @ theirs.dequantize().t()
    err = ((ours(x) - exact).norm() / exact.norm()).item()
    assert err < 5e-3  # the output is rounded to bfloat16, the compute dtype


@pytest.mark.parametrize("scheme", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_half_and_double_activations_keep_their_precision(scheme, dtype):
    """``model.half()`` / ``.double()`` of a model on these kernels: the product is as close to
    torch's exact one (float64, on the dequantized weight) as the dtype allows. Through bfloat16
    it was 10x further off than float16's own rounding."""
    linear = torch.nn.Linear(576, 192, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(3))
    layer = scheme.from_float(linear, **({"group_size": 32} if scheme is Int8Linear else {}))
    assert layer.uses_blocks_kernel
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4)).to(dtype)
    exact = x.double() @ layer.dequantize(torch.float64).t()
    y = layer(x)
    assert y.dtype == dtype
    err = ((y.double() - exact).norm() / exact.norm()).item()
    own_rounding = ((exact.to(dtype).double() - exact).norm() / exact.norm()).item()  # 0 for float64
    assert err < 2 * own_rounding + 1e-4  # the kernel's own input codes: ~3e-5 (as for float32)


def test_a_saved_blocks_layer_loads_into_either_kernel():
    ours, theirs = make_pair(bias=True)
    state = ours.state_dict()
    assert set(state) == {"weight_int4", "scales", "zeros", "bias"}
    fresh = Int4Linear(192, 64, True, 32)
    fresh.load_state_dict(state)
    for name, tensor in fresh.plain_state().items():
        assert torch.equal(ours.plain_state()[name], tensor)


def test_shapes_that_do_not_fit_keep_torchs_kernel():
    assert not blocks_kernel.fits(72, 192, 32)  # rows not a multiple of 16
    assert not blocks_kernel.fits(64, 192, 64)  # groups of 64
    linear = torch.nn.Linear(192, 64, bias=False)
    module = Int4Linear.from_float(linear, group_size=64)
    assert module.uses_cpu_kernel and not module.uses_blocks_kernel


def test_fused_blocks_layers_equal_their_parts():
    parts = []
    for seed in range(3):
        linear = torch.nn.Linear(192, 64 * (seed + 1), bias=False)
        torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(seed))
        parts.append(Int4Linear.from_float(linear))
    fused = Int4Linear.concatenated(tuple(parts))
    assert fused is not None and fused.uses_blocks_kernel
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(9))
    outputs = torch.split(fused(x), [64, 128, 192], dim=-1)
    for part, out in zip(parts, outputs):
        assert torch.equal(part(x), out)
        assert part.weight_int4.data_ptr() != 0 and part.weight_int4._base is not None  # views of the fused codes


def test_compiled_module_calls_the_kernel_as_one_op():
    ours, _ = make_pair()
    x = torch.randn(4, 192, generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), ours(x))


def test_switched_off_by_the_environment():
    code = ("from lucidlm.quantization import blocks_kernel as b; "
            "print(b.available(), b.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, LUCIDLM_CPU_KERNEL="torch")).stdout
    assert out.strip() == "False LUCIDLM_CPU_KERNEL=torch"


@pytest.mark.parametrize("M", [1, 8, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_matches_the_numpy_reference(M, dtype):
    N, K = 32, 128
    g = torch.Generator().manual_seed(M)
    codes = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    codes[0, :32] = -127  # the extremes of the shifted product (AVX-512)
    codes[1, :32] = 127
    codes[2, :32] = -128  # a file may hold it: AVX2's |q| makes it 128 as an unsigned byte
    codes[3, 1::2] = -128  # ... beside x's codes of either sign
    scales = torch.rand(N, K // 32, generator=g) * 0.01 + 1e-4  # float32: the int8 path keeps scales exact
    x = (torch.randn(M, K, generator=g) * 2).to(dtype)
    got = blocks_kernel.blocks_mm(x, blocks_kernel.int8_blocks_from_codes(codes), blocks_kernel.lanes_from_rows(scales),
                                  blocks_kernel.int8_code_sums(codes))
    want = reference_int8(x.float().numpy(), codes.numpy(), scales.numpy())
    if dtype == torch.float32:
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    else:
        np.testing.assert_allclose(got.float().numpy(), want, rtol=2 ** -8, atol=1e-3 * np.abs(want).max())


def test_gguf_nibble_words_are_the_blocks_layout():
    # GGUF's Q4 byte i holds column i (low nibble) and 16 + i (high): packing random codes that
    # way by hand, the words reordered must equal the layout built from the codes themselves.
    N, G = 48, 3
    codes = torch.randint(0, 16, (N, G, 32), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    gguf_bytes = (codes[..., :16] | (codes[..., 16:] << 4)).contiguous()  # (N, G, 16)
    words = gguf_bytes.view(torch.int32)  # (N, G, 4)
    assert torch.equal(blocks_kernel.blocks_from_nibble_words(words), blocks_kernel.blocks_from_codes(codes.view(N, -1)))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_row_gathers_read_the_layout(scheme):
    # A tied embedding's lookup dequantizes rows straight from the kernel layout: the scheme's
    # formula in NumPy float32 on the plain codes and scales of those rows, repeated rows too.
    N, K = 64, 96
    g = torch.Generator().manual_seed(9)
    rows = torch.tensor([0, 17, 63, 17, 5, 31, 48])
    if scheme == "int4":
        codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        scales = (torch.rand(N, K // 32, generator=g) * 0.1).to(torch.bfloat16)
        zeros = (torch.randn(N, K // 32, generator=g) * 0.1).to(torch.bfloat16)
        operands = (blocks_kernel.blocks_from_codes(codes), blocks_kernel.lanes_from_rows(scales),
                    blocks_kernel.lanes_from_rows(zeros))
        s = scales.float().numpy()[rows.numpy()].repeat(32, axis=1)
        z = zeros.float().numpy()[rows.numpy()].repeat(32, axis=1)
        want = (codes.numpy()[rows.numpy()].astype(np.float32) - np.float32(8)) * s + z
    else:
        codes = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        scales = torch.rand(N, K // 32, generator=g) * 0.1
        operands = (blocks_kernel.int8_blocks_from_codes(codes), blocks_kernel.lanes_from_rows(scales),
                    blocks_kernel.int8_code_sums(codes))
        want = codes.numpy()[rows.numpy()].astype(np.float32) * scales.numpy()[rows.numpy()].repeat(32, axis=1)
    got = blocks_kernel.dequantized_rows(*operands, rows)
    assert got.dtype == torch.float32 and got.shape == (len(rows), K)
    np.testing.assert_array_equal(got.numpy(), want)
    with pytest.raises(RuntimeError, match="outside"):
        blocks_kernel.dequantized_rows(*operands, torch.tensor([N]))


def test_int8_layout_round_trips():
    codes = torch.randint(-127, 128, (32, 64), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    blocks = blocks_kernel.int8_blocks_from_codes(codes)
    assert blocks.shape == (2, 2, 512)
    assert torch.equal(blocks_kernel.int8_codes_from_blocks(blocks), codes)
    b, g, t, i, j = 1, 1, 6, 3, 1
    assert int(blocks[b, g, 64 * t + 4 * i + j]) == int(codes[16 * b + i, 32 * g + 4 * t + j])


def test_int8linear_per_group_of_32_uses_it():
    linear = torch.nn.Linear(128, 48, bias=True)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(6))
    ours = Int8Linear.from_float(linear, group_size=32)
    per_channel = Int8Linear.from_float(linear)  # no groups of 32: torch's kernel
    with blocks_kernel.prefer(False):
        theirs = Int8Linear.from_float(linear, group_size=32)
    assert ours.uses_blocks_kernel and not theirs.uses_blocks_kernel and not per_channel.uses_blocks_kernel
    for name, tensor in theirs.plain_state().items():  # same codes, and the scales in the dtype they came in
        assert torch.equal(ours.plain_state()[name], tensor), name
    exact = {"weight_int8": theirs.plain_state()["weight_int8"], "scales": torch.rand(48, 4) * 0.01}
    kept = Int8Linear.from_plain(exact, 128, 32)  # float32 scales (a GGUF Q8_0's) stay float32
    assert kept.uses_blocks_kernel and torch.equal(kept.plain_state()["scales"], exact["scales"])
    assert set(ours.state_dict()) == {"weight_int8", "scales", "bias"}
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(7))
    exact = x @ theirs.dequantize().t() + linear.bias.detach()
    assert ((ours(x) - exact).norm() / exact.norm()).item() < 5e-3


def test_fake_tensors_get_the_real_outputs_shapes_dtypes_and_strides():
    # torch.compile traces with fake tensors, which run the operators' Meta kernels; with a shape
    # environment the sizes may be symbolic (dynamic prefill lengths).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    layer = Int4Linear.from_float(torch.nn.Linear(64, 32, bias=False), group_size=32)
    assert layer.uses_blocks_kernel
    buffers = (layer.weight_int4, layer.block_scales, layer.block_zeros)
    calls = {
        "blocks_mm": lambda: (torch.randn(5, 64), *buffers),
        "argmax_rows": lambda: (torch.randn(3, 11),),
        "rms_norm_rows": lambda: (torch.randn(2, 3, 8), torch.randn(8), 1e-5),
        "decode_attention": lambda: (torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8),
                                     torch.ones(2, 6, dtype=torch.bool), 0.35),
    }
    for name, make in calls.items():
        op = getattr(torch.ops.lucidlm, name)
        real = op(*make())
        mode = FakeTensorMode(shape_env=ShapeEnv())
        fake_args = [mode.from_tensor(a, static_shapes=False) if isinstance(a, torch.Tensor) else a for a in make()]
        with mode:
            fake = op(*fake_args)
        sizes = [int(s) for s in fake.shape]  # hints of the symbolic sizes: the real ones
        assert sizes == list(real.shape), name
        assert fake.dtype == real.dtype and [int(s) for s in fake.stride()] == list(real.stride()), name


def test_a_compiler_that_fails_leaves_torch_kernels_and_no_partial_library(tmp_path):
    # The C files and the operators' one translation unit are compiled side by side; a failure
    # in any of them is a reason, not an exception, and nothing half-built stays in the cache.
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'no such compiler today' >&2\nexit 3\n")
    failing.chmod(0o755)
    code = ("from lucidlm.quantization import blocks_kernel as b; "
            "print(b.available()); print(b.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, LUCIDLM_CACHE=str(tmp_path / "cache"), CC=str(failing),
                                  CXX=str(failing))).stdout
    available, reason = out.strip().split("\n", 1)
    assert available == "False"
    assert "building the kernels failed" in reason and "no such compiler today" in reason, reason
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []



def test_a_cache_that_cannot_be_written_builds_the_kernels_in_the_temporary_directory(tmp_path):
    # LUCIDLM_CACHE read-only or under a file (unwritable even for root): the GGUF join already
    # fell back to <tmp>/lucidlm-<uid>; the kernels fell back to torch's, ~10x slower, saying nothing.
    assert blocks_kernel.available(), blocks_kernel.unavailable_reason()
    fallback = tmp_path / "tmp" / f"lucidlm-{os.getuid()}"
    fallback.mkdir(parents=True)  # with this session's build in it: building again is 15-30 s
    (fallback / "kernels").symlink_to(blocks_kernel.library().parent, target_is_directory=True)
    blocker = tmp_path / "a-file"
    blocker.write_text("")

    def kernels() -> list[str]:
        code = ("from lucidlm.quantization import blocks_kernel as b; "
                "print(b.available()); print(b.library()); print(b.unavailable_reason())")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=dict(os.environ, LUCIDLM_CACHE=str(blocker / "cache"),
                                       TMPDIR=str(tmp_path / "tmp"))).stdout.strip().split("\n")

    fallback.chmod(0o777)  # anyone could have put a library there: it is code, never loaded
    available, _, reason = kernels()
    assert available == "False" and "not a private directory" in reason, reason
    fallback.chmod(0o755)
    available, where, reason = kernels()
    assert available == "True", reason
    assert where == str(fallback / "kernels" / blocks_kernel.library().name)
