"""``--dynmo-profile`` through the launcher: ``train.dynmo.profile.LayerProfiler`` on the decoder
layers of the model Megatron built, logged every ``--log-interval`` and written per rank.

Each rank writes ``<--dynmo-profile-dir>/layer_profile.rank<R>.json``: ``{"iteration", "rank",
"layers": [this rank's layers], "layer_profile": [every layer of the model]}``, each entry a
``plan.dynmo.profile.LayerProfile`` dict (what ``layer_costs`` reads), smoothed over iterations.
Optimizer bytes are the state this rank holds for a layer (a shard of it under the distributed
optimizer).
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from megatron_slim.megatron.dynmo.main_params import MainParams, OptimizerStateView


class ProfileLog:
    def __init__(self, args, model, main_params: MainParams, smoothing: float) -> None:
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        from megatron_slim.train.dynmo.profile import LayerProfiler

        self.args = args
        self._num_microbatches = get_num_microbatches
        chunks = [unwrapped(chunk) for chunk in model]
        self.profiler = LayerProfiler(
            chunks,
            OptimizerStateView(main_params),
            get_num_microbatches(),
            smoothing,
            parallel_state.get_pipeline_model_parallel_group(),
        )

    def start(self, iteration: int) -> None:
        self.profiler.num_microbatches = self._num_microbatches()  # batch-size ramp-up changes it

    def finish(self, iteration: int) -> None:
        mine = self.profiler.finish()
        interval = self.args.log_interval or 1
        if iteration % interval and iteration != self.args.train_iters:
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            print(_summary(iteration, self.profiler.whole_model), flush=True)
        directory = getattr(self.args, "dynmo_profile_dir", None)
        if directory:
            os.makedirs(directory, exist_ok=True)
            record = {
                "iteration": iteration,
                "rank": rank,
                "layers": [p.to_dict() for p in mine],
                "layer_profile": [p.to_dict() for p in self.profiler.whole_model],
            }
            path = os.path.join(directory, f"layer_profile.rank{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(record, f, indent=1)
            os.replace(path + ".tmp", path)


def unwrapped(chunk):
    """The ``GPTModel`` inside DDP / Float16Module wrappers (each keeps it as ``.module``)."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _summary(iteration: int, profiles) -> str:
    rows = [
        f"  layer {p.layer}: forward {p.forward_s * 1e3:.3f} ms, backward {p.backward_s * 1e3:.3f} ms, "
        f"activations {p.activation_bytes / 2**20:.2f} MiB, parameters+gradients+optimizer "
        f"{p.static_bytes / 2**20:.2f} MiB"
        for p in profiles
    ]
    return "\n".join([f"dynmo profile at iteration {iteration} (smoothed, per microbatch):", *rows])
