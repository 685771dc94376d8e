"""host_memory.keep_freed_memory: inside the block a large buffer allocated again and again is
faulted in once, not every time; after the block glibc's behaviour is back; Trainer.fit runs
inside it. Page faults are counted by the kernel (getrusage), not by the code under test."""

import json
import platform
import subprocess
import sys

import pytest

from lucidlm import host_memory
from lucidlm.training import TrainConfig, train

BUFFER_MB = 64  # over glibc's largest mmap threshold (32 MB): mapped afresh on every allocation by default
PAGES = BUFFER_MB * 256

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or host_memory._glibc() is None,
                                reason="glibc's malloc (Linux)")


# Run in a fresh interpreter: in a long test session the heap already holds large free chunks
# (left by earlier tests), and glibc serves a new buffer from one of those, resident, before
# it would map one afresh, so "the default" would depend on which tests ran first.
SCENARIO = f"""
import json, resource, torch
from lucidlm import host_memory

def faults_per_allocation(rounds):
    faults = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = torch.empty({BUFFER_MB} << 18, dtype=torch.float32)  # {BUFFER_MB} MiB
        buffer.fill_(1.0)
        del buffer
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults

default = faults_per_allocation(3)
with host_memory.keep_freed_memory():
    # The heap grows over the first few rounds (torch's aligned allocations do not fit the
    # hole a freed buffer leaves at first); then the buffer's pages are reused as they are.
    settled = faults_per_allocation(16)[-4:]
    with host_memory.keep_freed_memory():  # nested: the inner end must not undo the outer
        pass
    settled += faults_per_allocation(4)
after = faults_per_allocation(3)
print(json.dumps(dict(default=default, settled=settled, after=after)))
"""


def test_a_freed_buffer_is_reused_inside_the_block_and_mapped_afresh_outside():
    run = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    faults = json.loads(run.stdout.strip().splitlines()[-1])
    # glibc's default: the buffer is mapped afresh each time, so it faults in every time: one
    # fault per 4 KiB page, or per 2 MiB where transparent huge pages are on for every mapping.
    default = min(faults["default"])
    assert default >= PAGES // 512, faults
    assert max(faults["settled"]) < 0.05 * default, faults
    # The block's end gave the kept pages back: the next buffer faults in again. (Later ones may
    # reuse that heap chunk as it is: glibc's ordinary reuse of a freed heap chunk, not the block's.)
    assert faults["after"][0] > 0.5 * default, faults


def test_training_runs_inside_the_block(tmp_path):
    seen = []

    class Probe:
        def on_fit_start(self, trainer):
            seen.append(host_memory._keeping)

        def __getattr__(self, name):  # every other callback hook: nothing to do
            return lambda *args, **kwargs: None

    data = tmp_path / "text.txt"
    data.write_text("to be or not to be, that is the question. " * 200)
    config = TrainConfig(data=str(data), out_dir=str(tmp_path / "run"), tokenizer="char", n_layer=1, n_head=2,
                         n_embd=16, block_size=16, batch_size=4, max_iters=2, eval_interval=2, eval_iters=1,
                         sample_tokens=0, progress=False)
    train(config, callbacks=[Probe()])
    assert seen == [1]
    assert host_memory._keeping == 0
