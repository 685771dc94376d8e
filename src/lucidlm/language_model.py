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

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from lucidlm.config import ModelConfig
from lucidlm.devices import DTYPES, resolve_device, resolve_dtype
from lucidlm.errors import ConfigError, InputError
from lucidlm.evaluation import PerplexityResult, perplexity
from lucidlm.generation import GenerationResult, TextStream, generate, stream
from lucidlm.generation.api import Prompt, Prompts
from lucidlm.generation.compiled import CompiledSteps
from lucidlm.generation.sampling import LogitBias, SequenceBias
from lucidlm.inspect.cache import ActivationCache, run_with_cache, run_with_hooks
from lucidlm.inspect.hook_names import NamesFilter
from lucidlm.inspect.tokens import LooseIds, TextOrIds, TextOrLooseIds, to_str_tokens, to_string, to_tokens
from lucidlm.model.fused import fuse_projections
from lucidlm.model.hook_options import set_hook_options
from lucidlm.model.hooks import HookFn
from lucidlm.model.transformer import Transformer
from lucidlm.peft import merge_adapter, set_adapter, unmerge_adapter
from lucidlm.quantization.blocks_kernel import use_cpu_loops
from lucidlm.suggest import keyword_options, keywords_checked, unknown_keyword_message
from lucidlm.tokenizers.base import Tokenizer


def _is_text_batch(ids: Any) -> bool:
    return isinstance(ids, (list, tuple)) and len(ids) > 0 and all(isinstance(t, str) for t in ids)


