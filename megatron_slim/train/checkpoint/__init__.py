"""Checkpoints of a ``megatron-slim train`` run, through ``torch.distributed.checkpoint``.

``layout``: the folders, ``latest`` and the checksum manifest, and which iteration to resume from;
``naming``: the state keyed by whole-model parameter names (so any pipeline / data-parallel split
loads it); ``store``: the collective save and load; ``resume``: the checks made before any work.
"""

from megatron_slim.train.checkpoint.resume import CHANGEABLE, check_checkpoint_dir, check_resumable
from megatron_slim.train.checkpoint.store import load, save

__all__ = ["CHANGEABLE", "check_checkpoint_dir", "check_resumable", "load", "save"]
