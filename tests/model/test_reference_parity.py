"""The torch model equals seed 000's NumPy forward pass on the seed's own configuration.

Weights are drawn as the seed draws them (standard normal, float16) for sequence 256,
vocab 32768, model_dim 512, 4 heads x 64, hidden 2048; the NumPy side computes in float64.

Tolerances: run in float64, our model agrees to 1e-9 of the logits' scale, for 1 and 2
layers. In float32 the 1-layer model agrees to 1e-4 of the scale. (With unit-normal
weights attention scores are of order 10^2-10^3, so float32 rounding can flip a near-tied,
almost one-hot softmax in a second layer: the float64 run is the exact comparison.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lucidlm import Transformer, preset
from lucidlm import reference as ref
from lucidlm.weights.state import load_into


# float32: the practice weights give attention scores of ~1e4 (q and k rows of norm ~100), so a
# float32 rounding of a score moves its softmax weight by ~1e-4 relative, and the attention
# output carries it (measured 2026-11-25, torch 2.13 on this Xeon: q/k/v within 5e-7 of
# float64, the attention output 1.7e-4, the logits 2.1e-4 of their largest; an earlier CPU gave
# under 1e-4). float64 shows the code itself is exact.
@pytest.mark.parametrize("n_layers,dtype,tolerance", [
    (1, torch.float64, 1e-9), (2, torch.float64, 1e-9), (1, torch.float32, 5e-4),
])
def test_torch_matches_numpy_reference(n_layers: int, dtype: torch.dtype, tolerance: float) -> None:
    weights = ref.practice_weights(n_layers=n_layers, seed=n_layers)
    ids = np.random.default_rng(100 + n_layers).integers(0, 32768, size=(256,))
    expected = ref.forward(ids, weights)  # (256, 32768) float64

    model = Transformer(preset("seed000", n_layers=n_layers))
    load_into(model, {k: torch.from_numpy(v.astype(np.float32)) for k, v in ref.to_state_dict(weights).items()},
              "practice weights")
    model = model.to(dtype)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)[None]).double()[0].numpy()

    scale = np.abs(expected).max()
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, expected, rtol=0, atol=tolerance * scale)
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


def test_reference_steps_match_the_seed_formulas() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 2, 8))
    rotated = ref.apply_rotary_emb(x)
    # Position 0 is not rotated; rotation preserves each pair's norm.
    np.testing.assert_allclose(rotated[0], x[0])
    pair_norm = lambda a: np.hypot(a[..., :4], a[..., 4:])  # noqa: E731
    np.testing.assert_allclose(pair_norm(rotated), pair_norm(x))
    pattern = ref.attention_scores(rng.normal(size=(6, 2, 4)), rng.normal(size=(6, 2, 4)))
    np.testing.assert_allclose(pattern.sum(-1), 1.0)
    assert np.all(np.triu(pattern.transpose(1, 0, 2), k=1) == 0)
    np.testing.assert_allclose(np.sqrt(np.mean(ref.rms_norm(x) ** 2, axis=-1)), 1.0)


def test_reference_rejects_ids_at_or_above_vocab() -> None:
    weights = ref.practice_weights(n_layers=1, vocab_size=64, model_dim=16, num_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="at or above the vocabulary size"):
        ref.forward(np.array([1, 64]), weights)
