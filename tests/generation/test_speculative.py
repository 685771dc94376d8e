"""Speculative decoding (``generation/speculative.py``): greedy tokens equal transformers'
assisted generation (``assistant_model=``, ``prompt_lookup_num_tokens=``) and plain greedy
decoding, with EOS, stop strings, max_new_tokens, min_new_tokens, the repetition penalty and
log-probs; sampled sequences have exactly the model's distribution (a chi-square test against
the probabilities enumerated from the model, with a broken acceptance rule as the control)."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from generation_toys import byte_tokenizer, one_torch_thread, sharpened_llama_pair, toy_model  # noqa: F401
from test_no_host_sync import reading_back_forbidden

from lucidlm import Transformer, preset
from lucidlm.errors import GenerationError
from lucidlm.generation import generate, speculative, stream
from lucidlm.generation.decode import DecodeSession

transformers = pytest.importorskip("transformers")

EOS = 256
# prompts that repeat themselves (prompt lookup finds drafts) and one that does not
PROMPTS = [list(b"the cat sat on the mat; the cat sat on the"), [5, 6, 7, 5, 6, 7, 5, 6], [100, 20, 30, 40, 50],
           list(b"abcdefgh abcdefgh abcd")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sharpened_llama_pair(tmp_path_factory.mktemp("tiny_llama"), EOS)


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory, pair):
    """(transformers, ours) draft models: the target's weights, noised, so it agrees often, not always."""
    from lucidlm.weights.hf import load_hf

    hf, _ = pair
    hf_draft = transformers.LlamaForCausalLM(hf.config).eval()
    hf_draft.load_state_dict(hf.state_dict())
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf_draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_llama_draft")
    hf_draft.save_pretrained(path)
    ours = load_hf(path)
    ours.tokenizer = byte_tokenizer()
    return hf_draft, ours


def hf_greedy(hf, prompt, max_new, **kwargs):
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=EOS,
                      pad_token_id=EOS, **kwargs)[0, len(prompt):].tolist()
    return out[:out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("options", [
    {}, {"repetition_penalty": 1.3}, {"min_new_tokens": 12},
    # processors that read the row's last tokens: each checked position must see its own text
    {"no_repeat_ngram_size": 2}, {"bad_words_ids": [[116, 104], [32, 99, 97]]},
    {"sequence_bias": [[[97, 116], 4.0], [[6], -3.0]]},
], ids=["plain", "repetition", "min_new", "no_repeat_ngram", "bad_words", "sequence_bias"])
def test_greedy_equals_transformers_assisted_generation(pair, draft_pair, options):
    hf, ours = pair
    hf_draft, our_draft = draft_pair
    accepted = rejected = 0
    for prompt in PROMPTS:
        for k in (1, 3, 5):
            lookup = generate(ours, prompt, max_new_tokens=20, temperature=0, draft="prompt", draft_tokens=k, **options)
            assert lookup.token_ids == hf_greedy(hf, prompt, 20, prompt_lookup_num_tokens=k, **options), (prompt, k)
            drafted = generate(ours, prompt, max_new_tokens=20, temperature=0, draft=our_draft, draft_tokens=k,
                               **options)
            assert drafted.token_ids == hf_greedy(hf, prompt, 20, assistant_model=hf_draft, num_assistant_tokens=k,
                                                  num_assistant_tokens_schedule="constant", **options), (prompt, k)
            for stats in (lookup.speculation, drafted.speculation):
                accepted += stats.accepted
                rejected += stats.drafted - stats.accepted
    assert accepted > 20 and rejected > 20  # both paths taken: long accepted runs and rejections


@pytest.mark.parametrize("options", [{"presence_penalty": 1.5}, {"frequency_penalty": 0.7},
                                     {"presence_penalty": -0.5, "frequency_penalty": 0.4, "logit_bias": {116: 2.0}}])
def test_greedy_with_openai_penalties_equals_plain_greedy(pair, draft_pair, options):
    """The penalties count the generated tokens only (transformers has no oracle: plain greedy
    decoding, itself tested against OpenAI's formula, is the reference here)."""
    _, ours = pair
    _, our_draft = draft_pair
    for prompt in PROMPTS:
        plain = generate(ours, prompt, max_new_tokens=20, temperature=0, **options).token_ids
        for draft in ("prompt", our_draft):
            assert generate(ours, prompt, max_new_tokens=20, temperature=0, draft=draft, draft_tokens=4,
                            **options).token_ids == plain, (prompt, draft)


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 16])
def test_greedy_equals_plain_greedy_at_every_end(pair, draft_pair, max_new):
    """EOS, a stop string and max_new_tokens inside an accepted run end where plain decoding ends."""
    _, ours = pair
    _, our_draft = draft_pair
    for prompt, stop in itertools.product(PROMPTS, (None, "t", "at")):
        plain = generate(ours, prompt, max_new_tokens=max_new, temperature=0, stop=stop, logprobs=3)
        for draft in ("prompt", our_draft):
            spec = generate(ours, prompt, max_new_tokens=max_new, temperature=0, stop=stop, logprobs=3, draft=draft)
            assert (spec.token_ids, spec.text, spec.finish_reason) == \
                (plain.token_ids, plain.text, plain.finish_reason), (prompt, stop, draft)
            assert len(spec.logprobs) == len(plain.logprobs) == len(spec.token_ids)
            torch.testing.assert_close(torch.tensor(spec.logprobs), torch.tensor(plain.logprobs), atol=1e-4, rtol=0)
            assert [[i for i, _ in top] for top in spec.top_logprobs] == \
                [[i for i, _ in top] for top in plain.top_logprobs]
            torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in spec.top_logprobs]),
                                       torch.tensor([[v for _, v in top] for top in plain.top_logprobs]),
                                       atol=1e-4, rtol=0)


