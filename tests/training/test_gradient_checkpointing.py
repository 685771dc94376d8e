"""Gradient checkpointing (model/checkpointing.py): the same gradients as without it, against
torch's own uncheckpointed backward and against transformers' LlamaForCausalLM with
``gradient_checkpointing_enable()``, and fewer bytes kept for the backward pass."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from random_weights import randomize_, share_lora_with_peft, small_llama
from saved_bytes import saved_for_backward

from lucidlm.config import preset
from lucidlm.model.transformer import Transformer
from lucidlm.peft import add_adapters, add_lora, add_prefix
from lucidlm.tokenizers import CharTokenizer
from lucidlm.training import TrainConfig, pretrain
from lucidlm.training.loss import masked_cross_entropy
from lucidlm.weights.checkpoint import load_model, save_model


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return masked_cross_entropy(model(ids[:, :-1]), ids[:, 1:])


def grads_of_steps(model: torch.nn.Module, checkpointing: bool, steps: int = 3) -> tuple[list, list]:
    """Losses and every trainable gradient of ``steps`` AdamW steps of a copy of ``model``,
    dropout drawn from the same seed."""
    model = copy.deepcopy(model).train()
    model.gradient_checkpointing = checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    batches = torch.randint(0, model.config.vocab_size, (steps, 3, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    losses, grads = [], []
    for ids in batches:
        loss = loss_of(model, ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in params])
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def assert_same_training(model: torch.nn.Module) -> None:
    plain = grads_of_steps(model, False)
    checkpointed = grads_of_steps(model, True)
    assert torch.equal(torch.stack(plain[0]), torch.stack(checkpointed[0]))
    for step_plain, step_checkpointed in zip(plain[1], checkpointed[1]):
        for a, b in zip(step_plain, step_checkpointed):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    # and checkpointing was really in effect: the blocks' activations were not kept
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(2))
    sizes = []
    for on in (False, True):
        model.train().gradient_checkpointing = on
        sizes.append(saved_for_backward(lambda: loss_of(model, ids), model)[1])
    model.gradient_checkpointing = False
    assert sizes[1] < sizes[0] / 2


def gradients_off_and_on(model: torch.nn.Module, forward_backward) -> list[list[torch.Tensor]]:
    """Every parameter's gradient after ``forward_backward()`` with checkpointing off, then on."""
    grads = []
    for on in (False, True):
        model.gradient_checkpointing = on
        model.zero_grad()
        forward_backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def assert_same_gradients(grads: list[list[torch.Tensor]]) -> None:
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def tiny(dropout: float = 0.1) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("llama", vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_mlp=64,
                              max_seq_len=32, dropout=dropout))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_pretraining_gradients_are_those_without_checkpointing(dropout):
    assert_same_training(tiny(dropout))


@pytest.mark.parametrize("method", ["lora", "adapter", "prefix"])
def test_fine_tuning_gradients_are_those_without_checkpointing(method):
    model = tiny(dropout=0.0)
    if method == "lora":
        add_lora(model, r=4, alpha=8, dropout=0.3, targets="all-linear")
    elif method == "adapter":
        add_adapters(model, bottleneck=8)
    else:
        add_prefix(model, length=4, hidden=16)
    assert_same_training(model)


def llama_twins(tmp_path) -> tuple[torch.nn.Module, Transformer]:
    """transformers' LlamaForCausalLM (tiny, random weights) and the same model loaded by lucidlm,
    both in training mode."""
    transformers = pytest.importorskip("transformers")
    from lucidlm.weights.hf import load_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = randomize_(transformers.LlamaForCausalLM(config), seed=3)
    hf.save_pretrained(tmp_path)
    return hf.train(), load_hf(tmp_path).train()


