"""Tiny random Qwen 2 / Qwen 3 models for the family tests, no download: a transformers model with
weights large enough that a wrong mapping shows (``random_weights.randomize_``), the same weights
as a GGUF written the way llama.cpp's converter writes them (``convert_hf_to_gguf.py``
Qwen2Model / Qwen3Model: renamed, Q/K rows not permuted, vectors F32, tensors in the
checkpoint's sorted order, so ``attn_q.bias`` comes before ``attn_q.weight``), the
transformers model a quantized lucidlm model stands for, and the comparisons both family
tests make."""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from lucidlm.commands import convert
from random_weights import randomize_

ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
# A byte-level BPE vocabulary like Qwen's, in miniature: the 256 byte symbols, two merges, and
# Qwen's special tokens at the end (<|im_end|> ends a chat turn: the GGUF's eos).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [*bytes_to_unicode().values(), "\u0120t", "he", *SPECIALS]
MERGES = ["\u0120 t", "h e"]
VOCAB = len(TOKENS)
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def hf_qwen(arch: str, tie: bool = False, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` in float32, eval mode."""
    config_cls, model_cls = ARCHITECTURES[arch]
    config = config_cls(**{**SIZES, "tie_word_embeddings": tie, **overrides})
    torch.manual_seed(seed)
    return randomize_(model_cls(config), seed)


def token_batch(seed: int = 0, rows: int = 2, length: int = 24) -> torch.Tensor:
    """(rows, length) token ids spread over the whole vocabulary."""
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


# Hugging Face name (below model.layers.N.) -> llama.cpp's (below blk.N.)
_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
                "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    if layer:
        return f"blk.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}.{kind}"
    return f"{_GLOBAL_NAMES[module]}.{kind}"


def write_qwen_gguf(path: Path, hf: torch.nn.Module, arch: str, quant: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Write ``hf``'s weights as an ``arch`` GGUF with llama.cpp's names and metadata, every matrix
    as ``quant`` ("Q8_0", "Q4_0") blocks or F32; returns the Hugging Face state dict the file
    stands for (a quantized matrix as ``gguf.quants.dequantize`` of its stored blocks)."""
    config = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:  # the converter writes it where config.json has head_dim (Qwen 3 does)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(TOKENS.index("<|endoftext|>"))
    w.add_eos_token_id(TOKENS.index("<|im_end|>"))
    w.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    stands_for = {}
    for name, tensor in sorted(hf.state_dict().items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if quant is not None and values.ndim == 2:
            kind = gguf.GGMLQuantizationType[quant]
            blocks = gguf.quants.quantize(values, kind)
            w.add_tensor(gguf_name(name), blocks, raw_dtype=kind)
            values = gguf.quants.dequantize(blocks, kind)
        else:
            w.add_tensor(gguf_name(name), values)
        stands_for[name] = torch.from_numpy(np.array(values, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stands_for


def with_weights(hf: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of ``hf`` holding ``state`` (a tied model's lm_head follows its embedding)."""
    copied = copy.deepcopy(hf)
    missing, unexpected = copied.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return copied.eval()


# our module name (below blocks.N.) -> Hugging Face's (below model.layers.N.)
_OUR_LAYER_NAMES = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "attn.q_norm": "self_attn.q_norm",
                    "attn.k_norm": "self_attn.k_norm", **{f"attn.{p}_proj": f"self_attn.{p}_proj" for p in "qkvo"},
                    **{f"mlp.{p}_proj": f"mlp.{p}_proj" for p in ("gate", "up", "down")}}
_OUR_GLOBAL_NAMES = {"embed": "model.embed_tokens", "unembed": "lm_head", "ln_final": "model.norm"}


def dequantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a lucidlm model with quantized layers computes with, as a Hugging Face state dict: each
    quantized layer's ``dequantize()`` matrix, every float tensor (norms, biases) as it is."""
    state = {}
    for name, module in model.named_modules():
        layer = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        theirs = _OUR_GLOBAL_NAMES.get(name)
        if layer and layer.group(2) in _OUR_LAYER_NAMES:
            theirs = f"model.layers.{layer.group(1)}.{_OUR_LAYER_NAMES[layer.group(2)]}"
        if theirs is None:
            continue
        if hasattr(module, "dequantize"):
            state[f"{theirs}.weight"] = module.dequantize(torch.float32)
        elif getattr(module, "weight", None) is not None:
            state[f"{theirs}.weight"] = module.weight.detach().float()
        if getattr(module, "bias", None) is not None:
            state[f"{theirs}.bias"] = module.bias.detach().float()
    return state


# the groups ``quantize=`` requantizes a file's matrices into (quantization/int8.py, int4.py):
# int8 one symmetric scale per output row, int4 asymmetric groups of 32
REQUANTIZED_GROUP = {"int8": None, "int4": 32}
# a file's quants kept (quantize="gguf"): Q8_0's float16 scales stay exact, Q4_0's are rounded to
# bfloat16, so a matrix entry (code * scale) is the file's to bfloat16's unit roundoff of itself
KEPT_BLOCKS_RTOL = 2.0 ** -8


def one_step(reference: torch.Tensor, quantize: str) -> torch.Tensor:
    """(N, K) the quantization step of ``quantize``'s scheme at each entry of ``reference`` (N, K):
    its group's scale, max|w| / 127 (int8) or (max - min) / 15 (int4). Rounding to the nearest
    code is off by half a step; the scale's own rounding to bfloat16 adds under a quarter more."""
    N, K = reference.shape
    g = REQUANTIZED_GROUP[quantize] or K
    groups = reference.reshape(N, K // g, g)  # (N, G, g)
    if quantize == "int8":
        step = groups.abs().amax(-1, keepdim=True) / 127
    else:
        step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    return step.expand_as(groups).reshape(N, K)


def checked_dequantized_state(ours: torch.nn.Module, stands_for: dict[str, torch.Tensor],
                              quantize: Optional[str]) -> dict[str, torch.Tensor]:
    """``dequantized_state(ours)`` after asserting each tensor is the file's own (``stands_for``:
    ``gguf.quants.dequantize`` of its blocks) under the same name: the file's blocks kept
    (``None``, "gguf") to float rounding, requantized ("int8", "int4") within one step of the
    scheme. A matrix loaded into the wrong layer or projection is many steps off."""
    from torch.testing import assert_close

    state = dequantized_state(ours)
    want = dict(stands_for)
    want.setdefault("lm_head.weight", stands_for["model.embed_tokens.weight"])  # tied: the embedding
    assert set(state) == set(want), set(state) ^ set(want)
    for name, reference in want.items():
        got = state[name].float()
        if reference.ndim == 1 or quantize is None:
            assert_close(got, reference, msg=lambda m: f"{name}: {m}")
        elif quantize == "gguf":
            assert_close(got, reference, atol=0, rtol=KEPT_BLOCKS_RTOL, msg=lambda m: f"{name}: {m}")
        else:
            off = (got - reference).abs() / one_step(reference, quantize)
            assert off.max() <= 1, f"{name}: {off.max():.2f} quantization steps from the file's tensor"
    return state


# how far a quantized model's logits may be from transformers running its own dequantized
# matrices: the kernels multiply bfloat16 activations (logits' spread is ~1.2)
QUANTIZED_ATOL = {"gguf": 0.05, "int4": 0.05, "int8": 0.15}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def hf_greedy(model, prompt: torch.Tensor, new: int = 20) -> list[int]:
    with torch.no_grad():
        # the mask given: else transformers masks every prompt token equal to pad_token_id
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def our_greedy(model, prompt: torch.Tensor, new: int = 20) -> list[int]:
    return model.generate(prompt[0].tolist(), max_new_tokens=new, temperature=0, stop_on_eos=False).token_ids


def assert_picks_are_references(picks: list[int], reference: torch.nn.Module, prompt: torch.Tensor,
                                atol: float) -> None:
    """Each greedy token in ``picks`` (after ``prompt``, (1, T)) is the reference's pick from the
    same sequence, up to ``atol`` of rounding: a near-tie may go either way, a clear pick may not."""
    sequence = torch.cat([prompt, torch.tensor([picks])], dim=1)
    steps = logits(reference, sequence)[0, prompt.shape[1] - 1:-1]  # (new, V)
    chosen = steps.gather(-1, torch.tensor(picks)[:, None])[:, 0]
    assert (chosen >= steps.max(-1).values - atol).all(), (picks, steps.argmax(-1).tolist())
    clear = steps.topk(2).values.diff(dim=-1)[:, 0] < -2 * atol  # a margin rounding cannot flip
    assert clear.sum() >= len(picks) // 2  # the check means something


def run_convert(source, out_dir, to: str) -> int:
    parser = argparse.ArgumentParser()
    convert.register(parser.add_subparsers())
    args = parser.parse_args(["convert", str(source), str(out_dir), "--to", to])
    return args.handler(args)


GGUF_TYPES = ("F32", "Q8_0", "Q4_0")


def write_gguf_variants(hf: torch.nn.Module, arch: str,
                        folder: Path) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """{file type: (path, the HF state dict the file stands for)}: ``hf`` written as F32, Q8_0, Q4_0."""
    files = {}
    for quant in GGUF_TYPES:
        path = folder / f"tiny-{quant}.gguf"
        files[quant] = path, write_qwen_gguf(path, hf, arch, None if quant == "F32" else quant)
    return files


def assert_gguf_logits(ours: torch.nn.Module, hf: torch.nn.Module, path: Path, ids: torch.Tensor) -> None:
    """``ours`` (read from the F32 file ``path``) against transformers' model and its own GGUF loader."""
    import warnings

    from torch.testing import assert_close
    from transformers import AutoModelForCausalLM

    assert_close(logits(ours, ids), logits(hf, ids), atol=1e-4, rtol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=torch.float32).eval()
    assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-4, rtol=1e-4)


def assert_quantized_logits(ours: torch.nn.Module, hf: torch.nn.Module, stands_for: dict[str, torch.Tensor],
                            quantize: Optional[str], ids: torch.Tensor) -> None:
    """``ours`` loaded with ``quantize`` from a quantized file: its matrices are the file's
    (``checked_dequantized_state``); unquantized, it is transformers on the file's dequantized
    numbers; quantized, transformers on ``ours``'s own dequantized matrices."""
    from torch.testing import assert_close

    state = checked_dequantized_state(ours, stands_for, quantize)
    if quantize is None:
        assert_close(logits(ours, ids), logits(with_weights(hf, stands_for), ids), atol=1e-4, rtol=1e-4)
        return
    reference = with_weights(hf, state)
    assert_close(logits(ours, ids), logits(reference, ids), atol=QUANTIZED_ATOL[quantize], rtol=0)


def assert_same_logits(ours: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor) -> None:
    """Float32 logits of ``ours`` equal transformers' ``hf`` on ``ids``, spread enough to mean it."""
    from torch.testing import assert_close

    want = logits(hf, ids)
    assert want.std() > 0.3  # the comparison means something
    assert_close(logits(ours, ids), want, atol=1e-4, rtol=1e-4)


def assert_same_greedy(hf: torch.nn.Module, path: Path) -> None:
    """20 greedy tokens of the folder ``path`` read by lucidlm equal transformers' ``hf``'s."""
    import lucidlm

    prompt = token_batch(seed=2, rows=1, length=9)
    assert our_greedy(lucidlm.load(path), prompt) == hf_greedy(hf, prompt)
