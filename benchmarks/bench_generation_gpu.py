"""GPU decoding, side by side: lucidlm (eager, compiled, int8) vs transformers (dynamic cache,
static cache + torch.compile), on one random Llama-3.2-1B-shaped model in bf16, same weights.

Model: d_model 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64, ffn 8192, vocab 128256,
tied embeddings, rope theta 500000. 16 random prompt tokens, 256 greedy new tokens (EOS off),
batch 1 and 8. Each engine is warmed up (compiled, CUDA graphs recorded) before it is timed;
the figure is the best of the timed runs, prompt pass included. The limit is a measured
device-to-device copy: a decode step reads every weight once, so weight bytes / bandwidth is
the shortest a step can take; "% of copy" = tok/s x weight bytes / bandwidth (batch 1).

"lucidlm compiled" is ``model.compile()`` as a user gets it; "lucidlm compiled, cuBLAS
matmuls" is ``compile(options={})``, the same CUDA graphs without ``CUDA_DECODE_OPTIONS``.

Also checks, on a tiny bf16 model on the GPU, that compiled greedy tokens equal eager ones.
``--diagnose`` adds, for eager and compiled lucidlm at batch 1, the time of a bare decode step
(no sampling, no loop around it: what the loop costs is the difference) and of a one-token
generate; for the compiled engine also the top kernels of 20 steps in torch's profiler
(``generation_gpu_profile.txt``), generate's own loop timed with and without reading each token
back and with and without queueing a step ahead (``loop_diagnostics``), and a profiled
generate of 64 tokens (``generation_gpu_generate_profile.txt``: the host's operators, and how
busy the device was).

``--quick`` is what fits one session's 15 minutes of device time, the machine's start included
(2026-11-27, H100: 438 s of command): batch 1 only; transformers static+compile, lucidlm
compiled, int8 and int4 compiled; no diagnostics. Quantized rows also give their share of the
copy bandwidth on their own weight bytes (int8 reads half of bf16's).

    python benchmarks/bench_generation_gpu.py [--out benchmarks/results] [--runs 3] [--diagnose] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lucidlm import LanguageModel, preset  # noqa: E402

SHAPE = dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, d_mlp=8192,
             tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=2048)
PROMPT_LEN, NEW_TOKENS, BATCHES = 16, 256, (1, 8)
DEVICE = "cuda"  # --smoke runs a shrunken model on the CPU, to try the script without a GPU


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(gib: int = 2, repeats: int = 20) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of ``gib`` GiB."""
    if DEVICE != "cuda":
        return 42e9  # the 2-core CPU's measured copy rate (DESIGN.md); smoke runs only
    src = torch.empty(gib << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    return 2 * (gib << 30) * repeats / seconds


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.dtype == torch.float64:
            continue  # the float64 rotary table is looked up per position, not read whole
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def timed(run: Callable[[], Any], runs: int) -> tuple[float, float, Any]:
    """(seconds of the first call, i.e. warm-up and compile; best of ``runs`` after a second
    warm call; the last output)."""
    sync()
    t = time.perf_counter()
    out = run()
    sync()
    first = time.perf_counter() - t
    run()  # CUDA graphs are recorded on the first calls after compiling
    best = float("inf")
    for _ in range(runs):
        sync()
        t = time.perf_counter()
        out = run()
        sync()
        best = min(best, time.perf_counter() - t)
    return first, best, out


def lucidlm_model(seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = LanguageModel(preset("llama", **SHAPE))
    return model.to(torch.bfloat16).eval()


def lucidlm_run(model: LanguageModel, prompts: list[list[int]]) -> Callable[[], list[list[int]]]:
    def run() -> list[list[int]]:
        out = model.generate(prompts, max_new_tokens=NEW_TOKENS, temperature=0, stop_on_eos=False)
        return [r.token_ids for r in out]
    return run


def hf_model(ours: LanguageModel) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lucidlm.weights.hf import hf_config, hf_state_dict

    config = LlamaConfig(**hf_config(ours))
    with torch.device(DEVICE):
        hf = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(ours), strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    hf.tie_weights()
    return hf


def hf_run(hf: Any, prompts: list[list[int]], static: bool) -> Callable[[], list[list[int]]]:
    ids = torch.tensor(prompts, device=DEVICE)
    options: dict[str, Any] = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=0, attention_mask=torch.ones_like(ids))
    if static:  # transformers compiles the forward itself for a static cache (CUDA graphs)
        options["cache_implementation"] = "static"

    def run() -> list[list[int]]:
        with torch.inference_mode():
            return hf.generate(ids, **options)[:, PROMPT_LEN:].tolist()
    return run


def same_prefix(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens two engines agree on, row 0 (random bf16 weights: near-ties may split later)."""
    n = 0
    for x, y in zip(a[0], b[0]):
        if x != y:
            break
        n += 1
    return n


@contextmanager
def bare_steps(model: LanguageModel, batch: int) -> Iterator[Callable[[], None]]:
    """A function running one decode step directly, on a cache of the size generate uses,
    warmed up; the cache is freed afterwards."""
    ids = torch.zeros((batch, 1), dtype=torch.long, device=DEVICE)
    with torch.inference_mode():
        model.setup_kv_cache(batch, max_seq_len=PROMPT_LEN + NEW_TOKENS - 1)
        slot = torch.tensor([PROMPT_LEN], device=DEVICE)
        try:
            for _ in range(5):
                model.decode_step(ids, slot)
            sync()
            yield lambda: model.decode_step(ids, slot)
        finally:
            model.clear_kv_cache()


def bare_step_ms(model: LanguageModel, batch: int, steps: int = 100) -> float:
    """Milliseconds per decode step called directly (no sampling, no loop around it)."""
    with bare_steps(model, batch) as step:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        return (time.perf_counter() - start) / steps * 1e3


def profile_steps(model: LanguageModel, path: Path, steps: int = 20) -> None:
    """torch's profiler over ``steps`` bare decode steps at batch 1; the kernel table to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with bare_steps(model, 1) as step, profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    averages = prof.key_averages()
    tables = []
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            tables.append(f"sorted by {key}, {steps} steps\n" + averages.table(sort_by=key, row_limit=30))
            break
        except Exception:  # noqa: BLE001 - the key's name moved between torch versions
            continue
    tables.append(f"sorted by self_cpu_time_total, {steps} steps\n"
                  + averages.table(sort_by="self_cpu_time_total", row_limit=20))
    path.write_text("\n\n".join(tables) + "\n")


def loop_ms_per_token(model: LanguageModel, rows: list[list[int]], lookahead: bool, read_each: bool,
                      new_tokens: int = NEW_TOKENS) -> tuple[float, float]:
    """Drive generate's own loop (``sample_rows``, greedy) over ``rows``: (ms per token the host
    took to queue the work, ms per token until the device finished it). Without ``read_each``
    nothing is read back until the end, so the first figure is the host's cost alone: when
    it is not below a bare step's time, the loop is bound by the host, not the device."""
    from lucidlm.generation.decode import sample_rows
    from lucidlm.generation.sampling import SamplingSettings

    finished = torch.zeros(len(rows), dtype=torch.bool)  # no row ever ends: every token is timed
    sync()
    start = time.perf_counter()
    for ids in sample_rows(model, rows, new_tokens, SamplingSettings(temperature=0.0), None, finished,
                           lookahead=lookahead):
        if read_each:
            int(ids[0])  # what generate does with every token
    queued = time.perf_counter() - start
    sync()
    done = time.perf_counter() - start
    return queued / new_tokens * 1e3, done / new_tokens * 1e3


def loop_diagnostics(model: LanguageModel, rows: list[list[int]]) -> dict[str, float]:
    """Where a generated token's time goes (see ``loop_ms_per_token``), best of 3 each."""
    found: dict[str, float] = {}
    for lookahead, read_each in ((True, False), (True, True), (False, True)):
        runs = [loop_ms_per_token(model, rows, lookahead, read_each) for _ in range(4)][1:]
        name = f"{'lookahead' if lookahead else 'no lookahead'}, {'read each token' if read_each else 'no reads'}"
        found[f"{name}: host ms per token"] = min(r[0] for r in runs)
        found[f"{name}: ms per token"] = min(r[1] for r in runs)
    return found


def profile_generate(model: LanguageModel, rows: list[list[int]], path: Path, new_tokens: int = 64,
                     ) -> dict[str, float]:
    """torch's profiler over one greedy ``generate`` of ``new_tokens``: the host's operators
    sorted by their own time to ``path``, and how busy the device was."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    run = lambda: model.generate(rows, max_new_tokens=new_tokens, temperature=0, stop_on_eos=False)  # noqa: E731
    run()
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        sync()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    path.write_text(f"one generate of {new_tokens} tokens, batch 1, {wall * 1e3:.1f} ms under the profiler\n"
                    + averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
    kernels_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.events()
                     if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return {"profiled generate ms per token": wall * 1e3 / new_tokens,
            "device busy % in a profiled generate": 100 * kernels_us / 1e6 / wall}


def cuda_compile_check() -> dict[str, Any]:
    """Compiled greedy == eager greedy, bf16, on CUDA, one row and a left-padded batch."""
    torch.manual_seed(1)
    with torch.device(DEVICE):
        model = LanguageModel(preset("llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=300,
                                     max_seq_len=512, multiple_of=32))
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        model.unembed.weight.mul_(40.0)  # sharp logits: greedy choices far from bf16 ties
    cases = {"one row": [[5, 6, 7, 8]], "padded batch": [[5, 6, 7, 8, 9], [10, 11]]}
    eager = {k: [r.token_ids for r in model.generate(v, max_new_tokens=48, temperature=0, stop_on_eos=False)]
             for k, v in cases.items()}
    model.compile()
    compiled = {k: [r.token_ids for r in model.generate(v, max_new_tokens=48, temperature=0, stop_on_eos=False)]
                for k, v in cases.items()}
    return {k: eager[k] == compiled[k] for k in cases}


def main() -> None:
    global DEVICE, NEW_TOKENS, BATCHES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip", action="append", default=[], help="engine names to leave out")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script runs")
    parser.add_argument("--diagnose", action="store_true", help="bare step times and a profile of the compiled step")
    parser.add_argument("--int4", action="store_true", help="also lucidlm int4 (groups of 32), compiled, last")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="batch sizes (default 1 8)")
    parser.add_argument("--quick", action="store_true",
                        help="what fits 15 minutes of device time: batch 1; transformers static+compile, lucidlm "
                             "compiled, int8 and int4; no diagnostics")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.int4, args.diagnose = [1], True, False
        args.skip += ["lucidlm eager", "transformers dynamic cache", "lucidlm compiled, cuBLAS matmuls"]
    if args.smoke:
        DEVICE, NEW_TOKENS = "cpu", 8
        SHAPE.update(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_mlp=128)
    elif not torch.cuda.is_available():
        sys.exit("bench_generation_gpu.py needs a CUDA GPU (or --smoke).")
    BATCHES = tuple(args.batches)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": date.today().isoformat(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)",
        "python": platform.python_version(), "model": SHAPE, "prompt_tokens": PROMPT_LEN,
        "new_tokens": NEW_TOKENS, "rows": [], "errors": {},
    }

    def save() -> None:
        (out_dir / "generation_gpu.json").write_text(json.dumps(results, indent=2) + "\n")

    try:
        results["cuda_compiled_equals_eager" if DEVICE == "cuda" else "smoke_compiled_equals_eager"] = \
            cuda_compile_check()
    except Exception:  # noqa: BLE001 - recorded, the benchmark goes on
        results["errors"]["cuda_compile_check"] = traceback.format_exc()[-2000:]
    print("compiled == eager (bf16, tiny):", results.get("cuda_compiled_equals_eager",
                                                         results.get("smoke_compiled_equals_eager")), flush=True)

    bandwidth = copy_bandwidth()
    results["copy_bandwidth_bytes_per_s"] = bandwidth
    ours = lucidlm_model()
    wbytes = weight_bytes(ours)
    results["weight_bytes"] = wbytes
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {wbytes / 1e9:.2f} GB; "
          f"limit {bandwidth / wbytes:.0f} tok/s at batch 1", flush=True)
    generator = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, SHAPE["vocab_size"], (b, PROMPT_LEN), generator=generator).tolist()
               for b in BATCHES}
    outputs: dict[str, Any] = {}

    def measure(engine: str, make_run: Callable[[list[list[int]]], Callable[[], Any]],
                own_bytes: Optional[int] = None) -> None:
        """``own_bytes``: the weight bytes this engine reads a step, where not the bf16 model's."""
        if engine in args.skip:
            return
        for b in BATCHES:
            try:
                first, best, out = timed(make_run(prompts[b]), args.runs)
            except Exception:  # noqa: BLE001
                results["errors"][f"{engine} b{b}"] = traceback.format_exc()[-2000:]
                print(f"{engine} batch {b}: FAILED\n{results['errors'][f'{engine} b{b}']}", flush=True)
                continue
            tok_s = b * NEW_TOKENS / best
            row = {"engine": engine, "batch": b, "tok_s": tok_s, "seconds": best, "first_call_s": first,
                   "pct_of_copy": 100 * tok_s / b * wbytes / bandwidth,
                   "pct_of_copy_own_bytes": 100 * tok_s / b * (own_bytes or wbytes) / bandwidth}
            outputs[(engine, b)] = out
            # Row 0's tokens in common with the first engine that ran (as the run goes: a run cut
            # short keeps them); random bf16 weights have near-ties, so only a long prefix means much.
            first_engine = next(e for e, batch in outputs if batch == b)
            row[f"tokens_equal_to_{first_engine.replace(' ', '_')}_row0"] = same_prefix(out, outputs[(first_engine, b)])
            results["rows"].append(row)
            print(f"{engine:34s} batch {b}: {tok_s:8.1f} tok/s  (first call {first:6.1f} s)", flush=True)
            save()

    measure("lucidlm eager", lambda p: lucidlm_run(ours, p))
    diagnostics: dict[str, Any] = results.setdefault("diagnostics", {})

    def diagnose(name: str, model: LanguageModel, profile_to: Optional[str] = None) -> None:
        if not args.diagnose:
            return
        try:
            diagnostics[f"{name} bare step ms, batch 1"] = bare_step_ms(model, 1)
            # What a generate call costs besides its decode steps: set-up, checks, the prompt pass.
            row = prompts.get(1) or prompts[min(prompts)][:1]
            one_token = lambda: model.generate(row, max_new_tokens=1, temperature=0, stop_on_eos=False)  # noqa: E731
            diagnostics[f"{name} generate of 1 token ms, batch 1"] = 1e3 * timed(one_token, 3)[1]
            print(f"{name}: bare decode step {diagnostics[f'{name} bare step ms, batch 1']:.3f} ms at batch 1; "
                  f"generate of 1 token {diagnostics[f'{name} generate of 1 token ms, batch 1']:.1f} ms", flush=True)
            if profile_to:
                profile_steps(model, out_dir / profile_to)
                diagnostics.update({f"{name} {k}": v for k, v in loop_diagnostics(model, row).items()})
                diagnostics.update({f"{name} {k}": v for k, v in
                                    profile_generate(model, row, out_dir / "generation_gpu_generate_profile.txt").items()})
                print(json.dumps({k: round(v, 3) for k, v in diagnostics.items() if k.startswith(name)},
                                 indent=1), flush=True)
        except Exception:  # noqa: BLE001
            results["errors"][f"diagnose {name}"] = traceback.format_exc()[-2000:]
            print(results["errors"][f"diagnose {name}"], flush=True)
        save()

    diagnose("lucidlm eager", ours)
    hf = hf_model(ours)
    measure("transformers dynamic cache", lambda p: hf_run(hf, p, static=False))
    measure("transformers static cache + compile", lambda p: hf_run(hf, p, static=True))
    del hf
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    ours.compile()
    measure("lucidlm compiled", lambda p: lucidlm_run(ours, p))
    diagnose("lucidlm compiled", ours, "generation_gpu_profile.txt")
    # The same step compiled without the CUDA decode options (coordinate-descent tuning):
    # every matmul on cuBLAS, as before 2026-11-27. What those options buy, in the same run.
    ours.compile(options={})
    measure("lucidlm compiled, cuBLAS matmuls", lambda p: lucidlm_run(ours, p))
    del ours
    from lucidlm.quantization import quantize

    for scheme in ("int8", "int4") if args.int4 else ("int8",):
        engine = f"lucidlm {scheme} compiled"
        if engine in args.skip:
            continue
        try:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            quantized = quantize(lucidlm_model(), scheme).compile()
            results[f"weight_bytes_{scheme}"] = weight_bytes(quantized)
            measure(engine, lambda p: lucidlm_run(quantized, p), own_bytes=results[f"weight_bytes_{scheme}"])
            diagnose(engine, quantized)
            del quantized
        except Exception:  # noqa: BLE001 - recorded, the benchmark goes on
            results["errors"][engine] = traceback.format_exc()[-2000:]

    save()
    print(table(results))
    (out_dir / "generation_gpu.md").write_text(table(results) + "\n")


def table(results: dict[str, Any]) -> str:
    rows = results["rows"]
    by = {(r["engine"], r["batch"]): r for r in rows}
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    static = by.get(("transformers static cache + compile", 1))
    lines = [
        f"GPU decoding, {results['date']}, {results['device']} (torch {results['torch']}): random "
        f"Llama-3.2-1B-shaped model, bf16, {results['prompt_tokens']} prompt tokens, {results['new_tokens']} "
        f"greedy new tokens. Copy bandwidth {results['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, weights "
        f"{results['weight_bytes'] / 1e9:.2f} GB: at most "
        f"{results['copy_bandwidth_bytes_per_s'] / results['weight_bytes']:.0f} tok/s at batch 1.",
        "",
        "| engine | batch 1 tok/s | % of copy bandwidth (bf16 bytes) | % of copy, its own bytes "
        "| vs transformers static+compile | batch 8 tok/s | first call s (b1) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for engine in engines:
        b1, b8 = by.get((engine, 1)), by.get((engine, 8))
        cells = ["-"] * 6
        if b1:
            own = b1.get("pct_of_copy_own_bytes", b1["pct_of_copy"])  # older results have no such field
            cells[:3] = [f"{b1['tok_s']:.0f}", f"{b1['pct_of_copy']:.1f} %", f"{own:.1f} %"]
            cells[3] = f"{b1['tok_s'] / static['tok_s']:.2f}x" if static else "-"
            cells[5] = f"{b1['first_call_s']:.1f}"
        if b8:
            cells[4] = f"{b8['tok_s']:.0f}"
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
