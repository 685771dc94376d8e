"""One ModelConfig for every model family, and the named presets.

A family is a choice of fields, never a subclass: GPT-2 is learned positions + LayerNorm +
GELU(tanh) + biases + tied embeddings; LLaMA is RoPE + RMSNorm + SwiGLU + grouped-query
attention; the seeds' teaching models are post-norm variants. Derived sizes (head_dim,
n_kv_heads, d_mlp) are filled in by ``__post_init__`` so the rest of the code can rely on them.

The checks and the derived sizes are in ``config_checks.py``, the presets' data in
``config_presets.py``; both are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lucidlm.config_checks import (  # noqa: F401  (re-exported: this module was their home)
    INIT_SCHEMES, LLAMA3_ROPE_DEFAULTS, MLP_KINDS, NORM_KINDS, NORM_POSITIONS, POSITION_KINDS, ROPE_SCALING_PARAMETERS,
    ROPE_SCALING_TYPES, ROPE_VARIANTS, check_and_complete, llama_hidden_dim)
from lucidlm.config_presets import PRESETS
from lucidlm.errors import ConfigError
from lucidlm.suggest import did_you_mean, keywords_checked, unknown_fields_message
from lucidlm.validation import check_allocation, read_json_object

# Where the values of the ModelConfig being built came from: ("ModelConfig", {}) for Python code;
# from_dict sets (file, {our field: the file's name for it}) while a loader builds one.
_ORIGIN: ContextVar[tuple[str, dict[str, str], str]] = ContextVar(
    "lucidlm_config_origin", default=("ModelConfig", {}, "pass valid values to ModelConfig"))


@keywords_checked(ConfigError, unknown_fields_message)
@dataclass
class ModelConfig:
    """The architecture of a decoder-only transformer: sizes, positions, attention pattern,
    norms, MLP, biases and initialisation, for every family (GPT-2, LLaMA, Gemma, ...).

        cfg = ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12)
        cfg = preset("gpt2", n_layers=2)          # a named preset, with fields changed
        cfg.head_dim, cfg.d_mlp                   # derived sizes are filled in

    Every field is checked when the config is made (ConfigError naming the field, with the
    closest name for a misspelt one). ``save``/``load`` write and read it as JSON."""

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
    # Frequency scaling for a longer context, in Hugging Face's spelling (model/rope_scaling.py):
    # None | {"rope_type": "linear", "factor": 8.0} | {"rope_type": "llama3", "factor": 32.0,
    # "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    # | {"rope_type": "frequency_factors", "factors": [one divisor per pair]} (a GGUF's rope_freqs).
    # With a rope_local_theta, sliding-window layers keep unscaled frequencies (Gemma 3).
    rope_scaling: Optional[dict[str, Any]] = None

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
        # Where the values came from (set by from_dict while a loader builds one), so that every
        # refusal names the file and its own field names; then every field is checked.
        source, names, fix = _ORIGIN.get()
        self._origin = (source, dict(names), fix)
        check_and_complete(self)

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
            tables = 2 if self.has_local_rope_table else 1
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

    @property
    def has_local_rope_table(self) -> bool:
        """Whether sliding-window layers rotate by a table of their own: another base, or the
        same base unscaled while the global layers scale theirs."""
        return self.rope_local_theta is not None and (self.rope_local_theta != self.rope_theta
                                                      or self.rope_scaling is not None)

    def layer_is_local(self, index: int) -> bool:
        """Whether layer ``index`` uses sliding-window attention (and rope_local_theta)."""
        if self.sliding_window is None:
            return False
        return self.global_layer_every is None or (index + 1) % self.global_layer_every != 0

    # -- (de)serialisation --
    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data ({name: value}, derived sizes included), JSON-ready."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "ModelConfig",
                  names: Optional[dict[str, str]] = None, fix: str = "") -> "ModelConfig":
        """A config from plain data; ``source`` and ``names`` (our field -> the source's own
        name for it) make every refusal name the file and the field as the file spells them,
        and ``fix`` says what to do about it."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of config fields, got {type(data).__name__}.")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(unknown_fields_message(str(source), unknown, known))
        token = _ORIGIN.set((str(source), names or {}, fix or "pass valid values to ModelConfig"))
        try:
            return cls(**data)
        finally:
            _ORIGIN.reset(token)

    def save(self, path: str | Path) -> None:
        """Write the config to ``path`` as JSON (``to_dict``); ``ModelConfig.load`` reads it back."""
        from lucidlm.staging import atomic_write_text

        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")  # a failed write keeps the old file

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        """The config saved at ``path`` (a JSON object of fields), checked like any other;
        ConfigError naming the file when it is missing, not JSON, or has a bad field."""
        fix = "fix or regenerate it (lucidlm writes it beside the model's weights)"
        fields = read_json_object(path, ConfigError, "model config", fix=fix)
        return cls.from_dict(dict(fields.data), source=str(path), fix=fix)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed. Sizes this config derived rather than was given
        (n_kv_heads, head_dim, d_mlp) are derived again from the new fields unless given:
        ``replace(d_model=128)`` gets the head_dim and d_mlp of 128, and ``replace(n_heads=8)``
        of a multi-head config stays multi-head."""
        data = self.to_dict()
        for key in getattr(self, "_derived", ()):
            data.pop(key)
        data.update(changes)
        return ModelConfig.from_dict(data)


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset as a ModelConfig, with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(sorted(PRESETS))}"
                          f"{did_you_mean(name, PRESETS) or '.'}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides}, source=f"preset {name!r}")
