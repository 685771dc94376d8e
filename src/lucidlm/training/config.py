"""The settings of a training run, one dataclass per recipe.

``LoopConfig`` holds what the loop itself reads (steps, batches, schedule, evaluation,
sampling, runtime); ``TrainConfig`` (pre-training, ``pretrain``) and ``FinetuneConfig``
(``finetune``) add what their recipe builds. Each field carries its command-line help in
``metadata``: ``lucidlm train`` and ``lucidlm finetune`` generate their flags from these
classes, so a default or a help text lives in exactly one place.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lucidlm.config import PRESETS
from lucidlm.errors import ConfigError
from lucidlm.suggest import did_you_mean, keywords_checked, unknown_fields_message
from lucidlm.validation import (MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, check_float, check_int,
                                check_seed, first_surrogate)

# Step counts, intervals and token counts: far more than any run takes, but a whole number the loop
# can compute with (--gradient-accumulation-steps 1e30 overflowed mid-run) and a clear refusal.
MAX_STEPS = 2**31 - 1
DTYPES = ("auto", "float32", "bfloat16")
STRATEGIES = ("auto", "ddp", "fsdp")


def opt(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with its CLI help (``flag=`` renames the flag, ``choices=`` limits it,
    ``applies=`` names the one fine-tuning method or data kind it is for: ``check_options_apply``;
    ``short=`` adds a one-letter flag beside it)."""
    return field(default=default, metadata={"help": help, **extra})


