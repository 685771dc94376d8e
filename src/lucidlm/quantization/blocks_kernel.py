"""lucidlm's own CPU kernel for int4 and int8 weights in groups of 32 (``kernels/blocks32.c``).

The same library carries more loops: a float32 decode step's attention
(``kernels/decode_attention.c``), RMSNorm over float32 rows (``kernels/rms_norm_rows.c``) and a
whole block's decode step, or the whole stack's (``kernels/decode_block_op.cpp``), which ``use_cpu_loops`` below
switches on for a model's layers on a CPU, and greedy decoding's argmax over the logits
(``kernels/argmax_rows.c``, ``argmax_rows`` below).

torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) multiplies in floating point and its
time grows with every row of the input (SmolLM2's matrices, 2 threads: 5 ms for one row,
15 ms for 8). llama.cpp's way is faster: quantize each input row to int8 per group of 32 and
take the dot products in integers with AVX-512 VNNI, 64 bytes per instruction (or AVX2's
two-instruction equivalent, 32 bytes at a time, on CPUs without it). The C file
does that over a layout that puts 16 output rows side by side in each vector, so 8 input rows
share one unpacking of the weights (the module docstring of ``blocks32.c`` has the
arithmetic and the layout).

Each input value gets two int8 codes (a coarse one and one for what it misses), so the input
is kept about as precisely as a bfloat16 one: one code alone put the embedded model's logits
twice as far from float32's as torch's kernel and turned its greedy chat answer.
``tests/quantization/test_blocks_kernel.py`` holds the kernel to an independent NumPy
reference of exactly this arithmetic and to the exact product; the embedded model's checks
(perplexity, greedy choices, the README's question) hold with it.

The kernels are compiled on first use, 15-30 s on two cores, with the system's compilers (``$CC`` /
``$CXX``, else ``cc`` / ``c++``; the C files with ``-O3 -march=native -fopenmp``), together
with the ``kernels/*_op.cpp`` files (one translation unit), which register them as torch operators
such as ``torch.ops.lucidlm.blocks_mm`` (so eager calls and compiled graphs reach them in C++), into
``<cache>/kernels/`` (where that cannot be written, ``<tmp>/lucidlm-<uid>/kernels/``) under a
name that hashes the sources, the flags, torch's version and the CPU. ``scripts/install.sh`` builds them once. They are used only where the CPU has AVX-512
VNNI and BF16, or AVX2, FMA and F16C, and the build works; ``available()`` says so, and ``unavailable_reason()`` why
not. Where they are not, every layer keeps torch's kernels. Which kernel a layer uses is fixed
when its weights are installed (``QuantizedLinear.uses_blocks_kernel``).

    python3 -c "from lucidlm.quantization import blocks_kernel; blocks_kernel.build()"
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from lucidlm.cache_dir import cache_root, fallback_root, private_fallback_root
from lucidlm.staging import publish, staging_file

KERNELS = Path(__file__).with_name("kernels")
# the C loops (blocks32.c, decode_attention.c, rms_norm_rows.c, argmax_rows.c) and the files that
# make them torch operators
C_SOURCES, OP_SOURCES = sorted(KERNELS.glob("*.c")), sorted(KERNELS.glob("*.cpp"))
C_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
# the operator files: vectorized for this CPU too (decode_block_op.cpp's element-wise loops over a
# batch), never contracting a * b + c into an FMA, which would round differently from torch
CXX_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-fPIC")
# the CPU features of the two builds of the inner loops (blocks32_avx512.h, blocks32_avx2.h)
CPU_FLAG_SETS = (("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"), ("avx2", "fma", "f16c"))
ROW_BLOCK = 16  # output rows per vector (one 32-bit lane each)
GROUP = 32  # input columns per scale (and zero)
_unavailable: list[str] = []  # why the kernels could not be had (filled by library())


def instruction_set() -> Optional[str]:
    """Which build of the inner loops this CPU gets: "avx512-vnni", "avx2", or None (torch's
    kernels only); from the CPU's flags, without building anything (benchmarks record it)."""
    flags = _cpu()[1] if platform.machine() in ("x86_64", "AMD64") else set()
    for name, wanted in zip(("avx512-vnni", "avx2"), CPU_FLAG_SETS):
        if all(f in flags for f in wanted):
            return name
    return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where it cannot be read)."""
    return _cpu()[0]


def _cpu() -> tuple[str, set[str]]:
    """(model name, feature flags) of the first CPU in /proc/cpuinfo; empty where it cannot be read."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    return model, set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def _compile_commands(cc: str, cxx: str, work: Path) -> list[list[str]]:
    """One command per C file, and one for all the operator files at once: they are one
    translation unit (``ops.cpp`` includes each), because parsing torch's headers is nearly all of
    an operator file's compile time (~15 s each), and five files paid it five times."""
    torch_dir = Path(torch.__file__).parent
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    unity = work / "ops.cpp"
    unity.write_text("".join(f'#include "{source}"\n' for source in OP_SOURCES), encoding="utf-8")
    return [*[[cc, *C_FLAGS, "-c", str(source), "-o", str(work / f"{source.stem}.o")] for source in C_SOURCES],
            [cxx, *CXX_FLAGS, abi, f"-I{torch_dir / 'include'}", "-c", str(unity), "-o", str(work / "ops.o")]]


