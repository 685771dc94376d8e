"""Generation, inspection and LoRA fine-tuning on Gemma 3: short smoke tests, fast ones on the
tiny random gemma3 GGUF and slow ones on the real 270M model."""

from __future__ import annotations

import pytest
import torch
from test_gemma3_tiny import VOCAB, WINDOW, write_tiny

import lucidlm
from lucidlm.peft import add_lora, freeze_base, load_adapter, save_adapter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return lucidlm.load(write_tiny(tmp_path_factory.mktemp("gemma") / "tiny.gguf"))


def test_run_with_cache_shows_the_sliding_window(tiny):
    ids = torch.randint(4, VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    logits, cache = tiny.run_with_cache(ids)
    torch.testing.assert_close(logits, tiny(ids), atol=1e-5, rtol=1e-5)  # the explicit path agrees
    local, full = cache["blocks.0.attn.hook_pattern"][0], cache["blocks.5.attn.hook_pattern"][0]  # (nh, T, T)
    distance = torch.arange(3 * WINDOW)[:, None] - torch.arange(3 * WINDOW)[None, :]
    assert (local[:, distance >= WINDOW] == 0).all() and (local[:, (distance >= 0) & (distance < WINDOW)] > 0).all()
    assert (full[:, distance >= 0] > 0).all()
    assert "blocks.0.attn.q_norm.hook_normalized" in cache and "blocks.0.ln1_post.hook_normalized" in cache


def test_lora_fine_tuning_trains_and_round_trips(tiny, tmp_path):
    model = lucidlm.load(write_tiny(tmp_path / "copy.gguf"))  # its own copy: it will train
    freeze_base(model)
    add_lora(model, r=4, alpha=8, targets="q,v,gate,up,down")
    batch = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    model.train()
    for _ in range(6):
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    assert losses[-1] < losses[0]
    save_adapter(model, tmp_path / "adapter")
    again = lucidlm.load(tmp_path / "copy.gguf")
    load_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(again(batch), model(batch))


def test_stream_equals_generate(tiny):
    prompt = tiny.tokenizer.encode("ab bc a")
    result = tiny.generate(prompt, max_new_tokens=10, temperature=0, stop_on_eos=False)
    assert "".join(tiny.stream(prompt, max_new_tokens=10, temperature=0, stop_on_eos=False)) == result.text


@pytest.mark.slow
def test_real_gemma3_inspect_and_lora_step(gemma3):
    ids = gemma3.tokenizer.encode("The capital of France is")
    logits, cache = gemma3.run_with_cache(torch.tensor([ids]), names_filter=lambda n: n.endswith("hook_pattern"))
    assert len(cache) == 18 and cache["blocks.5.attn.hook_pattern"].shape == (1, 4, len(ids), len(ids))
    torch.testing.assert_close(cache["blocks.5.attn.hook_pattern"].sum(-1), torch.ones(1, 4, len(ids)))
    torch.testing.assert_close(logits, gemma3(torch.tensor([ids])), atol=1e-4, rtol=1e-4)

    model = lucidlm.load("gemma3-270m", dtype=torch.float32)  # its own copy: the session fixture must stay unchanged
    freeze_base(model)
    add_lora(model, r=4, targets="q,v")
    batch = torch.tensor([gemma3.tokenizer.encode("Roses are red, violets are blue.")])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    opt.step()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora" not in n)
    assert model.blocks[0].attn.q_proj.lora_B["default"].abs().max() > 0