def test_sliding_window_model():
    """A Gemma 3 shaped toy with a 4-token window: the checking pass's queries each see their
    own window, as one-token steps do."""
    from random_weights import randomize_

    config = preset("gemma3-270m", vocab_size=257, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                    d_mlp=64, max_seq_len=128, sliding_window=4, global_layer_every=3)
    model, draft = (randomize_(Transformer(config, byte_tokenizer()), seed) for seed in (0, 1))
    prompt = list(b"abcabcabcabc xyz abc")
    plain = generate(model, prompt, max_new_tokens=40, temperature=0, stop_on_eos=False)
    for guesser in ("prompt", draft):
        spec = generate(model, prompt, max_new_tokens=40, temperature=0, stop_on_eos=False, draft=guesser)
        assert spec.token_ids == plain.token_ids
        assert spec.speculation.rounds > 0


def test_stream_pieces_join_to_the_plain_text(pair):
    _, ours = pair
    prompt = PROMPTS[0]
    plain = generate(ours, prompt, max_new_tokens=24, temperature=0)
    pieces = stream(ours, prompt, max_new_tokens=24, temperature=0, draft="prompt")
    assert "".join(pieces) == plain.text
    assert pieces.result.token_ids == plain.token_ids


def test_reused_cache_after_speculation_gives_plain_tokens(pair, draft_pair):
    """A kept cache holds only the tokens the model ran with the right history: the next turn
    sees no rejected draft, whichever token (a kept draft, the model's own) ended the run."""
    _, ours = pair
    _, our_draft = draft_pair
    plain = generate(ours, PROMPTS[3], max_new_tokens=16, temperature=0).text
    stops = sorted(set(plain))  # each character the answer writes ends a run there (a stop string)
    assert len(stops) > 3
    for stop, draft in itertools.product(stops, ("prompt", our_draft)):
        first = generate(ours, PROMPTS[3], max_new_tokens=16, temperature=0, draft=draft, reuse_cache=True, stop=stop)
        follow = PROMPTS[3] + first.token_ids + list(b" abc")
        again = generate(ours, follow, max_new_tokens=8, temperature=0, draft=draft, reuse_cache=True)
        ours.clear_kv_cache()
        assert again.cached_tokens >= len(PROMPTS[3])
        assert again.token_ids == generate(ours, follow, max_new_tokens=8, temperature=0).token_ids, (stop, draft == "prompt")


