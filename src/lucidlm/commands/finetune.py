"""``lucidlm finetune``: adapt a pretrained model to a text corpus with LoRA, bottleneck
adapters or prefix tuning, training only the new parameters.

The training loop is lucidlm's ``Trainer`` (AdamW, warmup + cosine, gradient accumulation,
progress bar, metrics.jsonl, loss.png); ``FinetuneTrainer`` changes only what differs from
training from scratch: the model is given (pretrained, with an adapter attached), the
corpus is tokenized with the model's own tokenizer, a checkpoint is just the adapter, and
each evaluation shows the base model's and the tuned model's continuation of one prompt.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from lucidlm.errors import AdapterError, ConfigError, DataError

METHODS = ("lora", "adapter", "prefix")
DEFAULT_LEARNING_RATES = {"lora": 1e-3, "adapter": 1e-3, "prefix": 3e-3}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "finetune",
        help="fine-tune a pretrained model on a text corpus with LoRA, adapters or prefix tuning",
        description="Freeze a pretrained model and train a small number of new parameters on a text corpus: "
                    "LoRA (low-rank updates to chosen linear layers; saved in Hugging Face PEFT's format, so "
                    "peft.PeftModel.from_pretrained reads it), Houlsby bottleneck adapters (after every attention "
                    "and MLP output) or prefix tuning (trained keys/values in every attention layer). Each "
                    "evaluation prints the base model's and the tuned model's continuation of the same prompt. "
                    "OUT gets the adapter files, metrics.jsonl and loss.png. Use the result with "
                    "`lucidlm generate --model SOURCE --adapter OUT`, or fold a LoRA into the weights with "
                    "`lucidlm merge`.",
        epilog="examples:\n"
               "  lucidlm finetune --data input.txt --out runs/lora-shakespeare --max-iters 200\n"
               "  lucidlm finetune --model smollm2-135m --data input.txt --method lora --rank 16 --alpha 32 \\\n"
               "      --targets q,k,v,o --out runs/lora16\n"
               "  lucidlm finetune --data input.txt --method adapter --bottleneck 32 --out runs/adapter\n"
               "  lucidlm finetune --data input.txt --method prefix --prefix-length 16 --out runs/prefix",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, metavar="SOURCE",
                        help="the base model: a pretrained name, .gguf file, Hugging Face or lucidlm directory "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--data", required=True, metavar="FILE",
                        help="training text: a UTF-8 .txt file or a folder of .txt files")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the adapter, metrics and plot")
    parser.add_argument("--method", choices=METHODS, default="lora", help="what to train (default: lora)")

    lora = parser.add_argument_group("LoRA (--method lora)")
    lora.add_argument("--rank", type=int, default=8, help="rank r of each update B @ A (default: 8)")
    lora.add_argument("--alpha", type=float, default=16.0, help="scaling numerator: updates are scaled by alpha/r "
                                                                "(default: 16)")
    lora.add_argument("--dropout", type=float, default=0.05, help="dropout on the LoRA branch's input (default: 0.05)")
    lora.add_argument("--targets", default="q_proj,v_proj",
                      help="comma-separated linear layers to adapt: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                           "down_proj, the short forms q,k,v,o,gate,up,down, all-linear, or a regular expression over "
                           "full module names such as 'blocks\\.(0|1)\\.attn\\.q_proj' (default: q_proj,v_proj)")
    lora.add_argument("--init", choices=("kaiming", "gaussian"), default="kaiming",
                      help="initialisation of A (B always starts at zero): kaiming-uniform like PEFT, or the "
                           "LoRA paper's Gaussian (default: kaiming)")
    lora.add_argument("--adapter-name", default="default", help="name of the LoRA adapter (default: default)")
    other = parser.add_argument_group("adapters and prefix tuning")
    other.add_argument("--bottleneck", type=int, default=32,
                       help="--method adapter: width of each bottleneck adapter (default: 32)")
    other.add_argument("--prefix-length", type=int, default=16,
                       help="--method prefix: number of trained key/value positions per layer (default: 16)")
    other.add_argument("--prefix-hidden", type=int, default=None,
                       help="--method prefix: width of the reparameterisation MLP (default: d_model)")

    train = parser.add_argument_group("training (as in lucidlm train)")
    train.add_argument("--max-iters", type=int, default=200, help="optimizer steps (default: 200)")
    train.add_argument("--learning-rate", type=float, default=None,
                       help="peak learning rate (default: 1e-3 for lora and adapter, 3e-3 for prefix)")
    train.add_argument("--min-lr", type=float, default=None, help="final learning rate (default: learning-rate/10)")
    train.add_argument("--warmup-iters", type=int, default=20, help="linear warmup steps (default: 20)")
    train.add_argument("--lr-decay-iters", type=int, default=None, help="cosine decay length (default: max-iters)")
    train.add_argument("--constant-lr", action="store_true",
                       help="keep --learning-rate constant (no warmup or decay), as in lucidlm train")
    train.add_argument("--batch-size", type=int, default=8, help="windows per micro-batch (default: 8)")
    train.add_argument("--block-size", type=int, default=128, help="tokens per window (default: 128)")
    train.add_argument("--gradient-accumulation-steps", type=int, default=1,
                       help="micro-batches per optimizer step (default: 1)")
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)")
    train.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 = off (default: 1.0)")
    train.add_argument("--val-fraction", type=float, default=0.1,
                       help="last fraction of the corpus held out for validation (default: 0.1)")
    train.add_argument("--eval-interval", type=int, default=50, help="evaluate every N steps (default: 50)")
    train.add_argument("--eval-iters", type=int, default=10, help="batches per evaluation (default: 10)")
    train.add_argument("--sample-prompt", default=None,
                       help="prompt for the base-vs-tuned samples (default: the start of the validation text)")
    train.add_argument("--sample-tokens", type=int, default=40, help="tokens per sample, 0 = none (default: 40)")
    train.add_argument("--seed", type=int, default=1337, help="random seed (default: 1337)")
    train.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps (default: auto)")
    train.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                       help="autocast dtype: auto = bf16 on CUDA, fp32 elsewhere (default: auto)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


# ---------------------------------------------------------------------------------------
# The trainer, specialised
# ---------------------------------------------------------------------------------------

def tokenize_corpus(source: str | Path, tokenizer: Any, val_fraction: float, directory: Path) -> Any:
    """The corpus as train/val token arrays in the model's own vocabulary (in memory)."""
    from lucidlm.training.data import TokenData, corpus_files, read_corpus, tokenize_documents

    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction} must be between 0 and 1 (exclusive), e.g. 0.1.")
    texts = read_corpus(corpus_files(source))
    tokens = tokenize_documents(tokenizer, texts)
    n_train = int(len(tokens) * (1.0 - val_fraction))
    return TokenData(np.ascontiguousarray(tokens[:n_train]), np.ascontiguousarray(tokens[n_train:]),
                     tokenizer, directory)


