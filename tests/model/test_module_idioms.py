"""Ordinary nn.Module idioms on lucidlm's models, against what torch and transformers do for the
same call: torch's own module hooks on hook points (generic tools such as baukit attach them by
module name)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForCausalLM

import lucidlm
from random_weights import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama (GQA, tied embeddings) in transformers and, loaded from its folder, in lucidlm."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                         tie_word_embeddings=True)
    hf = randomize_(LlamaForCausalLM(config), seed=0)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return hf, lucidlm.load(path)


def ids(rows: int = 1, length: int = 10) -> torch.Tensor:
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))


# -- torch's own hooks on a hook point ------------------------------------------------------

def test_torch_forward_hook_on_a_hook_point_reads_the_activation(llama):
    hf, model = llama
    seen = []
    handle = model.blocks[1].hook_resid_pre.register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        model(ids())
        want = hf(ids(), output_hidden_states=True).hidden_states[1]  # the input of layer 1
    handle.remove()
    assert len(seen) == 1  # torch calls a forward hook once per call of its module
    assert_close(seen[0], want)


def test_torch_forward_hook_on_a_hook_point_replaces_the_activation(llama):
    """A forward hook's return value replaces the module's output (torch): zeroing each head's
    mix of values in layer 0 is zeroing the input of transformers' o_proj there."""
    hf, model = llama
    handle = model.blocks[0].attn.hook_z.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    hf_handle = hf.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda module, args: (args[0] * 0,))
    with torch.no_grad():
        ablated, want = model(ids()), hf(ids()).logits
    handle.remove()
    hf_handle.remove()
    with torch.no_grad():
        assert (ablated - hf(ids()).logits).abs().max() > 0.1  # the ablation changed something
        assert_close(model(ids()), hf(ids()).logits)  # and the removed hook is gone
    assert_close(ablated, want)


def test_torch_forward_hook_on_a_hook_point_runs_in_every_generation_pass(smollm2_default):
    """The embedded default decodes each block in one C++ call when nothing listens: a torch hook
    on a hook point inside a block listens, so it is called once per forward pass."""
    model = smollm2_default
    shapes = []
    handle = model.blocks[3].hook_resid_post.register_forward_hook(lambda module, args, out: shapes.append(out.shape))
    try:
        model.generate("The capital of France is", max_new_tokens=4, temperature=0, stop_on_eos=False)
    finally:
        handle.remove()
    prompt_len = len(model.tokenizer.encode("The capital of France is"))
    assert shapes == [(1, prompt_len, 576)] + [(1, 1, 576)] * 3  # the prompt, then one pass per further token



def test_torch_hook_on_a_hook_point_of_a_compiled_model(llama, tmp_path):
    """A compiled model runs eagerly while something listens, then compiled again once the
    handle is removed; the tokens are transformers' throughout."""
    hf, _ = llama
    hf.save_pretrained(tmp_path)
    model = lucidlm.load(tmp_path).compile(backend="aot_eager")  # dynamo, no code generation: quick
    prompt, want = [5, 17, 33, 2, 8], hf_greedy(hf, [5, 17, 33, 2, 8], 4)
    calls = []
    handle = model.blocks[0].hook_resid_post.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    assert model.generate(prompt, max_new_tokens=4, temperature=0, stop_on_eos=False).token_ids == want
    assert len(calls) == 4  # the prompt, then three single-token passes
    handle.remove()
    for _ in range(2):
        assert model.generate(prompt, max_new_tokens=4, temperature=0, stop_on_eos=False).token_ids == want
    assert len(calls) == 4

# -- train() / eval() ----------------------------------------------------------------------

def test_a_refused_train_leaves_every_module_in_eval_mode():
    """A quantized layer refuses ``train()``; the modules before it must not be left training,
    or their dropout runs in a model the caller still takes for an eval one (torch: in eval
    mode ``nn.Dropout`` is the identity, so two passes agree)."""
    model = lucidlm.load("llama", random_init=True, n_layers=2, d_model=64, n_heads=4, vocab_size=VOCAB,
                         max_seq_len=32, dropout=0.5).eval()
    lucidlm.quantize(model, "int8", embeddings=False)  # the first quantized layer sits inside block 0
    with pytest.raises(lucidlm.errors.QuantizationError, match="dtype='float32'"):
        model.train()
    assert not any(module.training for module in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids()), model(ids()))


# -- copies of a compiled model ------------------------------------------------------------

def hf_greedy(hf: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("copy_model", ["deepcopy", "pickle"])
def test_a_copy_of_a_compiled_model_generates_with_its_own_weights(tmp_path, copy_model):
    """``copy.deepcopy(model)`` (the README's way to give each thread a model) of a compiled
    model: the copy's compiled steps ran the original's step, its weights and KV cache."""
    import copy
    import pickle

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    hf = randomize_(LlamaForCausalLM(config), seed=1)
    hf.save_pretrained(tmp_path)
    model = lucidlm.load(tmp_path).compile(backend="aot_eager")  # dynamo, no code generation: quick
    prompt = [5, 17, 33, 2, 8]
    assert model.generate(prompt, max_new_tokens=6, temperature=0, stop_on_eos=False).token_ids == hf_greedy(hf, prompt, 6)

    twin = copy.deepcopy(model) if copy_model == "deepcopy" else pickle.loads(pickle.dumps(model))
    with torch.no_grad():  # a different model from here on, in both libraries alike
        for p in list(twin.parameters()) + list(hf.parameters()):
            p.mul_(-1.3)
    assert twin.compiled
    assert twin.generate(prompt, max_new_tokens=6, temperature=0, stop_on_eos=False).token_ids == hf_greedy(hf, prompt, 6)


# -- state dicts ---------------------------------------------------------------------------

def test_a_meta_model_given_its_weights_by_assign_runs_like_transformers(llama):
    """torch's way to skip the random init: build on the meta device, then
    ``load_state_dict(sd, assign=True)``. The position tables are derived, never saved, so they
    were left on meta (the forward failed), and the tied matrix was split in two."""
    from lucidlm.language_model import LanguageModel

    hf, model = llama
    with torch.device("meta"):
        fresh = LanguageModel(model.config)
    fresh.load_state_dict(model.state_dict(), assign=True)
    assert not any(t.is_meta for t in list(fresh.parameters()) + list(fresh.buffers()))
    assert fresh.unembed.weight is fresh.embed.weight  # tied, as transformers ties its own after loading
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    with torch.no_grad():
        assert_close(fresh(ids(2)), hf(ids(2)).logits)


# -- transformers' keyword names -------------------------------------------------------------

def test_input_ids_as_transformers_names_them(llama):
    """Code ported from transformers passes ``input_ids=``: the same logits and greedy tokens
    as transformers' own call; its ``labels=`` and a misspelt keyword are lucidlm errors
    naming the fix, not Python's TypeError."""
    hf, model = llama
    with torch.no_grad():
        assert_close(model(input_ids=ids(2)), hf(input_ids=ids(2)).logits)
    prompt = ids()[0].tolist()
    got = model.generate(input_ids=prompt, max_new_tokens=5, temperature=0, stop_on_eos=False).token_ids
    assert got == hf_greedy(hf, prompt, 5)
    with pytest.raises(lucidlm.errors.InputError, match="next_token_loss"):
        model(ids(), labels=ids())
    with pytest.raises(lucidlm.errors.InputError, match="did you mean 'attention_mask'"):
        model(ids(), atention_mask=torch.ones(1, 10))
    with pytest.raises(lucidlm.errors.InputError, match="give the ids once"):
        model(ids(), input_ids=ids())