def test_checking_drafts_reads_nothing_back_and_rewinding_hides_them():
    """The verify pass (``DecodeSession.feed``) and the roll-back are device-only, and after a
    rewind the rejected drafts' stale keys change nothing: the tokens are plain greedy's."""
    model = toy_model(seed=1, max_seq_len=128)
    prompt = [72, 105, 33]
    expected = generate(model, prompt, max_new_tokens=13, temperature=0, stop_on_eos=False).token_ids
    wrong = torch.tensor([[7, 8, 9]])  # drafts the model does not keep
    with DecodeSession(model, [prompt], capacity=3 + 13 + 3) as session:
        ids = session.prefill().argmax(-1)  # (1,)
        tokens = [ids]
        with reading_back_forbidden():
            for _ in range(6):
                logits = session.feed(torch.cat([ids[:, None], wrong], dim=1))  # (1, 4, V): the token, 3 drafts
                session.rewind(session.next_slot - 3)  # keep the token only; the drafts' slots go stale
                ids = logits[:, 0].argmax(-1)
                tokens.append(ids)
                ids = session.step(ids).argmax(-1)  # a plain step beside the stale slots
                tokens.append(ids)
    assert torch.cat(tokens).tolist() == expected


def test_rejected_rounds_back_off(monkeypatch):
    """Drafts the model never keeps (near-uniform sampling, a prompt where every token has an
    earlier successor): after each failed round 1, 2, 4, 8, 16 plain steps, so 64 tokens take 7
    checking passes (after tokens 1, 3, 6, 11, 20, 37 and 54), not 63."""
    monkeypatch.setattr(speculative, "MIN_NGRAM", 1)  # every token has a successor in the prompt: always a draft
    torch.manual_seed(0)
    model = Transformer(preset("llama", vocab_size=257, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                               max_seq_len=512, multiple_of=32), byte_tokenizer()).eval()
    result = generate(model, list(range(256)), max_new_tokens=64, temperature=1, seed=0, draft="prompt",
                      stop_on_eos=False)
    assert result.speculation.accepted == 0
    assert result.speculation.rounds == 7


def test_refusals(pair):
    _, ours = pair
    other_vocab = toy_model(tokenizer=byte_tokenizer(with_eos=False))
    cases = [(dict(draft="lookup"), "draft='lookup' is invalid"),
             (dict(draft_tokens=4), "needs a draft"),
             (dict(draft="prompt", draft_tokens=0), "draft_tokens=0 is invalid"),
             (dict(draft=ours), "the model itself"),
             (dict(draft=other_vocab), "vocabulary differs"),
             (dict(draft="prompt", num_beams=2), "beam search"),
             (dict(draft="prompt", context_overflow="crop"), "context_overflow=crop")]
    for options, message in cases:
        with pytest.raises(GenerationError, match=message):
            generate(ours, [1, 2, 3], max_new_tokens=4, **options)
    with pytest.raises(GenerationError, match="one prompt at a time"):
        generate(ours, [[1, 2], [3, 4]], max_new_tokens=4, draft="prompt")


def test_a_one_row_tensor_is_one_prompt(pair, draft_pair):
    """A (1, T) tensor (transformers' input_ids for one prompt, as assisted generation takes it)
    drafts as that prompt, answered as a batch is: a list of one result with plain greedy's tokens."""
    _, ours = pair
    _, our_draft = draft_pair
    for prompt in PROMPTS:
        plain = generate(ours, prompt, max_new_tokens=12, temperature=0).token_ids
        for draft in ("prompt", our_draft):
            results = generate(ours, torch.tensor([prompt]), max_new_tokens=12, temperature=0, draft=draft)
            assert isinstance(results, list) and len(results) == 1
            assert results[0].token_ids == plain and results[0].speculation is not None