def _trainer_class() -> type:
    from lucidlm.peft import disable_adapters, save_adapter
    from lucidlm.training.data import check_enough_data
    from lucidlm.training.trainer import Trainer, check_writable, configure_optimizer

    class FinetuneTrainer(Trainer):
        """The from-scratch Trainer with a given model and only its trainable parameters."""

        def __init__(self, config: Any, model: Any, base_name: str) -> None:
            self._given_model, self._base_name = model, base_name
            self._base_sample: Optional[str] = None
            super().__init__(config)

        def _setup(self) -> None:
            cfg = self.config
            if self.ctx.enabled:
                raise ConfigError("lucidlm finetune runs in a single process; launch it without torchrun.")
            if cfg.resume:
                raise ConfigError("lucidlm finetune cannot resume a run; start again with another --out.")
            check_writable(self.out_dir)
            model = self._given_model
            if model.tokenizer is None:
                raise ConfigError("the base model has no tokenizer, so the corpus cannot be encoded in its "
                                  "vocabulary; fine-tune a model that ships one (a pretrained name, .gguf or a "
                                  "directory with tokenizer.json).")
            self.data = tokenize_corpus(cfg.data, model.tokenizer, cfg.val_fraction, self.out_dir)
            self.model_config = model.config
            self.block_size = min(cfg.block_size or model.config.max_seq_len, model.config.max_seq_len)
            check_enough_data(self.data, cfg.batch_size, self.block_size)
            # The base-vs-tuned samples continue this prompt (default: the start of the held-out text).
            prompt = (model.tokenizer.encode(cfg.sample_prompt) if cfg.sample_prompt
                      else [int(t) for t in self.data.val[:16]])
            self.sample_prompt_ids = prompt[-(self.block_size - 1):]
            self.model = model.to(self.device)
            self.optimizer = configure_optimizer(self.model, cfg, self.device.type)
            self.batch_generator = torch.Generator().manual_seed(cfg.seed)
            torch.manual_seed(cfg.seed)
            self.train_model = self._wrap_model()

        def save_checkpoint(self) -> Path:
            """A checkpoint is the adapter alone (PEFT format for LoRA): megabytes, not the model."""
            return save_adapter(self.model, self.out_dir, base_model_name_or_path=self._base_name)

        def sample(self) -> str:
            tuned = super().sample()
            if self._base_sample is None:  # the base model never changes: sample it once
                with disable_adapters(self.model):
                    self._base_sample = super().sample()
            return tuned

        def evaluate(self, iters: int, elapsed: float, train_time: float, tokens_seen: int) -> dict[str, Any]:
            record = super().evaluate(iters, elapsed, train_time, tokens_seen)  # prints the tuned sample
            if self._base_sample is not None:
                self._print(f"  base model (adapter off): {self._base_sample[:200]!r}")
            return record

    return FinetuneTrainer


