"""Fine-tuning under torchrun with 2 CPU processes (gloo), DDP and FSDP2, every method (LoRA,
bottleneck adapters, prefix, full) in one program: per-step losses equal one process's on the
same global batch (examples of different lengths with masked prompts, so the ranks count
different numbers of tokens), what rank 0 writes loads in one process and gives the
one-process run's logits, and one process resumes the distributed checkpoint to the end the
single-process run reaches."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import lucidlm
from lucidlm.config import preset
from lucidlm.errors import CheckpointError
from lucidlm.generation import generate
from lucidlm.model.transformer import Transformer
from lucidlm.tokenizers import CharTokenizer
from lucidlm.training.config import FinetuneConfig
from lucidlm.training.finetune import finetune
from lucidlm.weights.checkpoint import save_model

METHODS = ("lora", "adapter", "prefix", "full")
ALPHABET = "abcdefghijklmnopqrstuvwxyz ?.:\n"
PROMPT = "what is xx?"
# 4 of the 8 steps the schedule is laid out for: the rest is run by the one-process resume.
SETTINGS = dict(rank=4, alpha=8.0, lora_dropout=0.0, targets="q,v,down", bottleneck=8, prefix_length=4,
                gradient_accumulation_steps=2, max_iters=4, lr_decay_iters=8, warmup_iters=2, learning_rate=1e-2,
                eval_interval=2, eval_iters=2, sample_tokens=0, progress=False, log_interval=1, mask_prompt=True,
                max_length=24)

# One program trains every method in turn (the process group is made once and reused).
SCRIPT = """
import json, shlex, sys, torch
torch.set_num_threads(1)
from lucidlm.cli import main
from lucidlm.training.config import FinetuneConfig, command_line
from lucidlm.training.finetune import finetune
root, strategy, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
PROMPT = {prompt!r}
def config(method, out, **changes):
    return FinetuneConfig(model=root + "/base", data=root + "/qa.jsonl", out_dir=root + "/" + out + "-" + strategy,
                          method=method, strategy=strategy, batch_size=2, **{**settings, **changes})
def tune(method, out, **changes):
    finetune(config(method, out, **changes))
for method in sys.argv[4].split(","):
    tune(method, method)
# Resuming under torchrun: LoRA with dropout, stopped at step 2 and resumed, against 4 steps in one go.
tune("lora", "dropout", lora_dropout=0.1, sample_tokens=4, sample_prompt=PROMPT)  # samples must not move the RNG
tune("lora", "resumed", lora_dropout=0.1, max_iters=2)
# The resume goes through the command the run prints on Ctrl-C: lucidlm finetune under torchrun.
words = shlex.split(command_line(config("lora", "resumed", lora_dropout=0.1), "finetune", 2, resume=True))
assert words[:5] == ["torchrun", "--nproc_per_node", "2", "-m", "lucidlm"], words
assert main(words[5:]) == 0
# One process's checkpoints (copied in by the test) continued by 2 processes.
for method in ("lora", "full"):
    tune(method, "grown-" + method, max_iters=8, resume=True)
""".replace("{prompt!r}", repr(PROMPT))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny runs on one torch thread


def config(root: Path, method: str, out: Path, **overrides) -> FinetuneConfig:
    return FinetuneConfig(model=str(root / "base"), data=str(root / "qa.jsonl"), out_dir=str(out), method=method,
                          **{"batch_size": 4, **SETTINGS, **overrides})


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """A tiny Llama, examples of 12 to 27 tokens, and every method tuned in this process with
    the global batch of 4: ``{method}-4`` after 4 steps, ``{method}-8`` resumed to 8."""
    root = tmp_path_factory.mktemp("finetune")
    tokenizer = CharTokenizer.train(ALPHABET)
    torch.manual_seed(0)
    base = Transformer(preset("llama", vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4,
                              n_kv_heads=2, d_mlp=64, max_seq_len=32), tokenizer=tokenizer)
    base.reset_parameters(0.3)
    save_model(base, root / "base")
    rng = np.random.default_rng(0)
    lines = [{"prompt": f"what is {'x' * a}?", "completion": f" {'y' * b}."} for a, b in rng.integers(0, 9, (48, 2))]
    (root / "qa.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    for method in METHODS:
        finetune(config(root, method, root / f"{method}-4"))
        shutil.copytree(root / f"{method}-4", root / f"{method}-8")
        finetune(config(root, method, root / f"{method}-8", max_iters=8, resume=True))
    return root


def losses(out: Path) -> list[float]:
    return json.loads((out / "checkpoint" / "trainer_state.json").read_text())["train_losses"]


def tuned(root: Path, method: str, out: Path):
    """The model a user gets from a run's OUT, in this one process."""
    if method == "full":
        return lucidlm.load(str(out))
    return lucidlm.load(str(root / "base"), adapter=str(out))


