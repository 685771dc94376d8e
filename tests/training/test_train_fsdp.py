"""FSDP2 under torchrun with 2 CPU processes (gloo): pre-training and LoRA fine-tuning lose
exactly what one process loses on the same global batch, and the sharded run's
checkpoint loads in a single process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lucidlm
from lucidlm.config import preset
from lucidlm.model.transformer import Transformer
from lucidlm.tokenizers import CharTokenizer
from lucidlm.weights.checkpoint import save_model

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"
STEPS = 8

SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from lucidlm.training import TrainConfig, pretrain
from lucidlm.training.config import FinetuneConfig
from lucidlm.training.finetune import finetune
root, batch, strategy, recipe = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
common = dict(batch_size=batch, gradient_accumulation_steps=2, max_iters={steps}, lr_decay_iters={steps},
              warmup_iters=2, learning_rate=1e-2, min_lr=1e-3, eval_interval=4, eval_iters=2, sample_tokens=0,
              progress=False, strategy=strategy, log_interval=1)
if recipe == "pre":
  pretrain(TrainConfig(data=root + "/head.txt", out_dir=root + "/pre-" + strategy, n_layer=2, n_head=2, n_embd=32,
                     block_size=16, dropout=0.0, **common))
else:
  finetune(FinetuneConfig(model=root + "/base", data=root + "/qa.jsonl", out_dir=root + "/lora-" + strategy,
                        rank=4, alpha=8.0, lora_dropout=0.0, targets="q,v,down", **common))
""".format(steps=STEPS)


def losses(out: Path) -> list[float]:
    return json.loads((out / "checkpoint" / "trainer_state.json").read_text())["train_losses"]


@pytest.mark.slow  # two torchrun processes and one plain one, each importing torch: ~40 s
def test_fsdp_matches_one_process_and_its_checkpoint_loads_alone(tmp_path):
    text = SHAKESPEARE.read_text()[:30000]
    (tmp_path / "head.txt").write_text(text)
    tokenizer = CharTokenizer.train(text)
    torch.manual_seed(0)
    base = Transformer(preset("llama", vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4,
                              n_kv_heads=2, d_mlp=64, max_seq_len=32), tokenizer=tokenizer)
    base.reset_parameters(0.3)
    save_model(base, tmp_path / "base")
    lines = [{"prompt": text[i: i + 12], "completion": text[i + 12: i + 24]} for i in range(0, 4000, 100)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    for recipe in ("pre", "lora"):  # one process group per program: each recipe in its own torchrun
        # Each of the 2 ranks takes 4 of the same 8 sequences the single process draws.
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               "2", str(script), str(tmp_path), "4", "fsdp", recipe], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "2 process(es), fsdp" in done.stdout
        subprocess.run([sys.executable, str(script), str(tmp_path), "8", "auto", recipe], check=True, timeout=600,
                       capture_output=True)

    for run in ("pre", "lora"):
        sharded, single = losses(tmp_path / f"{run}-fsdp"), losses(tmp_path / f"{run}-auto")
        assert len(sharded) == STEPS
        assert max(abs(a - b) for a, b in zip(sharded, single)) <= 1e-5, (run, sharded, single)
        assert sharded[-1] < sharded[0] - 0.1

    # The FSDP checkpoint is an ordinary model directory: one process loads and runs it.
    sharded_model, single_model = lucidlm.load(str(tmp_path / "pre-fsdp")), lucidlm.load(str(tmp_path / "pre-auto"))
    for (name, p), (_, q) in zip(sharded_model.named_parameters(), single_model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-4), name
    assert sharded_model.generate("ROMEO:", max_new_tokens=4, temperature=0).token_ids
    moments = load_file(str(tmp_path / "pre-fsdp" / "checkpoint" / "optimizer.safetensors"))
    reference = load_file(str(tmp_path / "pre-auto" / "checkpoint" / "optimizer.safetensors"))
    assert moments.keys() == reference.keys()
    assert all(torch.allclose(moments[k], reference[k], atol=1e-4) for k in moments)
    lora = load_file(str(tmp_path / "lora-fsdp" / "checkpoint" / "trainable.safetensors"))
    lora_single = load_file(str(tmp_path / "lora-auto" / "checkpoint" / "trainable.safetensors"))
    assert lora.keys() == lora_single.keys() and len(lora) == 2 * 3 * 2  # 2 layers x (q, v, down) x (A, B)
    assert all(torch.allclose(lora[k], lora_single[k], atol=1e-4) for k in lora)
