"""Meta's original Llama 3 checkpoints: ``params.json`` + ``consolidated.*.pth`` + ``tokenizer.model``.

What Meta's download script leaves in a directory (seed 001 builds this model):

- ``params.json``: ``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``vocab_size``,
  ``multiple_of``, ``ffn_dim_multiplier``, ``norm_eps``, ``rope_theta``, and from Llama 3.1 on
  ``use_scaled_rope`` (the llama3 RoPE scaling, ``model/rope_scaling.py``);
- ``consolidated.00.pth``: a ``torch.save``d dict of bf16 tensors under Meta's names
  (``layers.0.attention.wq.weight``, ``feed_forward.w1`` = gate, ``w3`` = up, ``w2`` = down);
  larger models come as model-parallel shards ``consolidated.00.pth`` ... ``.07.pth``, merged by
  ``meta_shards.py``;
- ``tokenizer.model``: tiktoken's format (``tokenizers/tiktoken_bpe.py``).

A ``.pth`` is a pickle, and unpickling can run code. It is read with
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers, and the
result must be a flat dict of tensors: anything else is refused. Meta's Q/K rows are in the
``interleaved`` RoPE layout (complex pairs); they are permuted to ``half`` on load, as
transformers' ``convert_llama_weights_to_hf`` does, so exports need no further thought.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from lucidlm.config import LLAMA3_ROPE_DEFAULTS, ModelConfig
from lucidlm.errors import CheckpointError, ConfigError
from lucidlm.model.positions import permute_qk_to_half
from lucidlm.model.transformer import Transformer
from lucidlm.validation import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Fields, read_json_object
from lucidlm.weights.finite import check_finite
from lucidlm.weights.meta_shards import merge_shards, shard_paths
from lucidlm.weights.state import load_into

PARAMS = "params.json"
LAYER_NAMES = {
    "attention.wq.weight": "attn.q_proj.weight",
    "attention.wk.weight": "attn.k_proj.weight",
    "attention.wv.weight": "attn.v_proj.weight",
    "attention.wo.weight": "attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "ln1.weight",
    "ffn_norm.weight": "ln2.weight",
}
GLOBAL_NAMES = {"tok_embeddings.weight": "embed.weight", "norm.weight": "ln_final.weight",
                "output.weight": "unembed.weight"}


def is_meta_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / PARAMS).is_file() and any(path.glob("consolidated.*.pth"))


_PARAMS_FIX = "correct that field in params.json, or download the model again"
# our ModelConfig field -> params.json's name for it, so refusals name the file's field
_PARAMS_NAMES = {"d_model": "dim"}


def config_from_params(params: Any, source: str, max_seq_len: int = 8192) -> ModelConfig:
    """The ModelConfig a Llama ``params.json`` describes, every field checked first."""
    fields = params if isinstance(params, Fields) else Fields(params, source, ConfigError, fix=_PARAMS_FIX)
    if fields.has("model"):  # some releases nest the sizes under "model"
        fields = fields.object("model")
    dim = fields.int("dim", low=1, high=MAX_WIDTH)
    rope_scaling = None
    if fields.bool("use_scaled_rope", default=False):
        # Llama 3.1-3.3's rule with Meta's constants; params.json does not carry the factor:
        # transformers' converter sets 32 for Llama 3.2 (the 1B and 3B, dim 2048 / 3072, the only
        # scaled releases of those widths) and 8 for 3.1 / 3.3. A params.json may say it.
        factor = fields.float("rope_scaling_factor", default=32.0 if dim in (2048, 3072) else 8.0, low=0.0,
                              low_open=True)
        rope_scaling = {"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE_DEFAULTS}
    n_heads = fields.int("n_heads", low=1, high=MAX_HEADS)
    multiple_of = fields.int("multiple_of", default=256, low=1, high=MAX_WIDTH)
    multiplier = fields.float("ffn_dim_multiplier", default=None, low=0.0, low_open=True, high=float(MAX_WIDTH))
    values = dict(
        name="llama", vocab_size=fields.int("vocab_size", low=1, high=MAX_VOCAB), d_model=dim,
        n_layers=fields.int("n_layers", low=1, high=MAX_LAYERS), n_heads=n_heads,
        n_kv_heads=fields.int("n_kv_heads", default=n_heads, low=1, high=MAX_HEADS),
        max_seq_len=fields.int("max_seq_len", default=max_seq_len, low=1, high=MAX_CONTEXT), positions="rope",
        rope_variant="half", rope_theta=fields.float("rope_theta", default=10000.0, low=0.0, low_open=True),
        rope_scaling=rope_scaling, norm="rms", norm_eps=fields.float("norm_eps", default=1e-5, low=0.0, high=1.0),
        mlp="swiglu",
        multiple_of=multiple_of, ffn_dim_multiplier=multiplier, tie_embeddings=False,
    )
    return ModelConfig.from_dict(values, source=source, names=_PARAMS_NAMES, fix=_PARAMS_FIX)


def read_pth(path: Path) -> dict[str, torch.Tensor]:
    """A ``.pth`` state dict, refusing anything but a flat dict of tensors."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path} holds objects other than tensors ({str(exc).splitlines()[0]}); lucidlm "
                              f"never unpickles code. Use a checkpoint of plain tensors (Meta's own) or safetensors.")
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read as a PyTorch checkpoint ({exc}); download it again.") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in data.items()):
        kind = type(data).__name__ if not isinstance(data, dict) else "a dict with non-tensor values"
        raise CheckpointError(f"{path} holds {kind}, not a state dict of named tensors; refusing it.")
    check_finite(data, path)
    return data