@keywords_checked(ConfigError, unknown_fields_message)  # a misspelt field: ConfigError, did you mean
@dataclass
class LoopConfig:
    """What every training run needs; names follow nanoGPT's train.py."""

    out_dir: str = opt("out", "output directory: checkpoint/, metrics.jsonl, loss.png", flag="--out")
    batch_size: int = opt(12, "sequences per micro-batch and process", low=1)
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step (global batch = batch size x this "
                                              "x processes)", low=1, high=MAX_STEPS)
    learning_rate: float = opt(1e-3, "peak learning rate", low=0.0, low_open=True)
    min_lr: float = opt(1e-4, "learning rate at the end of the cosine decay (at most --learning-rate)", low=0.0)
    warmup_iters: int = opt(100, "steps of linear warmup", low=0, high=MAX_STEPS)
    max_iters: int = opt(2000, "total optimizer steps", low=0, high=MAX_STEPS)
    lr_decay_iters: int = opt(2000, "step at which the cosine decay reaches --min-lr", low=0, high=MAX_STEPS)
    decay_lr: bool = opt(True, "keep --learning-rate constant (no warmup or decay)", flag="--constant-lr")
    beta1: float = opt(0.9, "AdamW beta1", low=0.0, high=1.0, high_open=True)
    beta2: float = opt(0.99, "AdamW beta2", low=0.0, high=1.0, high_open=True)
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only, not biases or norms)", low=0.0)
    grad_clip: float = opt(1.0, "clip the gradient norm to this (0 = no clipping)", low=0.0)
    eval_interval: int = opt(250, "evaluate, sample and checkpoint every this many steps", low=1, high=MAX_STEPS)
    eval_iters: int = opt(20, "batches per split in each evaluation", low=1, high=MAX_STEPS)
    final_eval_iters: Optional[int] = opt(None, "batches per split in the last evaluation (default: --eval-iters)",
                                          low=1, high=MAX_STEPS)
    log_interval: int = opt(10, "read the training loss back from the device every this many steps (progress bar)",
                            low=1, high=MAX_STEPS)
    sample_prompt: Optional[str] = opt(None, "prompt for the samples printed at each evaluation", text=True)
    sample_tokens: int = opt(100, "tokens sampled at each evaluation (0 = none); past the context each token is "
                                  "predicted from the last --block-size tokens, as nanoGPT's generate",
                             low=0, high=MAX_STEPS)
    sample_temperature: float = opt(0.0, "sampling temperature of those samples (0 = greedy)", low=0.0)
    sample_top_p: Optional[float] = opt(None, "nucleus (top-p) cut-off of those samples",
                                        low=0.0, low_open=True, high=1.0)
    sample_seed: Optional[int] = opt(None, "seed of those samples (default: --seed)", seed=True)
    progress: bool = opt(True, "no progress bar on stderr (drawn by default when stderr is a terminal)")
    quiet: bool = opt(False, "show only warnings, errors and the final summary: no header, progress bars, evaluation "
                             "lines or samples (metrics.jsonl and loss.png as always)", short="-q")
    seed: int = opt(1337, "random seed (weights, batches, dropout)", seed=True)
    device: str = opt("auto", "auto (CUDA if available, else CPU), cpu, cuda, cuda:N")
    dtype: str = opt("auto", "auto: bf16 autocast on CUDA, fp32 on CPU; bfloat16: autocast on CPU "
                               "too (2-3x faster where the CPU has AVX512-BF16 or AMX)", choices=DTYPES)
    compile: bool = opt(False, "torch.compile the training step: model, loss and backward (slow start, faster "
                               "steps)")
    compile_mode: str = opt("default", "torch.compile mode; reduce-overhead replays CUDA graphs (GPU)",
                            choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    gradient_checkpointing: bool = opt(False, "recompute each block in the backward pass instead of keeping its "
                                              "activations: less memory, ~1 more forward pass of time, the same "
                                              "gradients")
    fused_adamw: bool = opt(True, "torch's default AdamW instead of the fused kernel (which runs by default on CPU "
                                   "and CUDA)")
    strategy: str = opt("auto", "under torchrun: ddp (replicas) or fsdp (sharded, FSDP2); auto = ddp",
                        choices=STRATEGIES)
    resume: bool = opt(False, "continue the run in --out from its checkpoint (same settings; --max-iters, "
                              "evaluation, device, strategy and, with the same global batch, the number of "
                              "processes may change)")

    # Settings that may change between a run and its resume (everything else must match). The
    # strategy changes only how the same math is spread over processes; checkpoints are the same
    # full files under each; gradient checkpointing changes memory, not the gradients. batch_size
    # may change with the process count (setup.check_same_settings).
    MAY_CHANGE = ("max_iters", "eval_interval", "eval_iters", "final_eval_iters", "log_interval", "sample_prompt",
                  "sample_tokens", "sample_temperature", "sample_top_p", "sample_seed", "progress", "quiet", "device",
                  "compile", "compile_mode", "fused_adamw", "resume", "out_dir", "epochs", "strategy",
                  "gradient_checkpointing")

    def __post_init__(self) -> None:
        if isinstance(self.out_dir, (str, Path)) and str(self.out_dir).startswith("~"):  # as --data: $HOME's
            from lucidlm.outputs import user_path

            self.out_dir = str(user_path(self.out_dir))
        if isinstance(self.dtype, str):  # the names lucidlm.load takes: bf16, fp32, torch.bfloat16
            from lucidlm.devices import DTYPES

            name = self.dtype.strip().lower().removeprefix("torch.")
            known = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES.values()}
            self.dtype = next((full for full, dtype in known.items() if DTYPES.get(name) is dtype), self.dtype)
        check_fields(self)
        check_min_lr(self)

    def peak_learning_rate(self) -> float:
        """The learning rate the warm-up reaches (``FinetuneConfig`` fills in its method's default)."""
        return self.learning_rate

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def differences(self, saved: dict[str, Any], current: Optional[dict[str, Any]] = None) -> list[str]:
        """'name: saved -> current' for every trajectory-shaping setting that differs."""
        current = current if current is not None else self.to_dict()
        return [f"{name}: {saved.get(name)!r} -> {value!r}" for name, value in current.items()
                if name not in self.MAY_CHANGE and saved.get(name) != value]