def _link_command(cxx: str, work: Path, out: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    objects = [work / f"{source.stem}.o" for source in C_SOURCES] + [work / "ops.o"]
    # libgomp by its soname: the process already holds torch's copy, so both share one thread pool
    return [cxx, "-shared", *map(str, objects), "-fopenmp", f"-L{torch_dir / 'lib'}",
            "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(out)]


def _run_all(commands: list[list[str]], timeout: float) -> None:
    """Run the compilers side by side (the C files take ~1 s each next to the operators' ~15 s),
    each as ``subprocess.run(check=True)``; the first command's failure, in order, is raised."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        runs = [pool.submit(subprocess.run, command, check=True, capture_output=True, timeout=timeout)
                for command in commands]
        for run in runs:
            run.result()


def _build(target: Path, cc: str, cxx: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = staging_file(target)
    handle.close()
    print(f"lucidlm: compiling its CPU kernels once (~15-30 s) into {target.parent}", file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory() as work:
            _run_all(_compile_commands(cc, cxx, Path(work)), timeout=300)
            subprocess.run(_link_command(cxx, Path(work), staging), check=True, capture_output=True, timeout=300)
        publish(staging, target)
    finally:
        staging.unlink(missing_ok=True)


def library() -> Optional[Path]:
    """The operator library, built on first use and loaded into torch; None where it cannot be had."""
    if not _library_found:  # the first asks take a lock (the loader's worker threads ask at once:
        with _library_lock:  # one build, not one each); every later one, a decode step's, none
            if not _library_found:
                _library_found.append(_library())
    return _library_found[0]


_library_lock = threading.Lock()
_library_found: list[Optional[Path]] = []  # [the library or None] once looked for


def _library() -> Optional[Path]:
    if os.environ.get("LUCIDLM_CPU_KERNEL", "") == "torch":
        _unavailable.append("LUCIDLM_CPU_KERNEL=torch")
        return None
    cpu, flags = _cpu() if platform.machine() in ("x86_64", "AMD64") else ("", set())
    if instruction_set() is None:
        _unavailable.append("the CPU has neither AVX-512 VNNI + BF16 nor AVX2 + FMA + F16C")
        return None
    cc, cxx = os.environ.get("CC") or "cc", os.environ.get("CXX") or "c++"
    absent = [c for c in (cc, cxx) if shutil.which(c) is None]
    if absent:
        _unavailable.append(f"no compiler {' or '.join(map(repr, absent))} on PATH (apt-get install g++)")
        return None
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(KERNELS.iterdir()) if p.suffix in (".c", ".h", ".cpp"))
                         + repr((C_FLAGS, CXX_FLAGS, cc, cxx, torch.__version__, cpu, sorted(flags))).encode())
    name = f"blocks32-{key.hexdigest()[:16]}.so"
    # a cache that cannot be written (read-only, full, under a file) builds into the per-user
    # temporary directory, as the GGUF join does: falling back to torch's kernels silently made
    # the embedded model's decoding ~10x slower
    for root in dict.fromkeys((cache_root(), fallback_root())):
        target = root / "kernels" / name
        try:
            if root == fallback_root():
                private_fallback_root()
            if not target.exists():
                _build(target, cc, cxx)
            torch.ops.load_library(str(target))
            return target
        except OSError as error:  # this directory: try the next
            _unavailable.append(f"building the kernels failed: {error}")
        except (RuntimeError, subprocess.SubprocessError) as error:  # the compiler's: the same anywhere
            detail = getattr(error, "stderr", b"") or b""
            _unavailable.append(f"building the kernels failed: {error} {detail.decode(errors='replace')[-400:]}")
            return None
    return None


def available() -> bool:
    return library() is not None


def unavailable_reason() -> Optional[str]:
    """Why ``available()`` is False (None when it is True)."""
    return None if available() else "; ".join(_unavailable) or "unknown"


def fits(out_features: int, in_features: int, group_size: Optional[int]) -> bool:
    """Whether a matrix of this shape and grouping can use the kernel (where it is available)."""
    return group_size == GROUP and out_features % ROW_BLOCK == 0 and in_features % GROUP == 0


# -- layout: plain (N, K) codes and (N, G) scales <-> blocks -----------------------------------
def blocks_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in 0..15 -> (N/16, G, 256) uint8: for group g of row block b, 4 vectors of
    16 lanes x 4 bytes; byte j of lane i in vector t holds column 4t + j of row 16b + i in its
    low nibble and column 16 + 4t + j in its high nibble (``blocks32.c``)."""
    N, K = codes.shape
    c = codes.to(torch.uint8).view(N // ROW_BLOCK, ROW_BLOCK, K // GROUP, 2, 4, 4)  # (b, i, g, half, t, j)
    packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # (b, i, g, t, j)
    return packed.permute(0, 2, 3, 1, 4).reshape(N // ROW_BLOCK, K // GROUP, 256).contiguous()


def blocks_from_nibble_words(words: torch.Tensor) -> torch.Tensor:
    """(N, G, 4) int32, each group's 16 nibble bytes in GGUF's Q4 order (byte i: column i in
    its low nibble, column 16 + i in its high one), 4 bytes per word -> the same blocks as
    ``blocks_from_codes``: lane i of vector t holds bytes 4t..4t+3 of row 16b + i's group,
    which is word t itself. One copy of whole words: no unpacking."""
    N, G, _ = words.shape
    if library() is not None:  # one pass in C; torch's strided copy below is several times slower
        return torch.ops.lucidlm.lanes_from_groups(words.view(torch.uint8))  # (N, G, 16) bytes per group
    lanes = words.view(N // ROW_BLOCK, ROW_BLOCK, G, 4).permute(0, 2, 3, 1).contiguous()  # (b, g, t, i)
    return lanes.view(torch.uint8).view(N // ROW_BLOCK, G, 256)


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along the row blocks, without the copy where the parts already lie
    end to end in one storage (the loader writes a fused q/k/v's or gate/up's parts so:
    ``gguf_fill.py``); the result then shares their memory."""
    first, last = parts[0], parts[-1]
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts) and \
        all(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and
            a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(parts, parts[1:]))
    if not adjacent:
        return torch.cat(parts)
    rows = sum(p.shape[0] for p in parts)
    whole = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]),
                                    first.stride())
    assert whole[-last.shape[0]:].data_ptr() == last.data_ptr()
    return whole


def codes_from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of ``blocks_from_codes``: (N/16, G, 256) -> (N, K) uint8 codes."""
    B, G, _ = blocks.shape
    packed = blocks.view(B, G, 4, ROW_BLOCK, 4).permute(0, 3, 1, 2, 4)  # (b, i, g, t, j)
    halves = torch.stack([packed & 0x0F, packed >> 4], dim=3)  # (b, i, g, half, t, j)
    return halves.reshape(B * ROW_BLOCK, G * GROUP)


def int8_blocks_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) or (N, G, 32) int8 codes (the latter may be a strided view, e.g. of a GGUF
    file's Q8_0 blocks) -> (N/16, G, 512) int8: for group g of row block b, 8 vectors of 16
    lanes x 4 bytes; byte j of lane i in vector t is column 4t + j of row 16b + i."""
    N, G = codes.shape[0], codes.shape[1] // GROUP if codes.dim() == 2 else codes.shape[1]
    groups = codes.to(torch.int8).view(N, G, GROUP) if codes.dim() == 2 else codes.to(torch.int8)
    if library() is not None and groups.stride(2) == 1:  # one pass in C: torch's byte-strided copy took
        return torch.ops.lucidlm.lanes_from_groups(groups)  # ~150 ms for the embedded model's token table
    c = groups.reshape(N // ROW_BLOCK, ROW_BLOCK, G, 8, 4)  # (b, i, g, t, j)
    return c.permute(0, 2, 3, 1, 4).reshape(N // ROW_BLOCK, G, 512).contiguous()


def int8_codes_from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of ``int8_blocks_from_codes``: (N/16, G, 512) -> (N, K) int8 codes."""
    B, G, _ = blocks.shape
    return blocks.view(B, G, 8, ROW_BLOCK, 4).permute(0, 3, 1, 2, 4).reshape(B * ROW_BLOCK, G * GROUP)


def int8_code_sums(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) or (N, G, 32) int8 codes -> (N/16, G, 16) float32: each row's sum of codes per
    group (exact), which the AVX-512 kernel needs to undo the shift of x's codes."""
    groups = codes.view(codes.shape[0], -1, GROUP) if codes.dim() == 2 else codes
    if library() is not None and groups.dtype == torch.int8 and groups.stride(2) == 1:
        return torch.ops.lucidlm.int8_group_sums(groups)  # one pass in C (torch's widening copy: ~90 ms)
    return lanes_from_rows(groups.sum(-1, dtype=torch.int32).float())


def dequantized_rows(blocks: torch.Tensor, scales: torch.Tensor, extra: torch.Tensor,
                     rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (T,) int64 of a blocks-layout matrix (``blocks_mm``'s operands), dequantized to
    float32 (T, K) exactly as the plain layout's ``dequantize_plain`` gives them, the other rows
    never decoded: a tied embedding's lookup (``torch.ops.lucidlm.blocks_rows``, one C++ call)."""
    if not torch.compiler.is_compiling():
        assert library() is not None, f"the blocks kernels are not available here: {unavailable_reason()}"
    return torch.ops.lucidlm.blocks_rows(blocks, scales, extra, rows)


def lanes_from_rows(values: torch.Tensor) -> torch.Tensor:
    """(N, G) per-row, per-group values -> (N/16, G, 16): a group's 16 rows side by side."""
    N, G = values.shape
    return values.view(N // ROW_BLOCK, ROW_BLOCK, G).transpose(1, 2).contiguous()


def rows_from_lanes(values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``lanes_from_rows``."""
    B, G, _ = values.shape
    return values.transpose(1, 2).reshape(B * ROW_BLOCK, G)


# -- the matmul --------------------------------------------------------------------------------
def blocks_mm(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """(M, K) float32 or bfloat16 x -> (M, N) in x's dtype: x @ W.T for W in the blocks layout:
    int4 (``blocks`` uint8 (N/16, G, 256), ``scales`` and ``extra`` (the zeros) bfloat16
    (N/16, G, 16)) or int8 (``blocks`` int8 (N/16, G, 512), ``scales`` and ``extra`` (the code
    sums) float32). The operator ``torch.ops.lucidlm.blocks_mm``, which compiled graphs call too."""
    if not torch.compiler.is_compiling():  # (a graph is traced only after its layers loaded the library)
        assert library() is not None, f"the blocks kernels are not available here: {unavailable_reason()}"
    return torch.ops.lucidlm.blocks_mm(x, blocks, scales, extra)


def use_cpu_loops(model: torch.nn.Module) -> bool:
    """Let ``model``'s layers run their float32 inference through this library's loops, where the
    kernels are available and the model is on the CPU; returns whether it did:

    - attention layers (a ``decode_kernel`` flag): decode steps through
      ``torch.ops.lucidlm.decode_attention`` (``kernels/decode_attention.c``: q (B, H, G, D), the G
      query heads of each of the H kv heads; k, v (B, H, S, D); mask (B, S) bool, True = may
      attend -> (B, H, G, D));
    - RMSNorm layers (a ``row_kernel`` flag): ``torch.ops.lucidlm.rms_norm_rows``
      (``kernels/rms_norm_rows.c``: x (..., D), weight (D,), eps -> (..., D)) outside autograd
      and outside a compiled graph, where inductor fuses the norm itself;
    - blocks (a ``decode_kernel`` flag too): an eager decode step of a plain pre-norm block
      whose matmuls are on this kernel in one call, ``torch.ops.lucidlm.decode_block``
      (``kernels/decode_block_op.cpp``, the loops above and the matmuls from C++), where it
      computes bit for bit what the block's modules do (``model/decode_block.py`` says when),
      and all of a model's blocks in one call, ``torch.ops.lucidlm.decode_stack``, where
      every one of them would take it.

    ``LanguageModel.compile`` calls it, and ``lucidlm.load`` for models on lucidlm's kernels."""
    layers = [m for m in model.modules() if hasattr(m, "decode_kernel") or hasattr(m, "row_kernel")]
    on = bool(layers) and all(p.device.type == "cpu" for p in model.parameters()) and available()
    for layer in layers:
        if hasattr(layer, "decode_kernel"):
            layer.decode_kernel = on
        else:
            layer.row_kernel = on
    return on


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for float32 logits (B, V) on the CPU, through
    ``torch.ops.lucidlm.argmax_rows`` (``kernels/argmax_rows.c``: ~45 us a row of SmolLM2's
    49152 logits in torch, a few in C) where the kernels are available; torch's own elsewhere.
    The same indices either way: the first of equal values, the first NaN if there is one."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[-1] > 0 and available()):
        return torch.ops.lucidlm.argmax_rows(logits)
    return logits.argmax(dim=-1)


# -- which layers use it ------------------------------------------------------------------------
_preferred = [os.environ.get("LUCIDLM_CPU_KERNEL", "") != "torch"]


class prefer:
    """``with prefer(False):`` quantized layers installed inside keep torch's kernels (tiles for
    int4, dequantize + ``F.linear`` for int8 groups); by default (``prefer(True)``) layers in
    groups of 32 use lucidlm's kernel where it is available. A layer keeps its choice for life
    (``QuantizedLinear.uses_blocks_kernel``). ``LUCIDLM_CPU_KERNEL=torch`` switches it off."""

    def __init__(self, on: bool = True) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.saved = _preferred[0]
        _preferred[0] = self.on

    def __exit__(self, *exc: object) -> None:
        _preferred[0] = self.saved


def preferred() -> bool:
    return _preferred[0]


def build() -> None:
    """Build the kernels now (``scripts/install.sh`` does), saying where, or why not."""
    built = library()
    print(f"lucidlm CPU kernels: {built}" if built else f"lucidlm CPU kernels not available: {unavailable_reason()}")
