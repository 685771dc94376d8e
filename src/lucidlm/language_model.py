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

from lucidlm.generation import GenerationResult, TextStream, generate, stream
from lucidlm.inspect.cache import ActivationCache, run_with_cache, run_with_hooks
from lucidlm.inspect.tokens import to_str_tokens, to_string, to_tokens
from lucidlm.model.hook_options import set_hook_options
from lucidlm.model.hooks import HookFn
from lucidlm.model.transformer import Transformer
from lucidlm.peft import merge_adapter, set_adapter, unmerge_adapter

Prompt = Union[str, Sequence[int], torch.Tensor]
Prompts = Union[Prompt, Sequence[str], Sequence[Sequence[int]]]


def _is_text_batch(ids: Any) -> bool:
    return isinstance(ids, (list, tuple)) and len(ids) > 0 and all(isinstance(t, str) for t in ids)


class LanguageModel(Transformer):
    """A Transformer that generates text, records activations and switches adapters.

    Build it like a Transformer (``LanguageModel(config, tokenizer)``); ``lucidlm.load``
    returns one. It adds no parameters and no state dict entries: a checkpoint saved from
    either class loads into the other.
    """

    # ------------------------------------------------------------------ forward on text
    def forward(self, ids: Union[torch.Tensor, Sequence[int], str, Sequence[str]], *args: Any,
                **kwargs: Any) -> torch.Tensor:
        """Logits (B, T, vocab). ``ids``: token ids (B, T) or (T,), or text: ``model("Hello")``
        encodes with the model's tokenizer (like ``to_tokens``); a list of texts is left-padded
        with an attention mask, so position -1 of every row is that text's last token.
        The other arguments are ``Transformer.forward``'s."""
        texts = [ids] if isinstance(ids, str) else list(ids) if _is_text_batch(ids) else None
        if texts is not None:
            if len(texts) > 1 and kwargs.get("attention_mask") is None:
                ids, kwargs["attention_mask"] = to_tokens(self, texts, padding_side="left",
                                                          return_attention_mask=True)
            else:
                ids = to_tokens(self, texts)
        return super().forward(ids, *args, **kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: Prompts, *, max_new_tokens: int = 64, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
                 repetition_penalty: Optional[float] = None, seed: Optional[int] = None,
                 stop: Optional[Union[str, Sequence[str]]] = None, stop_on_eos: bool = True, num_beams: int = 1,
                 length_penalty: float = 1.0, chat: bool = False,
                 **options: Any) -> Union[GenerationResult, list[GenerationResult]]:
        """Continue ``prompt`` and return the new ids, their text and why it stopped.

        Args:
            prompt: text, a list of token ids or a 1-D tensor -> one ``GenerationResult``;
                a batch (a list of texts, a list of id lists, a (B, T) tensor) -> a list of B
                results, generated together (left-padded, one KV cache).
            max_new_tokens: the most tokens to add (fewer at EOS, a stop string or the context end).
            temperature: 0 is greedy; None takes the model's default (``model.generation_defaults``,
                e.g. SmolLM2: 0.2 with top_p 0.5), else 1. The same holds for top_k, top_p,
                min_p and repetition_penalty.
            top_k, top_p, min_p: keep the k likeliest tokens / the smallest set with mass >= p /
                tokens at least min_p times as likely as the top one (1, 1 and 0 switch them off).
            repetition_penalty: > 1 makes tokens already in the text less likely (HF's CTRL penalty).
            seed: makes sampling reproducible without touching torch's global RNG.
            stop: text(s) that end generation; the text stops just before them.
            stop_on_eos: stop at the tokenizer's end-of-sequence token(s).
            num_beams, length_penalty: beam search (one prompt at a time).
            chat: wrap a text prompt as a user message in the model's chat template.
            **options: further options of ``lucidlm.generation.generate``; unknown names are refused.

        >>> model.generate("What is the capital of France?", chat=True).text
        'The capital of France is Paris.'
        >>> [r.text for r in model.generate(["Once upon a time", "The sky is"], temperature=0)]
        """
        return generate(self, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop,
                        stop_on_eos=stop_on_eos, num_beams=num_beams, length_penalty=length_penalty, chat=chat,
                        **options)

    def stream(self, prompt: Prompt, **options: Any) -> TextStream:
        """Like ``generate`` (same options, one prompt) but yields text pieces as they are
        decoded; they join to exactly ``generate(...).text`` (never half a UTF-8 character,
        never a stop string). After the last piece, ``.result`` is the ``GenerationResult``.

        >>> for piece in model.stream("Tell me a story", max_new_tokens=64):
        ...     print(piece, end="", flush=True)
        """
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

