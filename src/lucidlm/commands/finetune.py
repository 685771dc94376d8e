"""``lucidlm finetune``: adapt a pretrained model with LoRA, bottleneck adapters, prefix
tuning or all its weights; the CLI face of ``lucidlm.training.finetune`` (its flags are
generated from ``FinetuneConfig``)."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from lucidlm.commands.config_flags import add_config_flags, config_from_args, typed_fields
from lucidlm.training.config import FinetuneConfig, check_options_apply


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "finetune",
        help="fine-tune a pretrained model with LoRA, adapters, prefix tuning or all weights",
        description="Train a pretrained model further on JSONL examples ({\"text\"}, {\"prompt\", \"completion\"} "
                    "or chat {\"messages\"} rendered with the model's template; padded/truncated to --max-length; "
                    "--mask-prompt for instruction tuning; --epochs or --max-iters) or on a text corpus (random "
                    "windows of --block-size). LoRA is saved in Hugging Face PEFT's format. Each evaluation samples "
                    "the base and the tuned model with the same settings. OUT gets the adapter, metrics.jsonl, "
                    "loss.png (with the learning rate), token_lengths.{json,png} and checkpoint/ for --resume. "
                    "Runs under torchrun (DDP, or --strategy fsdp).",
        epilog="examples:\n"
               "  lucidlm finetune --data input.txt --out runs/lora-shakespeare --max-iters 200\n"
               "  lucidlm finetune --data chat.jsonl --mask-prompt --epochs 3 --out runs/sft --sample-temperature 0.8 \\\n"
               "      --sample-top-p 0.9 --sample-seed 1\n"
               "  lucidlm finetune --model smollm2-135m --data input.txt --method lora --rank 16 --alpha 32 \\\n"
               "      --targets q,k,v,o --out runs/lora16\n"
               "  lucidlm finetune --data input.txt --method prefix --prefix-length 16 --out runs/prefix\n"
               "  lucidlm finetune --data chat.jsonl --out runs/sft --resume --max-iters 400\n"
               "  torchrun --nproc_per_node 2 -m lucidlm finetune --data chat.jsonl --out runs/ddp",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(parser, FinetuneConfig, required=("data", "out_dir"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lucidlm.training.distributed import is_main_process
    from lucidlm.training.finetune import finetune

    from lucidlm.commands.model_dir import refuse_writing_over

    config = config_from_args(FinetuneConfig, args)
    check_options_apply(config, typed_fields(FinetuneConfig, args))  # a typed flag the run would ignore: refused
    # a base that is a training run (RUN/checkpoint) read its checkpoint as a run to --resume,
    # and --resume then as an incomplete one: say what it is
    refuse_writing_over(Path(config.out_dir), config.model, "--model", "--out")
    start = time.perf_counter()
    result = finetune(config)
    if not is_main_process():  # under torchrun, one summary (rank 0's), not one per process
        return 130 if result.interrupted else 0
    out_dir = Path(config.out_dir)
    model_flag = f" --model {config.model}" if config.model is not None else ""
    val = "n/a" if result.val_loss is None or math.isnan(result.val_loss) else f"{result.val_loss:.4f}"
    evaluated = result.metrics[-1].get("step") if result.metrics else None
    if evaluated is not None and evaluated != result.step:  # Ctrl-C skips the last evaluation: say whose loss it is
        val += f" (evaluated at step {evaluated})"
    where = f"model in {out_dir}" if config.method == "full" else f"adapter in {out_dir}"
    use = (f"lucidlm generate --model {out_dir}" if config.method == "full" else
           f"lucidlm generate{model_flag} --adapter {out_dir}")
    ended = "stopped" if result.interrupted else "done"
    print(f"{ended} in {time.perf_counter() - start:.0f}s: step {result.step}, val loss {val}; {where}.\n"
          f"  try it:  {use} \"...\"")
    if config.method == "lora":
        print(f"  merge it: lucidlm merge{model_flag} --adapter {out_dir} --out {out_dir}-merged")
    return 130 if result.interrupted else 0