@keywords_checked(ConfigError, unknown_fields_message)
@dataclass
class TrainConfig(LoopConfig):
    """Pre-training from scratch; defaults are nanoGPT's documented CPU run of
    shakespeare-char (4 layers, 128 wide, 64 tokens of context, val loss ~1.88)."""

    data: str = opt("", "training text: a UTF-8 file, or a folder whose *.txt files are concatenated")
    tokenizer: str = opt("char", "char: one token per character; word: whitespace-separated words; bpe: byte-level "
                                 "BPE trained on the corpus", choices=("char", "word", "bpe"))
    vocab_size: Optional[int] = opt(None, "bpe: vocabulary size to train (default 1024); word: keep only the N-3 "
                                          "most frequent words", low=1, high=MAX_VOCAB)
    val_fraction: float = opt(0.1, "fraction of the tokens held out for validation (see --split)",
                              low=0.0, low_open=True, high=1.0, high_open=True)
    split: str = opt("tail", "tail = the last --val-fraction validates (nanoGPT); interleaved = every 10th chunk "
                             "of 1024 tokens", choices=("tail", "interleaved"))
    preset: str = opt("shakespeare-char", "model architecture to start from; --n-layer/--n-head/--n-embd/"
                                          "--block-size/--dropout resize it (keeping its MLP width ratio and its "
                                          "query heads per key/value head)", choices=sorted(PRESETS))
    n_layer: Optional[int] = opt(None, "number of transformer blocks (default: the preset's)", low=1, high=MAX_LAYERS)
    n_head: Optional[int] = opt(None, "attention heads per block (default: the preset's)", low=1, high=MAX_HEADS)
    n_embd: Optional[int] = opt(None, "model width d_model (default: the preset's)", low=1, high=MAX_WIDTH)
    block_size: Optional[int] = opt(None, "context length in tokens (default: the preset's max_seq_len)",
                                    low=1, high=MAX_CONTEXT)
    dropout: Optional[float] = opt(None, "dropout probability (default: the preset's)",
                                   low=0.0, high=1.0, high_open=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vocab_size is not None and self.tokenizer == "char":
            raise ConfigError(f"vocab_size (--vocab-size) {self.vocab_size} does not apply to --tokenizer char, whose "
                              f"vocabulary is the corpus' characters; drop --vocab-size, or pass --tokenizer bpe or "
                              f"word.")


PretrainConfig = TrainConfig


def check_fields(config: Any) -> None:
    """Check every field of a recipe config against its type and the bounds in its metadata
    (``low``/``high``, ``low_open``/``high_open``, ``seed``, ``choices``), so ``pretrain(TrainConfig(
    learning_rate=float("nan")))`` and ``lucidlm train --learning-rate nan`` are refused the same
    way, before any data is read. Each message names the field, its flag and the value."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value, meta = getattr(config, f.name), f.metadata
        kind, optional = _kind(hints[f.name])
        if value is None and optional:
            continue
        name = f"{f.name} ({flag_of(type(config), f.name)})"
        # e.g. TrainConfig(lr_decay_iters=None): only FinetuneConfig fills such a None in
        fix = f"{type(config).__name__} fills in no value for None (its default is {f.default!r})" \
            if value is None else ""
        if meta.get("seed"):
            check_seed(value, name, ConfigError)
        elif kind is int:
            check_int(value, name, ConfigError, low=meta.get("low"), high=meta.get("high"), fix=fix)
        elif kind is float:
            check_float(value, name, ConfigError, low=meta.get("low"), high=meta.get("high"),
                        low_open=meta.get("low_open", False), high_open=meta.get("high_open", False), fix=fix)
        elif kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} is invalid: expected True or False.")
        elif kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"{name}={value!r} is invalid: expected a string.")
            if meta.get("text") and first_surrogate(value) is not None:
                raise ConfigError(f"{name} is not valid UTF-8 text (a lone surrogate at character "
                                  f"{first_surrogate(value)}, from bytes that were not UTF-8); pass UTF-8 text.")
            choices = meta.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"{name}={value!r} is invalid: choose one of {', '.join(choices)}"
                                  f"{did_you_mean(value, choices) or '.'}")
    if not config.out_dir:
        raise ConfigError("out_dir (--out) is empty: name the directory the run writes to.")


def check_min_lr(config: LoopConfig) -> None:
    """Refuse a ``min_lr`` above the peak learning rate: the cosine "decay" would raise the rate."""
    peak = config.peak_learning_rate()
    if config.decay_lr and config.min_lr is not None and config.min_lr > peak:
        default = " (the default for this method)" if config.learning_rate is None else ""
        raise ConfigError(f"min_lr (--min-lr) {config.min_lr:g} is above the peak learning_rate (--learning-rate) "
                          f"{peak:g}{default}, so the cosine decay would raise the rate; pass --min-lr <= "
                          f"--learning-rate (nanoGPT uses about learning-rate / 10).")


@functools.lru_cache(maxsize=None)
def _hints(config_class: type) -> dict[str, Any]:
    return typing.get_type_hints(config_class)


def _kind(annotation: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of a field annotation such as ``Optional[int]``."""
    if typing.get_origin(annotation) is Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None)), True
    return annotation, False


def flag_of(config_class: type, name: str) -> str:
    """The command-line flag of a config field (``--field-name`` unless its metadata names one)."""
    f = config_class.__dataclass_fields__[name]
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    if isinstance(f.default, bool):  # a switch: --name turns on a False default, --no-name off a True one
        return f"--{'no-' if f.default else ''}{name.replace('_', '-')}"
    return f"--{name.replace('_', '-')}"


