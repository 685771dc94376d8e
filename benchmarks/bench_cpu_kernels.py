"""The CPU matmul kernels a quantized decode step could stand on, side by side in one process.

Issue 9 asks to try, measure and report the alternatives to the kernels lucidlm uses
(``_weight_int4pack_mm_for_cpu`` for int4, ``_weight_int8pack_mm`` for int8, oneDNN for bf16):

- **inductor's own dequantize-and-multiply**: int4 codes unpacked to bfloat16 and multiplied,
  all under one ``torch.compile``, so inductor can fuse the unpacking into the product;
- **int8 dynamic activations x int8 weights** (``torch._int_mm``, VNNI/AMX on this Xeon):
  each activation row quantized to int8 with its own scale, the int32 product rescaled;
- **lucidlm's own kernel** (``quantization/blocks_kernel.py``, C with AVX-512 VNNI): the
  input quantized to int8 per group of 32, integer dot products over a layout of 16 rows per
  vector; the unembedding as int4 or as int8 in groups of 32;
- **torchao's CPU layouts** (``torchao.quantization.quantize_`` with int8 weight-only, int4
  weight-only and int8 dynamic-activation configs), if torchao is installed
  (``pip install --no-deps torchao``: a benchmark peer, never used by lucidlm).

The workload is one decode step's matrices of SmolLM2-135M (30 layers x q, k, v, o, gate, up,
down, plus the 49152 x 576 unembedding: 211 matrices, random weights), at batch 1 and 8. Every
side runs its 211 products inside one function (compiled sides: one graph), so what is timed
is the kernels and their calls, as in a compiled decode step. Sides alternate round by round;
the best of ``--repeats`` per round, then the best round. Prints ms per step and the ratio to
lucidlm's int4 kernel; writes benchmarks/results/cpu_kernels.json.

At batch 1 a step reads every weight once, so memory bandwidth bounds it: the run measures the
read bandwidth (``torch.amax`` over 256 MB, same threads) and says what share of it lucidlm's
kernels reach (the weight bytes they read per step over their time), as
``bench_generation_gpu.py`` does with the GPU's copy bandwidth.

    python benchmarks/bench_cpu_kernels.py [--threads 2] [--rounds 3] [--batches 1 8] [--sides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from timing import best_time, machine

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_kernels.json"
D, FFN, KV, VOCAB, LAYERS, GROUP = 576, 1536, 192, 49152, 30, 32
SHAPES = [(D, D), (KV, D), (KV, D), (D, D), (FFN, D), (FFN, D), (D, FFN)] * LAYERS + [(VOCAB, D)]  # (out, in)


def random_weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(n, k) * 0.02 for n, k in SHAPES]


def int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric groups of 32: codes (N, K) in 0..15, scales and zeros (N, K/32), lucidlm's scheme."""
    N, K = w.shape
    g = w.reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = lo + 8 * scales
    codes = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32).reshape(N, K)
    return codes, scales.to(torch.bfloat16), zeros.to(torch.bfloat16)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = w.abs().amax(-1) / 127
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def inputs(batch: int) -> dict[int, torch.Tensor]:
    return {k: torch.randn(batch, k, dtype=torch.bfloat16) for k in (D, FFN)}


# ------------------------------------------------------------------------------ the sides


def side_bf16(weights):
    ws = [w.to(torch.bfloat16) for w in weights]

    def step(x):
        return [F.linear(x[w.shape[1]], w) for w in ws]
    return step


def side_int8_weight_only(weights):
    packed = [(q, s.to(torch.bfloat16)) for q, s in map(int8_rows, weights)]

    def step(x):
        return [torch.ops.aten._weight_int8pack_mm(x[q.shape[1]], q, s) for q, s in packed]
    return step


def side_int4_lucidlm(weights):
    packed = []
    for w in weights:
        codes, scales, zeros = int4_groups(w)
        tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        packed.append((tiles, torch.stack([scales.t(), zeros.t()], -1).contiguous(), w.shape[1]))  # (G, N, 2)

    def step(x):
        return [torch.ops.aten._weight_int4pack_mm_for_cpu(x[k], t, GROUP, sz) for t, sz, k in packed]
    return step


