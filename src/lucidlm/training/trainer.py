"""Training a model from scratch: nanoGPT's ``train.py`` as a class.

    result = train(TrainConfig(data="input.txt", out_dir="out"))   # then lucidlm.load("out")

One optimizer step = ``gradient_accumulation_steps`` micro-batches of ``batch_size`` random
windows (per process), AdamW with weight decay on matrices only, gradient clipping, and
nanoGPT's warmup + cosine learning rate. Every ``eval_interval`` steps the mean loss over
``eval_iters`` train and val batches is logged to ``OUT/metrics.jsonl``, the loss curve to
``OUT/loss.png``, a greedy sample is printed, and ``OUT/checkpoint/`` is rewritten.

A run resumed with ``resume=True`` continues bit-for-bit: the checkpoint holds the weights,
AdamW's moments, the batch sampler's generator and the dropout RNG. Evaluation and
sampling draw from their own generators, so how often you evaluate never changes training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lucidlm.config import PRESETS, ModelConfig, preset
from lucidlm.errors import CheckpointError, ConfigError
from lucidlm.model.transformer import Transformer
from lucidlm.training import checkpoint as ckpt
from lucidlm.training.data import TOKENIZER_KINDS, TokenData, check_enough_data, get_batch, prepare_data
from lucidlm.training.distributed import (DistributedContext, any_rank, barrier, cleanup_distributed,
                                          gather_rng_states, rank_slice, setup_distributed)
from lucidlm.training.loss import masked_cross_entropy
from lucidlm.training.schedule import get_lr
from lucidlm.weights.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from lucidlm.weights.state import load_into

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


@dataclass
class TrainConfig:
    """Every knob of a training run. Names follow nanoGPT's train.py; defaults are its
    documented CPU run of shakespeare-char (4 layers, 128 wide, 64 tokens of context)."""

    # data
    data: str = ""  # a .txt file or a folder of .txt files
    out_dir: str = "out"
    tokenizer: str = "char"  # char | word | bpe
    vocab_size: Optional[int] = None  # bpe: target size (default 1024); word: cap
    val_fraction: float = 0.1
    split: str = "tail"  # tail (nanoGPT: the end validates) | interleaved (every 10th chunk)
    # model: a preset, optionally resized
    preset: str = "shakespeare-char"
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    block_size: Optional[int] = None  # None -> the preset's max_seq_len
    dropout: Optional[float] = None  # None -> the preset's
    # optimisation
    batch_size: int = 12  # per process and micro-step
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    max_iters: int = 2000
    lr_decay_iters: int = 2000
    decay_lr: bool = True  # False: constant learning_rate (seed 004's Adam)
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    # evaluation and logging
    eval_interval: int = 250
    eval_iters: int = 20
    final_eval_iters: Optional[int] = None  # None -> eval_iters
    sample_prompt: Optional[str] = None  # None -> the first token of the validation split
    sample_tokens: int = 100
    progress: bool = True  # tqdm bar, only when stderr is a terminal
    # runtime
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 elsewhere) | float32 | bfloat16
    compile: bool = False
    resume: bool = False

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZER_KINDS:
            raise ConfigError(f"tokenizer={self.tokenizer!r}; choose one of {', '.join(TOKENIZER_KINDS)}.")
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; available: {', '.join(sorted(PRESETS))}.")
        for name in ("batch_size", "gradient_accumulation_steps", "max_iters", "eval_interval", "eval_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "max_iters" else 1):
                raise ConfigError(f"{name}={value!r} must be a positive integer.")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype={self.dtype!r}; choose auto, float32 or bfloat16.")
        if self.learning_rate <= 0 or self.min_lr < 0:
            raise ConfigError(f"learning_rate={self.learning_rate} must be > 0 and min_lr={self.min_lr} >= 0.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Settings that shape the training trajectory: a resumed run must use the same ones.
# (max_iters, evaluation, sampling, device and compile may change between runs.)
RESUME_MUST_MATCH = (
    "data", "tokenizer", "vocab_size", "val_fraction", "split", "preset", "n_layer", "n_head", "n_embd",
    "block_size", "dropout", "batch_size", "gradient_accumulation_steps", "learning_rate", "min_lr",
    "warmup_iters", "lr_decay_iters", "decay_lr", "beta1", "beta2", "weight_decay", "grad_clip", "seed", "dtype",
)


@dataclass
class TrainResult:
    step: int
    train_losses: list[float]  # one per optimizer step, since step 0 of the run (resumes included)
    train_loss: Optional[float]  # of the last evaluation
    val_loss: Optional[float]
    best_val_loss: float
    checkpoint: Optional[Path]
    interrupted: bool = False
    elapsed: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)


def model_config_for(config: TrainConfig, vocab_size: int) -> ModelConfig:
    """The preset resized by the nanoGPT-named overrides, with the tokenizer's vocabulary."""
    base = PRESETS[config.preset]
    overrides: dict[str, Any] = {"vocab_size": vocab_size}
    if config.block_size is not None:
        overrides["max_seq_len"] = config.block_size
    if config.n_layer is not None:
        overrides["n_layers"] = config.n_layer
    if config.n_head is not None or config.n_embd is not None:
        overrides["head_dim"] = None  # derive it again from the new width / head count
        if config.n_head is not None:
            overrides["n_heads"] = config.n_head
            if base.get("n_kv_heads") is not None:
                overrides["n_kv_heads"] = None
        if config.n_embd is not None:
            overrides["d_model"] = config.n_embd
    if config.dropout is not None:
        overrides["dropout"] = config.dropout
    return preset(config.preset, **overrides)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but no CUDA GPU is available; use --device cpu.")
    return device


