"""Training: one loop (``loop.Trainer``) and two recipes that build what it runs.

- ``pretrain(TrainConfig(...))``: a model from scratch on a text corpus (nanoGPT's train.py)
- ``finetune(FinetuneConfig(...))``: a pretrained model with LoRA, adapters, prefix tuning or
  all weights, on a text corpus or a JSONL dataset of examples

>>> from lucidlm.training import TrainConfig, pretrain
>>> result = pretrain(TrainConfig(data="input.txt", out_dir="out", max_iters=2000))
>>> model = lucidlm.load("out")   # reads out/checkpoint/

Both run in one process or many under ``torchrun`` (DDP, or FSDP2 with strategy="fsdp").
"""

from lucidlm.training.config import FinetuneConfig, LoopConfig, PretrainConfig, TrainConfig
from lucidlm.training.batches import PaddedBatch, get_batch, pad_batch
from lucidlm.training.data import TokenData, count_batches, prepare_data
from lucidlm.training.loop import Callback, Trainer, TrainResult
from lucidlm.training.loss import IGNORE_INDEX, masked_cross_entropy
from lucidlm.training.pretrain import build_pretraining, model_config_for, pretrain, train
# (the function takes the package attribute `finetune` from the submodule of that name)
from lucidlm.training.finetune import build_finetuning, finetune  # noqa: E402
from lucidlm.training.schedule import get_lr

__all__ = [
    "IGNORE_INDEX", "Callback", "FinetuneConfig", "LoopConfig", "PaddedBatch", "PretrainConfig", "TokenData",
    "TrainConfig", "TrainResult", "Trainer", "build_finetuning", "build_pretraining", "count_batches", "get_batch",
    "get_lr", "finetune", "masked_cross_entropy", "model_config_for", "pad_batch", "prepare_data", "pretrain", "train",
]
