"""One ModelConfig for every model family, and the named presets.

A family is a choice of fields, never a subclass: GPT-2 is learned positions + LayerNorm +
GELU(tanh) + biases + tied embeddings; LLaMA is RoPE + RMSNorm + SwiGLU + grouped-query
attention; the seeds' teaching models are post-norm variants. Derived sizes (head_dim,
n_kv_heads, d_mlp) are filled in by ``__post_init__`` so the rest of the code can rely on them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lucidlm.errors import ConfigError
from lucidlm.suggest import did_you_mean
from lucidlm.validation import (MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Fields, check_allocation,
                                read_json_object)

# Where the values of the ModelConfig being built came from: ("ModelConfig", {}) for Python code;
# from_dict sets (file, {our field: the file's name for it}) while a loader builds one.
_ORIGIN: ContextVar[tuple[str, dict[str, str], str]] = ContextVar(
    "lucidlm_config_origin", default=("ModelConfig", {}, "pass valid values to ModelConfig"))

POSITION_KINDS = ("rope", "sinusoidal", "learned", "none")
ROPE_VARIANTS = ("half", "interleaved")
NORM_KINDS = ("rms", "layer", "none")
NORM_POSITIONS = ("pre", "post")
MLP_KINDS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")
INIT_SCHEMES = ("gpt2", "lecun")


@dataclass
class ModelConfig:
    # sizes
    vocab_size: int = 32000
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # None -> n_heads (MHA); 1 -> MQA; in between -> GQA
    head_dim: Optional[int] = None  # None -> d_model // n_heads
    d_mlp: Optional[int] = None  # None -> 4*d_model, or LLaMA's rounding for swiglu
    max_seq_len: int = 2048

    # positions
    positions: str = "rope"  # rope | sinusoidal | learned | none
    rope_variant: str = "half"  # half (rotate_half, HF layout) | interleaved (complex pairs, GGUF/Meta)
    rope_theta: float = 10000.0
    rope_local_theta: Optional[float] = None  # RoPE base of sliding-window layers; None -> rope_theta

    # attention pattern and scale
    # Sliding-window (local) attention: a query sees itself and the sliding_window - 1 keys
    # before it. None -> every layer attends globally. With a window, layer i is global when
    # (i + 1) % global_layer_every == 0 (Gemma 3: 5 local layers, then 1 global), or never
    # when global_layer_every is None (every layer local, like Mistral).
    sliding_window: Optional[int] = None
    global_layer_every: Optional[int] = None
    query_pre_attn_scalar: Optional[float] = None  # scores scale by this**-0.5; None -> head_dim
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Gemma 3, Qwen 3)
    final_logit_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2)

    # normalisation
    norm: str = "rms"  # rms | layer | none (seed 002's toy model has no norm at all)
    norm_eps: float = 1e-5
    norm_position: str = "pre"  # pre (GPT-2, LLaMA) | post (seed 000, seed 004's add & norm)
    # Also normalise each sub-layer's output before it joins the residual stream (Gemma 2/3's
    # post-attention and post-feedforward norms): x = x + norm_out(attn(norm_in(x))).
    post_sublayer_norm: bool = False
    final_norm: bool = True

    # feed-forward
    mlp: str = "swiglu"  # relu | gelu | gelu_tanh | swiglu | geglu (gelu_tanh-gated, Gemma)
    multiple_of: int = 256  # LLaMA rounds the swiglu hidden size up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None

    # biases and embeddings
    attn_bias: bool = False  # q/k/v projections
    attn_out_bias: Optional[bool] = None  # None -> same as attn_bias
    mlp_bias: bool = False
    norm_bias: bool = True  # LayerNorm only; RMSNorm has no bias
    tie_embeddings: bool = False
    unembed_bias: bool = False
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model) (Gemma), in their dtype

    # regularisation and initialisation
    dropout: float = 0.0  # embeddings, residual branches and attention weights
    # gpt2: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layers) (GPT-2, nanoGPT);
    # lecun: N(0, 1/fan_in) for matrices and N(0, 1/d_model) for embeddings (Flax's defaults,
    # seed 004's): tokens start on the scale of fixed sinusoidal positions instead of 50x below.
    init: str = "gpt2"

    # bookkeeping: which family this is, used in messages and exports
    name: str = "custom"

    def __post_init__(self) -> None:
        # Every field is checked for type and range before anything is built from it (a model
        # of n_layers=10**6 would hang, max_seq_len=4e9 would ask for TBs of rotary tables).
        # Refusals name where the values came from: "ModelConfig" for Python code, or the file
        # a loader read them from, under that file's own field names (from_dict(names=...)).
        source, names, fix = _ORIGIN.get()
        self._origin = (source, dict(names), fix)
        name = self._name
        check = Fields({name(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}, source,
                       ConfigError, fix=fix)

        def put(kind: str, key: str, **bounds: Any) -> None:
            setattr(self, key, getattr(check, kind)(name(key), **bounds))

        for key, valid in (("positions", POSITION_KINDS), ("rope_variant", ROPE_VARIANTS), ("norm", NORM_KINDS),
                           ("norm_position", NORM_POSITIONS), ("mlp", MLP_KINDS), ("init", INIT_SCHEMES)):
            put("str", key, choices=valid)
        put("str", "name")
        for key, high in (("vocab_size", MAX_VOCAB), ("d_model", MAX_WIDTH), ("n_layers", MAX_LAYERS),
                          ("n_heads", MAX_HEADS), ("max_seq_len", MAX_CONTEXT), ("multiple_of", MAX_WIDTH)):
            put("int", key, low=1, high=high)
        put("int", "n_kv_heads", default=None, low=1, high=MAX_HEADS)
        put("int", "head_dim", default=None, low=1, high=MAX_WIDTH)
        put("int", "d_mlp", default=None, low=1, high=MAX_WIDTH)
        put("int", "sliding_window", default=None, low=1, high=MAX_CONTEXT)
        put("int", "global_layer_every", default=None, low=1, high=MAX_LAYERS)
        put("float", "ffn_dim_multiplier", default=None, low=0.0, low_open=True, high=float(MAX_WIDTH))
        put("float", "rope_theta", low=0.0, low_open=True)
        put("float", "rope_local_theta", default=None, low=0.0, low_open=True)
        put("float", "query_pre_attn_scalar", default=None, low=0.0, low_open=True)
        put("float", "final_logit_softcap", default=None, low=0.0, low_open=True)
        put("float", "norm_eps", low=0.0, high=1.0)
        put("float", "dropout", low=0.0, high=1.0, high_open=True)
        for key in ("qk_norm", "post_sublayer_norm", "final_norm", "attn_bias", "mlp_bias", "norm_bias",
                    "tie_embeddings", "unembed_bias", "scale_embeddings"):
            put("bool", key)
        put("bool", "attn_out_bias", default=self.attn_bias)

        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads > self.n_heads:
            check.fail(f"{name('n_kv_heads')}={self.n_kv_heads} is more than {name('n_heads')}={self.n_heads}: each "
                       f"key/value head serves one or more query heads; pick {name('n_kv_heads')} from "
                       f"{_divisors(self.n_heads)}")
        if self.n_heads % self.n_kv_heads != 0:
            check.fail(f"{name('n_heads')}={self.n_heads} is not divisible by {name('n_kv_heads')}={self.n_kv_heads}: "
                       f"each key/value head must serve the same number of query heads; pick "
                       f"{name('n_kv_heads')} from {_divisors(self.n_heads)}")
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                check.fail(f"{name('d_model')}={self.d_model} is not divisible by {name('n_heads')}={self.n_heads}; "
                           f"set {name('head_dim')} explicitly or choose {name('n_heads')} from "
                           f"{_divisors(self.d_model)[:24]}")
            self.head_dim = self.d_model // self.n_heads
        if self.n_heads * self.head_dim > MAX_WIDTH:
            check.fail(f"{name('n_heads')}={self.n_heads} heads of {name('head_dim')}={self.head_dim} make "
                       f"{self.n_heads * self.head_dim} attention dimensions, more than {MAX_WIDTH}")
        if self.positions == "rope" and self.head_dim % 2 != 0:
            check.fail(f"{name('head_dim')}={self.head_dim} is odd, but RoPE rotates pairs of dimensions; "
                       f"use an even head_dim or positions='learned'/'sinusoidal'/'none'")
        if self.positions == "sinusoidal" and self.d_model % 2 != 0:
            check.fail(f"sinusoidal positions need an even {name('d_model')}, got {self.d_model}")
        if self.d_mlp is None:
            self.d_mlp = llama_hidden_dim(self.d_model, self.multiple_of, self.ffn_dim_multiplier) \
                if self.mlp in ("swiglu", "geglu") else 4 * self.d_model
            if self.d_mlp > MAX_WIDTH:
                check.fail(f"the feed-forward width derived from {name('d_model')}={self.d_model} is {self.d_mlp}, "
                           f"more than {MAX_WIDTH}; set {name('d_mlp')}")
        if self.global_layer_every is not None and self.sliding_window is None:
            check.fail(f"global_layer_every={self.global_layer_every} needs a sliding_window for the "
                       f"other layers; set sliding_window or leave global_layer_every None")
        if self.post_sublayer_norm and self.norm_position != "pre":
            check.fail("post_sublayer_norm adds norms around pre-norm sub-layers; it needs norm_position='pre'")
        if self.norm == "none" and (self.qk_norm or self.post_sublayer_norm):
            check.fail("norm='none' has no norm to use for qk_norm / post_sublayer_norm; pick norm='rms'")

    def _name(self, key: str) -> str:
        """``key`` as the source of this config spells it (config.json's num_hidden_layers)."""
        return self._origin[1].get(key, key)

    # -- memory: what building a model of this config allocates --
    def parameter_count(self) -> int:
        """Numbers in the weights of a model of this config (each shared matrix once)."""
        d, gated = self.d_model, self.mlp in ("swiglu", "geglu")
        attn = d * 2 * (self.q_dim + self.kv_dim)
        if self.attn_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.attn_out_bias:
            attn += d
        mlp = (3 if gated else 2) * d * self.d_mlp + ((2 if gated else 1) * self.d_mlp + d if self.mlp_bias else 0)
        norm_size = 0 if self.norm == "none" else d * (2 if self.norm == "layer" and self.norm_bias else 1)
        norms = norm_size * (4 if self.post_sublayer_norm else 2) + (2 * self.head_dim if self.qk_norm else 0)
        total = self.n_layers * (attn + mlp + norms) + self.vocab_size * d * (1 if self.tie_embeddings else 2)
        total += (self.vocab_size if self.unembed_bias else 0) + (norm_size if self.final_norm else 0)
        return total + (self.max_seq_len * d if self.positions == "learned" else 0)

    def table_bytes(self) -> int:
        """Bytes of the position tables sized from max_seq_len: RoPE's cos and sin (float64,
        a second pair for a local base) or the sinusoidal table (float32)."""
        if self.positions == "rope":
            tables = 2 if self.rope_local_theta not in (None, self.rope_theta) else 1
            return tables * 2 * self.max_seq_len * (self.head_dim // 2) * 8
        return self.max_seq_len * self.d_model * 4 if self.positions == "sinusoidal" else 0

    def check_memory(self, bytes_per_parameter: int = 4) -> None:
        """Refuse, naming the sizes, a config whose model would not fit in this machine's memory,
        before anything is allocated."""
        source, name, fix = self._origin[0], self._name, self._origin[2]
        sizes = ", ".join(f"{name(k)}={getattr(self, k)}" for k in ("n_layers", "d_model", "d_mlp", "vocab_size",
                                                                     "max_seq_len"))
        need = self.parameter_count() * bytes_per_parameter + self.table_bytes()
        check_allocation(need, f"{source}: a model with {sizes}", ConfigError, fix)

    # -- derived sizes, for readers and for parameter counting --
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_is_local(self, index: int) -> bool:
        """Whether layer ``index`` uses sliding-window attention (and rope_local_theta)."""
        if self.sliding_window is None:
            return False
        return self.global_layer_every is None or (index + 1) % self.global_layer_every != 0

    # -- (de)serialisation --
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "ModelConfig",
                  names: Optional[dict[str, str]] = None, fix: str = "") -> "ModelConfig":
        """A config from plain data; ``source`` and ``names`` (our field -> the source's own
        name for it) make every refusal name the file and the field as the file spells them,
        and ``fix`` says what to do about it."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of config fields, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown config field(s) {unknown}; valid fields are: {', '.join(sorted(known))}"
                f"{did_you_mean(unknown[0], known) or '.'}"
            )
        token = _ORIGIN.set((str(source), names or {}, fix or "pass valid values to ModelConfig"))
        try:
            return cls(**data)
        finally:
            _ORIGIN.reset(token)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        fix = "fix or regenerate it (lucidlm writes it beside the model's weights)"
        fields = read_json_object(path, ConfigError, "model config", fix=fix)
        return cls.from_dict(dict(fields.data), source=str(path), fix=fix)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed; derived fields are recomputed unless given."""
        data = self.to_dict()
        data.update(changes)
        return ModelConfig.from_dict(data)


def llama_hidden_dim(d_model: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4*d (so the 3-matrix MLP costs what a 2-matrix one would),
    optionally scaled, then rounded up to a multiple of ``multiple_of`` for hardware efficiency."""
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------------------------
# Presets: plain data, looked up by name.
# ---------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    # OpenAI GPT-2 small (124M): learned positions, pre-LayerNorm, GELU(tanh), biases, tied.
    "gpt2": dict(
        name="gpt2", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024,
        positions="learned", norm="layer", norm_eps=1e-5, mlp="gelu_tanh", attn_bias=True,
        mlp_bias=True, tie_embeddings=True,
    ),
    # A LLaMA-3-style architecture at a size that trains on a laptop: RoPE (theta 500k),
    # RMSNorm, SwiGLU with multiple_of rounding, grouped-query attention, untied head.
    "llama": dict(
        name="llama", vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
        max_seq_len=2048, positions="rope", rope_theta=500000.0, norm="rms", norm_eps=1e-5,
        mlp="swiglu", multiple_of=256,
    ),
    # Meta's Llama 3 8B shape (for reading; instantiating it needs ~32 GB in fp32).
    "llama3-8b": dict(
        name="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        max_seq_len=8192, positions="rope", rope_theta=500000.0, norm="rms", norm_eps=1e-5,
        mlp="swiglu", multiple_of=1024, ffn_dim_multiplier=1.3,
    ),
    # SmolLM2-135M: the embedded pretrained model (LLaMA family, GQA 9/3, tied embeddings).
    "smollm2-135m": dict(
        name="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, d_mlp=1536, max_seq_len=8192, positions="rope", rope_theta=100000.0,
        norm="rms", norm_eps=1e-5, mlp="swiglu", tie_embeddings=True,
    ),
    # Gemma 3 270M (Google): 5 sliding-window layers (512 tokens, RoPE base 10k) then one
    # global layer (base 1M); RMSNorm before and after each sub-layer and on each q/k head;
    # GeGLU; embeddings scaled by sqrt(d_model); one key/value head; tied embeddings.
    "gemma3-270m": dict(
        name="gemma3", vocab_size=262144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
        d_mlp=2048, max_seq_len=32768, positions="rope", rope_theta=1000000.0, rope_local_theta=10000.0,
        sliding_window=512, global_layer_every=6, query_pre_attn_scalar=256.0, qk_norm=True,
        post_sublayer_norm=True, norm="rms", norm_eps=1e-6, mlp="geglu", tie_embeddings=True,
        scale_embeddings=True,
    ),
    # Seed 000's NumPy practice model: split RoPE, post-RMSNorm without eps or learned
    # scale in the reference, ReLU MLP 4x wide, no biases; one layer; logits through the
    # (tied) embedding matrix.
    "seed000": dict(
        name="seed000", vocab_size=32768, d_model=512, n_layers=1, n_heads=4, head_dim=64,
        d_mlp=2048, max_seq_len=256, positions="rope", rope_variant="half", rope_theta=10000.0,
        norm="rms", norm_eps=0.0, norm_position="post", final_norm=False, mlp="relu",
        tie_embeddings=True,
    ),
    # nanoGPT's documented CPU Shakespeare run (character level).
    "shakespeare-char": dict(
        name="gpt", vocab_size=65, d_model=128, n_layers=4, n_heads=4, max_seq_len=64,
        positions="learned", norm="layer", norm_bias=False, mlp="gelu", tie_embeddings=True,
        dropout=0.0,
    ),
    # Seed 004's word-level Shakespeare model: sinusoidal positions, add & norm (post-norm
    # LayerNorm), GELU MLP widened 2x, biases everywhere, separate prediction layer.
    "seed004-words": dict(
        name="seed004", vocab_size=25670, d_model=128, n_layers=1, n_heads=4, d_mlp=256,
        max_seq_len=64, positions="sinusoidal", norm="layer", norm_eps=1e-6, norm_position="post",
        final_norm=False, mlp="gelu_tanh", attn_bias=True, mlp_bias=True, unembed_bias=True, init="lecun",
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset as a ModelConfig, with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(sorted(PRESETS))}"
                          f"{did_you_mean(name, PRESETS) or '.'}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides}, source=f"preset {name!r}")
