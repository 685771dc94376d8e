"""``lucidlm merge --model SOURCE --adapter DIR --out DIR``: fold a LoRA adapter into the
base weights (W + alpha/r * B @ A, computed in float32) and write an ordinary model."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from lucidlm.errors import AdapterError, LucidLMError, TokenizerError
from lucidlm.outputs import check_output_dir, writing
from lucidlm.weights.finite import check_finite

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = ("lucidlm", "hf")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="merge a LoRA adapter into its base model and save the result",
        description="Load the base model and a LoRA adapter (written by lucidlm finetune or by Hugging Face "
                    "PEFT), add each update alpha/r * B @ A to its weight matrix in float32, and save a plain "
                    "model that runs at the base model's speed with no adapter code. Bottleneck adapters and "
                    "prefixes cannot be merged (they are not a change to any weight matrix): use them with "
                    "`lucidlm generate --adapter DIR`.",
        epilog="examples:\n"
               "  lucidlm merge --adapter runs/lora-shakespeare --out runs/merged\n"
               "  lucidlm merge --model smollm2-135m --adapter runs/lora --out runs/merged-hf --to hf",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, metavar="SOURCE",
                        help="the base model the adapter was trained on: a pretrained name, .gguf file, Hugging "
                             "Face or lucidlm directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--adapter", required=True, metavar="DIR",
                        help="LoRA adapter directory (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write the merged model to")
    parser.add_argument("--to", dest="to_format", choices=FORMATS, default="lucidlm",
                        help="lucidlm = lucidlm_config.json + model.safetensors + tokenizer.json (default); "
                             "hf = a Hugging Face directory that transformers loads")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the written weights; the merge itself is always float32 (default: float32)")
    parser.add_argument("--force", action="store_true",
                        help="write into --out even if it is not empty: a model saved there before (either format) "
                             "is replaced, other files are kept")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lucidlm.commands.model_dir import refuse_unusable_output, refuse_writing_over, replacing_model
    from lucidlm.loading import load
    from lucidlm.peft import lora_layers, merge_and_unload
    from lucidlm.peft.files import read_meta

    out_dir = check_output_dir(args.out, "--out")
    refuse_writing_over(out_dir, args.model, "--model", "--out")  # --force or not
    refuse_writing_over(out_dir, args.adapter, "--adapter", "--out")
    refuse_unusable_output(out_dir, "--out")  # a training run, or a directory named like a model file
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.force:
        raise LucidLMError(f"--out {out_dir} is not empty; pick another directory or pass --force.")
    meta = read_meta(Path(args.adapter).expanduser())
    if meta is not None and meta["method"] != "lora":
        raise AdapterError(f"{args.adapter} holds a {meta['method']!r} adapter, which cannot be merged into weight "
                           f"matrices (only LoRA can); use it with `lucidlm generate --adapter {args.adapter}`.")
    start = time.perf_counter()
    model = load(args.model, adapter=args.adapter)  # float32: the merge happens at full precision
    n_layers = sum(1 for _ in lora_layers(model))
    probe = _probe_ids(model)
    with torch.no_grad():
        with_adapter = model(probe)
        merge_and_unload(model)
        merged = model(probe)
    drift = float((with_adapter - merged).abs().max())
    model = model.to(DTYPES[args.dtype])
    # Finite adapters can still overflow: W + scale * B @ A past float32's (or float16's) range.
    # A NaN/inf model must never be written as if the merge had worked.
    check_finite(dict(model.named_parameters()), f"merging {args.adapter} into {args.model or 'smollm2-135m'}",
                 AdapterError, f"Nothing was written to {out_dir}. The adapter's update overflows {args.dtype}: "
                               f"check the adapter (a diverged training run?) or merge to float32.")
    with writing(out_dir, "--out"), replacing_model(out_dir):
        if args.to_format == "hf":
            from lucidlm.weights.hf import save_hf
            save_hf(model, out_dir)
        else:
            from lucidlm.weights.checkpoint import save_model
            save_model(model, out_dir)
    print(f"merged the LoRA adapter {args.adapter} into {n_layers} weight matrices of "
          f"{args.model or 'smollm2-135m'} (max logit difference merged vs adapter: {drift:.2e}); wrote a "
          f"{args.to_format} model ({args.dtype}) to {out_dir} in {time.perf_counter() - start:.1f}s")
    return 0


def _probe_ids(model: torch.nn.Module) -> torch.Tensor:
    """A few tokens to check that the merged model computes what model + adapter did."""
    tokenizer = model.tokenizer
    if tokenizer is not None:
        try:
            ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
        except TokenizerError:  # a character tokenizer trained on text without these letters
            ids = []
        if ids:
            return torch.tensor([ids[: model.config.max_seq_len]])
    return torch.arange(min(8, model.config.vocab_size, model.config.max_seq_len))[None]