def hf_checkpointing_enable(hf: torch.nn.Module) -> None:
    """transformers' gradient checkpointing, non-reentrant as lucidlm's."""
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers 5's name for it
        hf.activation_checkpointing_enable({"use_reentrant": False})
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def test_same_losses_and_gradients_as_transformers_with_checkpointing(tmp_path):
    from lucidlm.weights.hf_names import hf_state_dict

    hf, ours = llama_twins(tmp_path)
    hf_checkpointing_enable(hf)
    ours.gradient_checkpointing_enable()
    ids = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(4))
    hf_loss = hf(ids, labels=ids).loss
    hf_loss.backward()
    our_loss = loss_of(ours, ids)
    our_loss.backward()
    torch.testing.assert_close(our_loss, hf_loss, rtol=0, atol=1e-5)
    with torch.no_grad():  # our gradients under Hugging Face names and layouts, as save_hf maps weights
        for p in ours.parameters():
            p.copy_(p.grad)
    our_grads = hf_state_dict(ours)
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    assert set(our_grads) == set(hf_grads)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_checkpointed_lora_step_keeps_no_more_than_peft_with_checkpointing(tmp_path):
    peft = pytest.importorskip("peft")
    hf, ours = llama_twins(tmp_path)
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))
    hf_checkpointing_enable(theirs)
    add_lora(ours, r=4, alpha=8, targets=("q_proj", "v_proj"))
    ours.gradient_checkpointing = True
    share_lora_with_peft(ours, theirs)
    their_modules = dict(theirs.named_modules())
    ids = torch.randint(0, 61, (4, 21), generator=torch.Generator().manual_seed(4))
    our_loss, our_bytes = saved_for_backward(lambda: loss_of(ours, ids), ours)
    their_loss, their_bytes = saved_for_backward(
        lambda: masked_cross_entropy(theirs(input_ids=ids[:, :-1]).logits, ids[:, 1:]), theirs)
    # as tests/peft/test_peft_interop.py: lucidlm's RoPE cos and sin are per row, (B, T, 1, hd)
    per_row_rope = 2 * 3 * 20 * ours.config.head_dim * 4
    assert our_bytes <= their_bytes + per_row_rope, (our_bytes, their_bytes)
    our_loss.backward()
    their_loss.backward()
    torch.testing.assert_close(our_loss, their_loss, rtol=0, atol=1e-5)
    for i, block in enumerate(ours.blocks):
        for proj in ("q_proj", "v_proj"):
            hf_layer = their_modules[f"base_model.model.model.layers.{i}.self_attn.{proj}"]
            for ab in "AB":
                torch.testing.assert_close(getattr(getattr(block.attn, proj), f"lora_{ab}")["default"].grad,
                                           getattr(hf_layer, f"lora_{ab}")["default"].weight.grad, rtol=1e-4, atol=1e-6)


def test_fewer_bytes_kept_for_the_backward_on_a_smollm2_shaped_model():
    """SmolLM2-135M's widths (576, 9 heads of 64, 3 KV heads, MLP 1536), 6 of its 30 layers:
    the bytes autograd keeps, counted (not timed)."""
    torch.manual_seed(0)
    model = Transformer(preset("smollm2-135m", vocab_size=512, n_layers=6)).train()
    ids = torch.randint(0, 512, (2, 129), generator=torch.Generator().manual_seed(0))
    sizes = []
    for on in (False, True):
        model.gradient_checkpointing = on
        sizes.append(saved_for_backward(lambda: loss_of(model, ids), model)[1])
    block_input = 2 * 128 * 576 * 4
    assert sizes[1] < sizes[0] / 4  # each block keeps its input, not ~15 tensors as wide or wider
    assert sizes[0] - sizes[1] > 6 * 10 * block_input


def test_a_hooked_block_runs_once_and_unhooked_blocks_stay_checkpointed():
    """A block with a forward hook is not recomputed: a hook removed before the backward (as
    run_with_hooks does) would be missing from the recompute, and the gradients would be those
    of another forward. Oracle: the same hooked pass without checkpointing."""
    from lucidlm.inspect.cache import run_with_hooks

    model = tiny(dropout=0.0).train()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = []

    def doubled(x, hook):
        seen.append(hook.name)
        return x * 2

    sizes = []

    def forward_backward():
        logits, size = saved_for_backward(
            lambda: run_with_hooks(model, ids, fwd_hooks=[("blocks.1.hook_resid_mid", doubled)]), model)
        logits.square().mean().backward()  # the hook is already removed
        sizes.append(size)

    grads = gradients_off_and_on(model, forward_backward)
    assert seen == ["blocks.1.hook_resid_mid"] * 2  # once per pass, not again in a recompute
    assert_same_gradients(grads)
    assert sizes[1] < sizes[0] * 2 / 3  # blocks 0 and 2 are still checkpointed