def test_draft_of_a_model_whose_embedding_is_padded_past_its_tokenizer():
    """config.vocab_size 320 for a 257-token tokenizer (nanoGPT pads GPT-2's 50257 to 50304): two
    copies loaded apart have equal tokenizers, but decoding a padding id fails in both, and that
    failure refused the draft as "a different vocabulary"."""
    model = toy_model(seed=0, vocab_size=320)
    draft = toy_model(seed=1, vocab_size=320)  # its own tokenizer object, the same tokens
    assert model.tokenizer is not draft.tokenizer
    prompt = list(b"abcabcabc")
    plain = generate(model, prompt, temperature=0, max_new_tokens=12)
    assert generate(model, prompt, temperature=0, max_new_tokens=12, draft=draft).token_ids == plain.token_ids
    # still refused: the same size, padded, but another token text (id 256 is <s>, not the EOS)
    other = toy_model(seed=1, vocab_size=320, tokenizer=byte_tokenizer(with_eos=False, with_bos=True))
    with pytest.raises(GenerationError, match="vocabulary differs"):
        generate(model, prompt, max_new_tokens=4, draft=other)


# -- sampling: the distribution is the model's -------------------------------------------------

VOCAB, NEW, RUNS = 3, 4, 600
SAMPLING = dict(temperature=0.9, top_k=2)  # warped: the rule must use what plain sampling draws from


def tiny(seed: int, scale: float) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(preset("llama", vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                               max_seq_len=16, multiple_of=16)).eval()
    with torch.no_grad():
        model.unembed.weight.mul_(scale)
    return model


def exact_probabilities(model: Transformer, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """Every NEW-token continuation's probability under temperature 0.9 and top-k 2, from the
    model's own logits (one forward pass over all of them), warped with torch directly."""
    outcomes = list(itertools.product(range(VOCAB), repeat=NEW))
    ids = torch.tensor([prompt + list(o) for o in outcomes])
    with torch.no_grad():
        logits = model(ids)[:, len(prompt) - 1:-1].double() / SAMPLING["temperature"]  # (N, NEW, V)
    kth = logits.topk(SAMPLING["top_k"], dim=-1).values[..., -1:]
    log_p = logits.masked_fill(logits < kth, float("-inf")).log_softmax(dim=-1)
    chosen = log_p.gather(-1, ids[:, len(prompt):, None])[..., 0].sum(-1).exp()
    return dict(zip(outcomes, chosen.tolist()))


def chi_square_p_value(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    from scipy.stats import chisquare

    counts = {o: 0 for o in exact}
    for s in samples:
        counts[s] += 1  # a KeyError here: an impossible sequence
    assert all(counts[o] == 0 for o in exact if exact[o] == 0)  # top-k's cut holds
    big = [o for o in exact if exact[o] * len(samples) >= 5]
    rest = [o for o in exact if o not in big and exact[o] > 0]
    observed = [counts[o] for o in big] + ([sum(counts[o] for o in rest)] if rest else [])
    expected = [exact[o] * len(samples) for o in big] + ([sum(exact[o] for o in rest) * len(samples)] if rest else [])
    expected = [e * sum(observed) / sum(expected) for e in expected]  # float64 sums, to scipy's tolerance
    return chisquare(observed, expected).pvalue


def sampled(model, prompt, draft) -> list[tuple[int, ...]]:
    return [tuple(generate(model, prompt, max_new_tokens=NEW, seed=seed, stop_on_eos=False, draft=draft,
                           draft_tokens=3, **SAMPLING).token_ids) for seed in range(RUNS)]


@pytest.mark.parametrize("guesser", ["prompt", "model"])
@pytest.mark.parametrize("rule", ["exact", "broken"])
def test_sampled_sequences_have_the_model_distribution(guesser, rule, monkeypatch):
    model = tiny(0, 4.0)
    draft = "prompt" if guesser == "prompt" else tiny(5, 4.0)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]  # prompt lookup always finds a draft
    if rule == "broken":  # the usual slip: after a rejection, draw from p instead of max(p - q, 0)
        monkeypatch.setattr(speculative, "_rejection_distribution", lambda p, q: p)
    exact = exact_probabilities(model, prompt)
    samples = sampled(model, prompt, draft)
    p_value = chi_square_p_value(samples, exact)
    if rule == "exact":
        assert p_value > 1e-3, p_value
    else:
        assert p_value < 1e-6, p_value


# -- the embedded SmolLM2, and the command line -----------------------------------------------

SMOL_PROMPTS = ["Repeat the following text exactly: The quick brown fox jumps over the lazy dog by the river.",
                "What is the capital of France?"]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["float32", "default"])
