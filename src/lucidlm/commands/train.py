"""``lucidlm train --data FILE_OR_DIR --out DIR``: train a model from scratch (one process or torchrun)."""

from __future__ import annotations

import argparse

from lucidlm.commands.config_flags import add_config_flags, config_from_args
from lucidlm.training.config import TrainConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model from scratch on a text corpus",
        description="Train a decoder-only transformer from scratch. The corpus (a UTF-8 .txt file or a "
                    "folder of them) is tokenized once into memory-mapped token files under OUT/data; "
                    "training draws random windows of --block-size tokens, optimises next-token "
                    "cross-entropy with AdamW (warmup + cosine decay, nanoGPT's schedule) and every "
                    "--eval-interval steps logs train/val loss to OUT/metrics.jsonl, plots OUT/loss.png, "
                    "prints a greedy sample and writes OUT/checkpoint/ (atomically). Ctrl-C saves a "
                    "checkpoint and stops; --resume continues bit-for-bit. Under `torchrun "
                    "--nproc_per_node N -m lucidlm train ...` the processes train data-parallel (DDP). "
                    "The defaults are nanoGPT's CPU run of shakespeare-char (val loss ~1.88 after 2000 steps).",
        epilog="examples:\n"
               "  lucidlm train --data shakespeare.txt --out runs/shakespeare\n"
               "  lucidlm generate \"ROMEO:\" --model runs/shakespeare\n"
               "  lucidlm train --data shakespeare.txt --out runs/words --tokenizer word --preset seed004-words \\\n"
               "      --batch-size 32 --learning-rate 2e-3 --warmup-iters 0 --constant-lr --weight-decay 0\n"
               "  lucidlm train --data shakespeare.txt --out runs/shakespeare --resume --max-iters 5000\n"
               "  torchrun --nproc_per_node 2 -m lucidlm train --data shakespeare.txt --out runs/ddp\n"
               "  torchrun --nproc_per_node 8 -m lucidlm train --data corpus/ --out runs/big --strategy fsdp",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(parser, TrainConfig, required=("data", "out_dir"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lucidlm.training.distributed import is_main_process
    from lucidlm.training.pretrain import pretrain

    result = pretrain(config_from_args(TrainConfig, args))
    if result.interrupted:
        return 130
    if result.val_loss is not None and is_main_process():  # under torchrun, rank 0's summary only
        print(f"done: step {result.step}, val loss {result.val_loss:.4f}; model in {result.checkpoint} "
              f"(try: lucidlm generate \"...\" --model {args.out_dir})")
    return 0
