"""Rank function for the pruning tests (spawned by run_ranks; megatron is imported inside it)."""

from __future__ import annotations

import torch

from megatron_slim.plan.dynmo.prune import PruneSchedule
from megatron_slim.plan.recipe import ModelConfig, TrainConfig
from tests.oracle.models import TINY_GQA_4L

SCHEDULE = PruneSchedule(2, 3, 0.5)  # 70 of 160 neurons pruned in iteration 2, 80 from iteration 3
STEPS = 4


def _by_hand(layer, count: int, pruned: set) -> torch.Tensor:
    """The rule stated plainly: add the smallest (norm, index) kept neurons until ``count`` are pruned;
    returns the 0/1 neuron mask."""
    w1, w2 = layer.mlp.linear_fc1.weight.detach(), layer.mlp.linear_fc2.weight.detach()
    ffn = w2.shape[1]
    norms = [float(w1[j].norm() ** 2 + w1[ffn + j].norm() ** 2 + w2[:, j].norm() ** 2) for j in range(ffn)]
    candidates = sorted((norms[j], j) for j in range(ffn) if j not in pruned)
    pruned.update(j for _, j in candidates[: count - len(pruned)])
    return torch.tensor([0.0 if j in pruned else 1.0 for j in range(ffn)])


def _apply_mask(layer, mask: torch.Tensor) -> None:
    with torch.no_grad():
        layer.mlp.linear_fc1.weight.mul_(torch.cat([mask, mask]).unsqueeze(1))
        layer.mlp.linear_fc2.weight.mul_(mask.unsqueeze(0))


def pruning(rank, world_size, seed):
    """``train.dynmo.prune.Pruning`` against stock layers masked by hand before every forward and after
    every step: losses, final weights, pruned sets, the gradients of pruned entries, and forward FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_slim.megatron.model.gpt import global_state_dict
    from megatron_slim.megatron.model.optimizer import build_optimizer
    from megatron_slim.megatron.model.parallel import model_parallel
    from megatron_slim.train.dynmo.prune import Pruning
    from tests.oracle.reference import whole_model

    cfg = ModelConfig(**TINY_GQA_4L)
    g = torch.Generator().manual_seed(seed)
    ids, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g) for _ in range(2))
    out: dict = {"pruned_grad_max": 0.0, "pruned_weight_max": 0.0}
    with model_parallel(seed=seed) as groups:
        runs = {name: whole_model(cfg, groups, seed) for name in ("fast", "hand")}
        optimizers = {
            n: build_optimizer([c], TrainConfig(global_batch_size=1, lr=1e-2, weight_decay=0.1))[0]
            for n, c in runs.items()
        }
        fast = Pruning(SCHEDULE, [runs["fast"]], optimizers["fast"])
        pruned_by_hand: list[set] = [set() for _ in range(cfg.num_layers)]
        for name in runs:
            out[name] = {"losses": []}
        for it in range(1, STEPS + 1):
            fast.before(it)
            masks = []
            for layer, pruned in zip(runs["hand"].decoder.layers, pruned_by_hand):
                masks.append(_by_hand(layer, SCHEDULE.pruned_neurons(it, cfg.ffn_hidden_size), pruned))
                _apply_mask(layer, masks[-1])
            for name, chunk in runs.items():
                optimizers[name].zero_grad(set_to_none=True)
                loss = chunk(ids, None, None, labels=labels).mean()
                loss.backward()
                out[name]["losses"].append(float(loss))
                if name == "fast":
                    _track_pruned(out, chunk, masks)
                optimizers[name].step()
            for layer, mask in zip(runs["hand"].decoder.layers, masks):
                _apply_mask(layer, mask)
            _track_pruned(out, runs["fast"], masks, weights=True)
        for name, chunk in runs.items():
            out[name]["state"] = global_state_dict(chunk)
        out["fast_pruned"] = [
            sorted(set(range(cfg.ffn_hidden_size)) - set(m.slim_kept_neurons.tolist())) for _, m in fast.mlps
        ]
        out["hand_pruned"] = [sorted(p) for p in pruned_by_hand]
        out["kept_share"] = fast.kept_share()
        for name, chunk in runs.items():
            with FlopCounterMode(display=False) as counter:
                chunk(ids, None, None, labels=labels)
            out[name]["flops"] = counter.get_total_flops()
    return out


def _track_pruned(out: dict, chunk, masks, weights: bool = False) -> None:
    """The largest magnitude among pruned entries' gradients (or weights, after a step)."""
    key = "pruned_weight_max" if weights else "pruned_grad_max"
    for layer, mask in zip(chunk.decoder.layers, masks):
        gone = mask == 0
        w1, w2 = layer.mlp.linear_fc1.weight, layer.mlp.linear_fc2.weight
        t1, t2 = (w1, w2) if weights else (w1.grad, w2.grad)
        values = torch.cat([t1[torch.cat([gone, gone])].flatten(), t2[:, gone].flatten()])
        out[key] = max(out[key], float(values.abs().max()) if values.numel() else 0.0)