def test_smollm2_speculative_greedy_equals_plain_greedy(smollm2, smollm2_default, target):
    """In float32 drafted by the default 4-bit model, and in the default model drafted by float32.
    The default model checks its drafts in one C++ call (model/decode_block.py), which gives
    each token exactly what a plain step gives it: the same log-probabilities, bit for bit."""
    model, other = (smollm2, smollm2_default) if target == "float32" else (smollm2_default, smollm2)
    for prompt in SMOL_PROMPTS:
        plain = generate(model, prompt, chat=True, max_new_tokens=24, temperature=0, logprobs=2)
        for draft in ("prompt", other):
            spec = generate(model, prompt, chat=True, max_new_tokens=24, temperature=0, draft=draft, logprobs=2)
            assert spec.token_ids == plain.token_ids, (prompt, draft)
            assert spec.speculation.accepted > 0
            if target == "default":
                assert (spec.logprobs, spec.top_logprobs) == (plain.logprobs, plain.top_logprobs)


@pytest.mark.slow
def test_chat_with_a_draft_answers_as_without(smollm2, smollm2_default, tmp_path):
    """``lucidlm chat --draft``: every turn (the later ones continuing the kept cache) gives plain
    greedy's answer, /stats says how the drafts did, /set draft_tokens takes a new K, and /save
    keeps the draft out of the saved settings (it is the session's, as the model is)."""
    import io
    import json
    import re

    from lucidlm.commands.chat import chat_loop

    lines = ["Repeat exactly: the cat sat on the mat, and the dog sat on the log.", "/stats",
             "/set draft_tokens 3", "Now repeat it once more, exactly.", "/stats", "/show"]

    def transcript(draft, save_to=None):
        script = iter(lines + ([f"/save {save_to}"] if save_to else []))

        def read_line(_prompt):
            try:
                return next(script)
            except StopIteration:
                raise EOFError from None

        out = io.StringIO()
        options = dict(temperature=0, max_new_tokens=40, **({"draft": draft} if draft is not None else {}))
        assert chat_loop(smollm2_default, options, read_line=read_line, out=out, interactive=False) == 0
        return out.getvalue().splitlines()

    plain = transcript(None)
    assert plain[2] == "/set draft_tokens 3 needs speculative decoding: start the chat with --draft prompt " \
                       "(prompt lookup) or --draft SOURCE (a draft model)."
    for draft in ("prompt", smollm2):
        save_to = tmp_path / f"chat-{len(str(draft))}.json"
        drafted = transcript(draft, save_to)
        assert [drafted[0], drafted[3]] == [plain[0], plain[3]]  # the two answers
        assert re.search(r"; drafts: \d+ of \d+ kept in \d+ rounds; finish: eos\)$", drafted[1]), drafted[1]
        assert "drafts:" not in plain[1]
        assert drafted[2] == "(draft_tokens = 3)"
        assert ("draft prompt, draft_tokens 3" if draft == "prompt" else "draft a draft model, draft_tokens 3") \
            in drafted[5]
        assert json.loads(save_to.read_text())["settings"] == {"temperature": 0, "max_new_tokens": 40,
                                                               "draft_tokens": 3}


