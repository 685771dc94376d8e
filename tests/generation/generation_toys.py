"""Tiny models and tokenizers shared by the generation tests (imported, not collected)."""

from __future__ import annotations

from typing import Optional, Sequence

import pytest
import torch

from lucidlm import Transformer, preset
from lucidlm.generation.decode import DecodeSession
from lucidlm.generation.prompt_cache import CacheReuse
from lucidlm.tokenizers import BPETokenizer

EOT = "<|endoftext|>"


def byte_tokenizer(with_eos: bool = True, with_bos: bool = False) -> BPETokenizer:
    """Byte-level tokenizer with no merges: id b is byte b, so one emoji is 4 tokens."""
    specials = {}
    if with_eos:
        specials[EOT] = 256
    if with_bos:
        specials["<s>"] = 256 + len(specials)
    return BPETokenizer([], specials, eos_token=EOT if with_eos else None, bos_token="<s>" if with_bos else None)


def toy_model(seed: int = 0, tokenizer=None, max_seq_len: int = 256, model_cls=Transformer, **overrides) -> Transformer:
    tokenizer = tokenizer if tokenizer is not None else byte_tokenizer()
    torch.manual_seed(seed)
    cfg = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=tokenizer.vocab_size,
               max_seq_len=max_seq_len, multiple_of=32)
    cfg.update(overrides)
    model = model_cls(preset("llama", **cfg), tokenizer).eval()
    # Random init at std 0.02 makes near-uniform logits; sharpen them so greedy choices are
    # far from ties and runs say something about the model, not about rounding.
    with torch.no_grad():
        model.unembed.weight.mul_(40.0)
    return model


class ScriptedModel(torch.nn.Module):
    """Stands in for a Transformer: whatever the prompt, it 'generates' ``script`` token by
    token (a one-hot logit at the next scripted id), through the same KV-cache calls."""

    def __init__(self, tokenizer, script: Sequence[int], prompt_len: int, max_seq_len: int = 512) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.script = list(script)
        self.prompt_len = prompt_len
        self.config = preset("llama", vocab_size=tokenizer.vocab_size, max_seq_len=max_seq_len,
                             n_layers=1, d_model=8, n_heads=1, n_kv_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.cache_live = False
        self.calls = 0

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def setup_kv_cache(self, batch_size: int, max_seq_len: Optional[int] = None, dtype=None) -> None:
        self.cache_live = True

    def clear_kv_cache(self) -> None:
        self.cache_live = False

    def forward(self, ids, attention_mask=None, position_ids=None, input_pos=None, last_token_only=False):
        assert self.cache_live, "generation must set up the KV cache first"
        self.calls += 1
        step = int(input_pos[-1]) + 1 - self.prompt_len
        token = self.script[min(step, len(self.script) - 1)]
        logits = torch.full((ids.shape[0], 1, self.config.vocab_size), -10.0)
        logits[..., token] = 10.0
        return logits

    def step(self, ids, input_pos=None, attention_mask=None, last_token_only=False, new_cache=False):
        """What generation calls: the forward pass without input checks (new_cache changes
        nothing here: the script ignores the keys)."""
        return self(ids, attention_mask=attention_mask, input_pos=input_pos, last_token_only=last_token_only)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Imported by each test module. One torch thread: when other processes keep a 2-core
    machine busy, OpenMP's spinning second thread makes tiny kernels ~1000x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Imported by the modules that compile. Dynamo keeps compiled code per code object
    (``Transformer.step``) for the whole process, up to its recompile limit (8): models
    compiled by earlier tests would count against a test that checks it compiles once."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """``toy_model(seed=0)`` saved as a model directory, for the command-line tests."""
    from lucidlm.weights.checkpoint import save_model

    path = tmp_path_factory.mktemp("toy_model")
    save_model(toy_model(seed=0), path)
    return str(path)


@pytest.fixture
def only_generate_and_chat(monkeypatch):
    """Build the CLI's parser from the generate and chat modules only."""
    from lucidlm import cli

    monkeypatch.setattr(cli, "COMMANDS", ("generate", "chat"))


def sharpened_llama_pair(path, eos: int = 256):
    """(transformers model, our model) with the same weights: a tiny random Llama saved to
    ``path`` and read back by lucidlm with a byte tokenizer (EOS id ``eos``). The unembedding is
    sharpened (so fp32 rounding cannot reorder beams) and EOS swapped with a token the model
    likes, so that beams really finish at different lengths."""
    import transformers

    from lucidlm.weights.hf import load_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                                      eos_token_id=eos, pad_token_id=eos)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(30.0)
        greedy = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0]
        liked = int(greedy[-2])
        w = hf.lm_head.weight
        w[[liked, eos]] = w[[eos, liked]]
    hf.save_pretrained(path)
    ours = load_hf(path)
    ours.tokenizer = byte_tokenizer()  # EOS id 256, for generate()
    return hf, ours


def hf_byte_tokenizer():
    """transformers' tokenizer for the toys' byte vocabulary (id b is byte b, EOS 256): HF's
    stop strings read the vocabulary through it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}  # GPT-2's
    vocab = {byte_chars[b]: b for b in range(256)} | {"<|endoftext|>": 256}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def first_token_logits(model, kept_prompt, answer, next_prompt):
    """The first new token's logits (V,) for ``next_prompt``: from a cache kept after
    ``kept_prompt`` and its ``answer`` (fed as generation feeds it, all but the last), and
    from a fresh prefill; with the slots reused."""
    with DecodeSession(model, [kept_prompt], len(kept_prompt) + len(answer), reuse=CacheReuse()) as session:
        session.prefill()
        for token in answer[:-1]:
            session.step(torch.tensor([token]))
        session.keep(torch.tensor(list(kept_prompt) + answer[:-1]))
    reuse = CacheReuse()
    with DecodeSession(model, [next_prompt], len(next_prompt) + 4, reuse=reuse) as session:
        reused = session.prefill()[0]
    with DecodeSession(model, [next_prompt], len(next_prompt) + 4) as session:
        fresh = session.prefill()[0]
    return reused, fresh, reuse.cached_tokens


def reader(lines):
    """A read_line that answers with ``lines``, then signals end of input like input() does."""
    remaining = iter(lines)

    def read_line(prompt):
        try:
            return next(remaining)
        except StopIteration:
            raise EOFError from None
    return read_line


def assert_compiled_samples_like_eager(**options) -> None:
    """A compiled toy model samples the eager model's tokens with ``options`` and compiles its
    decode step once: samplers run outside the compiled step, on its logits."""
    from torch._dynamo.testing import CompileCounter

    from lucidlm import LanguageModel
    from lucidlm.generation import generate

    model = toy_model(seed=2, max_seq_len=128, model_cls=LanguageModel)
    options = dict(max_new_tokens=16, temperature=1.5, stop_on_eos=False, **options)
    eager = [generate(model, [5, 6, 7], seed=seed, **options).token_ids for seed in (0, 1)]
    counter = CompileCounter()
    model.compile(backend=counter, prefill=False)
    assert [generate(model, [5, 6, 7], seed=seed, **options).token_ids for seed in (0, 1)] == eager
    assert counter.frame_count == 1
