"""Training from scratch: corpus -> memory-mapped token windows -> masked cross-entropy ->
AdamW with warmup + cosine decay -> atomic checkpoints that resume exactly; one process
or many under ``torchrun``.

>>> from lucidlm.training import TrainConfig, train
>>> result = train(TrainConfig(data="input.txt", out_dir="out", max_iters=2000))
>>> model = lucidlm.load("out")   # reads out/checkpoint/
"""

from lucidlm.training.data import PaddedBatch, TokenData, count_batches, get_batch, pad_batch, prepare_data
from lucidlm.training.loss import IGNORE_INDEX, masked_cross_entropy
from lucidlm.training.schedule import get_lr
from lucidlm.training.trainer import TrainConfig, Trainer, TrainResult, model_config_for, train

__all__ = [
    "IGNORE_INDEX", "PaddedBatch", "TokenData", "TrainConfig", "TrainResult", "Trainer", "count_batches",
    "get_batch", "get_lr", "masked_cross_entropy", "model_config_for", "pad_batch", "prepare_data", "train",
]