def command_line(config: LoopConfig, command: str, world_size: int = 1, **changes: Any) -> str:
    """``lucidlm COMMAND`` with the flags that give ``config`` (plus ``changes``): the data and
    output (required flags) and every field that differs from its default, under torchrun for
    several processes. Tells the user the exact command that resumes a run."""
    import shlex

    values = {**config.to_dict(), **changes}
    launcher = ["lucidlm"] if world_size == 1 else ["torchrun", f"--nproc_per_node {world_size}", "-m", "lucidlm"]
    words = [*launcher, command]
    required = ("data", "out_dir")
    for f in sorted(dataclasses.fields(config), key=lambda f: f.name not in required):  # required first
        value, default = values[f.name], f.default
        if value is None or (value == default and f.name not in required) or not applies(config, f.name):
            continue  # an option the run ignores (another method's) would be refused on the command line
        words.append(flag_of(type(config), f.name))
        if not isinstance(value, bool):
            words.append(shlex.quote(str(value)))
    return " ".join(words)


FINETUNE_METHODS = ("lora", "adapter", "prefix", "full")
DEFAULT_LEARNING_RATES = {"lora": 1e-3, "adapter": 1e-3, "prefix": 3e-3, "full": 1e-4}
# What a fine-tuning option applies to (its metadata's ``applies``): one method, or one kind of data.
DATA_KINDS = {"jsonl": "JSONL examples (a .jsonl --data file)",
              "corpus": "a text corpus (a .txt --data file or folder)"}


def data_kind(data: str) -> str:
    """"jsonl" for a .jsonl file of examples, else "corpus" (text windows): as ``finetune`` reads --data."""
    return "jsonl" if Path(data).suffix == ".jsonl" else "corpus"


def applies(config: Any, name: str) -> bool:
    """Whether option ``name`` of a config changes its run: True unless it belongs to another
    fine-tuning method or to the other kind of data (unknown while --data is empty)."""
    field_ = config.__dataclass_fields__.get(name)
    target = field_.metadata.get("applies") if field_ is not None else None
    if target is None:
        return True
    if target in DATA_KINDS:
        return not config.data or data_kind(config.data) == target
    return config.method == target


def check_options_apply(config: Any, names: Any) -> None:
    """Refuse each option in ``names`` that the run would ignore (``--epochs`` with a text corpus,
    ``--rank`` with ``--method prefix``): silently dropped, it would train something else than
    asked for. ``names``: the options given (the command line's typed flags; in Python, fields
    changed from their default)."""
    for name in names:
        if applies(config, name):
            continue
        flag, target = flag_of(type(config), name), config.__dataclass_fields__[name].metadata["applies"]
        if target in DATA_KINDS:
            hint = {"epochs": " (--max-iters sets the length of a corpus run)",
                    "block_size": " (examples are padded to --max-length)"}.get(name, "")
            raise ConfigError(f"{name} ({flag}) applies only to {DATA_KINDS[target]}, but --data {config.data} is "
                              f"{DATA_KINDS[data_kind(config.data)].split(' (')[0]}, so it would be ignored; drop "
                              f"{flag}{hint}.")
        raise ConfigError(f"{name} ({flag}) applies only to --method {target}, not --method {config.method}, so it "
                          f"would be ignored; drop {flag} (or pass --method {target}).")