class LanguageModel(Transformer):
    """A Transformer that generates text, records activations and switches adapters.

    Build it like a Transformer (``LanguageModel(config, tokenizer)``); ``lucidlm.load``
    returns one. It adds no parameters and no state dict entries: a checkpoint saved from
    either class loads into the other.
    """

    # Compiled, the cache length is rounded up to a power of two, at least this, so prompts
    # of similar length share one compiled decode step (and one CUDA graph) instead of
    # recompiling. Every step attends over the whole cache, so a cache much longer than the
    # text costs time: with multiples of 256, batch-8 decoding of 48 tokens took 22.5 ms a
    # step against 17.5 ms in a 64-slot cache (int4, 2 threads). Powers of two also keep a
    # growing chat to one new compile per doubling (8 sizes up to 8,192 tokens).
    CACHE_MIN = 64

    def __init__(self, config: ModelConfig, tokenizer: Optional[Tokenizer] = None) -> None:
        super().__init__(config, tokenizer)
        # The sampling defaults from the model's file or lucidlm's table (generation/defaults.py);
        # lucidlm.load fills them in. {} (no file, e.g. random_init): temperature 1, no filters.
        self.generation_defaults: dict[str, Any] = {}
        self._compiled: Optional[CompiledSteps] = None
        self._kept_caches: list[nn.ModuleList] = []  # compiled: the cache outlives one generate call

    # ------------------------------------------------------------------ compiled decoding
    # Inductor settings when no mode is given on CPU. The generated step checks the size and
    # stride of every input at every call (~1,000 inputs for SmolLM2: each weight is one):
    # 0.56 ms of a 7 ms int4 step (cProfile, 2026-11-23). The decode step's own guards and the
    # structure check (generation/compiled.py) already pin those shapes, so the checks are off:
    # 128 -> 136 tok/s median, 133 -> 150 best (int4, 2 threads, same process, quiet machine).
    # ``freezing`` (weights folded in as constants) was measured and left off: ~2 % for a 74 s
    # warm-up and 110 MB more, and frozen weights would miss later in-place edits (a merged
    # adapter); int4 SmolLM2, 2 threads, 2026-11-23.
    CPU_INDUCTOR_OPTIONS: dict[str, Any] = {"size_asserts": False, "alignment_asserts": False}
    # The decode step alone also gets ``cpp_wrapper``: its ~300 kernel and operator calls are
    # made from generated C++ instead of a generated Python function. On the AMD EPYC host (2
    # threads, int4 SmolLM2, 2026-11-25) 109 -> 136 tok/s at batch 1, for a warm-up of 302 s
    # instead of 170 (on the Xeon, 2026-11-23: 4-5 % for 36 s more). The prefill keeps Python's
    # wrapper: its shapes are dynamic, and it runs once per prompt.
    CPU_DECODE_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}
    # On CUDA the decode step gets coordinate-descent tuning, as gpt-fast sets it: inductor then
    # writes each one-row matmul (batch 1) as a reduction kernel of its own, tuned for its shape
    # (torch._inductor.decomposition.mm), instead of calling cuBLAS, whose kernels for q/k/v, o
    # and the down projection reached 43-72 % of copy bandwidth (H100, 2026-11-26); an int8
    # weight's conversion to bf16 then happens inside that kernel, not as a copy of the matrix.
    CUDA_DECODE_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": True}

    def compile(self, mode: Optional[str] = None, *, backend: Union[str, Callable[..., Any]] = "inductor",
                prefill: bool = True, options: Optional[dict[str, Any]] = None) -> "LanguageModel":
        """Compile the steps that ``generate``/``stream``/``chat`` run, with ``torch.compile``.

        The decode step (one token per row against the static KV cache) is compiled once,
        with fixed shapes; ``mode`` defaults to ``"reduce-overhead"`` on CUDA, which replays
        it as a CUDA graph (the decode step with ``CUDA_DECODE_OPTIONS``), and on CPU to
        inductor with ``CPU_INDUCTOR_OPTIONS`` (and ``CPU_DECODE_OPTIONS`` for the decode step).
        ``options``: inductor settings instead (not with ``mode``), e.g. ``{"freezing": True}``,
        which folds the weights into the compiled steps at their first call: after editing
        weights in place, call ``compile()`` again. The prefill (the prompt) is compiled with dynamic lengths, so a
        new prompt length does not recompile (a new batch size does); pass ``prefill=False`` to leave it eager.
        ``backend`` goes to torch.compile (tests pass a counting backend). The first call of
        each pays the compile time (seconds to minutes); greedy tokens are the eager ones, except
        that int4 layers on torch's kernel multiply a compiled prompt pass in bfloat16, which can
        flip a near-tie (``quantization/int4.py``). Returns the model, so
        ``model = lucidlm.load().compile()`` reads naturally.
        ``model(ids)`` stays eager.
        """
        modes = ("default", "lite", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if mode is not None and mode not in modes:
            raise ConfigError(f"compile(mode={mode!r}): torch.compile modes are {', '.join(modes)} (None: "
                              f"reduce-overhead on CUDA, default on CPU).")
        if mode is not None and options is not None:
            raise ConfigError(f"compile(mode={mode!r}, options=...): torch.compile takes a mode or inductor options, "
                              f"not both; drop one.")
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"compile(options={options!r}): give a dict of inductor settings, e.g. "
                              f"{{'freezing': True}}, or {{}} for torch's defaults.")
        decode_options: dict[str, Any] = {}
        if mode is None and options is None:
            if self.device.type == "cpu":
                options, decode_options = dict(self.CPU_INDUCTOR_OPTIONS), dict(self.CPU_DECODE_OPTIONS)
            elif self.device.type == "cuda":
                decode_options = dict(self.CUDA_DECODE_OPTIONS)
        cuda_graphs = mode == "reduce-overhead" or (mode is None and self.device.type == "cuda")
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"
        # Fewer, larger matmuls where the layers allow it; float layers too on CUDA, where small
        # matmuls are launch-bound (model/fused.py).
        fuse_projections(self, float_layers=self.device.type == "cuda")
        use_cpu_loops(self)  # C loops for float32 decode attention (and eager RMSNorm) on the CPU
        self._compiled = CompiledSteps(self, mode, options, backend, prefill, cuda_graphs, decode_options)
        return self

    @property
    def compiled(self) -> bool:
        """Whether ``compile()`` has compiled the generation steps (the first generation pays for it)."""
        return self._compiled is not None

    def prefill_step(self, ids: torch.Tensor, input_pos: torch.Tensor,
                     attention_mask: Optional[torch.Tensor] = None, last_token_only: bool = True,
                     new_cache: bool = False) -> torch.Tensor:
        """Generation's prompt pass: ``Transformer.step``, compiled if ``compile()`` was called
        (``new_cache``: see ``Transformer.step``)."""
        run = self._compiled.prefill_step() if self._compiled is not None else self.step
        return run(ids, input_pos, attention_mask, None, last_token_only, None, new_cache)

    def decode_step(self, ids: torch.Tensor, input_pos: torch.Tensor,
                    attention_mask: Optional[torch.Tensor] = None, last_token_only: bool = True) -> torch.Tensor:
        """Generation's one-token step: ``Transformer.step``, compiled if ``compile()`` was called."""
        if self._compiled is None:
            return self.step(ids, input_pos, attention_mask, None, last_token_only)
        run = self._compiled.decode_step()
        if self._compiled.cuda_graphs and run is self._compiled.decode:  # (not a hooked model's eager step)
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's outputs may be reused
            # The graph writes its output into the same memory every replay: hand out a copy.
            return run(ids, input_pos, attention_mask, None, last_token_only).clone()
        return run(ids, input_pos, attention_mask, None, last_token_only)

    def setup_kv_cache(self, batch_size: int, max_seq_len: Optional[int] = None,
                       dtype: Optional[torch.dtype] = None, reserve_rows: int = 0) -> None:
        """``Transformer.setup_kv_cache``; compiled, the length is rounded up to a power of two
        (``CACHE_MIN`` at least) and the previous cache is reused when it has that size, so
        the compiled step (and its CUDA graph) stays valid (and no rows are reserved: a
        compiled batch takes no new rows)."""
        if not self.compiled:
            return super().setup_kv_cache(batch_size, max_seq_len, dtype, reserve_rows)
        self.kept_kv_cache = None  # its buffers may be the ones handed out again below
        wanted = max_seq_len or self.config.max_seq_len
        wanted = min(max(self.CACHE_MIN, 1 << (wanted - 1).bit_length()), self.config.max_seq_len)
        dtype = dtype or self.dtype
        for caches in self._kept_caches:
            cache = caches[0]
            if (cache.batch_size, cache.max_seq_len, cache.k.dtype, cache.k.device) == \
                    (batch_size, wanted, dtype, self.device):
                self.kv_caches = caches
                return
        super().setup_kv_cache(batch_size, wanted, dtype)

    def clear_kv_cache(self) -> None:
        """``Transformer.clear_kv_cache``; compiled, the last cache is kept for the next call."""
        if self.compiled and self.kv_caches is not None:
            self._kept_caches = [self.kv_caches]
        super().clear_kv_cache()

    def to(self, *args: Any, **kwargs: Any) -> "LanguageModel":
        """``nn.Module.to`` that also takes lucidlm's names, with ``lucidlm.load``'s one-line
        errors: ``model.to("bf16")``, ``model.to("cuda")`` (on a CPU-only torch: says so),
        ``model.to(device="cpu", dtype="float16")``."""
        args = tuple(_device_or_dtype(a) for a in args)
        if isinstance(kwargs.get("device"), (str, torch.device)):
            kwargs["device"] = resolve_device(kwargs["device"])
        if isinstance(kwargs.get("dtype"), (str, torch.dtype)):
            kwargs["dtype"] = resolve_dtype(kwargs["dtype"])
        return super().to(*args, **kwargs)

    # ------------------------------------------------------------------ forward on text
    def forward(self, ids: Union[torch.Tensor, Sequence[int], str, Sequence[str], None] = None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        """Logits (B, T, vocab). ``ids``: token ids (B, T) or (T,), or text: ``model("Hello")``
        encodes with the model's tokenizer (like ``to_tokens``); a list of texts is left-padded
        with an attention mask, so position -1 of every row is that text's last token.
        The other arguments are ``Transformer.forward``'s. transformers' ``input_ids=`` is taken
        for ``ids``; its ``labels=`` is refused (the loss is ``next_token_loss(logits, ids)``)."""
        ids = _hf_style_ids(ids, kwargs, "model")
        if "labels" in kwargs:
            raise InputError(
                "model(ids) returns the logits (B, T, vocab), not transformers' output with a .loss: leave "
                "labels= out and take the loss with lucidlm.inspect.cache.next_token_loss(logits, ids) "
                "(labels = the ids themselves, shifted inside it).")
        unknown = sorted(set(kwargs) - set(keyword_options(Transformer.forward)))
        if unknown:
            raise InputError(unknown_keyword_message("model", unknown, keyword_options(Transformer.forward)))
        texts = [ids] if isinstance(ids, str) else list(ids) if _is_text_batch(ids) else None
        if texts is not None:
            if len(texts) > 1 and kwargs.get("attention_mask") is None:
                ids, kwargs["attention_mask"] = to_tokens(self, texts, padding_side="left",
                                                          return_attention_mask=True)
            else:
                ids = to_tokens(self, texts)
        return super().forward(ids, *args, **kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: Optional[Prompts] = None, *, max_new_tokens: int = 64, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
                 repetition_penalty: Optional[float] = None, typical_p: Optional[float] = None,
                 epsilon_cutoff: Optional[float] = None, eta_cutoff: Optional[float] = None,
                 no_repeat_ngram_size: Optional[int] = None, suppress_tokens: Optional[Sequence[int]] = None,
                 bad_words_ids: Optional[Sequence[Sequence[int]]] = None, sequence_bias: Optional[SequenceBias] = None,
                 logit_bias: Optional[LogitBias] = None, presence_penalty: Optional[float] = None,
                 frequency_penalty: Optional[float] = None,
                 seed: Optional[int] = None, stop: Optional[Union[str, Sequence[str]]] = None,
                 stop_on_eos: bool = True, num_beams: int = 1, length_penalty: float = 1.0,
                 min_new_tokens: int = 0, context_overflow: str = "stop", logprobs: Union[bool, int, None] = None,
                 reuse_cache: bool = False, chat: bool = False, draft: Optional[Union[str, Transformer]] = None,
                 draft_tokens: Optional[int] = None,
                 **options: Any) -> Union[GenerationResult, list[GenerationResult]]:
        """Continue ``prompt`` and return the new ids, their text and why it stopped.

        Args:
            prompt: text, a list of token ids or a 1-D tensor -> one ``GenerationResult``;
                a batch (a list of texts, a list of id lists, a (B, T) tensor) -> a list of B
                results, generated together (left-padded, one KV cache).
            max_new_tokens: the most tokens to add (fewer at EOS, a stop string or the context end).
            temperature: 0 is greedy; None takes the model's default (``model.generation_defaults``,
                e.g. SmolLM2: 0.2 with top_p 0.5), else 1. None does the same for top_k, top_p,
                min_p, repetition_penalty, typical_p, epsilon_cutoff and eta_cutoff, whose
                fallback is off.
            top_k, top_p, min_p: keep the k likeliest tokens / the smallest set with mass >= p /
                tokens at least min_p times as likely as the top one (0, 1 and 0 switch them off;
                top_k=1 is greedy).
            repetition_penalty: > 1 makes tokens already in the text less likely (HF's CTRL penalty).
            typical_p: keep the tokens whose surprisal is closest to the entropy, as few as reach
                mass typical_p (locally typical sampling; 1 switches it off).
            epsilon_cutoff, eta_cutoff: drop tokens less likely than epsilon_cutoff / than
                min(eta_cutoff, sqrt(eta_cutoff) * exp(-entropy)) (Hewitt et al. 2022; 0 = off).
            no_repeat_ngram_size: n > 0 bans every token that would repeat an n-gram of the prompt
                or output (transformers' no_repeat_ngram_size; beam search uses it too).
            suppress_tokens: token ids never generated.
            bad_words_ids: token id sequences never generated (a longer one is banned at its
                last token once the rest is there; transformers' bad_words_ids).
            sequence_bias: [[ids, bias], ...] (or {(ids): bias}): adds bias to the last token's
                logit where the rest of ids is there (transformers' sequence_bias; -inf bans).
            logit_bias: {token_id: bias} added to those tokens' logits (OpenAI's and llama.cpp's;
                -100 or -inf bans, +100 all but forces).
            presence_penalty, frequency_penalty: OpenAI's: logit[j] -= frequency_penalty *
                count[j] + presence_penalty * (count[j] > 0), counting the generated tokens.
            seed: makes sampling reproducible without touching torch's global RNG.
            stop: text(s) that end generation; the text stops just before them.
            stop_on_eos: stop at the tokenizer's end-of-sequence token(s).
            num_beams, length_penalty: beam search (one prompt at a time).
            min_new_tokens: EOS cannot end generation before this many new tokens.
            context_overflow: "stop" at the context's end, or "crop": go on from the last
                max_seq_len tokens (one prompt, no beams).
            logprobs: True fills ``result.logprobs`` (each new token's log-prob under the
                distribution it was drawn from); N >= 1 also ``result.top_logprobs``.
            reuse_cache: keep the KV cache after generating, and start from the kept one when
                the prompt begins with its ids (a chat's next turn; one prompt).
            chat: wrap a text prompt as a user message in the model's chat template.
            draft, draft_tokens: speculative decoding (one prompt): ``"prompt"`` (prompt lookup)
                or a cheaper model with the same vocabulary drafts ``draft_tokens`` tokens
                (default 5) that this model checks in one pass; same tokens, same distribution.
            **options: ``input_ids=`` (transformers' name for the prompt); other names are refused.

        >>> model.generate("What is the capital of France?", chat=True).text
        'The capital of France is Paris.'
        >>> [r.text for r in model.generate(["Once upon a time", "The sky is"], temperature=0)]
        """
        prompt = _hf_style_ids(prompt, options, "model.generate")
        return generate(self, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, typical_p=typical_p,
                        epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff,
                        no_repeat_ngram_size=no_repeat_ngram_size, suppress_tokens=suppress_tokens,
                        bad_words_ids=bad_words_ids, sequence_bias=sequence_bias,
                        logit_bias=logit_bias, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, seed=seed, stop=stop,
                        stop_on_eos=stop_on_eos, num_beams=num_beams, length_penalty=length_penalty,
                        min_new_tokens=min_new_tokens, context_overflow=context_overflow, logprobs=logprobs,
                        reuse_cache=reuse_cache, chat=chat, draft=draft, draft_tokens=draft_tokens, **options)

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 64, temperature: Optional[float] = None,
               top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
               repetition_penalty: Optional[float] = None, typical_p: Optional[float] = None,
               epsilon_cutoff: Optional[float] = None, eta_cutoff: Optional[float] = None,
               no_repeat_ngram_size: Optional[int] = None, suppress_tokens: Optional[Sequence[int]] = None,
               bad_words_ids: Optional[Sequence[Sequence[int]]] = None, sequence_bias: Optional[SequenceBias] = None,
               logit_bias: Optional[LogitBias] = None, presence_penalty: Optional[float] = None,
               frequency_penalty: Optional[float] = None,
               seed: Optional[int] = None, stop: Optional[Union[str, Sequence[str]]] = None,
               stop_on_eos: bool = True, num_beams: int = 1, length_penalty: float = 1.0,
               min_new_tokens: int = 0, context_overflow: str = "stop", logprobs: Union[bool, int, None] = None,
               reuse_cache: bool = False, chat: bool = False, steady: bool = False,
               draft: Optional[Union[str, Transformer]] = None,
               draft_tokens: Optional[int] = None, **options: Any) -> TextStream:
        """Like ``generate`` (the same options, one prompt) but yields text pieces as they are
        decoded; they join to exactly ``generate(...).text`` (never half a UTF-8 character,
        never a stop string). After the last piece, ``.result`` is the ``GenerationResult``.
        ``steady=True``: the loop reading the pieces changes nothing in the model (no hook
        attached, no layer swapped), so the decode steps may keep what they look up
        (``lucidlm.generation.stream``).

        >>> for piece in model.stream("Tell me a story", max_new_tokens=64):
        ...     print(piece, end="", flush=True)
        """
        return stream(self, prompt, steady=steady, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                      typical_p=typical_p, epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff,
                      no_repeat_ngram_size=no_repeat_ngram_size, suppress_tokens=suppress_tokens,
                        bad_words_ids=bad_words_ids, sequence_bias=sequence_bias,
                        logit_bias=logit_bias, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, seed=seed,
                      stop=stop, stop_on_eos=stop_on_eos, num_beams=num_beams, length_penalty=length_penalty,
                      min_new_tokens=min_new_tokens, context_overflow=context_overflow, logprobs=logprobs,
                      reuse_cache=reuse_cache, chat=chat, draft=draft, draft_tokens=draft_tokens, **options)

    # ------------------------------------------------------------------ inspection
    def run_with_cache(self, ids: TextOrIds, names_filter: NamesFilter = None, *,
                       device: Optional[Union[str, torch.device]] = None, remove_batch_dim: bool = False,
                       input_pos: Optional[torch.Tensor] = None, incl_bwd: bool = False,
                       metric: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                       prepend_bos: Optional[bool] = None, padding_side: str = "right",
                       **forward_kwargs: Any) -> tuple[torch.Tensor, ActivationCache]:
        """One forward pass returning (logits, cache of every hooked activation).
        ``names_filter``: a hook name, a list of names or a predicate (default: all).
        ``device``: where the cached activations go; ``remove_batch_dim``: drop the batch dim
        of a batch of 1; ``input_pos``: KV-cache slots; ``incl_bwd``: cache gradients as
        name + "_grad", of ``metric(logits)`` or the next-token loss; ``prepend_bos``,
        ``padding_side``: for text (``to_tokens``); ``**forward_kwargs``: the forward's
        arguments (``attention_mask``, ...). See ``lucidlm.inspect.run_with_cache``."""
        return run_with_cache(self, ids, names_filter, device=device, remove_batch_dim=remove_batch_dim,
                              input_pos=input_pos, incl_bwd=incl_bwd, metric=metric, prepend_bos=prepend_bos,
                              padding_side=padding_side, **forward_kwargs)

    @keywords_checked(InputError)
    def perplexity(self, text_or_ids: Union[str, Sequence[int], torch.Tensor], *, max_length: Optional[int] = None,
                   stride: Optional[int] = None, batch_size: int = 1, progress: bool = False) -> PerplexityResult:
        """Perplexity of a text (tokenized once, BOS as the tokenizer adds it) or of ids, by
        Hugging Face's sliding-window recipe: windows of ``max_length`` tokens every ``stride``
        (``lucidlm.evaluation.perplexity``, which says the defaults)."""
        return perplexity(self, text_or_ids, max_length=max_length, stride=stride, batch_size=batch_size,
                          progress=progress)

    def run_with_hooks(self, ids: TextOrIds,
                       fwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                       bwd_hooks: Sequence[tuple[Union[str, Callable[[str], bool]], HookFn]] = (),
                       *, reset_hooks_end: bool = True, prepend_bos: Optional[bool] = None,
                       padding_side: str = "right", **forward_kwargs: Any) -> torch.Tensor:
        """One forward pass with ``fn(activation, hook) -> new | None`` attached at the named
        hook points; the hooks are removed afterwards (unless ``reset_hooks_end=False``).
        ``bwd_hooks``: ``fn(grad, hook)``, run when the returned logits are backpropagated.
        ``prepend_bos``, ``padding_side``: for text (``to_tokens``); ``**forward_kwargs``: the
        forward's arguments (``attention_mask``, ...)."""
        return run_with_hooks(self, ids, fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end,
                              prepend_bos=prepend_bos, padding_side=padding_side, **forward_kwargs)

    # ------------------------------------------------------------------ analysis (TransformerLens's names)
    @keywords_checked(InputError)
    def to_tokens(self, text: Union[str, Sequence[str]], prepend_bos: Optional[bool] = None,
                  padding_side: str = "right",
                  return_attention_mask: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Text -> ids (1, T); a list of texts -> (B, T_max), padded. ``prepend_bos``: None
        keeps the tokenizer's habit, True/False forces a BOS in or out. ``padding_side``: "right"
        or "left"; ``return_attention_mask=True`` returns (ids, mask). See inspect/tokens.py."""
        return to_tokens(self, text, prepend_bos, padding_side, return_attention_mask)

    @keywords_checked(InputError)
    def to_str_tokens(self, text_or_ids: TextOrLooseIds,
                      prepend_bos: Optional[bool] = None) -> Union[list[str], list[list[str]]]:
        """Each token as its text: a list of str (a list of lists for a batch)."""
        return to_str_tokens(self, text_or_ids, prepend_bos)

    def to_string(self, ids: LooseIds) -> Union[str, list[str]]:
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
        """Hook one copy per head feeding q, k and v together: ``blocks.{i}.hook_attn_in``
        (B, T, nh, d). Needs n_kv_heads == n_heads, as TransformerLens's does (SmolLM2's grouped
        heads refuse it: use ``set_use_split_qkv_input``)."""
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


def _device_or_dtype(value: Any) -> Any:
    """A positional argument of ``to``: a dtype name or dtype, a device name or device, checked;
    anything else (a tensor) as it is."""
    if isinstance(value, torch.dtype):
        return resolve_dtype(value)
    if isinstance(value, torch.device):
        return resolve_device(value)
    if isinstance(value, str):
        return resolve_dtype(value) if value.strip().lower().removeprefix("torch.") in DTYPES else resolve_device(value)
    return value


def _hf_style_ids(ids: Any, kwargs: dict[str, Any], name: str) -> Any:
    """The ids given positionally, or as transformers' ``input_ids=`` (taken out of ``kwargs``),
    which code ported from transformers passes. None (neither given) goes on to the input
    checks, whose error names what a prompt may be."""
    if "input_ids" in kwargs:
        if ids is not None:
            raise InputError(f"{name}() got both ids and input_ids=: give the ids once.")
        ids = kwargs.pop("input_ids")
    return ids
