"""``megatron-slim train``: prepare the corpus, spawn the recipe's ranks, train, report as JSON.

Two ways to get ranks: by default the command spawns ``tp*pp*cp*dp`` local gloo ranks itself
(``megatron_slim.runtime.spawn.run_ranks``; they never outlive it, and SIGTERM/Ctrl-C stop them all
and exit non-zero). Started by torchrun (``torchrun --nproc_per_node N -m megatron_slim train ...``;
detected from its environment, see ``megatron_slim.runtime.job``) each process is one rank instead:
``WORLD_SIZE`` must equal the recipe's ``tp*pp*cp*dp`` (checked before any work), local rank 0
prepares the corpus cache while the others wait, and the reporting rank (last pipeline stage,
first tp/cp/dp rank: the one whose losses the summary shows) prints the summary and writes
``--json``. Either way, the same recipe and seed give the same losses.

With ``parallel.cp > 1`` the recipe's ``cp.engine`` (and ``cp.remap``) runs every microbatch as a
pack of the documents between ``eod`` tokens, attention inside each document only (see
``megatron_slim.train.cp``); the JSON then has a ``cp`` section: engine, remap, topology,
``document_masking: true`` and per iteration the plans' counts (sequences local / intra-node /
inter-node, packs that left a CP rank without tokens, tokens per rank). Packed windows
(``data.packing``) run no engine: SlimPipe's query-out CP attention splits every slice over the CP
ranks (``megatron_slim.train.packed``); their ``cp`` section is ``engine: null, attention:
slimpipe-query-out``. With ``data.packing: slimpack`` and ``cp.engine: zeppelin`` the outliers SlimPack
CP-routes run under Zeppelin's placement instead (``megatron_slim.train.packed_routes``): ``engine:
zeppelin, cp_routes: true``, and each iteration's ``packing`` record lists them (``cp_routed``).
Context exchange (``schedule.slice_policy: exchange``, several slices) runs no engine either: plain
causal windows, every slice split zigzag-wise over the CP ranks (the query-out CP ``cp.engine: ring``
names; other engines are refused), so its ``cp`` section reads ``engine: null, attention:
slimpipe-query-out, document_masking: false``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from megatron_slim.commands.output import prepare_outputs
from megatron_slim.commands.train_dynmo import dynmo_overrides
from megatron_slim.commands.train_report import STOPPED_EXIT_CODE, is_reporter, report
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.recipe_note import world_size_note
from megatron_slim.plan.schema import ConfigError


def check_data(recipe) -> None:
    """Before any work: the corpus exists and the vocabulary a trained tokenizer gets can hold the
    256 bytes and the end-of-document token (``data.path``/``data.tokenizer`` are checked as they load)."""
    from megatron_slim.data.corpus import STDLIB
    from megatron_slim.data.tokenizer import MIN_VOCAB_SIZE

    d = recipe.data
    if d.path:
        return
    if d.corpus != STDLIB and not Path(d.corpus).expanduser().is_dir():
        raise ConfigError(
            f"data.corpus: {d.corpus!r} is not a directory (allowed: {STDLIB!r}, the Python standard "
            "library's sources, or a directory of UTF-8 text files)"
        )
    if not d.tokenizer and recipe.model.vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"model.vocab_size: got {recipe.model.vocab_size}; the tokenizer trained on the corpus needs "
            f"the 256 bytes and the end-of-document token (allowed: an integer >= {MIN_VOCAB_SIZE})"
        )


def _prepare(recipe, say: bool, log=sys.stdout):
    from megatron_slim.megatron.data import prepare_corpus
    from megatron_slim.megatron.data.existing import load_tokenizer, prepare_megatron_data

    d, vocab_size = recipe.data, recipe.model.vocab_size
    began = time.perf_counter()
    if d.path:
        prepared = prepare_megatron_data(d.path, d.tokenizer, vocab_size)
    else:
        tokenizer = load_tokenizer(d.tokenizer, vocab_size) if d.tokenizer else None
        prepared = prepare_corpus(
            corpus=d.corpus,
            cache_dir=d.cache_dir or None,
            vocab_size=vocab_size,
            max_files=d.max_files,
            tokenizer=tokenizer,
        )
    if say:
        print(
            f"data: {prepared.num_documents} documents, {prepared.num_tokens:,} tokens from {prepared.source} "
            f"({'cached' if prepared.cache_hit else 'prepared'} in {time.perf_counter() - began:.1f}s, "
            f"tokenizer vocab {prepared.vocab_size})",
            file=log,
            flush=True,
        )
    return prepared


def _print_plan(recipe, where: str, log=sys.stdout) -> None:
    p, t = recipe.parallel, recipe.train
    m = recipe.num_microbatches if recipe.data.packing == "none" else f"~{recipe.num_microbatches} packed"
    print(
        f"recipe {recipe.name}: {p.world_size} CPU ranks {where}(tp{p.tp} pp{p.pp} vpp{p.vpp} cp{p.cp} dp{p.dp}), "
        f"schedule {recipe.schedule.kind} with {recipe.schedule.num_slices} {recipe.schedule.slice_policy} "
        f"slice(s), {m} microbatches of {recipe.model.seq_length} tokens, {t.iters} iterations",
        file=log,
        flush=True,
    )
    if p.cp > 1:
        from megatron_slim.train.cp import describe

        print(describe(recipe), file=log, flush=True)
    print(_backends(recipe), file=log, flush=True)


def _backends(recipe) -> str:
    """What the ranks will run on, as they choose it (``runtime.attention.selection``)."""
    import torch

    from megatron_slim.megatron.fallback_warnings import backends_line
    from megatron_slim.runtime.attention import choose_backend

    dtype = torch.float32 if recipe.train.precision == "fp32" else torch.bfloat16
    return backends_line(choose_backend(device="cpu", dtype=dtype).label)


def check_world_size(recipe, job) -> None:
    """A launched job must have exactly the recipe's ranks."""
    p = recipe.parallel
    if job.world_size != p.world_size:
        raise ConfigError(
            f"WORLD_SIZE: {job.launcher} started {job.world_size} rank(s) but recipe {recipe.name} needs "
            f"tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp} = {p.world_size} (got {job.world_size}; allowed: "
            f"{p.world_size}: launch that many ranks, e.g. torchrun --nproc_per_node {p.world_size}, or change "
            f"parallel.* with --set)"
        )