def check_writable(out_dir: Path) -> None:
    """Fail before any training if checkpoints could not be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        raise CheckpointError(
            f"cannot write to the output directory {out_dir} ({exc.strerror or exc}); choose a writable --out."
        ) from None


def configure_optimizer(model: Transformer, config: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (embeddings, projections), never on biases or
    norm scales, as in nanoGPT's ``configure_optimizers``."""
    params = [p for p in model.parameters() if p.requires_grad]  # .parameters() lists tied weights once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2),
                             fused=device_type == "cuda")


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.ctx: DistributedContext = setup_distributed(resolve_device(config.device))
        self.device = torch.device(self.ctx.device)
        self.out_dir = Path(config.out_dir)
        self.step = 0
        self.best_val_loss = math.inf
        self.train_losses: list[float] = []
        self.last_eval_step = -1
        self.metrics: list[dict[str, Any]] = []
        self._stop_requested = False
        self._bar: Any = None
        try:
            self._setup()
        except BaseException:
            cleanup_distributed(self.ctx)
            raise

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        saved_state = None
        if ctx.is_main:
            check_writable(self.out_dir)
            ckpt.remove_stale_temporaries(self.out_dir)
            found = ckpt.find_checkpoint(self.out_dir)
            if found is not None and not cfg.resume:
                raise CheckpointError(
                    f"{self.out_dir} already holds a training checkpoint ({found}); pass --resume to continue "
                    f"it, or choose another --out."
                )
        barrier(ctx)
        if cfg.resume:
            found = ckpt.find_checkpoint(self.out_dir) if ctx.is_main else self.out_dir / ckpt.CHECKPOINT_DIR
            if found is None or not found.is_dir():
                raise CheckpointError(
                    f"--resume: there is no checkpoint in {self.out_dir / ckpt.CHECKPOINT_DIR}; train without "
                    f"--resume first (or point --out at the run to continue)."
                )
            self.checkpoint_dir = found
            saved_state = ckpt.read_trainer_state(found)
            # Before touching the data: a different tokenizer would re-tokenize OUT/data.
            self._check_same_settings(saved_state)

        # Tokenize once (main process); the others open the files it wrote.
        if ctx.is_main:
            self.data = self._prepare_data()
        barrier(ctx)
        if not ctx.is_main:
            self.data = self._prepare_data()
        self.model_config = model_config_for(cfg, self.data.tokenizer.vocab_size)
        self.block_size = self.model_config.max_seq_len
        check_enough_data(self.data, cfg.batch_size * ctx.world_size, self.block_size)
        # Encode the sample prompt now: a character the tokenizer lacks fails before training.
        prompt = self.data.tokenizer.encode(cfg.sample_prompt) if cfg.sample_prompt else []
        self.sample_prompt_ids = prompt[-(self.block_size - 1):] or [int(self.data.val[0])]

        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        self.model = Transformer(self.model_config, tokenizer=self.data.tokenizer).to(self.device)
        self.optimizer = configure_optimizer(self.model, cfg, self.device.type)
        self.batch_generator = torch.Generator().manual_seed(cfg.seed)  # identical on every rank
        torch.manual_seed(cfg.seed + ctx.rank)  # dropout masks differ between ranks
        if self.device.type == "cuda":
            torch.cuda.manual_seed(cfg.seed + ctx.rank)
        if saved_state is not None:
            self._load_checkpoint(saved_state)
        self.train_model = self._wrap_model()

    def _prepare_data(self) -> TokenData:
        cfg = self.config
        if not cfg.data:
            raise ConfigError("no training data given; pass --data FILE_OR_FOLDER.")
        progress = cfg.progress and self.ctx.is_main and sys.stderr.isatty()
        return prepare_data(cfg.data, self.out_dir, cfg.tokenizer, cfg.vocab_size, cfg.val_fraction, progress,
                            cfg.split)

    def _wrap_model(self) -> torch.nn.Module:
        model: torch.nn.Module = self.model
        if self.config.compile:
            model = torch.compile(model)
        if self.ctx.enabled:
            from torch.nn.parallel import DistributedDataParallel
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids)
        return model

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        # bf16 autocast by default only on CUDA: on CPU it is slower and less exact.
        if self.config.dtype == "bfloat16" or (self.config.dtype == "auto" and self.device.type == "cuda"
                                              and torch.cuda.is_bf16_supported()):
            return torch.bfloat16
        return None

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    @property
    def tokens_per_step(self) -> int:
        cfg = self.config
        return cfg.batch_size * cfg.gradient_accumulation_steps * self.ctx.world_size * self.block_size

    # ------------------------------------------------------------------ resume
    def _check_same_settings(self, state: dict[str, Any]) -> None:
        saved = state.get("train_config", {})
        current = self.config.to_dict()
        current["data"] = _resolved(current["data"])
        differences = [f"{name}: {saved.get(name)!r} -> {current[name]!r}" for name in RESUME_MUST_MATCH
                       if saved.get(name) != current[name]]
        if state.get("world_size", 1) != self.ctx.world_size:
            differences.append(f"world_size (processes): {state.get('world_size', 1)} -> {self.ctx.world_size}")
        if differences:
            raise CheckpointError(
                f"cannot resume from {self.checkpoint_dir}: it was trained with different settings "
                f"({'; '.join(differences)}). Resume with the original settings, or start a new run with "
                f"another --out."
            )

    def _load_checkpoint(self, state: dict[str, Any]) -> None:
        directory = self.checkpoint_dir
        saved_model = json.loads((directory / CONFIG_NAME).read_text())
        current_model = self.model_config.to_dict()
        differences = [f"model.{k}: {saved_model.get(k)!r} -> {v!r}" for k, v in current_model.items()
                       if saved_model.get(k) != v]
        if differences:
            raise CheckpointError(
                f"cannot resume from {directory}: its model config differs ({'; '.join(differences)}). "
                f"Resume with the original settings, or start a new run with another --out."
            )
        try:
            tensors = load_file(str(directory / WEIGHTS_NAME))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{directory / WEIGHTS_NAME} cannot be read ({exc}).") from None
        load_into(self.model, tensors, directory / WEIGHTS_NAME)
        ckpt.load_optimizer(self.optimizer, directory / ckpt.OPTIMIZER_NAME)
        self.step = int(state["step"])
        self.best_val_loss = float(state.get("best_val_loss", math.inf))
        self.train_losses = [float(x) for x in state.get("train_losses", [])][: self.step]
        self.last_eval_step = int(state.get("last_eval_step", -1))
        self.batch_generator.set_state(ckpt.decode_rng_state(state["batch_generator"]))
        torch_states = state["torch_rng"]
        torch.set_rng_state(ckpt.decode_rng_state(torch_states[self.ctx.rank]))
        if self.device.type == "cuda" and state.get("cuda_rng"):
            torch.cuda.set_rng_state(ckpt.decode_rng_state(state["cuda_rng"][self.ctx.rank]), self.device)
        if self.ctx.is_main:
            self._truncate_metrics(self.step)

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric lines written after the checkpoint (the run died before saving again)."""
        path = self.out_dir / METRICS_NAME
        if path.is_file():
            kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in kept))
            self.metrics = [json.loads(line) for line in kept]

    def trainer_state(self) -> dict[str, Any]:
        """Everything besides weights and optimizer that an exact resume needs. Collective
        under DDP (every rank's dropout RNG is gathered), so every rank must call it."""
        torch_states = gather_rng_states(torch.get_rng_state(), self.ctx)
        state = {
            "step": self.step,
            "best_val_loss": self.best_val_loss if math.isfinite(self.best_val_loss) else None,
            "last_eval_step": self.last_eval_step,
            "world_size": self.ctx.world_size,
            "batch_generator": ckpt.encode_rng_state(self.batch_generator.get_state()),
            "torch_rng": [ckpt.encode_rng_state(s) for s in torch_states],
            "train_losses": self.train_losses,
            "train_config": {**self.config.to_dict(), "data": _resolved(self.config.data)},
            "torch_version": torch.__version__,
        }
        if self.device.type == "cuda":
            cuda_states = gather_rng_states(torch.cuda.get_rng_state(self.device), self.ctx)
            state["cuda_rng"] = [ckpt.encode_rng_state(s) for s in cuda_states]
        return state

    def save_checkpoint(self) -> Optional[Path]:
        state = self.trainer_state()  # collective: all ranks
        path = None
        if self.ctx.is_main:
            path = ckpt.save_checkpoint(self.out_dir, self.model, self.optimizer, state)
        barrier(self.ctx)
        return path

    # ------------------------------------------------------------------ one step
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        x, y = get_batch(self.data.train, cfg.batch_size * self.ctx.world_size, self.block_size,
                         self.batch_generator)  # the global batch, same on every rank
        return rank_slice(x, self.ctx).to(self.device), rank_slice(y, self.ctx).to(self.device)

    def train_step(self) -> float:
        """One optimizer step; returns its training loss (averaged over ranks)."""
        cfg = self.config
        lr = get_lr(self.step, cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr) \
            if cfg.decay_lr else cfg.learning_rate
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        total = torch.zeros((), device=self.device)
        for micro_step in range(cfg.gradient_accumulation_steps):
            x, y = self.next_batch()
            last = micro_step == cfg.gradient_accumulation_steps - 1
            # Under DDP, all-reduce gradients once per step, on the last micro-batch only.
            sync = contextlib.nullcontext() if last or not self.ctx.enabled else self.train_model.no_sync()
            with sync:
                with self._autocast():
                    logits = self.train_model(x)  # (B, T, V)
                loss = masked_cross_entropy(logits, y) / cfg.gradient_accumulation_steps
                loss.backward()
            total += loss.detach()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.ctx.enabled:
            torch.distributed.all_reduce(total)
            total /= self.ctx.world_size
        return float(total)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def estimate_loss(self, iters: int) -> dict[str, float]:
        """Mean loss over ``iters`` batches of each split. The batches come from a generator
        seeded the same way at every evaluation: successive numbers compare like with like."""
        self.model.eval()
        out = {}
        for split, tokens in (("train", self.data.train), ("val", self.data.val)):
            generator = torch.Generator().manual_seed(self.config.seed + 1)
            losses = []
            for _ in range(iters):
                # The global batch, so the numbers do not depend on the number of processes.
                x, y = get_batch(tokens, self.config.batch_size * self.ctx.world_size, self.block_size,
                                 generator, self.device)
                with self._autocast():
                    logits = self.model(x)
                losses.append(float(masked_cross_entropy(logits, y)))
            out[split] = sum(losses) / len(losses)
        self.model.train()
        return out

    @torch.no_grad()
    def sample(self) -> str:
        """A greedy continuation of the sample prompt, to watch the model learn."""
        from lucidlm.generation import generate

        prompt = self.sample_prompt_ids
        self.model.eval()
        try:
            result = generate(self.model, prompt, max_new_tokens=self.config.sample_tokens, temperature=0.0)
        finally:
            self.model.clear_kv_cache()
            self.model.train()
        # Decode prompt and continuation together: word tokens need the spaces between them.
        return self.data.tokenizer.decode(list(prompt) + list(result.token_ids))

    def evaluate(self, iters: int, elapsed: float, train_time: float, tokens_seen: int) -> dict[str, Any]:
        """Log one evaluation (main process only): metrics.jsonl, loss.png, the console."""
        with torch.random.fork_rng(devices=[]):  # leave the training RNG exactly as it was
            losses = self.estimate_loss(iters)
            text = self.sample() if self.config.sample_tokens > 0 else ""
        cfg = self.config
        record = {
            "step": self.step,
            "train_loss": losses["train"],
            "val_loss": losses["val"],
            "val_ppl": math.exp(min(losses["val"], 50.0)),
            "lr": get_lr(max(self.step - 1, 0), cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters,
                         cfg.min_lr) if cfg.decay_lr else cfg.learning_rate,
            "tokens_per_s": tokens_seen / train_time if train_time > 0 else None,
            "elapsed": elapsed,
            "eval_iters": iters,
            "sample": text,
        }
        self.metrics.append(record)
        with open(self.out_dir / METRICS_NAME, "a") as f:
            f.write(json.dumps(record) + "\n")
        from lucidlm.inspect.loss_plot import plot_loss_curves
        plot_loss_curves(self.metrics, self.out_dir / PLOT_NAME, self.train_losses,
                         title=f"{cfg.preset} on {Path(cfg.data).name}")
        speed = f", {record['tokens_per_s']:,.0f} tok/s" if record["tokens_per_s"] else ""
        self._print(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                    f"(ppl {record['val_ppl']:.2f}){speed}")
        if text:
            self._print(f"  sample: {text[:200]!r}")
        return record

    def _print(self, message: str) -> None:
        if not self.ctx.is_main:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(message)
        else:
            print(message, flush=True)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainResult:
        cfg, ctx = self.config, self.ctx
        from tqdm.auto import tqdm

        total, trainable = self.model.num_parameters(), self.model.num_parameters(trainable_only=True)
        counted = f"{total:,}" if trainable == total else f"{trainable:,} of {total:,}"
        self._print(
            f"training {counted} parameters ({self.model_config.n_layers} layers, "
            f"d_model {self.model_config.d_model}, vocab {self.model_config.vocab_size}) on "
            f"{len(self.data.train):,} train / {len(self.data.val):,} val tokens; {self.tokens_per_step:,} tokens "
            f"per step ({ctx.world_size} process(es)), device {self.device}"
            + (f", resuming at step {self.step}" if cfg.resume else "")
        )
        self._bar = tqdm(total=cfg.max_iters, initial=self.step, desc="train", dynamic_ncols=True,
                         disable=not (cfg.progress and ctx.is_main and sys.stderr.isatty()))
        previous_handler = self._install_interrupt_handler()
        start = time.perf_counter()
        train_time, tokens_seen = 0.0, 0
        interrupted = False
        last_record: dict[str, Any] = self.metrics[-1] if self.metrics else {}
        checkpoint_path: Optional[Path] = None
        try:
            while self.step < cfg.max_iters:
                if self.step % cfg.eval_interval == 0 and self.step != self.last_eval_step:
                    last_record, checkpoint_path = self._evaluate_and_save(
                        cfg.eval_iters, time.perf_counter() - start, train_time, tokens_seen)
                    train_time, tokens_seen = 0.0, 0
                if any_rank(self._stop_requested, ctx):
                    interrupted = True
                    break
                t0 = time.perf_counter()
                loss = self.train_step()
                train_time += time.perf_counter() - t0
                tokens_seen += self.tokens_per_step
                self.train_losses.append(loss)
                self._bar.update(1)
                self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{self.optimizer.param_groups[0]['lr']:.2e}",
                                      tok_s=f"{tokens_seen / max(train_time, 1e-9):,.0f}", refresh=False)
            if interrupted:
                checkpoint_path = self.save_checkpoint()
                self._print(f"interrupted: saved a checkpoint at step {self.step} in {checkpoint_path}; "
                            f"continue with --resume.")
            elif self.last_eval_step != self.step:
                last_record, checkpoint_path = self._evaluate_and_save(
                    cfg.final_eval_iters or cfg.eval_iters, time.perf_counter() - start, train_time, tokens_seen)
        finally:
            self._bar.close()
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
            cleanup_distributed(ctx)
        return TrainResult(
            step=self.step, train_losses=list(self.train_losses), train_loss=last_record.get("train_loss"),
            val_loss=last_record.get("val_loss"), best_val_loss=self.best_val_loss, checkpoint=checkpoint_path,
            interrupted=interrupted, elapsed=time.perf_counter() - start, metrics=list(self.metrics),
        )

    def _evaluate_and_save(self, iters: int, elapsed: float, train_time: float,
                           tokens_seen: int) -> tuple[dict[str, Any], Optional[Path]]:
        record: dict[str, Any] = {}
        if self.ctx.is_main:
            record = self.evaluate(iters, elapsed, train_time, tokens_seen)
            self.best_val_loss = min(self.best_val_loss, record["val_loss"])
        self.last_eval_step = self.step
        return record, self.save_checkpoint()

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint and return (what Ctrl-C does)."""
        self._stop_requested = True

    def _install_interrupt_handler(self) -> Any:
        """First Ctrl-C: stop after the current step and save. Second: abort at once.
        Stopping between steps keeps the checkpoint consistent, so --resume stays exact."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigint(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            self._print("\nCtrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to abort).")

        return signal.signal(signal.SIGINT, on_sigint)


def _resolved(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else path


def train(config: TrainConfig) -> TrainResult:
    """Train a model as ``config`` says; the trained model is in ``OUT/checkpoint/``."""
    return Trainer(config).fit()
