"""int4 weight-only quantization: asymmetric groups of 32 (default), 64, 128 or 256 input columns.

Scheme, for row n and input column k in group j = k // group_size:

    W[n, k] = (q[n, k] - 8) * scales[n, j] + zeros[n, j],     q in [0, 15]
    scales = (max - min) / 15,  zeros = min + 8 * scales       (over the group; both rounded
                                                                to the compute dtype first)

This is torch's (and gpt-fast's) int4 convention, and GGUF's Q4_0 (zero = 0) and Q4_1
(W = d * q + m, so scale = d, zero = m + 8 d) are special cases of it.

Plain layout (state_dict / files): ``weight_int4`` uint8 (out, in / 2), column 2i in the low
nibble and column 2i + 1 in the high nibble; ``scales`` and ``zeros`` (out, groups) in the
compute dtype.

Kernel layout on CPU: ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` tiles the codes
(rows padded to a multiple of 16) for ``_weight_int4pack_mm_for_cpu``, which takes
``scales_and_zeros`` (groups, out, 2). Elsewhere the codes stay plain and are dequantized for
``F.linear``. torch does not document the tile order; on the CPUs seen so far it is blocks of
64 rows (32 with AVX2), each block stored as (in, 32) bytes whose low nibbles are the block's
first 32 rows and high nibbles its last 32. ``tile_rows`` checks that on a probe once per
process; where it holds, the codes are read back from the tiles by shifts and views
(``codes_from_tiles``), and where it does not, by multiplying with the identity (exact: small
integers in bfloat16, but K times the work).

Which kernel multiplies: torch's int4 kernel is made for few rows (decoding: 1-8 tokens) and
its time grows with every row; oneDNN's bfloat16 matmul is not. Inside ``torch.compile``, a
prompt pass (and a decode step over ``DEQUANTIZE_ROWS`` rows or more, see ``prompt_sized``)
unpacks the tiles to a bfloat16 matrix, which inductor fuses into one pass, then calls
``F.linear``: SmolLM2's 120 layer matrices at 512 rows, 2 threads, 363 -> 207 ms; at 64 rows
52 -> 69 ms (2026-11-23): the unpacking costs ~30 ms per pass whatever the length, which a
short prompt pays (a 16-token prefill: 31 -> 62 ms) to spare a second compile of the pass.
The dequantized weights are, bit for bit, what the kernel returns for the identity matrix (a
test checks it); the products differ from the kernel's within bfloat16 rounding (summation
order, and the kernel may keep its weights in float32), so a compiled int4 model's greedy
tokens can differ from the eager ones where the top two logits are that close. Eagerly the unpacking is ~8 separate passes (~2 ms per 3072x576 matrix) and
saves nothing below ~512 rows, so eager matmuls always use the kernel.

lucidlm's own kernel: a layer made inside ``blocks_kernel.prefer()`` (the embedded model's
default load) keeps its codes in that kernel's layout instead of torch's tiles, where the CPU
has AVX-512 VNNI and the groups are 32 (``blocks_kernel.py``; ``uses_blocks_kernel``). It
multiplies in integers against an int8 quantization of the input, is faster at every row count
(1.1x at one row, 1.7x at 8, 2.2x at 64 over SmolLM2's matrices) and is the same op eagerly
and compiled; its products differ from the bfloat16 ones by about as much as bfloat16's own
rounding.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from lucidlm.quantization import blocks_kernel
from lucidlm.quantization.base import BLOCKS_KERNEL_DTYPES, DEFAULT_COMPUTE_DTYPE, QuantizedLinear

ROW_TILE = 16  # the CPU packing works on 16 output rows at a time
PACK_BLOCK = 64  # ... and lays out each block of 64 rows on its own (32 on AVX2: a divisor)
TILE_CHUNK = 4096  # rows converted at once (a multiple of the packing's 64-row blocks)
DEQUANTIZE_ROWS = 128  # compiled matmuls with this many rows or more dequantize (module docstring)


# Measured (README, "On a GPU"): lucidlm has no CUDA int4 kernel, so the codes are dequantized
# for every matmul; a user who picked int4 for speed on a GPU should hear it once.
CUDA_NOTE = ("int4 layers on CUDA run without a fused kernel in lucidlm: each matmul dequantizes its whole "
             "matrix (a 1B model decoded 229 tok/s on an H100, against 693 in bf16 and 773 in int8). They save "
             "memory, not time: for speed on a GPU use quantize='int8' or no quantization.")
_cuda_noted = False


def note_cuda_int4(device: torch.device) -> bool:
    """Warn once per process that int4 on CUDA is slow; whether this call warned."""
    global _cuda_noted
    if device.type != "cuda" or _cuda_noted:
        return False
    _cuda_noted = True
    warnings.warn(CUDA_NOTE, UserWarning, stacklevel=4)
    return True


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in 0..15 -> (N, K/2) uint8, even columns in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 codes in 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def codes_from_nibble_words(words: torch.Tensor) -> torch.Tensor:
    """(..., 4) int32 words holding a group's 16 nibble bytes in GGUF's Q4 order (byte i:
    column i in its low nibble, 16 + i in its high one) -> (..., 32) uint8 codes in column
    order. Every byte keeps its place in its word (in either byte order): & keeps each byte's
    low nibble, and >> 4 moves each byte's high nibble down (what it shifts in from the
    neighbouring byte, the mask clears), 4 bytes per operation."""
    halves = torch.cat([words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F], dim=-1)  # (..., 8): columns 0-15, 16-31
    return halves.view(torch.uint8)


def cpu_tiles(packed: torch.Tensor, pad: int) -> torch.Tensor:
    """(N, K/2) plain codes -> torch's CPU kernel tiles (N + pad, K/2), padding rows code 8."""
    return tiles_from_codes(lambda start, stop: unpack_nibbles(packed[start:stop]), packed.shape[0], pad)