def test_a_chat_saved_with_a_draft_loads_into_a_chat_without_one(tmp_path):
    """/save keeps draft_tokens (the draft itself is the session's, as --model). A chat started
    without --draft loads that file all the same: the messages and the other settings, with
    draft_tokens left out and said so (refused, it kept the whole conversation out, in the
    API's words: 'draft_tokens=3 needs a draft: add draft=...'); a drafting chat keeps it."""
    import io
    import json

    from lucidlm.commands.chat import ChatSession

    model, path = toy_model(seed=0), tmp_path / "drafted.json"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    out = io.StringIO()
    drafting = ChatSession(model, {"temperature": 0.2, "draft": "prompt", "draft_tokens": 3}, None, out, False)
    drafting.convo.history.extend(messages)
    drafting.save(str(path))
    assert json.loads(path.read_text())["settings"] == {"temperature": 0.2, "draft_tokens": 3}

    plain = ChatSession(model, {"temperature": 0.7, "seed": 1}, None, out, False)
    plain.load(str(path))
    assert out.getvalue().splitlines()[-1] == \
        f"(loaded 2 messages from {path}; draft_tokens 3 left out: this chat has no --draft)"
    assert plain.convo.history == messages
    assert plain.settings == {"temperature": 0.2, "seed": 1}
    again = ChatSession(model, {"draft": "prompt", "draft_tokens": 5}, None, out, False)
    again.load(str(path))
    assert out.getvalue().splitlines()[-1] == f"(loaded 2 messages from {path})"
    assert again.settings == {"temperature": 0.2, "draft": "prompt", "draft_tokens": 3}
    again.set("draft_tokens default")  # lucidlm's 5, which no model's files set (it said "the model default")
    assert out.getvalue().splitlines()[-1] == "(draft_tokens = 5, the default)"
    assert again.settings["draft_tokens"] is None
    again.set("seed default")  # no model's files set a seed either
    assert out.getvalue().splitlines()[-1] == "(seed = none: each answer draws afresh)"

    # a file naming a draft (written by hand: /save leaves it out) turns no drafting on, and says so
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"messages": messages, "settings": {"draft": "prompt", "draft_tokens": 4}}))
    plain = ChatSession(model, {"temperature": 0.7}, None, out, False)
    plain.load(str(named))
    assert out.getvalue().splitlines()[-1] == (f"(loaded 2 messages from {named}; draft_tokens 4 left out: this chat "
                                               f"has no --draft; its draft left out: a chat drafts with its own --draft)")
    assert plain.settings == {"temperature": 0.7}
    drafting = ChatSession(model, {"draft": "prompt"}, None, out, False)
    drafting.load(str(named))
    assert drafting.settings == {"draft": "prompt", "draft_tokens": 4}


