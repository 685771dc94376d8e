"""``lucidlm train -q`` and ``lucidlm finetune --quiet``, as ``generate -q``: no header,
progress bars, evaluation lines or samples on the terminal; warnings, errors and the final
summary still show, and metrics.jsonl and loss.png are what a run that talks writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lucidlm import cli

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"
TINY = ["--preset", "seed000", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8",
        "--batch-size", "2", "--max-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--sample-tokens", "4",
        "--warmup-iters", "0", "--lr-decay-iters", "4"]
TUNE = ["--max-iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--batch-size", "2", "--block-size", "8",
        "--sample-tokens", "3"]  # its default warm-up is longer than 2 steps: a warning that must still show
TIMED = {"tokens_per_s", "elapsed", "seconds", "time", "train_seconds", "wall_seconds"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    if not SHAKESPEARE.exists():
        pytest.skip(f"{SHAKESPEARE} not found")
    path = tmp_path_factory.mktemp("corpus") / "head.txt"
    path.write_text(SHAKESPEARE.read_text()[:20000])
    return path


def _run(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMED and not k.endswith("_s")} for row in rows]


def test_train_and_finetune_quiet(corpus, tmp_path, capsys):
    code, loud, _ = _run(capsys, "train", "--data", str(corpus), "--out", str(tmp_path / "loud"), *TINY)
    assert code == 0 and any(line.startswith("step 2: train loss") for line in loud)  # what -q leaves out
    code, quiet, err = _run(capsys, "train", "-q", "--data", str(corpus), "--out", str(tmp_path / "quiet"), *TINY)
    assert code == 0 and err == ""
    assert len(quiet) == 1 and quiet[0].startswith("done: step 4, val loss"), quiet  # the summary alone
    assert _metrics(tmp_path / "quiet") == _metrics(tmp_path / "loud")  # the same run, recorded the same
    assert (tmp_path / "quiet" / "loss.png").stat().st_size > 0

    code, tuned, err = _run(capsys, "finetune", "--quiet", "--model", str(tmp_path / "quiet"), "--data", str(corpus),
                            "--out", str(tmp_path / "tuned"), *TUNE)
    assert code == 0 and err == ""
    assert tuned[0].startswith("warning: --max-iters 2 ends inside"), tuned  # warnings still show
    assert tuned[1].startswith("done in ") and "step 2, val loss" in tuned[1], tuned
    assert not any(word in line for line in tuned for word in ("evaluating", "sample:", "step 1:", "training "))
    assert (tmp_path / "tuned" / "loss.png").exists() and len(_metrics(tmp_path / "tuned")) == 3

    code, _, err = _run(capsys, "train", "-q", "--data", str(tmp_path / "missing.txt"), "--out",
                        str(tmp_path / "none"), *TINY)
    assert code != 0 and "lucidlm train: error" in err and "missing.txt" in err  # errors still show