def _check_checkpoint_dir(args, recipe, say: bool, log):
    """Before any work: ``--checkpoint-dir`` is a writable directory, and the iteration to resume
    from (None: start from scratch) is intact and comes from a compatible recipe."""
    if not args.checkpoint_dir:
        return None
    from megatron_slim.train.checkpoint import check_checkpoint_dir, check_resumable

    check_checkpoint_dir(args.checkpoint_dir)
    if args.no_resume:
        return None
    return check_resumable(
        args.checkpoint_dir,
        recipe.to_dict(),
        say=(lambda line: print(line, file=log, flush=True)) if say else (lambda line: None),
    )


def check_exit_interval(exit_interval, iters: int, resumed_from: int) -> None:
    """``--exit-interval N`` stops after iteration N: one this run trains, or it would never act."""
    if exit_interval is None:
        return
    where = f" (it resumes from the checkpoint at iteration {resumed_from})" if resumed_from else ""
    if not resumed_from < exit_interval <= iters:
        raise ConfigError(
            f"--exit-interval {exit_interval}: this run trains iterations {resumed_from + 1}..{iters}"
            f"{where}; allowed: {resumed_from + 1}..{iters}"
        )


def main(args) -> int:
    from megatron_slim.megatron.fallback_warnings import quiet_in_this_process
    from megatron_slim.runtime.job import launched_rank
    from megatron_slim.train.checks import check_trainable  # without torch: refusals come before importing it

    quiet_in_this_process()
    began = time.perf_counter()
    recipe = load_recipe(args.recipe, [*(args.set or []), *dynmo_overrides(args)])
    check_trainable(recipe)
    check_data(recipe)
    job = launched_rank()
    if job is not None:
        check_world_size(recipe, job)
    prepare_outputs(("--json", args.json))
    metrics, profile = _observability(args, recipe)
    log = sys.stderr if args.json == "-" else sys.stdout  # stdout carries only the JSON then
    holds_lock = bool(args.checkpoint_dir) and (job is None or job.rank == 0)
    with _run_lock(args.checkpoint_dir if holds_lock else None):
        return _train(args, recipe, job, metrics, profile, log, began)