def attach(model: Any, args: argparse.Namespace) -> str:
    """Add the chosen method to ``model``; returns a one-line description."""
    from lucidlm.peft import add_adapters, add_lora, add_prefix
    from lucidlm.peft.lora import expand_targets

    if args.method == "lora":
        targets = expand_targets(args.targets)
        names = add_lora(model, name=args.adapter_name, r=args.rank, alpha=args.alpha, dropout=args.dropout,
                         targets=targets, init=args.init)
        return f"LoRA r={args.rank} alpha={args.alpha:g} on {len(names)} layers ({', '.join(targets)})"
    if args.method == "adapter":
        names = add_adapters(model, bottleneck=args.bottleneck)
        return f"bottleneck adapters of width {args.bottleneck} after {len(names)} projections"
    add_prefix(model, length=args.prefix_length, hidden=args.prefix_hidden)
    return f"prefix of {args.prefix_length} key/value positions in {model.config.n_layers} layers"


def run(args: argparse.Namespace) -> int:
    from lucidlm.loading import load
    from lucidlm.peft import freeze_prefix, save_adapter, trainable_parameters_report
    from lucidlm.training.trainer import TrainConfig

    out_dir = Path(args.out).expanduser()
    for stale in ("lucidlm_adapter.json", "metrics.jsonl"):
        if (out_dir / stale).exists():
            raise AdapterError(f"{out_dir} already holds a fine-tuning run ({stale}); choose another --out "
                               f"(lucidlm finetune does not resume).")
    lr = args.learning_rate or DEFAULT_LEARNING_RATES[args.method]
    config = TrainConfig(
        data=args.data, out_dir=str(out_dir), val_fraction=args.val_fraction, block_size=args.block_size,
        batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=lr, min_lr=args.min_lr if args.min_lr is not None else lr / 10,
        warmup_iters=args.warmup_iters, max_iters=args.max_iters,
        lr_decay_iters=args.lr_decay_iters or args.max_iters, decay_lr=not args.constant_lr,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, sample_prompt=args.sample_prompt, sample_tokens=args.sample_tokens,
        progress=not args.no_progress, seed=args.seed, device=args.device, dtype=args.dtype,
    )
    base_name = str(args.model) if args.model is not None else "smollm2-135m"
    # The loss plot's title reads this field; TrainConfig has no other place for a run name.
    config.preset = f"{args.method} fine-tune of {Path(base_name).name}"

    model = load(args.model)
    description = attach(model, args)
    print(f"{base_name}: {description}")
    print(trainable_parameters_report(model))

    start = time.perf_counter()
    trainer = _trainer_class()(config, model, base_name)
    result = trainer.fit()
    if args.method == "prefix":
        freeze_prefix(model)  # keep the keys/values, drop the training-only MLP
        save_adapter(model, out_dir, base_model_name_or_path=base_name)
    model_flag = f" --model {args.model}" if args.model is not None else ""
    prompt = model.tokenizer.decode(trainer.sample_prompt_ids).replace("\n", " ").strip()
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    print(f"done in {time.perf_counter() - start:.0f}s: step {result.step}, val loss {val}; "
          f"adapter in {out_dir}.\n  try it:  lucidlm generate{model_flag} --adapter {out_dir} \"{prompt[:30]}\"")
    if args.method == "lora":
        print(f"  merge it: lucidlm merge{model_flag} --adapter {out_dir} --out {out_dir}-merged")
    return 130 if result.interrupted else 0