def codes_from_tiles(tiles: torch.Tensor, block: int) -> torch.Tensor:
    """torch's CPU tiles (N, K/2) uint8 -> the codes (N, K) uint8, for the tile order the
    module docstring describes with ``block`` rows per block (N a multiple of it)."""
    N, half = tiles.shape
    t = tiles.view(N // block, 2 * half, block // 2)  # (blocks, K, block/2): byte j of column k
    halves = torch.stack([t & 0x0F, t >> 4], dim=1)  # (blocks, 2, K, block/2): rows j and block/2 + j
    return halves.transpose(2, 3).reshape(N, 2 * half)  # (N, K)


@functools.cache
def tile_rows() -> Optional[int]:
    """Rows per block of torch's CPU tiles on this machine, if ``codes_from_tiles`` reads them
    exactly (checked on a probe), else None: the callers then fall back to the kernel."""
    probe = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)  # (128, 32)
    for block in (PACK_BLOCK, PACK_BLOCK // 2):
        if tiles.shape == (128, 32) and torch.equal(codes_from_tiles(tiles, block).to(torch.int32), probe):
            return block
    return None


def prompt_sized(rows: int | torch.SymInt) -> bool:
    """Whether a compiled matmul over ``rows`` rows dequantizes (module docstring): a row
    count the graph holds symbolic (a prompt pass, compiled once for every length) does
    unless the graph proves it below ``DEQUANTIZE_ROWS`` (a cache under that many slots
    bounds the prompt); a fixed one (a decode step: the batch size) from that count up.
    ``statically_known_true`` decides without guarding on a symbolic count: a guard would
    compile the whole prompt pass a second time (~1 min) when a prompt crosses the threshold."""
    # Called only while compiling, when the compiler has imported this module (it pulls in
    # sympy: 0.4 s, too much for every ``import lucidlm``).
    return not torch.fx.experimental.symbolic_shapes.statically_known_true(rows < DEQUANTIZE_ROWS)


def readable_block(rows: int) -> Optional[int]:
    """``tile_rows()`` if tiles of ``rows`` (padded) rows are whole blocks of it, else None."""
    block = tile_rows()
    return block if block is not None and rows % block == 0 else None


def tiles_from_codes(codes_of: Callable[[int, int], torch.Tensor], N: int, pad: int) -> torch.Tensor:
    """The CPU kernel tiles (N + pad, K/2) of N rows whose codes (rows, K) in 0..15
    ``codes_of(start, stop)`` gives, padding rows code 8.

    The kernel wants its input as (N, K) int32: 4 bytes per weight where the plain layout has
    half a byte (113 MB for SmolLM2's embedding). Its packing treats every block of at most
    64 rows on its own (the vector width times 4), so converting TILE_CHUNK rows at a time
    (a multiple of 64) gives the same bytes with a bounded int32 copy; a test checks the
    equality against one call."""
    out: Optional[torch.Tensor] = None
    for start in range(0, N + pad, TILE_CHUNK):
        stop = min(start + TILE_CHUNK, N + pad)
        codes = codes_of(start, min(stop, N)).to(torch.int32)  # (rows, K); no copy if int32 already
        if codes.shape[0] < stop - start:  # the padded tail
            codes = F.pad(codes, (0, 0, 0, stop - start - codes.shape[0]), value=8)
        tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)  # (rows, K/2) uint8
        if out is None:
            if stop == N + pad:  # one chunk: no copy
                return tiles
            out = torch.empty((N + pad, *tiles.shape[1:]), dtype=tiles.dtype)
        out[start:stop] = tiles
    assert out is not None
    return out


