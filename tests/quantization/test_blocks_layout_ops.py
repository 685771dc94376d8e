"""The loader's C passes into lucidlm's kernel layout (``torch.ops.lucidlm.lanes_from_groups``,
``int8_group_sums``, ``q4_blocks``, ``q8_blocks_into`` in kernels/blocks32.c) against NumPy spellings of the
layout's definition and of GGUF's Q4 block format, and bit for bit against the torch spelling
they replace (taken by hiding the kernel library)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lucidlm.model.positions import permute_qk_to_half
from lucidlm.quantization import Int4Linear, blocks_kernel


@pytest.fixture(autouse=True)
def kernels():
    assert blocks_kernel.available(), blocks_kernel.unavailable_reason()  # CI's CPUs have AVX2 or AVX-512


def lanes_reference(groups: np.ndarray) -> np.ndarray:
    """(N, G, W) bytes -> (N/16, G, 16 W): byte 64 t + 4 i + j of block (b, g) is byte 4 t + j
    of row 16 b + i's group g (blocks32.c's layout), spelled with loops."""
    N, G, W = groups.shape
    out = np.zeros((N // 16, G, 16 * W), dtype=groups.dtype)
    for b in range(N // 16):
        for g in range(G):
            for t in range(W // 4):
                for i in range(16):
                    out[b, g, 64 * t + 4 * i:64 * t + 4 * i + 4] = groups[16 * b + i, g, 4 * t:4 * t + 4]
    return out


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("block_bytes, start, width", [(20, 4, 16), (18, 2, 16), (34, 2, 32), (16, 0, 16)])
def test_lanes_from_groups_reads_strided_groups(block_bytes, start, width):
    # Q4_1, Q4_0 and Q8_0 blocks of a file (the codes a strided view inside each block), and plain bytes
    N, G = 48, 5
    blocks = random_bytes((N, G, block_bytes), seed=block_bytes)
    groups = blocks[..., start:start + width]
    if width == 32:
        groups = groups.view(torch.int8)
    got = torch.ops.lucidlm.lanes_from_groups(groups)
    assert got.dtype == groups.dtype and got.is_contiguous()
    np.testing.assert_array_equal(got.numpy(), lanes_reference(groups.numpy()))


def test_int8_group_sums_are_each_rows_sums_in_lanes():
    N, G = 32, 7
    blocks = random_bytes((N, G, 34), seed=3)
    codes = blocks[..., 2:].view(torch.int8)  # strided, as a Q8_0 file's codes
    got = torch.ops.lucidlm.int8_group_sums(codes)
    sums = codes.numpy().astype(np.int64).sum(-1)  # (N, G)
    want = sums.reshape(N // 16, 16, G).transpose(0, 2, 1).astype(np.float32)
    np.testing.assert_array_equal(got.numpy(), want)


def f16_fields(seed: int, count: int) -> np.ndarray:
    """Random float16 bit patterns (every exponent, so bfloat16 ties, subnormals, infinities
    and NaNs all occur), plus the cases that matter spelled out."""
    bits = np.random.default_rng(seed).integers(0, 1 << 16, count, dtype=np.uint16)
    special = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x3C00, 0x3C04, 0x3C0C, 0x3C08, 0x7C00, 0xFC00, 0x7E00,
                        0x7BFF, 0x0404], dtype=np.uint16)
    bits[:len(special)] = special
    return bits


def q4_reference(blocks: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_0 / Q4_1 (d, [m,] 16 nibble bytes per block) in lucidlm's int4 scheme, from the
    format's definition: codes = the nibble bytes in the lanes layout; scale d and zero m + 8 d
    (Q4_0: 0) in float32, rounded to bfloat16 by torch; output row n is source row rows[n]."""
    N, G, size = blocks.shape
    src = blocks[rows]
    d = src[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    with np.errstate(invalid="ignore"):  # inf - inf and NaNs are in the data on purpose
        zero = (src[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + np.float32(8) * d
                if size == 20 else np.zeros_like(d))
    def lanes(values: np.ndarray) -> np.ndarray:
        return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy() \
            .reshape(N // 16, 16, G).transpose(0, 2, 1)
    return lanes_reference(src[..., size - 16:]), lanes(d), lanes(zero)


@pytest.mark.parametrize("size", [18, 20])
@pytest.mark.parametrize("permuted", [False, True])
def test_q4_blocks_match_the_format_and_the_torch_spelling(size, permuted, monkeypatch):
    N, G = 64, 6
    blocks = random_bytes((N, G, size), seed=size)
    halves = blocks.view(torch.int16)  # the f16 fields: random bit patterns, specials first
    halves[..., 0] = torch.from_numpy(f16_fields(size, N * G).view(np.int16)).view(N, G)
    if size == 20:
        halves[..., 1] = torch.from_numpy(f16_fields(size + 1, N * G).view(np.int16)).view(N, G)
    file_rows = torch.zeros(N + 3, G, size, dtype=torch.uint8)
    file_rows[:N] = blocks
    view = file_rows[:N]  # like a tensor inside the map
    rows = permute_qk_to_half(torch.arange(N), 4) if permuted else torch.arange(N)
    codes, scales, zeros = torch.ops.lucidlm.q4_blocks(view, rows if permuted else None)
    want = q4_reference(blocks.numpy(), rows.numpy())
    np.testing.assert_array_equal(codes.numpy(), want[0])
    assert torch.isnan(scales).any() and torch.isinf(scales).any()  # the specials are in the data
    assert_same_bfloat16(scales, want[1])
    assert_same_bfloat16(zeros, want[2])

    # the loader's call writes the same into its own buffers and counts the blocks whose d or
    # m is NaN or infinite, which it then need not read again
    out = (torch.empty_like(codes), torch.empty_like(scales), torch.empty_like(zeros))
    nonfinite = torch.ops.lucidlm.q4_blocks_into(view, rows if permuted else None, *out)
    fields = blocks.numpy().view(np.float16)[..., :2 if size == 20 else 1]  # (N, G, 1 or 2): d (and m)
    assert nonfinite == int((~np.isfinite(fields)).any(-1).sum()) > 0
    assert torch.equal(out[0], codes)
    assert_same_bfloat16(out[1], want[1])
    assert_same_bfloat16(out[2], want[2])
    clean = blocks.clone()
    clean.view(torch.float16)[..., :2] = 0.5  # finite d and m in every block
    assert torch.ops.lucidlm.q4_blocks_into(clean, None, *out) == 0

    # the torch spelling the loader used before: the nibble words and the (N, G) scales, permuted
    words = blocks[..., size - 16:].contiguous().view(torch.int32)
    d = blocks.view(torch.float16)[..., 0].float()
    zero = blocks.view(torch.float16)[..., 1].float() + 8 * d if size == 20 else torch.zeros_like(d)
    words, d, zero = (permute_qk_to_half(t, 4) if permuted else t for t in (words, d, zero))
    monkeypatch.setattr(blocks_kernel, "library", lambda: None)  # its torch spelling of the reordering
    layer = Int4Linear(G * 32, N, False, 32)
    layer._install_blocks(blocks_kernel.blocks_from_nibble_words(words), d.to(torch.bfloat16), zero.to(torch.bfloat16))
    assert torch.equal(codes, layer.weight_int4)
    assert_same_bfloat16(scales, layer.block_scales.view(torch.int16).numpy())
    assert_same_bfloat16(zeros, layer.block_zeros.view(torch.int16).numpy())


@pytest.mark.parametrize("permuted", [False, True])
def test_q8_blocks_match_the_format_and_the_separate_passes(permuted):
    N, G = 48, 5
    blocks = random_bytes((N, G, 34), seed=34)
    blocks.view(torch.int16)[..., 0] = torch.from_numpy(f16_fields(34, N * G).view(np.int16)).view(N, G)
    file_rows = torch.zeros(N + 2, G, 34, dtype=torch.uint8)
    file_rows[:N] = blocks
    view = file_rows[:N]  # like a tensor inside the map
    rows = permute_qk_to_half(torch.arange(N), 3) if permuted else torch.arange(N)
    out = (torch.empty(N // 16, G, 512, dtype=torch.int8), torch.empty(N // 16, G, 16), torch.empty(N // 16, G, 16))
    nonfinite = torch.ops.lucidlm.q8_blocks_into(view, rows if permuted else None, *out)

    # the format: block = f16 d, then 32 int8 codes; output row n is source row rows[n]
    src = blocks.numpy()[rows.numpy()]
    d = src[..., 0:2].copy().view(np.float16)[..., 0]  # (N, G)
    codes = src[..., 2:].view(np.int8)  # (N, G, 32)
    np.testing.assert_array_equal(out[0].numpy(), lanes_reference(codes))
    lanes = lambda values: values.reshape(N // 16, 16, G).transpose(0, 2, 1)  # noqa: E731 - (N, G) -> lanes
    np.testing.assert_array_equal(out[1].numpy(), lanes(d.astype(np.float32)))  # NaN == NaN here
    np.testing.assert_array_equal(out[2].numpy(), lanes(codes.astype(np.int64).sum(-1).astype(np.float32)))
    assert nonfinite == int((~np.isfinite(d)).sum()) > 0  # the specials are in the data

    # the same bytes as the separate passes it replaces (lanes_from_groups, int8_group_sums)
    ordered = blocks[rows][..., 2:].view(torch.int8)
    assert torch.equal(out[0], torch.ops.lucidlm.lanes_from_groups(ordered))
    assert torch.equal(out[2], torch.ops.lucidlm.int8_group_sums(ordered))
    clean = blocks.clone()
    clean.view(torch.float16)[..., 0] = 0.25
    assert torch.ops.lucidlm.q8_blocks_into(clean, None, *out) == 0


def assert_same_bfloat16(got: torch.Tensor, want_bits: np.ndarray) -> None:
    """Bit for bit, except that any NaN matches any NaN (torch's own conversions differ in a
    NaN's bits); infinities, zeros' signs and every rounding must agree exactly."""
    want = torch.from_numpy(np.ascontiguousarray(want_bits)).view(torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(RuntimeError, match="rows must be a multiple of 16"):
        torch.ops.lucidlm.lanes_from_groups(torch.zeros(8, 2, 16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="uint8 or int8"):
        torch.ops.lucidlm.lanes_from_groups(torch.zeros(16, 2, 16))
    with pytest.raises(RuntimeError, match="18 or 20"):
        torch.ops.lucidlm.q4_blocks(torch.zeros(16, 2, 34, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.lucidlm.q4_blocks(torch.zeros(16, 2, 20, dtype=torch.uint8), torch.arange(16) + 1)
    with pytest.raises(RuntimeError, match="q8_blocks: blocks must be"):
        torch.ops.lucidlm.q8_blocks_into(torch.zeros(16, 2, 20, dtype=torch.uint8), None,
                                         torch.empty(1, 2, 512, dtype=torch.int8), torch.empty(1, 2, 16), torch.empty(1, 2, 16))
    with pytest.raises(RuntimeError, match="q8_blocks: row index"):
        torch.ops.lucidlm.q8_blocks_into(torch.zeros(16, 2, 34, dtype=torch.uint8), torch.arange(16) - 1,
                                         torch.empty(1, 2, 512, dtype=torch.int8), torch.empty(1, 2, 16), torch.empty(1, 2, 16))
    with pytest.raises(RuntimeError, match="int8_group_sums"):
        torch.ops.lucidlm.int8_group_sums(torch.zeros(16, 2, 32, dtype=torch.uint8))


def test_joined_rows_views_parts_that_lie_end_to_end_and_copies_others():
    base = torch.arange(6 * 2 * 4, dtype=torch.int16).view(6, 2, 4)
    parts = [base[0:2], base[2:5], base[5:6]]
    whole = blocks_kernel.joined_rows(parts)
    assert torch.equal(whole, torch.cat(parts))
    assert whole.data_ptr() == base.data_ptr()  # no copy: the parts' own memory
    whole[3, 1, 2] = -1
    assert int(parts[1][1, 1, 2]) == -1
    for apart in ([base[0:2], base[3:5]], [base[0:2], base[2:4].clone()], [base[2:4], base[0:2]]):
        joined = blocks_kernel.joined_rows(apart)  # a gap, another storage, out of order
        assert torch.equal(joined, torch.cat(apart))
        assert joined.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