def test_cli_draft_flags(tmp_path, capsys, monkeypatch):
    import json

    from lucidlm import cli
    from lucidlm.weights.checkpoint import save_model

    monkeypatch.setattr(cli, "COMMANDS", ("generate",))
    model = toy_model(seed=0)
    save_model(model, tmp_path / "target")
    save_model(toy_model(seed=1), tmp_path / "draft")
    expected = generate(model, "Hello Hello Hello", temperature=0, max_new_tokens=12).token_ids
    for draft in ("prompt", str(tmp_path / "draft")):
        assert cli.main(["generate", "Hello Hello Hello", "--model", str(tmp_path / "target"), "--temperature", "0",
                         "--max-new-tokens", "12", "--draft", draft, "--draft-tokens", "3", "--json", "-q"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["token_ids"] == expected
        assert 0 <= data["accepted_tokens"] <= data["drafted_tokens"] <= 3 * data["draft_rounds"]
    assert cli.main(["generate", "Hi", "--model", str(tmp_path / "target"), "--draft-tokens", "3", "-q"]) == 1
    assert "--draft-tokens 3 needs --draft" in capsys.readouterr().err
    monkeypatch.setattr(cli, "COMMANDS", ("chat",))
    assert cli.main(["chat", "--model", str(tmp_path / "target"), "--draft-tokens", "3", "-q"]) == 1
    assert "--draft-tokens 3 needs --draft" in capsys.readouterr().err
    assert cli.main(["chat", "--model", str(tmp_path / "target"), "--draft", str(tmp_path / "nowhere"), "-q"]) == 1
    assert "--draft " + str(tmp_path / "nowhere") + ": no such file or directory" in capsys.readouterr().err


def test_cli_missing_draft_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import lucidlm
    from lucidlm import cli
    from lucidlm.weights.checkpoint import save_model

    monkeypatch.setattr(cli, "COMMANDS", ("generate",))
    save_model(toy_model(seed=0), tmp_path / "target")
    loaded = []
    real_load = lucidlm.load
    monkeypatch.setattr(lucidlm, "load", lambda *a, **k: loaded.append(a) or real_load(*a, **k))
    missing = str(tmp_path / "no_such_draft")
    assert cli.main(["generate", "Hi", "--model", str(tmp_path / "target"), "--draft", missing, "-q"]) == 1
    assert f"--draft {missing}: no such file" in capsys.readouterr().err
    assert loaded == []  # the target did not load first


@pytest.mark.parametrize("command, flags, message", [
    ("generate", ["--draft", "prompt", "--num-beams", "2"],
     "--draft (speculative decoding) does not work with beam search (--num-beams 2); drop one of them."),
    ("generate", ["--draft", "prompt", "--context-overflow", "crop"],
     "--draft (speculative decoding) does not work with --context-overflow crop; drop one of them"),
    ("chat", ["--draft", "prompt", "--context-overflow", "crop"],  # every turn failed, the session open
     "--draft (speculative decoding) does not work with --context-overflow crop; drop one of them"),
    ("generate", ["--context-overflow", "crop", "--num-beams", "3"],
     "--context-overflow crop works with sampling and greedy decoding, not beam search (--num-beams 3); drop one"),
])
def test_cli_flags_generate_refuses_together_are_refused_before_the_model_loads(command, flags, message, tmp_path,
                                                                                capsys, monkeypatch):
    """Said in the flags' words before anything loads: they were refused only once the model had
    loaded, in generate()'s keywords (draft=..., num_beams=1, context_overflow='stop'), and by
    chat at every turn."""
    import lucidlm
    from lucidlm import cli
    from lucidlm.weights.checkpoint import save_model

    monkeypatch.setattr(cli, "COMMANDS", (command,))
    save_model(toy_model(seed=0), tmp_path / "target")
    loaded = []
    monkeypatch.setattr(lucidlm, "load", lambda *a, **k: loaded.append(a))
    prompt = ["Hi"] if command == "generate" else []
    assert cli.main([command, *prompt, "--model", str(tmp_path / "target"), *flags, "-q"]) == 1
    err = capsys.readouterr().err
    assert message in err and "=" not in err, err
    assert loaded == []


def test_cli_a_draft_of_another_vocabulary_is_refused_as_it_loads(tmp_path, capsys, monkeypatch):
    """Once both have loaded, before any prompt (chat took the session and failed every turn),
    and in the flags' words (draft='prompt' was the API's)."""
    from lucidlm import cli
    from lucidlm.weights.checkpoint import save_model

    save_model(toy_model(seed=0), tmp_path / "target")
    save_model(toy_model(tokenizer=byte_tokenizer(with_eos=False)), tmp_path / "other")
    for command in ("generate", "chat"):
        monkeypatch.setattr(cli, "COMMANDS", (command,))
        monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
        prompt = ["Hi"] if command == "generate" else []
        assert cli.main([command, *prompt, "--model", str(tmp_path / "target"), "--draft", str(tmp_path / "other"),
                         "-q"]) == 1
        err = capsys.readouterr().err
        assert f"--draft {tmp_path / 'other'}: the draft model's vocabulary differs from the model's (256 tokens " \
               f"against 257, or other token texts): its ids would mean other tokens. Use a draft of the same " \
               f"family and tokenizer, or --draft prompt." in err, err


def test_accepted_counts_only_the_tokens_handed_out():
    """A stop string inside a round of kept drafts ends the text there: the drafts after it are in
    no result, so accepted_tokens must not count them (8 accepted for 4 new tokens was reported)."""
    model, same = toy_model(seed=0), toy_model(seed=0)  # the same weights: every draft is kept
    prompt = list(b"abcabc")
    plain = generate(model, prompt, temperature=0, max_new_tokens=20).token_ids
    stop = model.tokenizer.decode(plain[2:4])
    result = generate(model, prompt, temperature=0, max_new_tokens=20, draft=same, draft_tokens=8, stop=[stop])
    assert result.finish_reason == "stop" and result.token_ids == plain[:len(result.token_ids)]
    stats = result.speculation
    assert stats.drafted == 8 and stats.accepted == len(result.token_ids) - 1  # the first token is the prompt's
