"""Prompt caching across generations: keep the KV cache of one generation for the next.

A chat sends the whole conversation as each turn's prompt, and all of it but the new user
message is what the last turn's generation already ran through the model. Its KV cache holds
the keys and values of those ids (prompt + answer, but the last sampled token, never fed): a
next prompt sharing its first k ids keeps slots [0, k) and runs only the rest, as llama.cpp's
server (``cache_prompt``) and ollama do. Opt in with ``reuse_cache=True`` (``Conversation``
does by default).

Slot s of the cache depends on the ids in slots 0..s and on everything the forward passes
read. A kept cache is reused only where none of that can have changed, else the prompt runs
whole (correct, only slower):

- the weights: every parameter and buffer is the same tensor (``data_ptr``) at the same
  ``_version``, torch's in-place counter (``copy_``, an optimizer step, a merge all bump it),
  and the module tree and its settings are the same (``structure_fingerprint``: an adapter
  attached, merged or switched, ``model.to(...)``, ``train()``);
- nothing listened during the kept run nor listens now (no hook function, no torch hook,
  none attached meanwhile), there is no prefix module and no dropout in effect;
- the kept run ended normally (the last token, EOS or a stop string; not Ctrl-C nor an
  error), and no other cache was set up since: ``setup_kv_cache`` and ``clear_kv_cache``
  forget the kept one (a compiled model hands the same buffers to the next set-up, and every
  generation sets one up);
- one row, not beam search, not ``context_overflow="crop"`` (only ``sample_rows`` keeps).

A tensor edited through ``.data`` bypasses torch's counter: call ``model.clear_kv_cache()``
after such an edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lucidlm.generation.compiled import structure_fingerprint
from lucidlm.model.decode_block import nothing_listens
from lucidlm.model.hooks import HookPoint
from torch.utils.hooks import RemovableHandle


@dataclass
class CacheReuse:
    """A request to reuse the model's kept cache, and what came of it: ``cached_tokens`` prompt
    tokens whose keys and values came from the kept cache (0: the whole prompt ran)."""

    cached_tokens: int = 0


@dataclass
class KeptCache:
    """A finished generation's KV cache (``caches``, one per layer) holding ``ids`` in slots
    0..len(ids)-1, and the model's state (``model_state``) when it ran."""

    caches: Any
    ids: list[int]
    state: tuple = field(repr=False)

    def __reduce__(self) -> tuple:
        """A copy of the model (``copy.deepcopy``, pickle) keeps nothing: its tensors are others,
        so its state could never match, and the copy would only carry the cache's memory."""
        return type(None), ()


def model_state(model: Any) -> Optional[tuple]:
    """What the cache's values depend on besides the ids, cheap to compare (SmolLM2: ~5 ms), or
    None where a cache of this model must not be kept (something listens, a prefix, dropout)."""
    if not nothing_listens(model) or getattr(model, "prefix_encoder", None) is not None or model.training:
        return None
    tensors = [(t.data_ptr(), t._version) for name, t in _weights(model)]
    return structure_fingerprint(model), tuple(tensors), HookPoint.version, RemovableHandle.next_id


def _weights(model: Any) -> list[tuple[str, Any]]:
    """Every parameter and buffer but the KV caches'."""
    return [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()]
            if not name.startswith("kv_caches.")]


def reusable_slots(kept: Optional[KeptCache], state: Optional[tuple], row: Sequence[int], caches: Any) -> int:
    """How many leading slots of ``kept`` the prompt ``row`` can take over into ``caches`` (the
    cache just set up for it): the ids they share, at most all but the last (its logits are
    needed), and 0 unless the model's ``state`` now (``model_state``) is the kept one's and
    the caches are alike."""
    if kept is None or caches is None or len(caches) != len(kept.caches):
        return 0
    old, new = kept.caches[0].k, caches[0].k  # (B, n_kv, S, hd)
    if (old.shape[0], old.shape[1], old.shape[3], old.dtype, old.device) != \
            (1, new.shape[1], new.shape[3], new.dtype, new.device) or new.shape[0] != 1:
        return 0
    if state is None or state != kept.state:
        return 0
    shared = 0
    for a, b in zip(kept.ids, row[:-1]):
        if a != b:
            break
        shared += 1
    return shared


def take_over(kept: KeptCache, caches: Any, slots: int) -> None:
    """Copy slots [0, ``slots``) of ``kept`` into ``caches`` (nothing to do where a compiled
    model handed the same buffers back)."""
    for old, new in zip(kept.caches, caches):
        if old is not new:
            new.k[:, :, :slots].copy_(old.k[:, :, :slots])
            new.v[:, :, :slots].copy_(old.v[:, :, :slots])