@pytest.mark.parametrize("point", ["blocks.1.ln1.hook_scale", "blocks.1.attn.hook_pattern"])
def test_a_backward_hook_removed_before_the_backward_leaves_the_gradients_exact(point):
    """A backward hook function alone changes the block's forward (an active norm scale or
    attention pattern takes the explicit path), and run_with_hooks removes it before the
    backward: recomputed without it, the block's saved tensors were another path's and the
    gradients wrong by ~1e-3. Oracle: the same hooked pass without checkpointing."""
    from lucidlm.inspect.cache import run_with_hooks

    model = tiny(dropout=0.0).train()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = []

    def forward_backward():
        logits = run_with_hooks(model, ids, bwd_hooks=[(point, lambda grad, hook: seen.append(grad.clone()))])
        logits.square().mean().backward()  # the hook is already removed

    grads = gradients_off_and_on(model, forward_backward)
    torch.testing.assert_close(seen[1], seen[0], rtol=0, atol=1e-6)  # the hook saw the same gradient
    assert_same_gradients(grads)


def test_pretrain_and_resume_with_checkpointing_switched(tmp_path, corpus):
    """A run's loss curve and weights are the same with --gradient-checkpointing, and a resume
    may switch it (it changes memory, not the math)."""
    base = dict(data=str(corpus), n_layer=2, n_embd=32, n_head=2, block_size=16, batch_size=4, dropout=0.1,
                eval_interval=2, eval_iters=1, sample_tokens=0, warmup_iters=1, lr_decay_iters=4, progress=False)
    pretrain(TrainConfig(out_dir=str(tmp_path / "plain"), max_iters=4, **base))
    pretrain(TrainConfig(out_dir=str(tmp_path / "switched"), max_iters=2, **base))
    pretrain(TrainConfig(out_dir=str(tmp_path / "switched"), max_iters=4, gradient_checkpointing=True, resume=True,
                         **base))

    def run(name):
        state = json.loads((tmp_path / name / "checkpoint" / "trainer_state.json").read_text())
        return state, load_model(tmp_path / name / "checkpoint")

    (plain_state, plain), (switched_state, switched) = run("plain"), run("switched")
    assert switched_state["train_config"]["gradient_checkpointing"] is True
    assert plain_state["train_losses"] == switched_state["train_losses"]
    for (name, a), b in zip(plain.state_dict().items(), switched.state_dict().values()):
        assert torch.equal(a, b), name


def test_finetune_command_with_gradient_checkpointing(tmp_path, shared_dir):
    import argparse

    from lucidlm.commands import finetune

    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text()[:20_000]
    (tmp_path / "corpus.txt").write_text(text)
    save_model(small_llama(CharTokenizer.train(text), n_layers=2, max_seq_len=64), tmp_path / "base")
    parser = argparse.ArgumentParser(prog="lucidlm")
    finetune.register(parser.add_subparsers(dest="command", required=True))
    losses = []
    for name, extra in (("plain", []), ("checkpointed", ["--gradient-checkpointing"])):
        args = parser.parse_args(["finetune", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "corpus.txt"),
                                  "--out", str(tmp_path / name), "--max-iters", "4", "--eval-interval", "2",
                                  "--eval-iters", "1", "--batch-size", "4", "--block-size", "32", "--sample-tokens",
                                  "0", "--no-progress", "--warmup-iters", "1", "--dropout", "0.1", *extra])
        assert args.handler(args) == 0
        state = json.loads((tmp_path / name / "checkpoint" / "trainer_state.json").read_text())
        losses.append(state["train_losses"])
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses.append([m["val_loss"] for m in metrics])
    assert state["train_config"]["gradient_checkpointing"] is True
    assert losses[0] == losses[2] and losses[1] == losses[3] and len(losses[0]) == 4


def test_a_global_module_hook_runs_once_per_module_call():
    """torch's global forward hook (``register_module_forward_hook``) sees every module call; in
    a recompute it would see each block's modules twice. Oracle: the calls of the same training
    step without checkpointing, and its gradients."""
    model = tiny(dropout=0.0).train()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    calls: list[list[str]] = []

    def forward_backward():
        seen: list[str] = []
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: seen.append(type(module).__name__))
        try:
            loss_of(model, ids).backward()
        finally:
            handle.remove()
        calls.append(seen)

    grads = gradients_off_and_on(model, forward_backward)
    assert calls[1] == calls[0]
    assert_same_gradients(grads)