def side_blocks(int8_unembedding: bool):
    """lucidlm's own kernels (quantization/blocks_kernel.py): int4/32 layers; the unembedding as
    int4/32 too, or as int8/32 (GGUF Q8_0's layout) with ``int8_unembedding``."""
    def build(weights):
        from lucidlm.quantization import blocks_kernel as bk
        if not bk.available():
            raise RuntimeError(bk.unavailable_reason())
        packed = []
        for w in weights:
            K = w.shape[1]
            if int8_unembedding and w.shape[0] == VOCAB:
                scales = (w.reshape(VOCAB, K // GROUP, GROUP).abs().amax(-1) / 127).to(torch.bfloat16)
                codes = torch.round(w.reshape(VOCAB, K // GROUP, GROUP) / scales.float()[..., None]).clamp(-127, 127)
                codes = codes.to(torch.int8).reshape(VOCAB, K)
                packed.append((bk.int8_blocks_from_codes(codes), bk.lanes_from_rows(scales.float()), bk.int8_code_sums(codes), K))
                continue
            codes, scales, zeros = int4_groups(w)
            packed.append((bk.blocks_from_codes(codes), bk.lanes_from_rows(scales), bk.lanes_from_rows(zeros), K))

        def step(x):
            return [torch.ops.lucidlm.blocks_mm(x[k], b, s, e) for b, s, e, k in packed]
        # what a step reads: codes, scales and zeros; an int8 matrix's code sums only with
        # AVX-512 (its unsigned side is x shifted by 128; the AVX2 loops do not read them)
        reads_sums = bk.instruction_set() == "avx512-vnni"
        step.weight_bytes = sum(t.numel() * t.element_size() for b, s, e, _ in packed
                                for t in ((b, s, e) if e.dtype != torch.float32 or reads_sums else (b, s)))
        return step
    return build


def read_bandwidth(repeats: int = 10) -> float:
    """Bytes per second torch reads from memory: the best ``amax`` over a 256 MB tensor (far
    past the caches), on the threads set for the run."""
    x = torch.ones(64 << 20)
    seconds = best_time(lambda: torch.amax(x), repeats)
    return x.numel() * x.element_size() / seconds


def side_int4_inductor(weights):
    """Plain nibbles (N, K/2) uint8 + scales/zeros; the unpacking is ordinary torch code for
    inductor to fuse (compiled below)."""
    packed = []
    for w in weights:
        codes, scales, zeros = int4_groups(w)
        nibbles = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        packed.append((nibbles, scales, zeros))

    def dequantize(nibbles, scales, zeros):
        N = nibbles.shape[0]
        codes = torch.stack([nibbles & 15, nibbles >> 4], -1).reshape(N, -1, GROUP)  # (N, G, 32)
        return ((codes.to(torch.bfloat16) - 8) * scales[..., None] + zeros[..., None]).reshape(N, -1)

    def step(x):
        return [F.linear(x[n.shape[1] * 2], dequantize(n, s, z)) for n, s, z in packed]
    return step


def side_int8_dynamic(weights):
    """int8 activations (one scale per row) x int8 weights (one per output channel) on torch._int_mm."""
    packed = [(q.t().contiguous(), s) for q, s in map(int8_rows, weights)]  # (K, N) int8, (N,)

    def step(x):
        out = []
        for wt, ws in packed:
            a = x[wt.shape[0]].float()
            a_scale = a.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127  # (M, 1)
            a_q = torch.round(a / a_scale).to(torch.int8)
            out.append((torch._int_mm(a_q, wt).float() * a_scale * ws).to(torch.bfloat16))
        return out
    return step


def side_torchao(config_name: str):
    def build(weights):
        from torchao.quantization import quantize_
        import torchao.quantization as tq
        from torchao.quantization.granularity import PerGroup

        layers = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights)
        with torch.no_grad():
            for layer, w in zip(layers, weights):
                layer.weight.copy_(w)
        layers = layers.to(torch.bfloat16)
        config = {"int8wo": lambda: tq.Int8WeightOnlyConfig(),
                  "int8dyn": lambda: tq.Int8DynamicActivationInt8WeightConfig(),
                  # torchao 0.18's int4 weight-only needs mslk (CUDA) or its own C++ ops; on a CPU
                  # with a torch it was not built for, the int4 path left is IntxWeightOnly,
                  # codes kept one per int8 and dequantized in torch code (compiled here).
                  "int4wo": lambda: tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(GROUP)),
                  }[config_name]()
        quantize_(layers, config)

        def step(x):
            return [layer(x[layer.in_features]) for layer in layers]
        return step
    return build


SIDES: dict[str, tuple[Callable, bool]] = {  # name -> (builder, compiled)
    "bf16 oneDNN": (side_bf16, False),
    "int8 weight-only (_weight_int8pack_mm)": (side_int8_weight_only, False),
    "int4 lucidlm (_weight_int4pack_mm_for_cpu)": (side_int4_lucidlm, False),
    "int4 lucidlm, compiled": (side_int4_lucidlm, True),
    "int4 lucidlm blocks kernel": (side_blocks(False), False),
    "int4 blocks, unembedding int8/32 blocks": (side_blocks(True), False),
    "int4 inductor dequantize+mm, compiled": (side_int4_inductor, True),
    "int8 dyn act x int8 (_int_mm)": (side_int8_dynamic, False),
    "int8 dyn act x int8 (_int_mm), compiled": (side_int8_dynamic, True),
    "torchao int8 weight-only, compiled": (side_torchao("int8wo"), True),
    "torchao int4/32 weight-only (Intx), compiled": (side_torchao("int4wo"), True),
    "torchao int8 dyn act, compiled": (side_torchao("int8dyn"), True),
}
REFERENCE = "int4 lucidlm (_weight_int4pack_mm_for_cpu)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES),
                        help="run only these (the reference, torch's int4 kernel, is always run)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = random_weights()
    steps, errors, warmup = {}, {}, {}
    with torch.inference_mode():
        for name, (build, compiled) in SIDES.items():
            if name not in args.sides and name != REFERENCE:
                continue
            try:
                step = build(weights)
                if compiled:
                    step = torch.compile(step, dynamic=False)
                start = time.perf_counter()
                for batch in args.batches:
                    step(inputs(batch))
                steps[name], warmup[name] = step, time.perf_counter() - start
            except Exception as exc:  # a side this torch (or a missing torchao) cannot run: say why, go on
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                print(f"{name}: not run ({errors[name]})")
        loads = []
        best: dict[str, dict[int, float]] = {name: {} for name in steps}
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for batch in args.batches:
                x = inputs(batch)
                for name, step in steps.items():
                    t = best_time(lambda: step(x), args.repeats)
                    best[name][batch] = min(best[name].get(batch, float("inf")), t)
        bandwidth = read_bandwidth()
    print(f"\nOne decode step's 211 SmolLM2 matrices, {args.threads} threads, best of {args.rounds} rounds x "
          f"{args.repeats}; load average {min(loads):.1f}..{max(loads):.1f}")
    header = "side".ljust(46) + "".join(f"b={b} ms  vs int4".rjust(20) for b in args.batches) + "  warm-up s"
    print(header)
    ref = best.get(REFERENCE, {})
    for name, times in best.items():
        cells = "".join(f"{times[b] * 1e3:9.2f}  {ref[b] / times[b]:6.2f}x".rjust(20) if b in ref else
                        f"{times[b] * 1e3:9.2f}".rjust(20) for b in args.batches)
        print(name.ljust(46) + cells + f"{warmup[name]:9.1f}")
    share = {name: steps[name].weight_bytes / times[1] / bandwidth for name, times in best.items()
             if hasattr(steps[name], "weight_bytes") and 1 in times}
    print(f"\nread bandwidth: {bandwidth / 1e9:.1f} GB/s (torch.amax over 256 MB, {args.threads} threads)")
    for name, fraction in share.items():
        megabytes = steps[name].weight_bytes / 1e6
        print(f"{name}: b=1 reads {megabytes:.1f} MB per step (floor {steps[name].weight_bytes / bandwidth * 1e3:.2f} ms): "
              f"{fraction:.0%} of the read bandwidth")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "workload": "SmolLM2-135M decode step: 211 matrices (30 x q,k,v,o,gate,up,down + unembedding), random",
        "threads": args.threads, "rounds": args.rounds, "repeats": args.repeats,
        "machine": machine(load_average_min_max=[min(loads), max(loads)]),
        "torch": torch.__version__,
        "ms_per_step": {name: {str(b): t * 1e3 for b, t in times.items()} for name, times in best.items()},
        "warmup_s": warmup, "not_run": errors,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "weight_mb": {name: steps[name].weight_bytes / 1e6 for name in share},
        "b1_share_of_read_bandwidth": share,
    }, indent=1) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