@keywords_checked(ConfigError, unknown_fields_message)
@dataclass
class FinetuneConfig(LoopConfig):
    """Fine-tuning a pretrained model: what to train, on which data, and the loop settings
    (defaults sized for a short CPU run on the embedded SmolLM2-135M)."""

    model: Optional[str] = opt(None, "the base model: a pretrained name, .gguf file, Hugging Face or lucidlm "
                                     "directory (default: the embedded SmolLM2-135M-Instruct)")
    data: str = opt("", "a .jsonl file of examples ({\"text\"}, {\"prompt\", \"completion\"} or {\"messages\"}), or "
                        "a UTF-8 .txt file / folder to train on random windows of")
    method: str = opt("lora", "what to train: lora, adapter (bottleneck), prefix, or full (every weight)",
                      choices=FINETUNE_METHODS)
    rank: int = opt(8, "LoRA: rank r of each update B @ A", low=1, high=MAX_WIDTH, applies="lora")
    alpha: float = opt(16.0, "LoRA: updates are scaled by alpha/r", applies="lora")
    lora_dropout: float = opt(0.05, "LoRA: dropout on the LoRA branch's input", flag="--dropout",
                              low=0.0, high=1.0, high_open=True, applies="lora")
    targets: str = opt("default", "LoRA: comma-separated linear layers (q,k,v,o,gate,up,down, all-linear), "
                                  "a regular expression over module names, or default (PEFT's for the "
                                  "architecture: q_proj,v_proj; GPT-2's c_attn)", applies="lora")
    init: str = opt("kaiming", "LoRA: initialisation of A (B starts at zero)", choices=("kaiming", "gaussian"),
                    applies="lora")
    adapter_name: str = opt("default", "LoRA: name of the adapter", applies="lora")
    bottleneck: int = opt(32, "adapter: width of each bottleneck adapter", low=1, high=MAX_WIDTH, applies="adapter")
    prefix_length: int = opt(16, "prefix: trained key/value positions per layer", low=1, high=MAX_CONTEXT,
                             applies="prefix")
    prefix_hidden: Optional[int] = opt(None, "prefix: width of the reparameterisation MLP (default: d_model)",
                                       low=1, high=MAX_WIDTH, applies="prefix")
    example_format: str = opt("auto", "JSONL examples: text, prompt_completion, messages, or auto (from the first "
                                      "line)", choices=("auto", "text", "prompt_completion", "messages"),
                              applies="jsonl")
    max_length: Optional[int] = opt(None, "JSONL examples: pad or truncate each to this many tokens (default: the "
                                          "longest, at most the model's context)", low=1, high=MAX_CONTEXT,
                                    applies="jsonl")
    truncate: bool = opt(True, "JSONL examples: refuse examples longer than --max-length instead of cutting them",
                         flag="--no-truncate", applies="jsonl")
    mask_prompt: bool = opt(False, "JSONL examples: no loss on prompt tokens (instruction tuning)", applies="jsonl")
    epochs: Optional[float] = opt(None, "JSONL examples: train this many passes over the data (overrides "
                                        "--max-iters)", low=0.0, low_open=True, applies="jsonl")
    block_size: int = opt(128, "text corpus: tokens per random window (at most the model's context)",
                          low=1, high=MAX_CONTEXT, applies="corpus")
    val_fraction: float = opt(0.1, "fraction of the examples (or of the corpus' end) held out for validation",
                              low=0.0, low_open=True, high=1.0, high_open=True)
    batch_size: int = opt(8, "sequences per micro-batch and process", low=1)
    learning_rate: Optional[float] = opt(None, "peak learning rate (default: 1e-3 lora and adapter, 3e-3 prefix, "
                                               "1e-4 full)", low=0.0, low_open=True)
    min_lr: Optional[float] = opt(None, "final learning rate (default: learning-rate / 10)", low=0.0)
    warmup_iters: int = opt(20, "steps of linear warmup", low=0, high=MAX_STEPS)
    max_iters: int = opt(200, "total optimizer steps", low=0, high=MAX_STEPS)
    lr_decay_iters: Optional[int] = opt(None, "cosine decay length (default: the number of steps)", low=0,
                                        high=MAX_STEPS)
    weight_decay: float = opt(0.0, "AdamW weight decay (matrices only)", low=0.0)
    eval_interval: int = opt(50, "evaluate, sample and checkpoint every this many steps", low=1, high=MAX_STEPS)
    eval_iters: int = opt(10, "batches per split in each evaluation", low=1, high=MAX_STEPS)
    sample_tokens: int = opt(40, "tokens sampled at each evaluation, base model beside tuned (0 = none)", low=0,
                             high=MAX_STEPS)

    def __post_init__(self) -> None:
        super().__post_init__()
        # In Python only the data-kind options are refused when changed from their default: a
        # settings dict shared by runs of several methods (a sweep) may carry the others.
        check_options_apply(self, [f.name for f in dataclasses.fields(self) if f.metadata.get("applies") in DATA_KINDS
                                   and getattr(self, f.name) != f.default])

    def peak_learning_rate(self) -> float:
        return self.learning_rate or DEFAULT_LEARNING_RATES[self.method]

    def differences(self, saved: dict[str, Any], current: Optional[dict[str, Any]] = None) -> list[str]:
        """As ``LoopConfig.differences``, less the options this run ignores (another method's)."""
        current = current if current is not None else self.to_dict()
        return super().differences(saved, {name: value for name, value in current.items() if applies(self, name)})

    def resolved(self, max_iters: Optional[int] = None) -> "FinetuneConfig":
        """The settings the loop runs with: method defaults and the step count filled in
        (an explicit ``lr_decay_iters=0`` stays 0: the decay is done at step 0, as in TrainConfig)."""
        steps = self.max_iters if max_iters is None else max_iters
        lr = self.peak_learning_rate()
        return dataclasses.replace(self, max_iters=steps, learning_rate=lr,
                                   min_lr=lr / 10 if self.min_lr is None else self.min_lr,
                                   lr_decay_iters=steps if self.lr_decay_iters is None else self.lr_decay_iters)
