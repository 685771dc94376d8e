"""The fine-tuning recipe: a pretrained model, LoRA / bottleneck adapters / prefix tuning /
every weight, on JSONL examples or a text corpus, in the same loop as pre-training.

    from lucidlm.training import FinetuneConfig, finetune
    result = finetune(FinetuneConfig(data="train.jsonl", out_dir="runs/lora", mask_prompt=True, epochs=3))
    tuned = lucidlm.load(adapter="runs/lora")

OUT gets the adapter (LoRA in Hugging Face PEFT's format; the full model for ``full``),
metrics.jsonl, loss.png (losses beside the learning rate), for JSONL data
token_lengths.{json,png}, and checkpoint/ (trainable weights, AdamW moments, loop and RNG
state): ``resume=True`` continues bit for bit. Each evaluation samples the base model and
the tuned one with the same settings. Runs under torchrun (DDP, or FSDP2).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lucidlm.errors import ConfigError
from lucidlm.model.transformer import Transformer
from lucidlm.outputs import writing
from lucidlm.training.batches import ExampleBatches, WindowBatches, fit_batch_to_examples
from lucidlm.training.callbacks import Console, MetricsLog, Sampler
from lucidlm.training.checkpointer import TRAINABLE_NAME, Checkpointer
from lucidlm.training.config import FinetuneConfig, command_line
from lucidlm.training.corpus import corpus_files
from lucidlm.training.distributed import barrier, cleanup_distributed, setup_distributed
from lucidlm.training.resume_checks import (check_same_data, corpus_sha256, fixed_settings, run_identity,
                                            tokenizer_sha256, weights_sha256)
from lucidlm.training.step import wrap_model
from lucidlm.training.loop import Callback, Trainer, TrainResult
from lucidlm.training.setup import (autocast_dtype, check_same_settings, configure_optimizer, open_run,
                                   resolve_device, resolved, with_checkpoint)


def attach_method(model: torch.nn.Module, config: FinetuneConfig) -> str:
    """Add the chosen trainable parts to ``model`` (freezing the rest); a one-line description."""
    from lucidlm.peft import add_adapters, add_lora, add_prefix
    from lucidlm.peft.lora import check_whole_c_attn
    from lucidlm.peft.lora_targets import match_targets, resolved_targets
    from lucidlm.quantization.base import check_float_model

    if config.method == "lora":
        # before the target match, which on a quantized model finds no linear layer and names none
        check_float_model(model, "adding LoRA")
        targets = resolved_targets(model, config.targets)
        check_whole_c_attn(model, match_targets(model, targets))  # the run saves a PEFT file: refused now, not then
        names = add_lora(model, name=config.adapter_name, r=config.rank, alpha=config.alpha,
                         dropout=config.lora_dropout, targets=targets, init=config.init)
        return f"LoRA r={config.rank} alpha={config.alpha:g} on {len(names)} layers ({', '.join(targets)})"
    if config.method == "adapter":
        names = add_adapters(model, bottleneck=config.bottleneck)
        return f"bottleneck adapters of width {config.bottleneck} after {len(names)} projections"
    if config.method == "prefix":
        add_prefix(model, length=config.prefix_length, hidden=config.prefix_hidden)
        return f"prefix of {config.prefix_length} key/value positions in {model.config.n_layers} layers"
    for p in model.parameters():
        p.requires_grad_(True)
    return "every weight (full fine-tuning)"


def unsharded_copy(model: torch.nn.Module, model_class: type, config: FinetuneConfig,
                   tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An FSDP-sharded model as one plain module on the CPU, from its gathered weights
    (``checkpointer.full_model_state``, rank 0): what ``save_adapter`` reads, since the sharded
    model's own parameters are pieces spread over the ranks. Built on the meta device, then
    given the gathered tensors themselves: no second copy of the weights."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the training RNG stays as it was
        copy = model_class(model.config, tokenizer=model.tokenizer)
        attach_method(copy, config)
    copy.load_state_dict(tensors, strict=False, assign=True)
    return copy


def build_finetuning(config: FinetuneConfig, model: Optional[Transformer] = None,
                     callbacks: Sequence[Callback] = ()) -> Trainer:
    """Everything ``finetune`` runs, built (and restored, with ``resume``) but not started.
    ``model``: an already loaded base model (default: ``lucidlm.load(config.model)``)."""
    ctx = setup_distributed(resolve_device(config.device), config.strategy)
    try:
        return _build(config, model, ctx, callbacks)
    except BaseException:
        cleanup_distributed(ctx)
        raise


def _build(config: FinetuneConfig, model: Any, ctx: Any, callbacks: Sequence[Callback]) -> Trainer:
    from lucidlm.peft import disable_adapters, freeze_prefix, save_adapter, trainable_parameters_report

    if not config.data:
        raise ConfigError("no training data given; pass --data FILE.jsonl (or a .txt corpus).")
    out_dir = Path(config.out_dir)
    # What the adapter file records as its base: the name loaded, or the passed-in model's own
    # (None when it has none), never the default model's name for another model.
    if config.model is not None:
        base_name: Optional[str] = str(config.model)
    else:
        base_name = "smollm2-135m" if model is None else getattr(model, "name_or_path", None)
    payload = "model" if config.method == "full" else "trainable"
    found = open_run(out_dir, config.resume, ctx, "model.safetensors" if payload == "model" else TRAINABLE_NAME)
    if model is None:
        from lucidlm.loading import load

        model = load(config.model, dtype=torch.float32)  # training needs float weights, not the quantized default
    base_label = base_name or f"{model.config.name} (passed in)"  # for messages and the console
    if model.tokenizer is None:
        raise ConfigError("the base model has no tokenizer, so the data cannot be encoded in its vocabulary; "
                          "fine-tune a model that ships one (a pretrained name, .gguf, or a directory with "
                          "tokenizer.json).")
    data_path = Path(config.data)
    corpus_hash = corpus_sha256([data_path] if data_path.suffix == ".jsonl" and data_path.is_file()
                                else corpus_files(data_path))
    tokenizer_hash = tokenizer_sha256(model.tokenizer)
    # Only the trained part is saved (full fine-tunes save the whole model): the frozen base
    # must be the run's own too, or a resume would continue another model.
    base_hash = weights_sha256(model) if payload == "trainable" else None
    if found is not None:  # before anything is written: the data, vocabulary and base must be the run's own
        check_same_data(found[1], "corpus_sha256", corpus_hash, "the data", config.data, found[0])
        check_same_data(found[1], "tokenizer_sha256", tokenizer_hash, "the base model's tokenizer", base_label,
                        found[0])
        if base_hash is not None:
            check_same_data(found[1], "base_sha256", base_hash, "the base model's weights", base_label, found[0])
    torch.manual_seed(config.seed)  # the same new weights on every rank
    description = attach_method(model, config)
    device = torch.device(ctx.device)
    model = model.to(device)
    data, prompt, write_report = _data(config, model, ctx, out_dir, found is not None, corpus_hash)
    run_config = _run_config(config, data, found[1] if found is not None else None, ctx)
    saved_config = {**run_config.to_dict(), "data": resolved(config.data)}
    if found is not None:
        check_same_settings(run_config, saved_config, found[1], found[0], ctx)
    torch.manual_seed(config.seed + ctx.rank)
    model_class = type(model)  # before FSDP swaps in its own subclass
    train_model = wrap_model(model, ctx, config.compile, config.compile_mode, config.gradient_checkpointing)
    optimizer = configure_optimizer(model, run_config, device, ctx.sharded)

    def export(directory: Path, tensors: dict[str, torch.Tensor], final: bool = False) -> None:
        """The adapter in its user-facing format (``final``: the prefix as fixed keys/values)."""
        plain = unsharded_copy(model, model_class, config, tensors) if ctx.sharded else model
        if final and config.method == "prefix":
            freeze_prefix(plain)  # keep the keys/values, drop the training-only MLP
        save_adapter(plain, directory, base_model_name_or_path=base_name)

    checkpointer = Checkpointer(out_dir, model, optimizer, saved_config, ctx, payload,
                                export if payload == "trainable" else None,
                                run_identity(fixed_settings(run_config, saved_config), corpus_hash, tokenizer_hash,
                                             base_hash))
    sequences = run_config.batch_size * run_config.gradient_accumulation_steps * ctx.world_size  # per step
    header = (f"{base_label}: {description}\n{trainable_parameters_report(model)}\n"
              f"{run_config.max_iters} steps of {sequences} sequences ({ctx.world_size} process(es), {ctx.strategy}), "
              f"device {device}")
    base = (lambda: disable_adapters(model)) if payload == "trainable" else None
    sampler = Sampler(prompt, config.sample_tokens, model.tokenizer, config.sample_temperature, config.sample_top_p,
                      config.seed if config.sample_seed is None else config.sample_seed, base)
    title = f"{config.method} fine-tune of {Path(base_name).name if base_name else base_label}"
    shown = [sampler, MetricsLog(out_dir, title),
             Console(config.progress and ctx.is_main, header,
                     command_line(config, "finetune", ctx.world_size, resume=True), config.quiet)]
    trainer = Trainer(model, data, optimizer, run_config, train_model=train_model, checkpointer=checkpointer,
                      callbacks=[*shown, *callbacks], ctx=ctx, autocast_dtype=autocast_dtype(config.dtype, device))
    trainer.export = export
    if found is not None:
        checkpointer.restore(trainer, *found)
    if write_report is not None:  # written only once every check has passed
        write_report()
    return trainer


def _run_config(config: FinetuneConfig, data: Any, saved_state: Optional[dict[str, Any]], ctx: Any) -> FinetuneConfig:
    """The settings the run uses and records (so that a resume compares what really ran): the
    method's defaults and the step count filled in (``--epochs`` counted in the batches' steps),
    and what the data made smaller (a batch larger than the examples, a window longer than the
    model's context). On a resume a default ``--lr-decay-iters`` is the saved run's: the decay
    follows the step count the run started with, so ``--max-iters``/``--epochs`` may change
    (as the --resume help says) and the steps already taken keep the rates they had."""
    steps = config.max_iters
    if isinstance(data, ExampleBatches):
        changes: dict[str, Any] = dict(batch_size=data.batch_size, gradient_accumulation_steps=data.accumulation)
        if config.epochs is not None:
            steps = math.ceil(config.epochs * data.steps_per_epoch / data.accumulation)
    else:
        changes = dict(block_size=data.block_size)
    run_config = dataclasses.replace(config.resolved(steps), **changes)
    saved = (saved_state or {}).get("train_config")
    saved_decay = saved.get("lr_decay_iters") if isinstance(saved, dict) else None
    if config.lr_decay_iters is None and isinstance(saved_decay, int) and not isinstance(saved_decay, bool) \
            and saved_decay != run_config.lr_decay_iters:
        run_config = dataclasses.replace(run_config, lr_decay_iters=saved_decay)
        if ctx.is_main and config.decay_lr and steps > saved_decay:
            print(f"note: the learning rate keeps the saved run's cosine decay over {saved_decay} steps (the "
                  f"default --lr-decay-iters is the step count the run started with), so the {steps - saved_decay} "
                  f"step(s) after it train at --min-lr {run_config.min_lr:g}.", flush=True)
    return run_config


def _data(config: FinetuneConfig, model: Any, ctx: Any, out_dir: Path, resume: bool,
          corpus_hash: str) -> tuple[Any, list[int], Optional[Callable[[], None]]]:
    """The batches (JSONL examples or corpus windows), the ids of the sample prompt, and what
    writes the token-length report (None when there is none to write: corpus data, or a resume,
    whose report was written when the run started). Writes nothing itself."""
    tokenizer, context = model.tokenizer, model.config.max_seq_len
    write_report = None
    if Path(config.data).suffix == ".jsonl":
        from lucidlm.training.examples import check_loss_tokens, load_examples, split_examples
        from lucidlm.training.length_report import describe, length_stats, write_length_report

        examples = load_examples(config.data, tokenizer, config.max_length, context, config.truncate,
                                 config.mask_prompt, config.example_format)
        length = examples.ids.shape[1]
        if ctx.is_main:
            if not config.quiet:
                print(f"token lengths: {describe(length_stats(examples.lengths, length))}", flush=True)
            if not resume:
                write_report = lambda: write_length_report(examples.lengths, length, out_dir)  # noqa: E731
        train_rows, val_rows = split_examples(examples, config.val_fraction, config.seed)
        warning = check_loss_tokens(examples, train_rows, val_rows, config.mask_prompt,
                                    "--max-length" if config.max_length is not None else "the model's context",
                                    context)
        batch, accumulation = fit_batch_to_examples(len(train_rows), config.batch_size,
                                                    config.gradient_accumulation_steps, ctx.world_size)
        if ctx.is_main:
            if warning:
                print(warning, flush=True)
            if (batch, accumulation) != (config.batch_size, config.gradient_accumulation_steps):
                print(f"warning: one step of --batch-size {config.batch_size} x {ctx.world_size} process(es) x "
                      f"--gradient-accumulation-steps {config.gradient_accumulation_steps} is more than the "
                      f"{len(train_rows)} training examples; training with --batch-size {batch} and "
                      f"--gradient-accumulation-steps {accumulation}, so that no step counts an example twice.",
                      flush=True)
        batches = ExampleBatches((examples.ids[train_rows], examples.targets[train_rows]),
                                 (examples.ids[val_rows], examples.targets[val_rows]), batch, config.seed, ctx,
                                 accumulation)
        first = int(val_rows[0])
        n_prompt = min(examples.prompt_lengths[first], length)
        default = examples.ids[first, : n_prompt or min(16, length - 1)].tolist()
        chat = examples.format == "messages"
    else:
        from lucidlm.training.data import check_enough_data, prepare_data

        block = min(config.block_size, context)
        if block < config.block_size and ctx.is_main:  # the run records the windows it trains on
            print(f"note: --block-size {config.block_size} is longer than the model's context of {context} tokens; "
                  f"training on windows of {block} tokens.", flush=True)
        prepare = dict(val_fraction=config.val_fraction, resume=resume, corpus_hash=corpus_hash)
        if ctx.is_main:  # tokenize once; the other ranks open the files it wrote
            prepare_data(config.data, out_dir, tokenizer, **prepare)
        barrier(ctx)
        corpus = prepare_data(config.data, out_dir, tokenizer, **prepare)
        check_enough_data(corpus, config.batch_size * ctx.world_size, block)
        batches = WindowBatches(corpus.train, corpus.val, config.batch_size, block, config.seed, ctx)
        default, chat = [int(t) for t in corpus.val[:16]], False
    if not config.sample_prompt:
        return batches, default, write_report
    if chat:
        from lucidlm.chat import encode_chat

        return batches, encode_chat(tokenizer, [{"role": "user", "content": config.sample_prompt}]), write_report
    return batches, list(tokenizer.encode(config.sample_prompt)), write_report


def finetune(config: FinetuneConfig, model: Optional[Transformer] = None,
             callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Fine-tune as ``config`` says; the adapter (or model, for ``full``) is written to OUT."""
    from lucidlm.training.checkpointer import full_model_state

    trainer = build_finetuning(config, model, callbacks)
    ctx = trainer.ctx
    try:
        with writing(config.out_dir, "--out"):  # a full disk mid-run: one line naming OUT
            result = with_checkpoint(trainer.fit(), Path(config.out_dir), ctx)
            if config.method != "full":
                # Under FSDP every rank takes part in gathering the weights; rank 0 writes.
                tensors = full_model_state(trainer.model, ctx) if ctx.sharded else {}
                if ctx.is_main:
                    trainer.export(Path(config.out_dir), tensors, final=True)
        return result
    finally:
        cleanup_distributed(trainer.ctx)