def digest(directory: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())).hexdigest()


@pytest.mark.slow  # one torchrun of 2 processes (~25 s) and 16 tiny in-process runs
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distributed_finetuning_equals_one_process_and_resumes_in_one(single, strategy, capsys):
    root = single
    script = root / "tune_all.py"
    script.write_text(SCRIPT)
    for method in ("lora", "full"):
        shutil.copytree(root / f"{method}-4", root / f"grown-{method}-{strategy}")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(root), strategy, json.dumps(SETTINGS), ",".join(METHODS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"2 process(es), {strategy}") == len(METHODS) + 5
    assert done.stdout.count("resuming a run of 1 process(es) with 2") == 2
    assert done.stdout.count("done in") == 1  # the CLI's summary: rank 0's only
    for method in ("lora", "full"):  # 2 processes end where one process ends
        grown, one = losses(root / f"grown-{method}-{strategy}"), losses(root / f"{method}-8")
        assert len(grown) == 8 and max(abs(a - b) for a, b in zip(grown, one)) <= 1e-5, (method, grown, one)
    # Samples at each evaluation, FSDP included (every rank decodes, gathering the whole model):
    # at step 0 LoRA's B is zero, so tuned and base continue the prompt as the base model does here.
    base = lucidlm.load(str(root / "base"))
    records = [json.loads(line) for line in (root / f"dropout-{strategy}" / "metrics.jsonl").open()]
    expected = PROMPT + base.tokenizer.decode(list(generate(base, base.tokenizer.encode(PROMPT), max_new_tokens=4,
                                                            temperature=0.0).token_ids))
    assert [r["step"] for r in records] == [0, 2, 4] and records[0]["sample"] == expected
    assert all(r["base_sample"] == expected and r["sample"].startswith(PROMPT) for r in records)
    # A 2-process run resumed by 2 processes is bit-identical (every rank's dropout RNG restored).
    uninterrupted, resumed = root / f"dropout-{strategy}", root / f"resumed-{strategy}"
    assert losses(resumed) == losses(uninterrupted) and len(losses(resumed)) == 4
    adapter, reference = (load_file(str(d / "checkpoint" / "trainable.safetensors")) for d in (resumed, uninterrupted))
    assert adapter.keys() == reference.keys() and all(torch.equal(adapter[k], reference[k]) for k in adapter)
    ids = torch.tensor([base.tokenizer.encode("what is xxx? yy")])  # (1, T)
    with torch.no_grad():
        base_logits = base.forward(ids)  # (1, T, V)
    for method in METHODS:
        out = root / f"{method}-{strategy}"
        distributed, one = losses(out), losses(root / f"{method}-4")
        assert len(distributed) == 4 and distributed[-1] < distributed[0] - 0.2, (method, distributed)
        # Same examples, same math; only the order of float additions differs (gradient all-reduce).
        assert max(abs(a - b) for a, b in zip(distributed, one)) <= 1e-5, (method, distributed, one)
        with torch.no_grad():
            ours, reference = tuned(root, method, out).forward(ids), tuned(root, method, root / f"{method}-4").forward(ids)
        assert (reference - base_logits).abs().max() > 1e-2  # the tuning shows in the logits
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)

        # One process continues the 2-process run: the same global batch of 4 is required...
        before = digest(out)
        with pytest.raises(CheckpointError, match=r"global batch .*2 x 2 -> 2 x 1.*--batch-size 4"):
            finetune(config(root, method, out, batch_size=2, max_iters=8, resume=True))
        assert digest(out) == before
        # ...and with it the run ends where the one-process run ends.
        result = finetune(config(root, method, out, max_iters=8, resume=True))
        assert "resuming a run of 2 process(es) with 1" in capsys.readouterr().out
        reference_losses = losses(root / f"{method}-8")
        assert result.step == 8 and max(abs(a - b) for a, b in zip(result.train_losses, reference_losses)) <= 1e-5
        payload = "model.safetensors" if method == "full" else "trainable.safetensors"
        weights, expected = (load_file(str(d / "checkpoint" / payload)) for d in (out, root / f"{method}-8"))
        assert weights.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], atol=1e-4, rtol=1e-4)