def meta_tensors(checkpoint: dict[str, torch.Tensor], config: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Meta's tensors under our names, float32, Q/K rows permuted to the half layout."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.items():
        if name in GLOBAL_NAMES:
            ours = GLOBAL_NAMES[name]
        else:
            parts = name.split(".", 2)
            if not (len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in LAYER_NAMES):
                if name.endswith("inner_attention.rope.freqs") or name == "rope.freqs":
                    continue  # some releases store the RoPE table; it is derived from rope_theta
                raise CheckpointError(f"{source}: tensor {name!r} has no place in a Llama model.")
            ours = f"blocks.{parts[1]}.{LAYER_NAMES[parts[2]]}"
        tensor = tensor.float()
        if ours.endswith("q_proj.weight") and tensor.shape[0] == config.q_dim:
            tensor = permute_qk_to_half(tensor, config.n_heads)
        elif ours.endswith("k_proj.weight") and tensor.shape[0] == config.kv_dim:
            tensor = permute_qk_to_half(tensor, config.n_kv_heads)
        out[ours] = tensor
    return out


def load_meta(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              model_cls: type[Transformer] = Transformer) -> Transformer:
    """A model (and its tokenizer, if ``tokenizer.model`` is there) from a Meta Llama 3 directory."""
    path = Path(path)
    params_path = path / PARAMS
    params = read_json_object(params_path, ConfigError, "Llama params file", fix=_PARAMS_FIX)
    config = config_from_params(params, str(params_path))
    config.check_memory()  # before reading GBs of shards for a model that cannot be built
    shards = shard_paths(path)
    if len(shards) == 1:
        checkpoint, source = read_pth(shards[0]), str(shards[0])
    else:  # model-parallel (70B: 8 shards), read one at a time and stitched back together
        checkpoint = merge_shards(((shard, read_pth(shard)) for shard in shards), len(shards), config)
        source = f"{path}/consolidated.*.pth ({len(shards)} shards)"
    tensors = meta_tensors(checkpoint, config, source)
    model = model_cls.empty(config, device)
    load_into(model, tensors, f"{source} (sizes from {params_path.name})")
    tokenizer_path = path / "tokenizer.model"
    if tokenizer_path.is_file():
        from lucidlm.tokenizers.tiktoken_bpe import TiktokenTokenizer

        model.tokenizer = TiktokenTokenizer.from_llama3_file(tokenizer_path)
    return model.to(dtype).eval()
