"""One rank of ``megatron-slim train``: megatron-core chunks trained with the schedule interpreter.

Each iteration reads its microbatches in an order that depends only on the iteration
(``megatron_slim.train.microbatch``), so a resumed run reads what the uninterrupted run would have.
With ``parallel.cp > 1`` every microbatch is a pack of documents run by the recipe's CP engine
(``megatron_slim.train.cp``), or, for packed windows (``data.packing``, ``Recipe.query_out_cp``), a
window whose slices SlimPipe's query-out CP attention runs (``train.packed``; SlimPack's CP-routed
outliers under Zeppelin's placement, ``train.packed_routes``), or, under context exchange
(``Recipe.exchange_cp``), a plain causal window whose slices the same attention splits zigzag-wise
(``train.packed.zigzag_cp_forward_step``); gradients are then
averaged over data x context parallel ranks.
The ``dynmo:`` section (freezing, early exit, per-layer profiling) runs in ``train.dynmo.run``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.recipe import Recipe, recipe_from_dict
from megatron_slim.plan.sim.costs import slice_lengths
from megatron_slim.runtime.heartbeat import set_step
from megatron_slim.train import checkpoint
from megatron_slim.train.checkpoint.store import CheckpointNotWritten
from megatron_slim.train.dynmo.planned import migrate_if_planned
from megatron_slim.train.dynmo.rebalance import Rebalancer, rebalance_if_due
from megatron_slim.train.dynmo.run import DynamicTraining, with_dynamic_layers
from megatron_slim.train.metrics import open_metrics
from megatron_slim.train.microbatch import dp_mean, summed_loss, vocab_forward_step
from megatron_slim.train.packed import iteration_batches, training_data
from megatron_slim.train.profiler import IterationProfiler
from megatron_slim.train.report import RankReport, TrainOptions
from megatron_slim.train.step import (
    average_data_parallel,
    clip_and_step,
    loss_is_finite,
    nonfinite_reason,
    sum_tied_embedding_grads,
)

if TYPE_CHECKING:  # the schedule imports megatron; loop.py imports it only when a run starts
    from megatron_slim.megatron.slimpipe.schedule import ForwardBackwardFunc


def pipeline_settings(recipe: Recipe, measure_memory: bool = True):
    """The schedule settings every rank of ``megatron-slim train`` runs under: the recipe's kind and
    the slice plan the simulator is given (``plan.sim.costs.slice_lengths``), and the share of each
    slice's layer activations that waits in host memory for its backward (``train.offload_ratio``), and
    whether training calls run context exchange (``schedule.slice_policy: exchange``), paired as
    ``megatron-slim simulate`` pairs it: timed with the recipe's cost model."""
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings

    lengths = slice_lengths(recipe, CostModel(recipe))
    exchange = recipe.schedule.kind == "slimpipe" and recipe.schedule.slice_policy == "exchange"
    return SlimPipeSettings(
        lengths,
        measure_memory=measure_memory,
        kind=recipe.schedule.kind,
        offload_ratio=recipe.train.offload_ratio,
        exchange=exchange,
        exchange_recipe=recipe if exchange else None,
    )


def train_rank(rank: int, world_size: int, recipe_data: dict, prepared, options: TrainOptions) -> RankReport:
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.optimizer import build_optimizer
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.model.recompute import recompute_config
    from megatron_slim.megatron.model.vocab_head import build_vocab_head
    from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.runtime.attention import choose_backend
    from megatron_slim.runtime.pipeline.dp_merge import MergeLink
    from megatron_slim.runtime.pipeline.slice_context import SliceContext
    from megatron_slim.train.cp import cp_layer_classes
    from megatron_slim.train.cp_slices import CPSlicedTrainStep, engine_train_step
    from megatron_slim.train.packed_routes import RoutedWindows

    recipe = recipe_from_dict(recipe_data)
    p, t = recipe.parallel, recipe.train
    torch.manual_seed(t.seed)
    groups = init_model_parallel(tp=p.tp, pp=p.pp, cp=p.cp, vpp=p.vpp, dp=p.dp, seed=t.seed)
    engine = p.cp > 1 and not recipe.query_out_cp
    settings = pipeline_settings(recipe, options.measure_memory)
    cp_step = engine_train_step(recipe, groups, prepared.tokenizer.eod, settings.slice_lengths) if engine else None
    sliced = isinstance(cp_step, CPSlicedTrainStep)
    layers = cp_layer_classes(recipe) if cp_step and not sliced else {"core_attention": SliceCoreAttention}
    layers = with_dynamic_layers(recipe, layers)
    built = dict(layers_per_stage=p.layers_per_stage, seed=t.seed, **recompute_config(t.recompute_plan))
    chunks = build_rank_chunks(recipe.model, groups, **layers, **built)
    if cp_step:
        cp_step.attach(chunks)
    optimizer, scheduler = build_optimizer(chunks, t)
    vocab_head = build_vocab_head(chunks, groups) if recipe.schedule.vocab_parallel else None
    context = cp_step.slices if isinstance(cp_step, CPSlicedTrainStep) else SliceContext()
    context.documents_on_every_tp_rank = True  # no TP batch broadcast: every rank reads its own
    dataset = training_data(recipe, prepared)
    routed = RoutedWindows(dataset.cp_route, context, groups.cp, settings.slice_lengths) if recipe.cp_routes else None
    rows = cp_step.stage_rows if cp_step else (routed.stage_rows if routed else None)
    forward_backward = make_forward_backward_func(settings, context=context, vocab_head=vocab_head, stage_rows=rows)
    backend = choose_backend(None, torch.device("cpu"), torch.float32).label
    report = RankReport(rank, groups.pp_rank, groups.dp_rank, groups.tp_rank, groups.cp_rank, attention_backend=backend)
    parts = (chunks, optimizer, scheduler, forward_backward, dataset, cp_step, report, vocab_head)
    training = _RankTraining(recipe, recipe_data, options, rank, groups, *parts)
    training.rebalancer, training.routed = Rebalancer.for_recipe(recipe), routed
    if recipe.dp_merge:  # SlimPack may split outliers over DP replicas (docs/packing.md)
        context.dp_merge = training.merge = MergeLink(groups.dp, settings.slice_lengths)
    start = training.resume()
    training.metrics = open_metrics(options.metrics, recipe, training.reporter)
    training.profiler = IterationProfiler(options.profile, rank, recipe, groups)
    for it in range(start, t.iters):
        set_step(f"iteration {it + 1}")
        if not training.iteration(it + 1):
            break
    if training.metrics:
        training.metrics.close()
    return report


