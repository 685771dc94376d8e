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

from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from lucidlm.generation import GenerationResult, generate, stream
from lucidlm.inspect.cache import ActivationCache, run_with_cache, run_with_hooks
from lucidlm.inspect.tokens import to_str_tokens, to_string, to_tokens
from lucidlm.model.hook_options import set_hook_options
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
        Other options: device, remove_batch_dim, input_pos, incl_bwd (cache gradients as
        name + "_grad", of ``metric(logits)`` or the next-token loss), prepend_bos,
        padding_side, and the forward's arguments."""
        return run_with_cache(self, ids, names_filter, **options)

    def run_with_hooks(self, ids: Prompt,
                       fwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                       bwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                       **options: Any) -> torch.Tensor:
        """One forward pass with ``fn(activation, hook) -> new | None`` attached at the named
        hook points; the hooks are removed afterwards (unless reset_hooks_end=False).
        ``bwd_hooks``: ``fn(grad, hook)``, run when the returned logits are backpropagated."""
        return run_with_hooks(self, ids, fwd_hooks, bwd_hooks, **options)

    # ------------------------------------------------------------------ analysis (TransformerLens's names)
    def to_tokens(self, text: Union[str, Sequence[str]], prepend_bos: Optional[bool] = None,
                  padding_side: str = "right", return_attention_mask: bool = False) -> Any:
        """Text -> ids (1, T); a list of texts -> (B, T_max), padded. ``prepend_bos``: None
        keeps the tokenizer's habit, True/False forces a BOS in or out. See inspect/tokens.py."""
        return to_tokens(self, text, prepend_bos, padding_side, return_attention_mask)

    def to_str_tokens(self, text_or_ids: Any, prepend_bos: Optional[bool] = None) -> Any:
        """Each token as its text: a list of str (a list of lists for a batch)."""
        return to_str_tokens(self, text_or_ids, prepend_bos)

    def to_string(self, ids: Any) -> Union[str, list[str]]:
        """Ids -> text; a (B, T) batch -> a list of texts."""
        return to_string(self, ids)

    def set_use_attn_result(self, on: bool) -> None:
        """Hook each head's output before the sum: ``blocks.{i}.attn.hook_result`` (B, T, nh, d)."""
        set_hook_options(self, attn_result=on)

    def set_use_split_qkv_input(self, on: bool) -> None:
        """Hook one residual-stream copy per head for queries, keys and values:
        ``blocks.{i}.hook_q_input`` (B, T, nh, d), ``hook_k_input`` / ``hook_v_input`` (B, T, n_kv, d)."""
        set_hook_options(self, split_qkv_input=on)

    def set_use_attn_in(self, on: bool) -> None:
        """Hook one copy per head feeding q, k and v together: ``blocks.{i}.hook_attn_in``."""
        set_hook_options(self, attn_in=on)

    def set_use_hook_mlp_in(self, on: bool) -> None:
        """Hook the MLP's input before its norm: ``blocks.{i}.hook_mlp_in`` (B, T, d)."""
        set_hook_options(self, mlp_in=on)

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

