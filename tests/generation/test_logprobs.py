"""Per-token log-probs (``generate(..., logprobs=...)``) against transformers: the same values as
``compute_transition_scores`` on ``output_scores`` (the processed distribution the token was
drawn from) and, for greedy decoding, as ``log_softmax`` of ``output_logits``; the top-N
alternatives as ``topk`` of the same; beam search's as its transition scores with
``beam_indices``. Batches, streams, the crop path and the CLI give the same numbers."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch
from generation_toys import one_torch_thread, sharpened_llama_pair, toy_model  # noqa: F401 (autouse fixture)

from lucidlm import cli
from lucidlm.errors import GenerationError
from lucidlm.generation import generate, generate_batch, stream

transformers = pytest.importorskip("transformers")

EOS = 256
TOP = 5
SAMPLING = [dict(temperature=1.5, top_k=20), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=30,
                                                                                       top_p=0.8)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sharpened_llama_pair(tmp_path_factory.mktemp("tiny_llama"), EOS)


@contextmanager
def sampling_forced(tokens: list[int]):
    """transformers' sampler draws ``tokens`` in turn (its scores are what it would sample them
    from): torch.multinomial is replaced while its generate runs."""
    original = torch.multinomial
    queue = list(tokens)

    def forced(probs, num_samples, *args, **kwargs):
        token = queue.pop(0)
        assert probs[0, token] > 0, "transformers' filters removed the token lucidlm sampled"
        return torch.tensor([[token]])

    torch.multinomial = forced
    try:
        yield
    finally:
        torch.multinomial = original


def hf_scores(hf, prompt: list[int], tokens: list[int], eos: int = EOS, **options):
    """transformers' (log-probs of ``tokens``, its top-TOP (ids, log-probs) per step, raw logits)
    with ``options``, following ``tokens``."""
    sample = bool(options)
    kwargs = dict(do_sample=True, top_k=options.pop("top_k", 0), **options) if sample else dict(do_sample=False)
    with sampling_forced(tokens) if sample else contextmanager(lambda: (yield))():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), return_dict_in_generate=True,
                          output_scores=True, output_logits=True, eos_token_id=eos, pad_token_id=eos, **kwargs)
    assert out.sequences[0, len(prompt):].tolist() == tokens
    transition = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    top = torch.stack(out.scores)[:, 0].log_softmax(dim=-1).topk(TOP, dim=-1)  # (steps, TOP)
    return transition, top, torch.stack(out.logits)[:, 0]


def assert_top_equal(got, top, atol: float = 1e-4) -> None:
    """``got`` (per step, k (id, log-prob) pairs) is the first k of ``top`` (steps, TOP)."""
    k = len(got[0])
    assert [[token for token, _ in step] for step in got] == top.indices[:, :k].tolist()
    values = torch.tensor([[value for _, value in step] for step in got])
    torch.testing.assert_close(values, top.values[:, :k], rtol=0, atol=atol)


PROMPTS = [[5, 6, 7], [100, 20, 30, 40, 50], [250, 3, 3, 3, 9, 80, 81]]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_logprobs_equal_transformers(pair, prompt):
    hf, ours = pair
    result = generate(ours, prompt, max_new_tokens=10, temperature=0, logprobs=TOP)
    transition, top, logits = hf_scores(hf, prompt, result.token_ids)
    torch.testing.assert_close(torch.tensor(result.logprobs), transition, rtol=0, atol=1e-4)
    raw = logits.log_softmax(dim=-1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.logprobs), raw, rtol=0, atol=1e-4)  # greedy: the model's own
    assert_top_equal(result.top_logprobs, top)


@pytest.mark.parametrize("options", SAMPLING)
def test_sampled_logprobs_are_transformers_processed_distribution(pair, options):
    """Sampling: the log-probs of the processed distribution (temperature, top-k, top-p), what
    compute_transition_scores(normalize_logits=True) gives, and not the raw model's."""
    hf, ours = pair
    for seed, prompt in enumerate(PROMPTS):
        result = generate(ours, prompt, max_new_tokens=10, seed=seed, logprobs=TOP, **options)
        transition, top, logits = hf_scores(hf, prompt, result.token_ids, **options)
        torch.testing.assert_close(torch.tensor(result.logprobs), transition, rtol=0, atol=1e-4)
        assert_top_equal(result.top_logprobs, top)
        raw = logits.log_softmax(dim=-1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
        assert not torch.allclose(torch.tensor(result.logprobs), raw, atol=1e-3)  # not the model's raw ones


def test_logprobs_true_gives_no_alternatives_and_off_changes_nothing(pair):
    _, ours = pair
    options = dict(max_new_tokens=8, temperature=0.9, top_k=40, seed=5)
    plain = generate(ours, PROMPTS[0], **options)
    assert plain.logprobs is None and plain.top_logprobs is None
    scored = generate(ours, PROMPTS[0], logprobs=True, **options)
    assert scored.token_ids == plain.token_ids  # the same draws: recording takes no randomness
    assert len(scored.logprobs) == len(scored.token_ids) and scored.top_logprobs is None
    assert generate(ours, PROMPTS[0], logprobs=0, **options).logprobs == scored.logprobs
    for bad in (-1, 1.5, "3"):
        with pytest.raises(GenerationError, match="logprobs="):
            generate(ours, PROMPTS[0], logprobs=bad, **options)


def test_batch_rows_equal_single_prompts_and_stop_where_the_row_ends(pair):
    hf, ours = pair
    rows = generate_batch(ours, PROMPTS, max_new_tokens=12, temperature=0, logprobs=3)
    assert any(r.finish_reason == "eos" and len(r.token_ids) < 12 for r in rows)  # a row ended early
    for prompt, row in zip(PROMPTS, rows):
        alone = generate(ours, prompt, max_new_tokens=12, temperature=0, logprobs=3)
        assert row.token_ids == alone.token_ids
        assert len(row.logprobs) == len(row.top_logprobs) == len(row.token_ids)  # padded steps left out
        torch.testing.assert_close(torch.tensor(row.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5)
        transition, top, _ = hf_scores(hf, prompt, row.token_ids)
        torch.testing.assert_close(torch.tensor(row.logprobs), transition, rtol=0, atol=1e-4)
        assert_top_equal(row.top_logprobs, top)


def test_stream_result_equals_generate(pair):
    _, ours = pair
    options = dict(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=2, logprobs=4)
    expected = generate(ours, PROMPTS[1], **options)
    pieces = stream(ours, PROMPTS[1], **options)
    "".join(pieces)
    assert pieces.result.token_ids == expected.token_ids
    assert pieces.result.logprobs == expected.logprobs and pieces.result.top_logprobs == expected.top_logprobs


def test_crop_path_logprobs_are_the_windows():
    """Past the context (context_overflow="crop") each token's log-prob is that of the last
    max_seq_len tokens' logits, as torch computes them by hand."""
    model = toy_model(seed=0, max_seq_len=8)
    result = generate(model, [72, 101, 108, 108, 111], max_new_tokens=8, temperature=0, logprobs=2,
                      context_overflow="crop", stop_on_eos=False)
    ids = [72, 101, 108, 108, 111] + result.token_ids
    with torch.no_grad():
        for t, token in enumerate(result.token_ids):
            window = ids[:5 + t][-8:]
            log_probs = model(torch.tensor([window]))[0, -1].float().log_softmax(-1)
            assert result.logprobs[t] == pytest.approx(float(log_probs[token]), abs=1e-4)
            assert [i for i, _ in result.top_logprobs[t]] == log_probs.topk(2).indices.tolist()


@pytest.mark.parametrize("num_beams, length_penalty", [(2, 1.0), (4, 0.0), (3, 1.0)])
def test_beam_logprobs_are_transformers_transition_scores(pair, num_beams, length_penalty):
    hf, ours = pair
    for prompt in PROMPTS:
        result = generate(ours, prompt, num_beams=num_beams, length_penalty=length_penalty, max_new_tokens=10,
                          logprobs=3, repetition_penalty=1.3 if num_beams == 3 else None)
        out = hf.generate(torch.tensor([prompt]), do_sample=False, num_beams=num_beams, max_new_tokens=10,
                          length_penalty=length_penalty, eos_token_id=EOS, pad_token_id=EOS,
                          repetition_penalty=1.3 if num_beams == 3 else 1.0,
                          return_dict_in_generate=True, output_scores=True)
        transition = hf.compute_transition_scores(out.sequences, out.scores, out.beam_indices)[0]
        n = len(result.token_ids)
        assert out.sequences[0, len(prompt):len(prompt) + n].tolist() == result.token_ids
        torch.testing.assert_close(torch.tensor(result.logprobs), transition[:n], rtol=0, atol=1e-4)
        assert float(transition[n:].abs().sum()) == 0  # transformers pads after EOS with 0
        # the alternatives: the same step's row of scores, the beam the token came from
        rows = torch.stack([out.scores[t][int(out.beam_indices[0, t])] for t in range(n)])  # (n, V)
        top = rows.topk(3, dim=-1)
        assert_top_equal(result.top_logprobs, top)
        assert out.sequences_scores[0] == pytest.approx(sum(result.logprobs) / n ** length_penalty, abs=1e-4)


def test_beam_alternatives_past_the_vocabulary_are_every_token(pair):
    """logprobs=N above the vocabulary size gives every token's score, as sampling does; beam
    search failed on a size mismatch while extending its paths."""
    hf, ours = pair
    vocab = hf.config.vocab_size
    result = generate(ours, PROMPTS[0], num_beams=2, max_new_tokens=6, logprobs=vocab + 10)
    out = hf.generate(torch.tensor([PROMPTS[0]]), do_sample=False, num_beams=2, max_new_tokens=6, eos_token_id=EOS,
                      pad_token_id=EOS, return_dict_in_generate=True, output_scores=True)
    n = len(result.token_ids)
    assert out.sequences[0, len(PROMPTS[0]):len(PROMPTS[0]) + n].tolist() == result.token_ids
    assert all(len(step) == vocab for step in result.top_logprobs)
    rows = torch.stack([out.scores[t][int(out.beam_indices[0, t])] for t in range(n)])  # (n, V)
    got = torch.tensor([sorted(step) for step in result.top_logprobs])[..., 1]  # (n, V) in vocabulary order
    torch.testing.assert_close(got, rows, rtol=0, atol=1e-4)


def test_cli_json_carries_logprobs(pair, tmp_path, monkeypatch, capsys):
    """``generate --json --logprobs N``: the result's values, -inf as null; with --stream the last
    line carries them."""
    from lucidlm.weights.checkpoint import save_model

    monkeypatch.setattr(cli, "COMMANDS", ("generate",))
    _, ours = pair
    save_model(ours, tmp_path / "m")
    expected = generate(ours, "Hi", max_new_tokens=6, temperature=0.9, top_k=3, seed=1, logprobs=4)
    for extra in ([], ["--stream"]):
        code = cli.main(["generate", "Hi", "--model", str(tmp_path / "m"), "--temperature", "0.9", "--top-k", "3",
                         "--seed", "1", "--max-new-tokens", "6", "--logprobs", "4", "--json", "-q", *extra])
        assert code == 0
        data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert data["token_ids"] == expected.token_ids
        assert data["logprobs"] == pytest.approx(expected.logprobs)
        assert [[[i, v] for i, v in step] for step in expected.top_logprobs] == [
            [[i, float("-inf") if v is None else v] for i, v in step] for step in data["top_logprobs"]]
        assert all(step[3][1] is None for step in data["top_logprobs"])  # top-k 3 removed the 4th
    assert cli.main(["generate", "Hi", "--model", str(tmp_path / "m"), "--logprobs", "2"]) == 1
    assert "--json" in capsys.readouterr().err


def test_cli_refuses_a_negative_logprobs_by_its_flag(capsys):
    """--logprobs -1 is named as the flag, with what it takes, before any model loads; it was
    generate()'s message, which offers True / False / None, values no flag can give."""
    assert cli.main(["generate", "Hi", "--logprobs", "-1", "--json", "-q"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("lucidlm generate: error: --logprobs=-1 is invalid: expected a whole number >= 0"), err
    assert "True" not in err and "None" not in err, err


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=0.8, top_p=0.9)])
def test_embedded_model_logprobs_equal_transformers(smollm2, hf_smollm2, options):
    """SmolLM2 in float32, greedy and sampled: the same numbers as transformers on the same file."""
    hf, _ = hf_smollm2
    prompt = smollm2.tokenizer.encode("The capital of France is")
    result = generate(smollm2, prompt, max_new_tokens=6, seed=0, logprobs=TOP, stop_on_eos=False, **options)
    sample = options.get("temperature", 0) > 0
    eos = smollm2.tokenizer.eos_id  # not among the 6 tokens: both run to the length
    transition, top, _ = hf_scores(hf, prompt, result.token_ids, eos=eos, **(dict(options) if sample else {}))
    # 1e-3: the bound tests/weights/test_smollm2_parity.py holds the two models' logits to
    torch.testing.assert_close(torch.tensor(result.logprobs), transition, rtol=0, atol=1e-3)
    assert_top_equal(result.top_logprobs, top, atol=1e-3)


def test_recording_reads_nothing_back_and_a_compiled_step_compiles_once(monkeypatch):
    """The log-probs stay on the device while tokens come (no host sync added to a step), and a
    compiled decode step is traced once whether they are asked for or not."""
    from test_no_host_sync import reading_back_forbidden
    from torch._dynamo.testing import CompileCounter

    from lucidlm import LanguageModel
    from lucidlm.generation.logprobs import LogprobRecorder

    model = toy_model(seed=2, max_seq_len=512, model_cls=LanguageModel)
    eager = generate(model, [[5, 6, 7], [9, 8]], max_new_tokens=32, temperature=0.9, top_k=50, seed=1, logprobs=3,
                     stop_on_eos=False)
    original = LogprobRecorder.record

    def record_without_read_back(self, *args):
        with reading_back_forbidden():
            original(self, *args)

    monkeypatch.setattr(LogprobRecorder, "record", record_without_read_back)
    torch._dynamo.reset()
    counter = CompileCounter()
    model.compile(backend=counter, prefill=False)
    try:
        for logprobs in (3, None, True):
            compiled = generate(model, [[5, 6, 7], [9, 8]], max_new_tokens=32, temperature=0.9, top_k=50, seed=1,
                                logprobs=logprobs, stop_on_eos=False)
            assert [r.token_ids for r in compiled] == [r.token_ids for r in eager]
        assert counter.frame_count == 1, f"the decode step was compiled {counter.frame_count} times"
        compiled = generate(model, [[5, 6, 7], [9, 8]], max_new_tokens=32, temperature=0.9, top_k=50, seed=1,
                            logprobs=3, stop_on_eos=False)
        for ours, theirs in zip(compiled, eager):
            assert [[i for i, _ in s] for s in ours.top_logprobs] == [[i for i, _ in s] for s in theirs.top_logprobs]
            torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), rtol=0, atol=1e-5)
    finally:
        torch._dynamo.reset()
