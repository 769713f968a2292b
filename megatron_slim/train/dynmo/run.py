"""What ``train.loop`` calls for the recipe's ``dynmo:`` section: the layer class a run builds with,
and, around every iteration, the freeze and prune schedules before it and the profile and exit counts
after it."""

from __future__ import annotations

from collections import defaultdict

from megatron_slim.plan.dynmo.options import frozen_layers
from megatron_slim.plan.recipe import Recipe


def with_dynamic_layers(recipe: Recipe, layer_classes: dict) -> dict:
    """``build_rank_chunks``'s layer classes, with the early-exit layer when ``dynmo.exit_threshold > 0``
    or the mixture-of-depths one when ``dynmo.mod_capacity > 0`` (the recipe refuses either beside
    another layer class: ``cp.remap``, each other); with ``dynmo.moe_experts``, MoE MLPs."""
    if recipe.dynmo.moe:
        from megatron_slim.train.dynmo.moe_load import moe_build_kwargs

        d = recipe.dynmo
        layer_classes = {**layer_classes, **moe_build_kwargs(d.moe_experts, d.moe_topk, recipe.model.ffn_hidden_size)}
    if recipe.dynmo.mixture_of_depths:
        from megatron_slim.megatron.model.mixture_of_depths import mixture_of_depths_layer

        return {**layer_classes, "transformer_layer": mixture_of_depths_layer(recipe.dynmo.mod_capacity)}
    if not recipe.dynmo.early_exit:
        return layer_classes
    from megatron_slim.megatron.model.early_exit import EarlyExitTransformerLayer

    return {**layer_classes, "transformer_layer": EarlyExitTransformerLayer}


class DynamicTraining:
    def __init__(self, recipe: Recipe, chunks, optimizer, groups) -> None:
        d = recipe.dynmo
        self.chunks = chunks
        self.freeze_steps = d.freeze_steps(recipe.model.num_layers)
        self.freeze_embedding = d.freeze_embedding
        self.frozen: frozenset[int] = frozenset()
        self.profiler = None
        if d.profile:
            from megatron_slim.train.dynmo.profile import LayerProfiler

            self.profiler = LayerProfiler(chunks, optimizer, recipe.num_microbatches, d.profile_smoothing, groups.pp)
        self.exit_counts: list | None = None
        if d.early_exit:
            from megatron_slim.megatron.model.early_exit import ExitRule, attach_exit_rule

            self.exit_counts = []
            attach_exit_rule(chunks, ExitRule(d.exit_threshold, d.exit_from_layer), self.exit_counts)
        self.pruning = None
        if d.prune_schedule is not None:
            from megatron_slim.train.dynmo.prune import Pruning

            self.pruning = Pruning(d.prune_schedule, chunks, optimizer)
        self.expert_load = None
        if d.moe:
            from megatron_slim.train.dynmo.moe_load import ExpertLoad

            self.expert_load = ExpertLoad(chunks, d.moe_experts, d.moe_drift)

    def before(self, iteration: int) -> None:
        from megatron_slim.train.dynmo.freeze import set_embedding_frozen, set_frozen, set_input_needs_grad

        frozen = frozen_layers(self.freeze_steps, iteration)
        if frozen != self.frozen:
            set_frozen(self.chunks, frozen)
            self.frozen = frozen
            if self.freeze_embedding:
                set_embedding_frozen(self.chunks, 0 in frozen)
                set_input_needs_grad(self.chunks, frozen, 0 in frozen)
        if self.exit_counts is not None:
            self.exit_counts.clear()
        if self.pruning is not None:
            self.pruning.before(iteration)
        if self.expert_load is not None:
            self.expert_load.before(iteration)

    def after(self, report) -> None:
        """Record in ``report.dynmo``: the whole model's smoothed profile (``layer_profile``, a list of
        ``plan.dynmo.profile.LayerProfile`` dicts), the layers frozen in the iteration
        (``frozen_layers``) and, per decoder layer of this rank, the share of tokens that ran it
        (``active_token_share``), the share of its FFN neurons still computed (``kept_neuron_share``) and
        its tokens per expert in every iteration so far (``expert_load``).
        Nothing when the section is off."""
        if self.freeze_steps:
            report.dynmo["frozen_layers"] = sorted(self.frozen)
        if self.profiler is not None:
            self.profiler.finish()
            report.dynmo["layer_profile"] = [p.to_dict() for p in self.profiler.whole_model]
        if self.exit_counts is not None:
            report.dynmo["active_token_share"] = active_shares(self.exit_counts)
        if self.pruning is not None:
            report.dynmo["kept_neuron_share"] = self.pruning.kept_share()
        if self.expert_load is not None:  # one list of tokens per expert per iteration, for each layer
            for layer, counts in self.expert_load.finish().items():
                report.dynmo.setdefault("expert_load", {}).setdefault(layer, []).append(counts)


def active_shares(counts: list) -> dict[int, float]:
    """Per layer index: the share of the tokens it saw that ran it (not exited)."""
    active: dict[int, int] = defaultdict(int)
    seen: dict[int, int] = defaultdict(int)
    for layer, a, n in counts:
        active[layer] += a
        seen[layer] += n
    return {layer: active[layer] / seen[layer] for layer in sorted(seen) if seen[layer]}
