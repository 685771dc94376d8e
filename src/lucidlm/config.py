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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lucidlm.errors import ConfigError
from lucidlm.suggest import did_you_mean

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
        self._check_choice("positions", POSITION_KINDS)
        self._check_choice("rope_variant", ROPE_VARIANTS)
        self._check_choice("norm", NORM_KINDS)
        self._check_choice("norm_position", NORM_POSITIONS)
        self._check_choice("mlp", MLP_KINDS)
        self._check_choice("init", INIT_SCHEMES)
        for size in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            self._check_positive_int(size)

        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self._check_positive_int("n_kv_heads")
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                f"each key/value head must serve the same number of query heads. "
                f"Pick n_kv_heads from {_divisors(self.n_heads)}."
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    f"set head_dim explicitly or choose n_heads from {_divisors(self.d_model)}."
                )
            self.head_dim = self.d_model // self.n_heads
        self._check_positive_int("head_dim")
        if self.positions == "rope" and self.head_dim % 2 != 0:
            raise ConfigError(
                f"head_dim={self.head_dim} is odd, but RoPE rotates pairs of dimensions; "
                f"use an even head_dim or positions='learned'/'sinusoidal'/'none'."
            )
        if self.positions == "sinusoidal" and self.d_model % 2 != 0:
            raise ConfigError(f"sinusoidal positions need an even d_model, got {self.d_model}.")
        if self.d_mlp is None:
            self.d_mlp = llama_hidden_dim(self.d_model, self.multiple_of, self.ffn_dim_multiplier) \
                if self.mlp in ("swiglu", "geglu") else 4 * self.d_model
        self._check_positive_int("d_mlp")
        if self.attn_out_bias is None:
            self.attn_out_bias = self.attn_bias
        if not (0.0 <= self.dropout < 1.0):
            raise ConfigError(f"dropout={self.dropout} must be in [0, 1).")
        if not (self.norm_eps >= 0.0):
            raise ConfigError(f"norm_eps={self.norm_eps} must be >= 0.")
        if not (self.rope_theta > 0):
            raise ConfigError(f"rope_theta={self.rope_theta} must be > 0.")
        if self.rope_local_theta is not None and not (self.rope_local_theta > 0):
            raise ConfigError(f"rope_local_theta={self.rope_local_theta} must be > 0 (or None: rope_theta).")
        for size in ("sliding_window", "global_layer_every"):
            if getattr(self, size) is not None:
                self._check_positive_int(size)
        if self.global_layer_every is not None and self.sliding_window is None:
            raise ConfigError(f"global_layer_every={self.global_layer_every} needs a sliding_window for the "
                              f"other layers; set sliding_window or leave global_layer_every None.")
        for cap in ("query_pre_attn_scalar", "final_logit_softcap"):
            value = getattr(self, cap)
            if value is not None and not (value > 0):
                raise ConfigError(f"{cap}={value} must be > 0 (or None).")
        if self.post_sublayer_norm and self.norm_position != "pre":
            raise ConfigError("post_sublayer_norm adds norms around pre-norm sub-layers; it needs norm_position='pre'.")
        if self.norm == "none" and (self.qk_norm or self.post_sublayer_norm):
            raise ConfigError("norm='none' has no norm to use for qk_norm / post_sublayer_norm; pick norm='rms'.")

    def _check_choice(self, name: str, valid: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in valid:
            raise ConfigError(f"unknown {name}={value!r}; valid options are: {', '.join(valid)}.")

    def _check_positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}.")

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
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of config fields, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown config field(s) {unknown}; valid fields are: {', '.join(sorted(known))}"
                f"{did_you_mean(unknown[0], known) or '.'}"
            )
        try:
            return cls(**data)
        except TypeError as exc:  # wrong types that dataclass itself trips on
            raise ConfigError(f"{source}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist.") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}); fix or regenerate it.") from None
        return cls.from_dict(data, source=str(path))

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
