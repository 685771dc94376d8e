"""lm-evaluation-harness against ``lucidlm serve``: its ``local-completions`` client (prompt
log-probs by ``echo`` + ``logprobs``, tokens through the server's ``/tokenize``) scores and
generates with the float32 SmolLM2 served, and must give what lm-evaluation-harness's own
transformers backend (``HFLM``) gives on transformers' float32 SmolLM2 read from the same GGUF
file. The tokenizer routes are held to transformers' tokenizer of that file."""

from __future__ import annotations

import json
import urllib.request

import pytest

from serving_helpers import NAME, post, served

lm_eval_models = pytest.importorskip("lm_eval.models.openai_completions")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [("The capital of France is", " Paris"), ("The capital of France is", " London"),
         ("Question: What is 2 + 2?\nAnswer:", " 4"), ("Water boils at 100 degrees", " Celsius at sea level."),
         ("Hello", " world, how are you?")]


@pytest.fixture(scope="module")
def server(smollm2):
    with served(smollm2) as server:
        yield server


@pytest.fixture(scope="module")
def harness_client(server):
    return lm_eval_models.LocalCompletionsAPI(base_url=f"{server.url}/completions", model=NAME,
                                              tokenizer_backend="remote", batch_size=2, max_retries=1)


@pytest.fixture(scope="module")
def harness_reference(hf_smollm2):
    hf, tokenizer = hf_smollm2
    return HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=1)


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def test_loglikelihoods_are_the_harness_transformers_backends(harness_client, harness_reference):
    got = harness_client.loglikelihood(requests("loglikelihood", PAIRS))
    want = harness_reference.loglikelihood(requests("loglikelihood", PAIRS))
    assert [greedy for _, greedy in got] == [greedy for _, greedy in want]
    assert any(greedy for _, greedy in want) and not all(greedy for _, greedy in want)  # both kinds checked
    assert [value for value, _ in got] == pytest.approx([value for value, _ in want], abs=2e-4)


def test_rolling_loglikelihood_and_generation_are_the_harness_transformers_backends(harness_client,
                                                                                      harness_reference):
    """Rolling: a whole text's log-likelihood, its first token scored after the end token (the
    client reads that token's id through /tokenizer_info and /tokenize)."""
    texts = [("To be, or not to be, that is the question.",)]
    got = harness_client.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    want = harness_reference.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    assert got == pytest.approx(want, abs=2e-4)
    asks = [("The capital of France is", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False})]
    assert harness_client.generate_until(requests("generate_until", asks)) == \
        harness_reference.generate_until(requests("generate_until", asks))


def test_tokenize_and_detokenize_are_the_files_tokenizer(server, hf_smollm2):
    _, tokenizer = hf_smollm2
    text = "Hello <|im_end|> wörld 日本\n\n  tabs\tand 1234"  # a special token, a split character, spaces
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    for body in ({"prompt": text}, {"content": text}, {"prompt": text, "add_special_tokens": False},
                 {"content": text, "add_special": True}):
        assert post(server, "/tokenize", body) == (200, {"tokens": want, "count": len(want), "max_model_len": 8192})
    assert 2 in want  # <|im_end|> read as the special token, as vLLM and llama-server read it
    status, pieces = post(server, "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200 and [p["id"] for p in pieces["tokens"]] == want
    # each piece the token's own text, or its bytes where it holds part of a character (日 here)
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"])
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                      for p in pieces["tokens"])
    assert joined.decode() == text
    assert post(server, "/detokenize", {"tokens": want}) == (200, {"prompt": tokenizer.decode(want),
                                                                     "content": tokenizer.decode(want)})
    host, port = server.server_address[:2]
    with urllib.request.urlopen(f"http://{host}:{port}/tokenizer_info", timeout=60) as response:
        info = json.loads(response.read())
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == \
        (tokenizer.eos_token, tokenizer.bos_token, 8192)
    assert info["chat_template"] == tokenizer.chat_template


@pytest.mark.parametrize("path, body, fragment, param", [
    ("/tokenize", {}, "give the text to tokenize as prompt", "prompt"),
    ("/tokenize", {"prompt": "a", "content": "b"}, "give the text to tokenize as prompt", "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt=5 is invalid: expected the text", "prompt"),
    ("/tokenize", {"prompt": "a", "add_special": "yes"}, 'add_special="yes" is invalid', "add_special"),
    ("/tokenize", {"prompt": "a", "add_special": True, "add_special_tokens": True}, "not both", "add_special"),
    ("/tokenize", {"promt": "a"}, "did you mean 'prompt'?", "promt"),
    ("/detokenize", {"tokens": [1, 99999]}, "token id 99999, outside this model's vocabulary 0..49151", "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 'tokens="1 2" is invalid: expected a list of token ids', "tokens"),
])
def test_bad_tokenizer_requests_are_400s_naming_the_field(server, path, body, fragment, param):
    status, answer = post(server, path, body)
    assert status == 400 and answer["error"]["param"] == param and fragment in answer["error"]["message"]
