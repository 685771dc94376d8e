"""lucidlm's blocks kernels (``quantization/kernels/blocks32.c``) from two or more source trees,
taking turns in one process.

A change to the inner loops is worth a few percent, and between two processes this host's noise
is larger than that. Here each tree's ``blocks32.c`` is compiled as a plain C library (the flags of
``blocks_kernel.C_FLAGS``, linked against torch's libgomp, so every tree shares torch's thread
pool, as the real build does) and called through ctypes on one decode step's matrices of
SmolLM2-135M as the model runs them (q/k/v and gate/up fused: 121 products, random weights in
lucidlm's int4 groups of 32; the 49152 x 576 unembedding in int8 groups of 32, GGUF Q8_0's
layout). The trees take turns round by round, the order reversed every other round. Prints the
minimum and median ms per step of the int4 and the int8 matrices apart, and the largest
difference of each tree's outputs from the first tree's, relative to the output's largest value.

    git worktree add /tmp/before HEAD~1
    python benchmarks/bench_kernel_ab.py /tmp/before/src/lucidlm/quantization/kernels \\
        src/lucidlm/quantization/kernels --batch 1 --threads 2 --rounds 40

``--march``: what the libraries are compiled for instead of ``native`` (``znver3`` builds the AVX2
loops on an AVX-512 machine).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench_cpu_kernels import D, FFN, GROUP, KV, LAYERS, VOCAB, int4_groups

SHAPES = [(D + 2 * KV, D), (D, D), (2 * FFN, D), (D, FFN)] * LAYERS + [(VOCAB, D)]  # (out, in), as fused


def packed_weights() -> list[tuple[torch.Tensor, ...]]:
    """(codes in the blocks layout, scales, zeros or code sums, is_int8) per matrix of SHAPES."""
    from lucidlm.quantization import blocks_kernel as bk

    torch.manual_seed(0)
    out = []
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        if n == VOCAB:
            groups = w.reshape(n, k // GROUP, GROUP)
            scales = (groups.abs().amax(-1) / 127).half().float()  # Q8_0 keeps float16 scales
            codes = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
            out.append((bk.int8_blocks_from_codes(codes), bk.lanes_from_rows(scales), bk.int8_code_sums(codes), True))
        else:
            codes, scales, zeros = int4_groups(w)
            out.append((bk.blocks_from_codes(codes), bk.lanes_from_rows(scales), bk.lanes_from_rows(zeros), False))
    return out


def build(kernels: Path, march: str, work: Path, index: int) -> ctypes.CDLL:
    from lucidlm.quantization.blocks_kernel import C_FLAGS

    torch_lib = Path(torch.__file__).parent / "lib"
    flags = [f"-march={march}" if f == "-march=native" else f for f in C_FLAGS]
    library = work / f"blocks32-{index}.so"
    subprocess.run(["cc", *flags, "-shared", str(kernels / "blocks32.c"), "-o", str(library), f"-L{torch_lib}",
                    f"-Wl,-rpath,{torch_lib}"], check=True)
    return ctypes.CDLL(str(library))


def run(library: ctypes.CDLL, jobs: list, int8: bool) -> float:
    """Seconds for this tree's products of one kind (int8 or int4), in SHAPES order."""
    start = time.perf_counter()
    for x, codes, scales, extra, y, is_int8 in jobs:
        if is_int8 != int8:
            continue
        kernel = library.lucidlm_int8_blocks_mm if is_int8 else library.lucidlm_int4_blocks_mm
        status = kernel(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), 0, ctypes.c_int64(x.shape[0]),
                        ctypes.c_int64(x.shape[1]), ctypes.c_int64(y.shape[1]), ctypes.c_void_p(codes.data_ptr()),
                        ctypes.c_void_p(scales.data_ptr()), ctypes.c_void_p(extra.data_ptr()))
        if status != 0:
            raise MemoryError("blocks kernel: out of memory for the quantized input")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path, help="directories holding blocks32.c and its headers")
    parser.add_argument("--batch", type=int, default=1, help="rows of x (1: a decode step, 8: a batch of 8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--march", default="native")
    args = parser.parse_args()
    missing = [str(t) for t in args.trees if not (t / "blocks32.c").is_file()]
    if missing:
        raise SystemExit(f"no blocks32.c in {', '.join(missing)}: pass kernel directories, e.g. "
                         f"src/lucidlm/quantization/kernels")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        libraries = [build(tree, args.march, Path(work), i) for i, tree in enumerate(args.trees)]
        torch.manual_seed(1)
        jobs = [(torch.randn(args.batch, codes.shape[1] * GROUP), codes, scales, extra,
                 torch.empty(args.batch, codes.shape[0] * 16), is_int8)
                for codes, scales, extra, is_int8 in packed_weights()]
        times = [{"int4": [], "int8": []} for _ in libraries]
        order = list(range(len(libraries)))
        for r in range(args.rounds):
            for i in (order if r % 2 == 0 else order[::-1]):
                times[i]["int4"].append(run(libraries[i], jobs, int8=False))
                times[i]["int8"].append(run(libraries[i], jobs, int8=True))
        outputs = []
        for library in libraries:
            run(library, jobs, int8=False), run(library, jobs, int8=True)
            outputs.append([job[4].clone() for job in jobs])
    print(f"batch {args.batch}, {args.threads} threads, {args.rounds} rounds, -march={args.march}; ms per step")
    for tree, t, out in zip(args.trees, times, outputs):
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(out, outputs[0]))
        print(f"  int4 min {min(t['int4']) * 1e3:6.2f} median {statistics.median(t['int4']) * 1e3:6.2f} | "
              f"int8 min {min(t['int8']) * 1e3:6.2f} median {statistics.median(t['int8']) * 1e3:6.2f} | "
              f"max difference from the first {diff:.1e}  {tree}")


if __name__ == "__main__":
    main()