class Int4Linear(QuantizedLinear):
    """A linear layer with int4 weights: asymmetric codes in 0..15, two per byte, with a scale and
    a zero point per group of 32 (default), 64, 128 or 256 input columns (module docstring).
    Built by ``quantize(model, "int4")``; y = x @ dequantize(W).T + b, in the compute dtype."""

    scheme = "int4"
    default_group_size = 32
    group_sizes = (32, 64, 128, 256)  # what torch's CPU int4 kernel (and lucidlm's, at 32) runs
    plain_names = ("weight_int4", "scales", "zeros")
    compute_dtypes = (torch.bfloat16, torch.float16, torch.float32)  # torch's int4 kernel refuses float64
    # Rows per block of the CPU tiles when ``codes_from_tiles`` can read them (set with the
    # tiles): then the codes come back by shifts and views, and compiled prompts dequantize.
    tile_block: Optional[int] = None

    @staticmethod
    def quantize_weight(weight: torch.Tensor, group_size: Optional[int],
                        scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        N, K = weight.shape
        g = group_size or Int4Linear.default_group_size
        grouped = weight.float().reshape(N, K // g, g)  # (N, G, g)
        low, high = torch.aminmax(grouped, dim=-1)  # (N, G), one pass
        span = high - low  # overflows float32 for finite weights near +-3e38: divided first there
        scales = torch.where(span.isfinite(), span / 15, high / 15 - low / 15).to(scale_dtype)
        safe = scales.float().masked_fill(scales.float() == 0, 1.0)  # a constant group: all codes 8
        zeros = (low + 8 * scales.float()).to(scale_dtype)
        # round((w - zero) / scale + 8), clamped: one temporary, the rest in place (same arithmetic)
        q = (grouped - zeros.float()[..., None]).div_(safe[..., None]).add_(8).round_().clamp_(0, 15)
        return {"weight_int4": pack_nibbles(q.reshape(N, K)), "scales": scales, "zeros": zeros}

    @staticmethod
    def dequantize_plain(plain: dict[str, torch.Tensor], group_size: Optional[int]) -> torch.Tensor:
        codes = unpack_nibbles(plain["weight_int4"]).float()  # (N, K)
        N, K = codes.shape
        g = group_size or K
        scales, zeros = plain["scales"].float()[..., None], plain["zeros"].float()[..., None]  # (N, G, 1)
        return ((codes.reshape(N, K // g, g) - 8) * scales + zeros).reshape(N, K)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: Optional[int],
                   compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> "Int4Linear":
        """A module from unpacked codes (N, K) in 0..15 (int32 on CPU is what the kernel's
        packing reads) and scales / zeros (N, G): a GGUF Q4 block map goes straight to the
        tiles, without packing nibbles for the plain layout and unpacking them again."""
        N, K = codes.shape
        module = cls(K, N, False, group_size, compute_dtype)
        if codes.device.type != "cpu":
            module._install({"weight_int4": pack_nibbles(codes), "scales": scales, "zeros": zeros})
        else:
            module._install_cpu(lambda start, stop: codes[start:stop], N, scales, zeros)
        return module

    @classmethod
    def from_nibble_words(cls, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> "Int4Linear":
        """A module in groups of 32 from GGUF Q4 nibbles: ``words`` (N, G, 4) int32 holding each
        group's 16 bytes (byte i: column i in its low nibble, 16 + i in its high one) and
        scales / zeros (N, G). lucidlm's kernel layout is those very words, reordered (one
        copy); other kernels get the codes unpacked."""
        N, G, _ = words.shape
        module = cls(G * 32, N, False, 32, compute_dtype)
        scales, zeros = scales.to(compute_dtype), zeros.to(compute_dtype)
        if words.device.type == "cpu" and module.blocks_kernel_fits(N):
            module.installs += 1
            module._install_blocks(blocks_kernel.blocks_from_nibble_words(words), scales, zeros)
            return module
        codes = codes_from_nibble_words(words).view(N, G * 32)
        return cls.from_codes(codes if words.device.type != "cpu" else codes.to(torch.int32), scales, zeros, 32,
                              compute_dtype)

    @classmethod
    def from_q4_blocks(cls, blocks: torch.Tensor, rows: Optional[torch.Tensor] = None,
                       compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE,
                       out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                       ) -> Optional[tuple["Int4Linear", int]]:
        """(A module in groups of 32 from GGUF Q4_0 / Q4_1 blocks, how many of those blocks have a
        scale d or minimum m that is NaN or infinite). blocks: (N, G, 18 or 20) uint8 (a view of
        the file's map); output row n is taken from row ``rows[n]`` (all rows in order when
        None). One C pass (``torch.ops.lucidlm.q4_blocks_into``) writes lucidlm's kernel layout:
        the nibble bytes reordered, scale d and zero m + 8 d rounded to bfloat16 (the same bytes
        ``from_nibble_words`` makes in ~10 torch ops), and counts the non-finite scales on the
        way, so a loader need not read them again. ``out``: (codes (N/16, G, 256) uint8,
        scales, zeros (N/16, G, 16) bfloat16) to write into, e.g. slices of a fused layer's
        buffers. None where that layout does not apply."""
        N, G, _ = blocks.shape
        module = cls(G * 32, N, False, 32, compute_dtype)
        if blocks.device.type != "cpu" or not module.blocks_kernel_fits(N):
            return None
        if out is None:
            out = (torch.empty((N // blocks_kernel.ROW_BLOCK, G, 256), dtype=torch.uint8),
                   *(torch.empty((N // blocks_kernel.ROW_BLOCK, G, 16), dtype=torch.bfloat16) for _ in range(2)))
        nonfinite = torch.ops.lucidlm.q4_blocks_into(blocks, rows, *out)
        module.installs += 1
        module._install_block_lanes(*out)
        return module, nonfinite

    @classmethod
    def concatenated(cls, parts: tuple["Int4Linear", ...]) -> Optional["Int4Linear"]:
        """One module computing ``parts`` side by side (outputs concatenated), for
        ``model/fused.py``; each part then reads its rows of the fused tiles as a view, so
        the codes are not stored twice. Only for CPU-kernel parts whose row counts are whole
        packing blocks (each part's tiles are then a row slice of the whole's) with the same
        input, groups and compute dtype and no bias; else None."""
        first = parts[0]
        if all(p.uses_blocks_kernel and p.bias is None and (p.in_features, p.group_size) == (first.in_features, 32)
               for p in parts):
            return cls._concatenated_blocks(parts)
        if not all(p.uses_cpu_kernel and p.bias is None and p.out_features % PACK_BLOCK == 0
                   and (p.in_features, p.group_size, p.compute_dtype) == (first.in_features, first.group_size,
                                                                            first.compute_dtype)
                   for p in parts):
            return None
        fused = cls(first.in_features, sum(p.out_features for p in parts), False, first.group_size,
                    first.compute_dtype)
        fused.uses_cpu_kernel = True
        fused.tile_block = first.tile_block  # every part's rows are whole blocks, so the sum's are
        tiles = torch.cat([p.weight_int4 for p in parts])  # (sum N, K/2): block-aligned, so rows stay put
        fused.register_buffer("weight_int4", tiles)
        fused.register_buffer("scales_and_zeros", torch.cat([p.scales_and_zeros for p in parts], dim=1).contiguous())
        start = 0
        for p in parts:  # same bytes, now shared: no install, the fused path stays valid
            p.weight_int4 = tiles[start:start + p.out_features]
            start += p.out_features
        return fused

    @classmethod
    def _concatenated_blocks(cls, parts: tuple["Int4Linear", ...]) -> "Int4Linear":
        """``concatenated`` for blocks-kernel parts: their row blocks one after another."""
        first = parts[0]
        fused = cls(first.in_features, sum(p.out_features for p in parts), False, 32, first.compute_dtype)
        fused.uses_blocks_kernel = True
        for name in ("weight_int4", "block_scales", "block_zeros"):
            whole = blocks_kernel.joined_rows([getattr(p, name) for p in parts])  # (sum N / 16, G, ...)
            fused.register_buffer(name, whole)
            start = 0
            for p in parts:  # same bytes, now shared: no install, the fused path stays valid
                rows = p.out_features // blocks_kernel.ROW_BLOCK
                setattr(p, name, whole[start:start + rows])
                start += rows
        return fused

    def _install(self, plain: dict[str, torch.Tensor]) -> None:
        packed = plain["weight_int4"].to(torch.uint8)
        if packed.device.type == "cpu":
            self._install_cpu(lambda start, stop: unpack_nibbles(packed[start:stop]), packed.shape[0],
                              plain["scales"], plain["zeros"])
            return
        self.installs += 1  # (the CPU path counts in _install_cpu)
        note_cuda_int4(packed.device)
        self.uses_cpu_kernel = self.uses_blocks_kernel = False
        self.tile_block = None
        scales = plain["scales"].to(self.compute_dtype).reshape(packed.shape[0], -1)
        zeros = plain["zeros"].to(self.compute_dtype).reshape(packed.shape[0], -1)
        self.register_buffer("weight_int4", packed.contiguous())
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).contiguous())
        self.block_scales = self.block_zeros = None  # a blocks-kernel layer moved off the CPU

    def _install_cpu(self, codes_of: Callable[[int, int], torch.Tensor], N: int, scales: torch.Tensor,
                     zeros: torch.Tensor) -> None:
        self.installs += 1
        scales = scales.to(self.compute_dtype).reshape(N, -1)
        zeros = zeros.to(self.compute_dtype).reshape(N, -1)
        if self.blocks_kernel_fits(N):
            blocks = torch.empty((N // blocks_kernel.ROW_BLOCK, self.in_features // blocks_kernel.GROUP, 256),
                                 dtype=torch.uint8)
            for start in range(0, N, TILE_CHUNK):  # a bounded int32 copy of the codes at a time
                stop = min(start + TILE_CHUNK, N)
                blocks[start // blocks_kernel.ROW_BLOCK:stop // blocks_kernel.ROW_BLOCK] = \
                    blocks_kernel.blocks_from_codes(codes_of(start, stop))
            self._install_blocks(blocks, scales, zeros)
            return
        self.uses_cpu_kernel, self.uses_blocks_kernel = True, False
        self.block_scales = self.block_zeros = None
        pad = -N % ROW_TILE
        if pad:  # padding rows are never read back: the output is sliced to N
            scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
        self.register_buffer("weight_int4", tiles_from_codes(codes_of, N, pad))
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).contiguous())
        self.tile_block = readable_block(N + pad)

    def _install_blocks(self, blocks: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Codes already in lucidlm's kernel layout (N/16, G, 256); scales, zeros (N, G) in the compute dtype."""
        self._install_block_lanes(blocks, blocks_kernel.lanes_from_rows(scales), blocks_kernel.lanes_from_rows(zeros))

    def _install_block_lanes(self, blocks: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Codes (N/16, G, 256), scales and zeros (N/16, G, 16) all in the kernel's layout."""
        self.uses_cpu_kernel, self.uses_blocks_kernel, self.tile_block = False, True, None
        self.register_buffer("weight_int4", blocks)
        self.register_buffer("scales_and_zeros", None)
        self.register_buffer("block_scales", scales)
        self.register_buffer("block_zeros", zeros)

    def plain_state(self) -> dict[str, torch.Tensor]:
        N = self.out_features
        if self.uses_blocks_kernel:
            return {"weight_int4": pack_nibbles(blocks_kernel.codes_from_blocks(self.weight_int4)),
                    "scales": blocks_kernel.rows_from_lanes(self.block_scales).contiguous(),
                    "zeros": blocks_kernel.rows_from_lanes(self.block_zeros).contiguous()}
        scales = self.scales_and_zeros[..., 0].t()[:N].contiguous()  # (N, G)
        zeros = self.scales_and_zeros[..., 1].t()[:N].contiguous()
        if not self.uses_cpu_kernel:
            return {"weight_int4": self.weight_int4, "scales": scales, "zeros": zeros}
        block = self.tile_block
        if block is not None:
            return {"weight_int4": pack_nibbles(codes_from_tiles(self.weight_int4, block)[:N]), "scales": scales,
                    "zeros": zeros}
        # Unknown tile order: with scale 1 and zero 8 the kernel returns the codes themselves.
        K, Npad = self.in_features, self.weight_int4.shape[0]
        groups = K // self.group_size
        unit = torch.stack([torch.ones(groups, Npad), torch.full((groups, Npad), 8.0)], -1).to(torch.bfloat16)
        eye = torch.eye(K, dtype=torch.bfloat16)
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight_int4, self.group_size, unit)  # (K, Npad)
        codes = codes.t()[:N].round().to(torch.uint8)
        return {"weight_int4": pack_nibbles(codes), "scales": scales, "zeros": zeros}

    def dequantized_tiles(self) -> torch.Tensor:
        """(Npad, K) in the compute dtype, straight from the tiles (needs ``tile_block``):
        code - 8 is exact in bfloat16 and addcmul rounds once."""
        block = self.tile_block
        assert block is not None, "dequantized_tiles needs a known tile order (tile_block)"
        Npad, K, g = self.weight_int4.shape[0], self.in_features, self.group_size
        codes = codes_from_tiles(self.weight_int4, block).view(Npad, K // g, g)  # (Npad, G, g)
        centred = codes.to(self.compute_dtype) - 8
        scales = self.scales_and_zeros[..., 0].t().unsqueeze(-1)  # (Npad, G, 1)
        zeros = self.scales_and_zeros[..., 1].t().contiguous().unsqueeze(-1)  # row-major: addcmul's output follows it
        return torch.addcmul(zeros, centred, scales).view(Npad, K)

    def blocks_operands(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        b = self._buffers  # read directly: a decode step asks for 120 of these (base.py)
        return (b["weight_int4"], b["block_scales"], b["block_zeros"]) if self.uses_blocks_kernel else None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_blocks_kernel and x.dtype in BLOCKS_KERNEL_DTYPES:
            return blocks_kernel.blocks_mm(x, *self.blocks_operands())  # (M, N)
        if self.uses_cpu_kernel and x.dtype == self.scales_and_zeros.dtype:
            if torch.compiler.is_compiling() and self.tile_block is not None and prompt_sized(x.shape[0]):
                y = F.linear(x, self.dequantized_tiles())  # see the module docstring
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight_int4, self.group_size,
                                                                 self.scales_and_zeros)  # (M, Npad)
            return y[:, :self.out_features] if y.shape[1] != self.out_features else y
        return F.linear(x, self.dequantize(x.dtype))