@dataclass
class _RankTraining:
    """What ``train_rank`` built for one rank, and its iterations (numbered from 1) over it."""

    recipe: Recipe
    recipe_data: dict
    options: TrainOptions
    rank: int
    groups: Any
    chunks: list
    optimizer: Any
    scheduler: Any
    forward_backward: ForwardBackwardFunc
    dataset: Any
    cp_step: Any
    report: RankReport
    vocab_head: Any = None  # schedule.vocab_parallel: this rank's copy of the output weight
    metrics: Any = None
    profiler: Any = None
    rebalancer: Any = None  # dynmo.rebalance: the trigger's state, kept across migrations
    routed: Any = None  # packed_routes.RoutedWindows when SlimPack's CP routes run (Recipe.cp_routes)
    merge: Any = None  # runtime/pipeline/dp_merge.MergeLink when SlimPack may DP-merge (Recipe.dp_merge)

    def __post_init__(self) -> None:
        p, groups = self.recipe.parallel, self.groups
        self.params = [q for c in self.chunks for q in c.parameters()]
        self.dynamic = DynamicTraining(self.recipe, self.chunks, self.optimizer, self.groups)
        self.last_stage = groups.pp_rank == p.pp - 1 and groups.tp_rank == 0
        self.reporter = self.last_stage and groups.dp_rank == 0 and groups.cp_rank == 0
        # gradients are averaged, loss reports summed over data x context parallel ranks
        self.grad_group, self.grad_size = (groups.dp_cp, p.dp * p.cp) if p.cp > 1 else (groups.dp, p.dp)

    def resume(self) -> int:
        """Load the checkpoint ``options.resume_from`` names, if any; returns the iterations already done."""
        options, report = self.options, self.report
        if not (options.checkpoint_dir and options.resume and options.resume_from is not None):
            return 0
        saved = checkpoint.load(
            options.checkpoint_dir,
            options.resume_from,
            self.rank,
            self.chunks,
            self.optimizer,
            self.scheduler,
            self.recipe_data,
        )
        start = report.resumed_from = report.last_iteration = options.resume_from
        report.losses = [tuple(x) for x in saved.get("losses", [])]
        report.cp_iterations = list(saved.get("cp_iterations", []))
        if self.reporter and not options.quiet:
            print(f"resumed from {options.checkpoint_dir} at iteration {start}", flush=True)
        return start

    def iteration(self, number: int) -> bool:
        """Train iteration ``number``; False when training stops after it (or instead of its step)."""
        from megatron_slim.train.cp import reduce_summary

        t, report, groups, dp = self.recipe.train, self.report, self.groups, self.recipe.parallel.dp
        began = time.perf_counter()
        reports = self._forward_backward(number)
        if self.vocab_head is not None:  # every copy, tied embedding ones included, gets the sum
            self.vocab_head.reduce_grads()
        else:
            sum_tied_embedding_grads(self.chunks, groups.embd)
        average_data_parallel(self.params, self.grad_group, self.grad_size)
        cp_summary = reduce_summary(self.cp_step.summary(), groups.dp, dp) if self.cp_step else None
        if cp_summary is not None and self.reporter:
            report.cp_iterations.append(cp_summary)
        finite = loss_is_finite(reports)
        stepped, norm = clip_and_step(
            self.params, self.optimizer, self.scheduler, t.clip_grad, groups.mp, groups.tp_rank, finite
        )
        if not stepped and not t.skip_nonfinite_steps:
            report.stopped = nonfinite_reason(number, finite, norm)
            return False
        if not stepped:
            report.skipped_steps += 1
            report.skipped_iterations.append(number)
        elapsed = time.perf_counter() - began
        self._record(number, elapsed)
        if self.reporter:
            loss = dp_mean(summed_loss(reports), self.grad_group, self.grad_size)
            report.losses.append((number, loss))
            if self.metrics:
                self.metrics.log(number, loss, self.optimizer.param_groups[0]["lr"], norm, elapsed, report)
            if not self.options.quiet and (number % t.log_interval == 0 or number == t.iters or not stepped):
                self._print(number, loss, norm, stepped, elapsed, cp_summary)
        elif self.grad_size > 1 and self.last_stage:
            dp_mean(summed_loss(reports), self.grad_group, self.grad_size)
        report.last_iteration = number
        self._save_if_due(number)
        if report.stopped:
            return False
        moving = migrate_if_planned(self, number) and rebalance_if_due(self, number)
        return moving and number != self.options.exit_interval

    def _forward_backward(self, number: int) -> list:
        self.profiler.before(number)
        self.dynamic.before(number)
        self.optimizer.zero_grad(set_to_none=True)
        groups = self.groups
        cp_group = groups.cp if self.recipe.query_out_cp else None
        packing, batches, step_func = iteration_batches(
            self.dataset, self.recipe, number, groups.dp_rank, cp_group, self.routed, self.merge
        )
        self.report.packing += [packing.record()] if packing else []
        if self.vocab_head is not None:
            self.vocab_head.refresh()
            step_func = vocab_forward_step
        if self.cp_step:
            cp_step = self.cp_step
            step_func = cp_step.vocab_forward_step if self.vocab_head is not None else cp_step.forward_step
            batches = cp_step.plan_iteration(batches)
        reports = self.forward_backward(
            forward_step_func=step_func,
            data_iterator=[iter(batches) for _ in self.chunks],
            model=self.chunks,
            num_microbatches=len(batches) if packing else self.recipe.num_microbatches,
            seq_length=self.recipe.model.seq_length,
            micro_batch_size=self.recipe.train.micro_batch_size,
        )
        if self.merge is not None:
            self.merge.finish()
        return reports

    def _record(self, number: int, elapsed: float) -> None:
        report, stats = self.report, self.forward_backward.stats
        report.iteration_seconds.append(elapsed)
        self.profiler.after(number, stats.schedule_digest)
        self.dynamic.after(report)
        report.peak_activation_bytes = max(report.peak_activation_bytes, stats.peak_activation_bytes)
        report.peak_kv_bytes = max(report.peak_kv_bytes, stats.peak_kv_bytes)
        report.offloaded_bytes = max(report.offloaded_bytes, stats.offloaded_bytes)
        report.peak_p2p_bytes = max(report.peak_p2p_bytes, stats.peak_p2p_bytes)
        report.exchanged_tokens = max(report.exchanged_tokens, stats.exchanged_tokens)
        report.schedule_digest = stats.schedule_digest

    def _print(self, number: int, loss: float, norm: float, stepped: bool, elapsed: float, cp_summary) -> None:
        from megatron_slim.train.cp import summary_text

        t, r = self.recipe.train, self.recipe
        if self.report.packing:
            tokens, extra = self.report.packing[-1]["document_tokens"], f" | {self.report.packing[-1]['summary']}"
        else:
            tokens = t.global_batch_size * r.model.seq_length
            extra = f" | {summary_text(r.cp.engine, cp_summary)}" if cp_summary else ""
        print(
            f"iter {number:4d}/{t.iters} | loss {loss:.4f} | lr {self.optimizer.param_groups[0]['lr']:.2e} | "
            f"grad norm {norm:.3f}{'' if stepped else ' (skipped: not finite)'} | {elapsed:.2f} s/it | "
            f"{tokens / elapsed:,.0f} tokens/s{extra}",
            flush=True,
        )

    def _save_if_due(self, number: int) -> None:
        t, options = self.recipe.train, self.options
        done = number == t.iters or (options.exit_interval and number == options.exit_interval)
        if options.checkpoint_dir and (done or (t.save_interval and number % t.save_interval == 0)):
            saved_report = (
                {"losses": self.report.losses, "cp_iterations": self.report.cp_iterations} if self.reporter else None
            )
            try:
                checkpoint.save(
                    options.checkpoint_dir,
                    number,
                    self.rank,
                    self.chunks,
                    self.optimizer,
                    self.scheduler,
                    self.recipe_data,
                    report=saved_report,
                )
            except CheckpointNotWritten as exc:  # every rank stops here, with the reason
                self.report.stopped = str(exc)
