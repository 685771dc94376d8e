"""TransformerLens 3.9 as the oracle for hook values and the cache's analysis functions: the same
tiny random GPT-2 and Llama (GQA) weights, loaded into both, must give the same numbers under
every hook name the two share, and the same stacks from accumulated_resid, decompose_resid,
stack_head_results, apply_ln_to_stack and logit_attrs (labels included)."""

from __future__ import annotations

import pytest
import torch

from lucidlm.inspect import run_with_cache, run_with_hooks

pytest.importorskip("transformer_lens")
import tl_oracle  # noqa: E402  (a helper beside this file, like tests/generation/generation_toys.py)

FAMILIES = ["gpt2", "llama"]
ATOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    family = request.param
    hf = tl_oracle.hf_model(family)
    lucid = tl_oracle.lucid_model(hf, tmp_path_factory.mktemp(family))
    tl = tl_oracle.tl_model(family, hf)
    ids = tl_oracle.ids()
    with torch.no_grad():
        tl_logits, tl_cache = tl.run_with_cache(ids)
        logits, cache = run_with_cache(lucid, ids)
    return dict(family=family, hf=hf, lucid=lucid, tl=tl, ids=ids, tl_cache=tl_cache, cache=cache,
                tl_logits=tl_logits, logits=logits)


def test_every_shared_hook_name_holds_the_same_values_and_shapes(pair):
    cache, tl_cache = pair["cache"], pair["tl_cache"]
    torch.testing.assert_close(pair["logits"], pair["tl_logits"], atol=ATOL, rtol=0)
    ours = set(pair["lucid"].hook_points())
    shared = [name for name in tl_cache.keys() if name in ours]
    # Every hook lucidlm has on these families is one TransformerLens has too.
    assert sorted(shared) == sorted(ours), sorted(ours - set(shared))
    assert len(shared) == {"gpt2": 38, "llama": 43}[pair["family"]]
    for name in shared:
        assert cache[name].shape == tl_cache[name].shape, name
        torch.testing.assert_close(cache[name], tl_cache[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("hook", ["blocks.1.ln1.hook_normalized", "blocks.0.ln2.hook_scale",
                                  "ln_final.hook_normalized"])
def test_writing_a_norm_hook_changes_the_output_as_in_transformer_lens(pair, hook):
    def double(act, hook):
        return act * 2.0 if "scale" in hook.name else act.flip(-1)

    with torch.no_grad():
        ours = run_with_hooks(pair["lucid"], pair["ids"], fwd_hooks=[(hook, double)])
        theirs = pair["tl"].run_with_hooks(pair["ids"], fwd_hooks=[(hook, double)])
    assert (ours - pair["logits"]).abs().max() > 1e-3  # the hook did something
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


ACCUMULATED = [dict(), dict(incl_mid=True), dict(layer=1, incl_mid=True, mlp_input=True), dict(apply_ln=True),
               dict(layer=1, apply_ln=True), dict(layer=0, mlp_input=True, apply_ln=True),
               dict(pos_slice=-1, apply_ln=True), dict(layer=1, pos_slice=(2, 6), apply_ln=True, incl_mid=True)]


@pytest.mark.parametrize("kwargs", ACCUMULATED, ids=str)
def test_accumulated_resid_matches(pair, kwargs):
    ours, labels = pair["cache"].accumulated_resid(return_labels=True, **kwargs)
    theirs, tl_labels = pair["tl_cache"].accumulated_resid(return_labels=True, **kwargs)
    assert labels == tl_labels
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


DECOMPOSED = [dict(), dict(mode="attn"), dict(mode="mlp", layer=1), dict(apply_ln=True),
              dict(layer=1, mlp_input=True, apply_ln=True), dict(pos_slice=-1, incl_embeds=False, apply_ln=True)]


@pytest.mark.parametrize("kwargs", DECOMPOSED, ids=str)
def test_decompose_resid_matches(pair, kwargs):
    ours, labels = pair["cache"].decompose_resid(return_labels=True, **kwargs)
    theirs, tl_labels = pair["tl_cache"].decompose_resid(return_labels=True, **kwargs)
    assert labels == tl_labels
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(), dict(incl_remainder=True), dict(layer=1, apply_ln=True),
                                    dict(pos_slice=-1, apply_ln=True, incl_remainder=True)], ids=str)
def test_stack_head_results_matches(pair, kwargs):
    ours, labels = pair["cache"].stack_head_results(return_labels=True, **kwargs)
    theirs, tl_labels = pair["tl_cache"].stack_head_results(return_labels=True, **kwargs)
    assert labels == tl_labels
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_apply_ln_to_stack_matches_at_every_layer_and_norm(pair):
    cache, tl_cache = pair["cache"], pair["tl_cache"]
    stack = cache.decompose_resid(layer=2)
    for layer in (0, 1, 2, None):
        for mlp_input in ((False, True) if layer in (0, 1) else (False,)):
            ours = cache.apply_ln_to_stack(stack, layer, mlp_input=mlp_input)
            theirs = tl_cache.apply_ln_to_stack(stack, layer, mlp_input=mlp_input)
            torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0, msg=f"layer={layer} mlp_input={mlp_input}")


