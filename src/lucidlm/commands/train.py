"""``lucidlm train --data FILE_OR_DIR --out DIR``: train a model from scratch (one process or torchrun)."""

from __future__ import annotations

import argparse

from lucidlm.config import PRESETS
from lucidlm.training.data import TOKENIZER_KINDS
from lucidlm.training.trainer import TrainConfig

DEFAULTS = TrainConfig()

# (flag, TrainConfig field, type, help); defaults come from TrainConfig so they cannot drift.
NANOGPT_OPTIONS = (
    ("--n-layer", "n_layer", int, "number of transformer blocks (default: the preset's)"),
    ("--n-head", "n_head", int, "attention heads per block (default: the preset's)"),
    ("--n-embd", "n_embd", int, "model width d_model (default: the preset's)"),
    ("--block-size", "block_size", int, "context length in tokens, = the model's max_seq_len (default: the preset's)"),
    ("--dropout", "dropout", float, "dropout probability (default: the preset's)"),
    ("--batch-size", "batch_size", int, "sequences per micro-batch and process"),
    ("--gradient-accumulation-steps", "gradient_accumulation_steps", int,
     "micro-batches per optimizer step (global batch = batch size x this x processes)"),
    ("--learning-rate", "learning_rate", float, "peak learning rate"),
    ("--min-lr", "min_lr", float, "learning rate at the end of the cosine decay"),
    ("--warmup-iters", "warmup_iters", int, "steps of linear warmup"),
    ("--max-iters", "max_iters", int, "total optimizer steps"),
    ("--lr-decay-iters", "lr_decay_iters", int, "step at which the cosine decay reaches --min-lr"),
    ("--beta1", "beta1", float, "AdamW beta1"),
    ("--beta2", "beta2", float, "AdamW beta2"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (matrices only, not biases or norms)"),
    ("--grad-clip", "grad_clip", float, "clip the gradient norm to this (0 = no clipping)"),
    ("--eval-interval", "eval_interval", int, "evaluate, sample and checkpoint every this many steps"),
    ("--eval-iters", "eval_iters", int, "batches per split in each evaluation"),
    ("--final-eval-iters", "final_eval_iters", int, "batches per split in the last evaluation (default: --eval-iters)"),
    ("--seed", "seed", int, "random seed (weights, batches, dropout)"),
    ("--val-fraction", "val_fraction", float, "fraction of the tokens held out for validation (see --split)"),
    ("--sample-tokens", "sample_tokens", int, "tokens of greedy sample printed at each evaluation (0 = none)"),
)


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
               "  torchrun --nproc_per_node 2 -m lucidlm train --data shakespeare.txt --out runs/ddp",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", required=True, metavar="FILE_OR_DIR",
                        help="training text: a UTF-8 file, or a folder whose *.txt files are concatenated")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory: data/, checkpoint/, metrics.jsonl, loss.png")
    parser.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default=DEFAULTS.tokenizer,
                        help="char: one token per character; word: whitespace-separated words; bpe: byte-level "
                             "BPE trained on the corpus (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help="bpe: vocabulary size to train (default 1024); word: keep only the N-3 most "
                             "frequent words; char: ignored")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULTS.preset,
                        help="model architecture to start from; --n-layer/--n-head/--n-embd/--block-size/--dropout "
                             "resize it (default: %(default)s)")
    for flag, name, kind, text in NANOGPT_OPTIONS:
        default = getattr(DEFAULTS, name)
        suffix = "" if "(default" in text else f" (default: {default})"
        parser.add_argument(flag, dest=name, type=kind, default=default, metavar=kind.__name__.upper(),
                            help=text + suffix)
    parser.add_argument("--split", choices=("tail", "interleaved"), default=DEFAULTS.split,
                        help="which tokens validate: tail = the last --val-fraction of the corpus (nanoGPT); "
                             "interleaved = every 10th chunk of 1024 tokens, from all over the corpus "
                             "(default: %(default)s)")
    parser.add_argument("--constant-lr", action="store_true",
                        help="keep --learning-rate constant (no warmup or decay), like seed 004's Adam")
    parser.add_argument("--device", default=DEFAULTS.device,
                        help="auto (CUDA if available, else CPU), cpu, cuda, cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=DEFAULTS.dtype,
                        help="auto: bf16 autocast on CUDA, fp32 on CPU (bf16 on CPU is opt-in: slower and "
                             "less exact) (default: %(default)s)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (slow start, faster steps)")
    parser.add_argument("--sample-prompt", default=None, metavar="TEXT",
                        help="prompt for the samples printed at each evaluation (default: the first token "
                             "of the validation text)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its checkpoint; the training settings must match "
                             "(--max-iters, evaluation and device may change)")
    parser.set_defaults(handler=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {name: getattr(args, name) for _, name, _, _ in NANOGPT_OPTIONS}
    return TrainConfig(
        data=args.data, out_dir=args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        preset=args.preset, split=args.split, decay_lr=not args.constant_lr, device=args.device, dtype=args.dtype,
        compile=args.compile, sample_prompt=args.sample_prompt, progress=not args.no_progress,
        resume=args.resume, **fields,
    )


def run(args: argparse.Namespace) -> int:
    from lucidlm.training.trainer import train

    result = train(config_from_args(args))
    if result.interrupted:
        return 130
    if result.val_loss is not None:
        print(f"done: step {result.step}, val loss {result.val_loss:.4f}; model in {result.checkpoint} "
              f"(try: lucidlm generate \"...\" --model {args.out})")
    return 0
