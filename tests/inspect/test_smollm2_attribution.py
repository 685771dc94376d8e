"""Attribution patching on SmolLM2's France/Italy example ranks the same components as exact
activation patching (metric: logit difference " Paris" - " Rome")."""

import pytest
import torch

from lucidlm.inspect import run_with_cache
from lucidlm.inspect.patching import attr_patch_resid_pre, get_act_patch_resid_pre

pytestmark = pytest.mark.slow


def test_attribution_ranks_the_residual_stream_like_exact_patching(smollm2):
    model = smollm2
    clean, corrupt = model.to_tokens("The capital of France is"), model.to_tokens("The capital of Italy is")
    (paris,), (rome,) = model.tokenizer.encode(" Paris"), model.tokenizer.encode(" Rome")

    def metric(logits):
        return logits[0, -1, paris] - logits[0, -1, rome]

    with torch.no_grad():
        _, cache = run_with_cache(model, clean, names_filter=lambda n: n.endswith("hook_resid_pre"))
        base = metric(model(corrupt))
    exact = get_act_patch_resid_pre(model, corrupt, cache, metric) - base  # (30, 5): change of the metric
    approx = attr_patch_resid_pre(model, cache, corrupt, metric)
    assert exact.shape == approx.shape == (30, 5)
    assert exact.max() > 10  # restoring " France" at the subject flips the answer (from about -6 to +7)
    # "The capital of" is the same in both prompts: nothing to patch there, exactly or approximately.
    assert exact[:, :3].abs().max() < 1e-3 and approx[:, :3].abs().max() < 1e-3
    correlation = torch.corrcoef(torch.stack([exact.flatten(), approx.flatten()]))[0, 1]
    assert correlation > 0.9
    # Both put their strongest cells on the subject token (" France"), not on the last position.
    top_exact = {divmod(int(i), 5) for i in exact.flatten().topk(5).indices}
    top_approx = {divmod(int(i), 5) for i in approx.flatten().topk(5).indices}
    assert {pos for _, pos in top_exact} == {pos for _, pos in top_approx} == {3}
