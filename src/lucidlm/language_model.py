"""``LanguageModel``: the Transformer with the conveniences a user reaches for first.

    model = lucidlm.load()                      # a LanguageModel
    model.generate("Once upon a time").text     # lucidlm.generation
    logits, cache = model.run_with_cache(ids)   # lucidlm.inspect
    model.set_adapter("french")                 # lucidlm.peft

``Transformer`` (``lucidlm.model``) is only the network and its state; it imports nothing
above it. The methods here are thin doors into the packages that implement them, so this
module sits on top of generation, inspection and adapters, and nothing below imports it.
Every function also takes a bare ``Transformer`` (``lucidlm.generation.generate(model, ...)``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence, Union

import torch

from lucidlm.generation import GenerationResult, generate, stream
from lucidlm.inspect.cache import ActivationCache, run_with_cache, run_with_hooks
from lucidlm.model.hooks import HookFn
from lucidlm.model.transformer import Transformer
from lucidlm.peft import merge_adapter, set_adapter, unmerge_adapter

Prompt = Union[str, Sequence[int], torch.Tensor]


class LanguageModel(Transformer):
    """A Transformer that generates text, records activations and switches adapters.

    Build it like a Transformer (``LanguageModel(config, tokenizer)``); ``lucidlm.load``
    returns one. It adds no parameters and no state dict entries: a checkpoint saved from
    either class loads into the other.
    """

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: Prompt, **options: Any) -> GenerationResult:
        """Continue ``prompt`` (text, or token ids) and return the ids, text and finish reason.

        Options: max_new_tokens (64), temperature (1.0; 0 = greedy), top_k, top_p, min_p,
        repetition_penalty, seed, stop (str or list), stop_on_eos, num_beams, length_penalty,
        chat (wrap the prompt in the model's chat template). See ``lucidlm.generation``.
        """
        return generate(self, prompt, **options)

    def stream(self, prompt: Prompt, **options: Any) -> Iterator[str]:
        """Like ``generate`` but yields text pieces as they are decoded; they join to
        exactly ``generate(...).text``."""
        return stream(self, prompt, **options)

    # ------------------------------------------------------------------ inspection
    def run_with_cache(self, ids: Prompt, names_filter: Any = None, **options: Any,
                       ) -> tuple[torch.Tensor, ActivationCache]:
        """One forward pass returning (logits, cache of every hooked activation).
        ``names_filter``: a hook name, a list of names or a predicate (default: all).
        Other options: device, remove_batch_dim, input_pos, and the forward's arguments."""
        return run_with_cache(self, ids, names_filter, **options)

    def run_with_hooks(self, ids: Prompt,
                       fwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                       **options: Any) -> torch.Tensor:
        """One forward pass with ``fn(activation, hook) -> new | None`` attached at the named
        hook points; the hooks are removed afterwards (unless reset_hooks_end=False)."""
        return run_with_hooks(self, ids, fwd_hooks, **options)

    # ------------------------------------------------------------------ adapters
    def set_adapter(self, name: str) -> None:
        """Make the LoRA adapter ``name`` the active one (``lucidlm.peft.add_lora`` adds them)."""
        set_adapter(self, name)

    def merge_adapter(self) -> None:
        """Fold the active LoRA adapter into the base weights (merged in fp32), for speed."""
        merge_adapter(self)

    def unmerge_adapter(self) -> None:
        """Take a merged LoRA adapter back out of the base weights."""
        unmerge_adapter(self)