def test_logit_attrs_match_transformer_lens_with_folded_norms(pair):
    """lucidlm folds the final norm's weight into the token directions, which is what
    TransformerLens computes for a model loaded with fold_ln=True (its default)."""
    folded = tl_oracle.tl_model(pair["family"], pair["hf"], fold_ln=True)
    with torch.no_grad():
        _, tl_cache = folded.run_with_cache(pair["ids"])
    cache = pair["cache"]
    right, wrong = torch.tensor([5, 17]), torch.tensor([40, 3])
    for stack_fn in ("decompose_resid", "accumulated_resid", "stack_head_results"):
        stack = getattr(cache, stack_fn)(pos_slice=-1)
        tl_stack = getattr(tl_cache, stack_fn)(pos_slice=-1)
        ours = cache.logit_attrs(stack, right, wrong, pos_slice=-1)
        theirs = tl_cache.logit_attrs(tl_stack, right, wrong, pos_slice=-1)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0, msg=stack_fn)
    # The attributions of a full decomposition add up to the logit difference, biases aside.
    stack = cache.decompose_resid(pos_slice=-1)
    total = cache.logit_attrs(stack, right, wrong, pos_slice=-1).sum(0)  # (B,)
    logits = pair["logits"][:, -1]
    diff = logits[torch.arange(2), right] - logits[torch.arange(2), wrong]
    bias_part = _bias_logit_diff(pair["lucid"], cache, right, wrong)
    torch.testing.assert_close(total + bias_part, diff, atol=1e-4, rtol=0)


def _bias_logit_diff(model, cache, right, wrong):
    """What the decomposition leaves out of the logit difference: the final norm's bias and
    the unembedding bias (attention and MLP output biases sit inside attn_out / mlp_out)."""
    extra = torch.zeros(len(right))
    direction = (model.unembed.weight[right] - model.unembed.weight[wrong]).detach()  # (B, d)
    if getattr(model.ln_final, "bias", None) is not None:
        extra = extra + (direction * model.ln_final.bias.detach()).sum(-1)
    if model.unembed.bias is not None:
        extra = extra + (model.unembed.bias[right] - model.unembed.bias[wrong]).detach()
    return extra


OPTIONS = [dict(attn_result=True), dict(split_qkv_input=True), dict(attn_in=True), dict(mlp_in=True),
           dict(attn_result=True, split_qkv_input=True, mlp_in=True)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(o))
def test_opt_in_hooks_match_transformer_lens(pair, options):
    """hook_result, hook_q/k/v_input, hook_attn_in and hook_mlp_in: same values as with
    TransformerLens's set_use_* switches, and a patch into one head's input reaches that
    head alone in both."""
    from lucidlm.errors import ConfigError
    from lucidlm.model.hook_options import set_hook_options

    if options.get("attn_in") and pair["family"] == "llama":
        # TransformerLens's attn_in cannot feed grouped key/value heads; lucidlm says so.
        with pytest.raises(ConfigError, match="split_qkv_input"):
            set_hook_options(pair["lucid"], **options)
        return
    lucid, tl = pair["lucid"], tl_oracle.tl_model(pair["family"], pair["hf"])
    for option, on in options.items():
        getattr(tl, tl_oracle.TL_SETTERS[option])(on)
    set_hook_options(lucid, **options)
    try:
        with torch.no_grad():
            tl_logits, tl_cache = tl.run_with_cache(pair["ids"])
            logits, cache = run_with_cache(lucid, pair["ids"])
            assert sorted(cache.keys()) == sorted(n for n in tl_cache.keys() if not n.startswith("unembed."))
            for name in cache.keys():
                torch.testing.assert_close(cache[name], tl_cache[name], atol=ATOL, rtol=0, msg=name)
            torch.testing.assert_close(logits, tl_logits, atol=ATOL, rtol=0)
            hook = ("blocks.1.hook_q_input" if "split_qkv_input" in options else
                    "blocks.1.attn.hook_result" if "attn_result" in options else
                    "blocks.1.hook_attn_in" if "attn_in" in options else "blocks.1.hook_mlp_in")

            def zero_one_head(act, hook):
                act = act.clone()
                act[..., 1, :] = 0.0  # head 1 (or, for mlp_in (B, T, d), position 1)
                return act
            ours = run_with_hooks(lucid, pair["ids"], fwd_hooks=[(hook, zero_one_head)])
            theirs = tl.run_with_hooks(pair["ids"], fwd_hooks=[(hook, zero_one_head)])
        assert (ours - logits).abs().max() > 1e-3
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    finally:
        set_hook_options(lucid, **{option: False for option in options})
    assert sorted(lucid.hook_points()) == sorted(pair["cache"].keys())  # switched off: gone again