def _run_lock(directory):
    """The checkpoint directory's run lock (``train.checkpoint.lock``), held by the reporting process."""
    import contextlib

    if not directory:
        return contextlib.nullcontext()
    from megatron_slim.train.checkpoint import check_checkpoint_dir
    from megatron_slim.train.checkpoint.lock import only_run_in

    check_checkpoint_dir(directory)  # the directory exists before its lock file is made
    return only_run_in(directory)


def _train(args, recipe, job, metrics, profile, log, began) -> int:
    from megatron_slim.train.report import TrainOptions

    resume_from = _check_checkpoint_dir(args, recipe, say=job is None or job.rank == 0, log=log)
    check_exit_interval(args.exit_interval, recipe.train.iters, resume_from or 0)
    note = world_size_note(args.recipe, args.set, recipe, unit="ranks")
    if note and (job is None or job.rank == 0):
        print(note, file=log, flush=True)
    options = TrainOptions(
        checkpoint_dir=args.checkpoint_dir,
        resume=not args.no_resume,
        resume_from=resume_from,
        exit_interval=args.exit_interval or 0,
        quiet=args.json == "-",
        metrics=metrics,
        profile=profile,
    )
    if job is not None:
        return _run_launched(args, recipe, options, job, began, log)

    from megatron_slim.megatron.fallback_warnings import quiet_in_children
    from megatron_slim.runtime.spawn import run_ranks
    from megatron_slim.train.loop import train_rank

    p = recipe.parallel
    prepared = _prepare(recipe, say=True, log=log)
    _print_plan(recipe, "", log)
    threads = max(1, (os.cpu_count() or 1) // p.world_size)
    with quiet_in_children():
        reports = run_ranks(
            train_rank,
            p.world_size,
            recipe.to_dict(),
            prepared,
            options,
            threads_per_rank=threads,
            timeout_s=None,
            watchdog_s=args.rank_timeout or None,
        )
    return report(args, recipe, reports, began)


def _observability(args, recipe):
    """``--tensorboard-dir``/``--wandb-*`` and ``--profile``: checked, their directories created."""
    from megatron_slim.commands.output import prepare_output_dirs
    from megatron_slim.train.metrics import metrics_options
    from megatron_slim.train.profiler import profile_options

    metrics, profile = metrics_options(args), profile_options(args, recipe)
    prepare_output_dirs(
        ("--tensorboard-dir", args.tensorboard_dir),
        ("--wandb-save-dir", args.wandb_save_dir),
        ("--profile", args.profile),
    )
    return metrics, profile


def _run_launched(args, recipe, options, job, began, log) -> int:
    """This process is one rank of a torchrun job: join it, train this rank's part, and let the
    rank that reports (last pipeline stage, first tp/cp/dp rank) print the summary and write JSON."""
    import torch.distributed as dist

    from megatron_slim.runtime.job import joined, local_first
    from megatron_slim.train.loop import train_rank

    with joined(job, backend="gloo"):
        # local rank 0 of each node tokenizes into the cache (an atomic, locked build); the others then read it
        prepared = local_first(job, lambda: _prepare(recipe, say=job.rank == 0, log=log))
        if job.rank == 0:
            _print_plan(recipe, f"under {job.launcher} ", log)
        mine = train_rank(job.rank, job.world_size, recipe.to_dict(), prepared, options)
        reports = [None] * job.world_size
        dist.all_gather_object(reports, mine)
    if is_reporter(mine, recipe.parallel.pp):
        return report(args, recipe, reports, began)
    return STOPPED_EXIT_CODE if mine.stopped else 0
