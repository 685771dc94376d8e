"""TransformerLens 3.9 as the oracle: the same tiny random Hugging Face model loaded into
lucidlm (through weights/hf.py) and into TransformerLens's ``HookedTransformer`` (through its
own ``weight_conversions``), with TransformerLens's folding and centring off unless asked."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lucidlm.weights.hf import load_hf
from random_weights import randomize_

VOCAB = 101



def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                         eos_token_id=0)
        return randomize_(GPT2LMHeadModel(cfg), seed, norm_spread=0.2)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=80, max_position_embeddings=64, rope_theta=10000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    return randomize_(LlamaForCausalLM(cfg), seed, norm_spread=0.2)


def tl_config(family: str, hf):
    from transformer_lens import HookedTransformerConfig
    c = hf.config
    if family == "gpt2":
        return HookedTransformerConfig(
            d_model=c.n_embd, d_head=c.n_embd // c.n_head, n_heads=c.n_head, d_mlp=4 * c.n_embd, n_layers=c.n_layer,
            n_ctx=c.n_positions, d_vocab=c.vocab_size, act_fn="gelu_new", normalization_type="LN",
            eps=c.layer_norm_epsilon, positional_embedding_type="standard", original_architecture="GPT2LMHeadModel",
            device="cpu", dtype=torch.float32)
    head_dim = c.hidden_size // c.num_attention_heads
    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=head_dim, n_heads=c.num_attention_heads, d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, d_vocab=c.vocab_size, act_fn="silu",
        normalization_type="RMS", eps=c.rms_norm_eps, positional_embedding_type="rotary", rotary_dim=head_dim,
        rotary_base=10000, rotary_adjacent_pairs=False, n_key_value_heads=c.num_key_value_heads, gated_mlp=True,
        final_rms=True, original_architecture="LlamaForCausalLM", device="cpu", dtype=torch.float32)


def tl_model(family: str, hf, fold_ln: bool = False):
    """TransformerLens's HookedTransformer on the HF model's weights. ``fold_ln`` folds the
    norms' weights into the next matrices (TransformerLens's default for pretrained models);
    residual-stream activations are unchanged by it, centring stays off."""
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights, convert_llama_weights
    cfg = tl_config(family, hf)
    state = (convert_gpt2_weights if family == "gpt2" else convert_llama_weights)(hf, cfg)
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(state, fold_ln=fold_ln, center_writing_weights=False, center_unembed=False,
                                      fold_value_biases=False, refactor_factored_attn_matrices=False)
    return model.eval()


def lucid_model(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    return load_hf(tmp_path).eval()


def ids(seed: int = 0, batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


TL_SETTERS = {"attn_result": "set_use_attn_result", "split_qkv_input": "set_use_split_qkv_input",
              "attn_in": "set_use_attn_in", "mlp_in": "set_use_hook_mlp_in"}
