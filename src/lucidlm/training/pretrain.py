"""The pre-training recipe: a model from scratch on a text corpus, nanoGPT's ``train.py``.

    from lucidlm.training import TrainConfig, pretrain
    result = pretrain(TrainConfig(data="input.txt", out_dir="out"))   # then lucidlm.load("out")

The corpus is tokenized once into memory-mapped token files (``data.py``); each optimizer
step is ``gradient_accumulation_steps`` micro-batches of random windows; AdamW with weight
decay on matrices only, clipping, warmup + cosine. Every ``eval_interval`` steps: mean
train/val loss over fixed batches, a sample, metrics.jsonl, loss.png, and an atomic
checkpoint that ``resume=True`` continues bit for bit (weights, AdamW moments, batch
sampler, dropout RNG). Under ``torchrun``: DDP, or FSDP2 with ``strategy="fsdp"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from lucidlm.config import PRESETS, ModelConfig, preset
from lucidlm.errors import CheckpointError, ConfigError
from lucidlm.model.transformer import Transformer
from lucidlm.outputs import writing
from lucidlm.training.batches import WindowBatches
from lucidlm.training.callbacks import Console, MetricsLog, Sampler
from lucidlm.training.checkpointer import Checkpointer
from lucidlm.training.config import TrainConfig, command_line
from lucidlm.training.corpus import corpus_files
from lucidlm.training.data import check_enough_data, prepare_data
from lucidlm.training.distributed import barrier, cleanup_distributed, setup_distributed
from lucidlm.training.resume_checks import (DAMAGED, check_same_data, corpus_sha256, fixed_settings, run_identity,
                                            tokenizer_sha256)
from lucidlm.training.step import wrap_model
from lucidlm.training.loop import Callback, Trainer, TrainResult
from lucidlm.training.setup import (autocast_dtype, check_same_settings, configure_optimizer, open_run,
                                   resolve_device, resolved, with_checkpoint)
from lucidlm.validation import read_json_object
from lucidlm.weights.checkpoint import CONFIG_NAME


def model_config_for(config: TrainConfig, vocab_size: int) -> ModelConfig:
    """The preset resized by the nanoGPT-named overrides, with the tokenizer's vocabulary.

    A resized preset keeps its shape: the MLP keeps its width ratio to ``d_model`` (see
    ``mlp_width_for``) and grouped-query attention its query heads per key/value head."""
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
                overrides["n_kv_heads"] = kv_heads_for(config.preset, config.n_head)
        if config.n_embd is not None:
            overrides["d_model"] = config.n_embd
            if base.get("d_mlp") is not None:
                overrides["d_mlp"] = mlp_width_for(config.preset, config.n_embd)
    if config.dropout is not None:
        overrides["dropout"] = config.dropout
    return preset(config.preset, **overrides)


def mlp_width_for(name: str, d_model: int) -> Optional[int]:
    """The MLP width of preset ``name`` resized to ``d_model``: None (derive it again, with the
    family's rounding) where the preset's width is what its config derives anyway (seed000's 4x,
    SmolLM2's LLaMA rounding), else the preset's ratio to its own width (seed004-words: 2x)."""
    base = PRESETS[name]
    if base["d_mlp"] == preset(name, d_mlp=None).d_mlp:
        return None
    return max(1, round(base["d_mlp"] * d_model / base["d_model"]))


def kv_heads_for(name: str, n_heads: int) -> int:
    """The key/value heads of grouped-query preset ``name`` with ``n_heads`` query heads: the
    preset's query heads per key/value head are kept (SmolLM2's 9/3 -> 6/2), or ConfigError."""
    base = PRESETS[name]
    group = base["n_heads"] // base["n_kv_heads"]  # query heads per key/value head
    if n_heads % group:
        choices = ", ".join(str(group * k) for k in range(1, 5))
        raise ConfigError(f"n_head (--n-head) {n_heads} does not fit the grouped-query attention of preset {name!r} "
                          f"({base['n_heads']} query heads share {base['n_kv_heads']} key/value heads, {group} per "
                          f"key/value head); pass a multiple of {group} ({choices}, ...), or another --preset.")
    return n_heads // group


def build_pretraining(config: TrainConfig, callbacks: Sequence[Callback] = ()) -> Trainer:
    """Everything ``pretrain`` runs, built (and restored, with ``resume``) but not started."""
    ctx = setup_distributed(resolve_device(config.device), config.strategy)
    try:
        return _build(config, ctx, callbacks)
    except BaseException:
        cleanup_distributed(ctx)
        raise


def _build(config: TrainConfig, ctx: Any, callbacks: Sequence[Callback]) -> Trainer:
    if not config.data:
        raise ConfigError("no training data given; pass --data FILE_OR_FOLDER.")
    model_config_for(config, PRESETS[config.preset]["vocab_size"])  # a bad resize is refused before any work
    out_dir = Path(config.out_dir)
    saved_config = {**config.to_dict(), "data": resolved(config.data)}
    found = open_run(out_dir, config.resume, ctx)
    corpus_hash = corpus_sha256(corpus_files(config.data))
    saved_model = None
    if found is not None:  # before touching the data: nothing is written until the run is known to be this one
        check_same_settings(config, saved_config, found[1], found[0], ctx)
        check_same_data(found[1], "corpus_sha256", corpus_hash, "the corpus", config.data, found[0])
        saved_model = read_json_object(found[0] / CONFIG_NAME, CheckpointError, "model config", DAMAGED).data
    progress = config.progress and not config.quiet and ctx.is_main
    prepare = dict(tokenizer=config.tokenizer, vocab_size=config.vocab_size, val_fraction=config.val_fraction,
                   split=config.split, resume=found is not None, corpus_hash=corpus_hash)
    if ctx.is_main:  # tokenize once; the other ranks open the files it wrote
        prepare_data(config.data, out_dir, progress=progress, **prepare)
    barrier(ctx)
    data = prepare_data(config.data, out_dir, **prepare)
    tokenizer_hash = tokenizer_sha256(data.tokenizer)
    if found is not None:
        check_same_data(found[1], "tokenizer_sha256", tokenizer_hash, "the tokenizer", data.directory / "tokenizer.json",
                        found[0])
    model_config = model_config_for(config, data.tokenizer.vocab_size)
    block_size = model_config.max_seq_len
    check_enough_data(data, config.batch_size * ctx.world_size, block_size)
    # Encode the sample prompt now: a character the tokenizer lacks fails before training.
    prompt = data.tokenizer.encode(config.sample_prompt) if config.sample_prompt else []
    prompt = prompt[-(block_size - 1):] or [int(data.val[0])]

    device = torch.device(ctx.device)
    torch.manual_seed(config.seed)  # same initial weights on every rank
    model = Transformer(model_config, tokenizer=data.tokenizer).to(device)
    if saved_model is not None:
        _check_model_config(found[0], saved_model, model_config)
    torch.manual_seed(config.seed + ctx.rank)  # dropout masks differ between ranks
    if device.type == "cuda":
        torch.cuda.manual_seed(config.seed + ctx.rank)
    # FSDP shards `model` in place
    train_model = wrap_model(model, ctx, config.compile, config.compile_mode, config.gradient_checkpointing)
    optimizer = configure_optimizer(model, config, device, ctx.sharded)
    batches = WindowBatches(data.train, data.val, config.batch_size, block_size, config.seed, ctx)
    identity = run_identity(fixed_settings(config, saved_config), corpus_hash, tokenizer_hash)
    checkpointer = Checkpointer(out_dir, model, optimizer, saved_config, ctx, identity=identity)
    header = (f"training {sum(p.numel() for p in model.parameters()):,} parameters ({model_config.n_layers} layers, d_model {model_config.d_model}, "
              f"vocab {model_config.vocab_size}) on {len(data.train):,} train / {len(data.val):,} val tokens; "
              f"{config.batch_size * config.gradient_accumulation_steps * ctx.world_size * block_size:,} tokens "
              f"per step ({ctx.world_size} process(es), {ctx.strategy}), device {device}")
    sampler = Sampler(prompt, config.sample_tokens, data.tokenizer, config.sample_temperature, config.sample_top_p,
                      config.seed if config.sample_seed is None else config.sample_seed)
    shown = [sampler, MetricsLog(out_dir, f"{config.preset} on {Path(config.data).name}"),
             Console(progress, header, command_line(config, "train", ctx.world_size, resume=True), config.quiet)]
    trainer = Trainer(model, batches, optimizer, config, train_model=train_model, checkpointer=checkpointer,
                      callbacks=[*shown, *callbacks], ctx=ctx, autocast_dtype=autocast_dtype(config.dtype, device))
    trainer.corpus = data
    if found is not None:
        checkpointer.restore(trainer, *found)
    return trainer


def _check_model_config(directory: Path, saved: dict[str, Any], current: ModelConfig) -> None:
    differences = [f"model.{k}: {saved.get(k)!r} -> {v!r}" for k, v in current.to_dict().items()
                   if saved.get(k) != v]
    if differences:
        raise CheckpointError(f"cannot resume from {directory}: its model config differs ({'; '.join(differences)}). "
                              f"Resume with the original settings, or start a new run with another --out.")


def pretrain(config: TrainConfig, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Train a model as ``config`` says; the trained model is in ``OUT/checkpoint/``."""
    trainer = build_pretraining(config, callbacks)
    try:
        with writing(config.out_dir, "--out"):  # a full disk mid-run: one line naming OUT
            return with_checkpoint(trainer.fit(), Path(config.out_dir), trainer.ctx)
    finally:
        cleanup_distributed(trainer.ctx)


train = pretrain  # the name lucidlm has used since its first release
