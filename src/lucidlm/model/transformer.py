"""The Transformer: one module for every family, configured by a ModelConfig.

    ids (B, T) -> embed (+ positions) -> [Block x n_layers] -> ln_final -> unembed -> logits (B, T, V)

Read this file top to bottom with ``block.py`` beside it and you have the whole model.
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lucidlm.config import ModelConfig
from lucidlm.errors import InputError
from lucidlm.validation import check_allocation, check_int
from lucidlm.validation_memory import allocation_fits
from lucidlm.model.block import Block
from lucidlm.model.checkpointing import checkpointed_block
from lucidlm.model.decode_block import nothing_listens, one_call_stack
from lucidlm.model.hooks import HookPoint
from lucidlm.model.input_checks import check_ids, check_length, check_positions, check_slots
from lucidlm.model.kv_cache import KVCache
from lucidlm.model.masks import attention_mask_for, fit_key_mask, positions_of, sliding_window_mask
from lucidlm.model.norms import make_norm
from lucidlm.model.positions import RotaryEmbedding, position_embedding
from lucidlm.model.traced_once import run_block

if TYPE_CHECKING:  # for the hints only: the model layer imports nothing above config when it runs
    from lucidlm.tokenizers.base import Tokenizer


# Set while Transformer.empty builds a model whose weights a loader will overwrite.
_SKIP_INIT: ContextVar[bool] = ContextVar("lucidlm_skip_init", default=False)


class _NoRandomInit(TorchFunctionMode):
    """Inside ``Transformer.skeleton``: torch's layers initialise their own weights in their
    constructors (``nn.Linear`` draws kaiming-uniform values); on the meta device that is no
    data but still a decomposed op per tensor, 0.1 s for SmolLM2's 211 layers. Every weight
    of a skeleton is overwritten, so those in-place draws return their tensor untouched.
    ``torch.nn.init``'s functions are caught too, not only the tensor methods they call: a mode
    is off while it runs the function it was handed, so ``nn.Linear``'s ``kaiming_uniform_``
    passed through would reach its ``uniform_`` unseen (~10 ms of SmolLM2's skeleton)."""

    DRAWS = frozenset({torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.zero_, torch.Tensor.fill_,
                       nn.init.kaiming_uniform_, nn.init.kaiming_normal_, nn.init.xavier_uniform_,
                       nn.init.xavier_normal_, nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_,
                       nn.init.zeros_, nn.init.ones_, nn.init.constant_})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self.DRAWS:
            target = args[0] if args else kwargs.get("tensor")  # nn.init hands its tensor by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


class Transformer(nn.Module):
    """The network and the state it owns: one rotary table for all layers, the KV caches
    (``setup_kv_cache`` / ``clear_kv_cache``) and an optional prefix module (prefix tuning).
    Generation, inspection and adapters live above it (``lucidlm.LanguageModel``)."""

    # Recompute each block in the backward pass instead of keeping its activations
    # (model/checkpointing.py); read only by a training forward with autograd on and no cache.
    # A class default, so models pickled before the switch existed load.
    gradient_checkpointing = False

    def __init__(self, config: ModelConfig, tokenizer: Optional[Tokenizer] = None) -> None:
        super().__init__()
        self.config = cfg = config
        self.tokenizer = tokenizer  # set by loaders that know one; not part of the module tree

        if torch.get_default_device().type != "meta":  # refuse a size that cannot fit before allocating it
            cfg.check_memory()
        skip_init = _SKIP_INIT.get()  # Transformer.empty: every weight is about to be overwritten
        # (an init on the meta device is not free: its normal_ imports torch._dynamo, ~1.5 s)
        self.embed = (nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
                      if skip_init else nn.Embedding(cfg.vocab_size, cfg.d_model))
        self.pos_embed = position_embedding(cfg.positions, cfg.max_seq_len, cfg.d_model)  # or None (positions.py)
        # One rotation table for every layer, looked up once per forward pass; sliding-window
        # layers may have their own RoPE base (Gemma 3: 10k local, 1M global), hence a second,
        # which is never scaled (Gemma 3 scales only its global layers' frequencies).
        self.rotary = (RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_variant,
                                       cfg.rope_scaling) if cfg.positions == "rope" else None)
        self.rotary_local = (RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta, cfg.rope_variant)
                             if self.rotary is not None and cfg.has_local_rope_table else None)
        self.embed_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_final = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias) if cfg.final_norm else None
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.unembed_bias)
        if cfg.tie_embeddings:
            self.unembed.weight = self.embed.weight  # one matrix reads tokens in and out

        # State that is not weights: one KVCache per layer while generating (setup_kv_cache),
        # and a prefix module, called with no argument, that returns the prefix keys/values
        # of every layer, (n_layers, 2, n_kv, P, hd) or None (peft.add_prefix installs one).
        self.kv_caches: Optional[nn.ModuleList] = None
        # A finished generation's cache, kept for the next prompt that starts with its ids
        # (generation/prompt_cache.py); any new set-up or clear forgets it
        self.kept_kv_cache: Any = None
        self.register_module("prefix_encoder", None)
        self._steady: Optional[dict] = None  # inside steady_decode(): what its decode steps keep

        self.hook_embed = HookPoint()  # (B, T, d)
        if self.pos_embed is not None:
            self.hook_pos_embed = HookPoint()  # (B, T, d)

        if not skip_init:
            self.reset_parameters()
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name

    @classmethod
    def empty(cls, config: ModelConfig, device: str | torch.device = "cpu",
              tokenizer: Optional[Tokenizer] = None) -> "Transformer":
        """A model with uninitialised parameters, for loaders that overwrite every weight:
        skipping the random init makes loading a pretrained model much faster."""
        if torch.device(device).type != "meta":
            config.check_memory()  # refused before materialize allocates anything
        return cls.skeleton(config, tokenizer).materialize(device)

    @classmethod
    def skeleton(cls, config: ModelConfig, tokenizer: Optional[Tokenizer] = None) -> "Transformer":
        """The module tree on the meta device: names and shapes, no storage, no init. A
        streaming loader puts each weight in place (or swaps in a quantized module), then
        ``materialize`` allocates whatever is left (check ``config.check_memory`` first)."""
        token = _SKIP_INIT.set(True)
        try:
            with torch.device("meta"), _NoRandomInit():
                return cls(config, tokenizer)
        finally:
            _SKIP_INIT.reset(token)

    def materialize(self, device: str | torch.device = "cpu") -> "Transformer":
        """Uninitialised storage on ``device`` for every parameter and buffer still on the
        meta device, and the position tables computed. One ``torch.empty`` per tensor:
        ``nn.Module.to_empty`` costs 0.5 s here, because ``empty_like`` of a meta tensor goes
        through torch's Python references, which import sympy."""
        if self.config.tie_embeddings and isinstance(self.unembed, nn.Linear) and isinstance(self.embed, nn.Embedding):
            self.unembed.weight = self.embed.weight  # one matrix, even if a loader replaced one side
        done: dict[int, torch.Tensor] = {}  # shared tensors stay shared
        for module in self.modules():
            for store in (module._parameters, module._buffers):
                for name, tensor in store.items():
                    if tensor is None or not tensor.is_meta:
                        continue
                    if id(tensor) not in done:
                        real = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                        done[id(tensor)] = (nn.Parameter(real, requires_grad=tensor.requires_grad)
                                            if isinstance(tensor, nn.Parameter) else real)
                    store[name] = done[id(tensor)]
        for module in self.modules():  # position tables (rotary, sinusoidal): computed, never loaded
            if callable(getattr(module, "reset_buffers", None)):
                module.reset_buffers()
        return self

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> tuple[list[str], list[str]]:
        """``nn.Module.load_state_dict``, which returns torch's named tuple (missing_keys,
        unexpected_keys). With ``assign=True`` on a model built on the meta device
        (torch's way to skip the random init), the position tables stayed on meta, as they are
        derived from the config and never saved, and the forward failed ("Tensor on device meta");
        a tied unembedding got a Parameter of its own. Once every parameter is real,
        ``materialize`` computes the tables and ties the matrix again."""
        loaded = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign and not any(p.is_meta for p in self.parameters()):
            self.materialize(self.device)
        return loaded

    # ------------------------------------------------------------------ parameters
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random weights as ``config.init`` says. "gpt2": N(0, 0.02) everywhere, residual
        output projections scaled down by sqrt(2 * n_layers) so the residual stream's variance
        does not grow with depth. "lecun": N(0, 1/fan_in) for matrices, N(0, 1/d_model) for
        embeddings (Flax's defaults, which seed 004's models use)."""
        lecun = self.config.init == "lecun"
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.ndim == 1:  # norm scales
                nn.init.ones_(param)
            elif lecun:
                fan_in = param.shape[1] if name.endswith("proj.weight") or name.startswith("unembed") \
                    else self.config.d_model
                nn.init.normal_(param, 0.0, 1.0 / math.sqrt(fan_in))
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, 0.0, std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(param, 0.0, std)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Parameters, a tied matrix counted once. A quantized layer (``quantization/``) counts
        the float weights its codes stand for: they are buffers, never trained, so
        ``trainable_only`` leaves them out."""
        count = sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)
        if trainable_only:
            return count
        for name, module in self.named_modules():
            stands_for = getattr(module, "float_parameter_count", None)
            tied_copy = name == "unembed" and self.config.tie_embeddings  # the embedding's codes, again
            if stands_for is not None and not tied_copy:
                count += stands_for
        return count

    def train(self, mode: bool = True) -> "Transformer":
        """``nn.Module.train``, all or nothing: where a module refuses (a quantized layer cannot be
        trained), every module keeps the mode it had. nn.Module switches children one by one, so
        the modules before the refusing one were left training, their dropout on in a model the
        caller still took for an eval one."""
        before = [(module, module.training) for module in self.modules()]
        try:
            return super().train(mode)
        except Exception:
            for module, was in before:
                module.training = was
            raise

    @property
    def device(self) -> torch.device:
        """Where the weights are (the token embedding's device)."""
        return getattr(self.embed, "device", None) or self.embed.weight.device  # quantized: no float weight

    @property
    def dtype(self) -> torch.dtype:
        """The residual stream's dtype (the token embedding's; a quantized one says what it returns)."""
        return getattr(self.embed, "dtype", None) or self.embed.weight.dtype

    # ------------------------------------------------------------------ forward
    def forward(self, ids: torch.Tensor | Sequence[int], attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, input_pos: Optional[torch.Tensor] = None,
                last_token_only: bool = False, prefix_kv: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T) (or (T,), or a list), checked first.

        attention_mask: (B, S) 1 for real tokens, 0 for padding, over key positions from
            slot 0 (without a cache S = T; with one, slots past its end count as real).
            Left padding works.
        position_ids: (B, T) positions for RoPE / position embeddings, each in
            0..max_seq_len-1 (the position tables' rows); by default counted from the first
            real token of each row, so padding does not shift positions.
        input_pos: (T,) KV-cache slots to write; uses the cache set up by ``setup_kv_cache``
            and attends over all of it. None runs without touching any cache.
        last_token_only: unembed only the last position (all generation needs): logits (B, 1, vocab).
        prefix_kv: (n_layers, 2, n_kv, P, hd) keys and values every query sees before the
            text; by default those of the installed prefix module, if any.

        The checks read the ids (and slots, positions) back once; ``step`` is the same pass without them.
        """
        ids = check_ids(ids, self.config.vocab_size, self.device)  # (B, T) long, ids in range
        B, T = ids.shape
        if input_pos is not None and self.kv_caches is None:
            raise InputError("input_pos names KV-cache slots, but this model has no KV cache: call "
                             "model.setup_kv_cache(batch_size, max_seq_len) first, or leave input_pos out.")
        if input_pos is not None:
            input_pos = check_slots(input_pos, T, self.device, self._context_limit(), self.config.max_seq_len)
            cache_rows = self.kv_caches[0].batch_size
            if B != cache_rows:
                raise InputError(f"{B} rows of ids, but the KV cache was set up for {cache_rows}: call "
                                 f"model.setup_kv_cache({B}, ...) first, or leave input_pos out.")
        else:  # a pass without input_pos touches no cache: only the context window limits it
            check_length(T, self.config.max_seq_len, self.config.max_seq_len)
        if attention_mask is not None and (attention_mask.ndim != 2 or attention_mask.shape[0] != B):
            raise InputError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected ({B}, key positions).")
        if position_ids is not None:
            position_ids = check_positions(position_ids, B, T, self.config.max_seq_len, self.device)  # (B, T)
        return self.step(ids, input_pos, attention_mask, position_ids, last_token_only, prefix_kv)

    def step(self, ids: torch.Tensor, input_pos: Optional[torch.Tensor] = None,
             attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
             last_token_only: bool = False, prefix_kv: Optional[torch.Tensor] = None,
             new_cache: bool = False) -> torch.Tensor:
        """``forward`` without the input checks: ids (B, T) long and in range, input_pos (T,)
        inside the cache. Shapes depend only on the arguments' shapes and nothing is read back
        to the host, so a decode step is the same graph every time: generation runs this,
        and this is what ``torch.compile`` compiles.

        new_cache: the caller promises that input_pos is 0..T-1 and the cache holds nothing
        else (a prompt's prefill). The queries then attend over those T slots only, not the
        whole cache: a compiled cache is rounded up to a power of two, and a 513-token prompt
        would otherwise score 1024 keys per query (twice the attention time)."""
        B, T = ids.shape
        cached = input_pos is not None and self.kv_caches is not None
        key_len = self.kv_caches[0].max_seq_len if cached and not new_cache else T
        query_slots = input_pos if cached else torch.arange(T, device=ids.device)  # (T,)
        keys_real = fit_key_mask(attention_mask, key_len)  # (B, S) bool, or None
        if position_ids is None:
            position_ids = positions_of(query_slots, keys_real, B)  # (B, T)
        # Keys that are exactly the queries, with no padding: SDPA's built-in causal mask is
        # exact and fastest. Otherwise the mask hides unwritten slots and padding.
        keys_are_queries = not cached or new_cache
        mask = None if keys_are_queries and keys_real is None else attention_mask_for(query_slots, key_len, keys_real)

        x = self.embed(ids)  # (B, T, d)
        if self.config.scale_embeddings:  # Gemma: sqrt(d_model), rounded to the activations' dtype
            x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype)
        # Hooked after the scale, as TransformerLens (which folds it into W_E): hook_embed is
        # what the stream receives, so the residual decomposition adds up to resid_pre.
        x = self.hook_embed(x)
        if self.pos_embed is not None:
            x = x + self.hook_pos_embed(self.pos_embed(position_ids).to(x.dtype))
        x = self.embed_dropout(x)
        rope = self.rotary.cos_sin(position_ids, x.dtype) if self.rotary is not None else None
        rope_local = self.rotary_local.cos_sin(position_ids, x.dtype) if self.rotary_local is not None else rope
        local_mask = sliding_window_mask(mask, query_slots, key_len, self.config.sliding_window) \
            if self.config.sliding_window is not None else mask
        if prefix_kv is None and self.prefix_encoder is not None:
            prefix_kv = self.prefix_encoder()
        caches = self.kv_caches if cached else [None] * len(self.blocks)
        # An eager decode step on lucidlm's CPU kernels: every block in one C++ call, where that
        # computes exactly what the loop below does (decode_block.py); else None
        stacked = one_call_stack(self.blocks, Block, x, rope, rope_local, mask, local_mask, caches, input_pos,
                                 self._steady) if cached and not new_cache and prefix_kv is None else None
        if stacked is not None:
            x = stacked
        else:
            # run_block: block(...), traced once for all the blocks alike when compiled (traced_once.py)
            checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled() and not cached
            run = checkpointed_block if checkpointing else run_block
            for i, (block, cache) in enumerate(zip(self.blocks, caches)):
                x = run(block, x, rope_local if block.local else rope, local_mask if block.local else mask,
                        cache, input_pos if cached else None, prefix_kv[i] if prefix_kv is not None else None,
                        T if cached and new_cache else None)  # kv_len: None attends over the whole cache
        if last_token_only:
            x = x[:, -1:]
        if self.ln_final is not None:
            x = self.ln_final(x)
        logits = self.unembed(x)  # (B, T, vocab)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ------------------------------------------------------------------ gradient checkpointing
    def gradient_checkpointing_enable(self) -> None:
        """Training forwards keep only each block's input and recompute the block in the
        backward pass: less memory, about one more forward pass of time, the same gradients
        (transformers' name; ``model.gradient_checkpointing = True`` is the same switch)."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    # ------------------------------------------------------------------ input checks (model/input_checks.py)
    def _context_limit(self) -> int:
        """The most tokens a pass can hold: the context window, or the KV cache if shorter."""
        limit = self.config.max_seq_len
        return min(limit, self.kv_caches[0].max_seq_len) if self.kv_caches is not None else limit

    # ------------------------------------------------------------------ KV cache
    def setup_kv_cache(self, batch_size: int, max_seq_len: Optional[int] = None,
                       dtype: Optional[torch.dtype] = None, reserve_rows: int = 0) -> None:
        """Preallocate a static cache for every layer (one size for all, one cache each).
        ``reserve_rows``: room for rows added later (``add_kv_rows``), mapped but not written
        until they are added; none where even the address space could not hold them."""
        self.kept_kv_cache = None
        check_int(batch_size, "batch_size", InputError, low=1)
        if max_seq_len is not None:
            check_int(max_seq_len, "max_seq_len", InputError, low=0)
        max_seq_len = min(max_seq_len or self.config.max_seq_len, self.config.max_seq_len)
        dtype = dtype or self.dtype
        c = self.config
        row_bytes = self._kv_row_bytes(max_seq_len, dtype)
        check_allocation(batch_size * row_bytes, f"a KV cache for {batch_size} sequence(s) of {max_seq_len} tokens",
                         InputError, "use a smaller batch or max_seq_len")
        if not allocation_fits(reserve_rows * row_bytes):
            reserve_rows = 0  # rows added past this cache's are new buffers (add_kv_rows checks them)
        self.kv_caches = nn.ModuleList(
            KVCache(batch_size, max_seq_len, c.n_kv_heads, c.head_dim, dtype, self.device, reserve_rows)
            for _ in self.blocks)

    def _kv_row_bytes(self, slots: int, dtype: torch.dtype) -> int:
        """Bytes of one row of every layer's cache: keys and values for ``slots`` tokens."""
        c = self.config
        return 2 * len(self.blocks) * c.n_kv_heads * slots * c.head_dim * dtype.itemsize

    def clear_kv_cache(self) -> None:
        """Drop the cache, and the one kept for prompt caching (``reuse_cache``)."""
        self.kv_caches = None
        self.kept_kv_cache = None

    @contextlib.contextmanager
    def steady_decode(self) -> Iterator[None]:
        """For a run of decode steps between which nothing changes the model: generation's own
        loops where no caller code runs between tokens (``generate``, ``generate_batch``). If
        nothing listens when it starts (no hook function, no torch hook: so no code but the
        model's runs in its passes), the one-call decode step (``model/decode_block.py``) looks
        its operands up at the first step and keeps them for the others, instead of checking
        every block again at every step. Leaving it forgets them.

        Runs do not nest: each generation takes the model's one KV cache over from the last, so
        leaving forgets the kept operands if they are still this run's, and never brings an
        earlier run's back (two streams closed out of order left the first one's dict on the
        model, and every later decode step, a plain stream's too, kept its operands and missed a
        hook attached between tokens)."""
        mine = self._steady = {} if nothing_listens(self) else None
        try:
            yield
        finally:
            if self._steady is mine:
                self._steady = None

    def place_kv_row(self, row: int, length: int, start: int) -> None:
        """Move the first ``length`` slots of cache row 0 to slots ``start``.. of row ``row``, in
        every layer (``KVCache.place``)."""
        if self.kv_caches is not None:
            for cache in self.kv_caches:
                cache.place(row, length, start)

    def add_kv_rows(self, count: int, written: int) -> None:
        """``count`` more rows in every layer's cache, the old rows' first ``written`` slots kept
        (``KVCache.add_rows``). What a steady run kept of the caches (``steady_decode``) is
        forgotten: it pointed at the old buffers."""
        if self.kv_caches is None:
            raise InputError("add_kv_rows(): the model has no KV cache; set one up first (setup_kv_cache)")
        rows, slots = self.kv_caches[0].batch_size + count, self.kv_caches[0].max_seq_len
        check_allocation(rows * self._kv_row_bytes(slots, self.kv_caches[0].k.dtype),
                         f"a KV cache for {rows} sequence(s) of {slots} tokens", InputError,
                         "use fewer rows or a smaller max_seq_len")
        for cache in self.kv_caches:
            cache.add_rows(count, written)
        if self._steady is not None:
            self._steady.clear()

    def keep_kv_rows(self, count: int) -> None:
        """Keep the first ``count`` rows of every layer's cache (``KVCache.keep_rows``): a batch
        whose last rows have ended decodes fewer rows. What a steady run kept is forgotten."""
        for cache in self.kv_caches or ():
            cache.keep_rows(count)
        if self._steady is not None:
            self._steady.clear()

    def shift_kv_slots(self, shift: int, end: int) -> None:
        """Move every row's slots ``shift``..``end``-1 to the cache's start, in every layer
        (``KVCache.shift_slots``); in place, so a steady run's kept operands still hold."""
        for cache in self.kv_caches or ():
            cache.shift_slots(shift, end)

    def copy_kv_slots(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's copy of cache row ``row``'s first ``length`` slots (``KVCache.copy_slots``)."""
        return [cache.copy_slots(row, length) for cache in self.kv_caches or ()]

    def write_kv_slots(self, row: int, saved: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put ``copy_kv_slots``' copies back into row ``row`` of every layer's cache."""
        for cache, values in zip(self.kv_caches or (), saved, strict=True):
            cache.write_slots(row, values)

    def reorder_kv_cache(self, rows: torch.Tensor, length: Optional[int] = None) -> None:
        """Keep cache rows ``rows`` (B,), in that order (beam search reshuffles hypotheses);
        ``length``: only the first slots hold anything yet (None: all may)."""
        if self.kv_caches is not None:
            for cache in self.kv_caches:
                cache.reorder(rows, length)

    # ------------------------------------------------------------------ hooks
    def hook_points(self) -> dict[str, HookPoint]:
        """Every hook point, by its stable name (``blocks.0.attn.hook_pattern``)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, HookPoint)}

    def reset_hooks(self) -> None:
        """Remove every hook function from every hook point (TransformerLens's reset_hooks)."""
        for hook in self.hook_points().values():
            hook.remove_hooks()
