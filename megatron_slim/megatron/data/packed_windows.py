"""``--slimpipe-packing``: Megatron-LM's training split served as packed windows (b=1).

The launcher replaces the train dataset Megatron's loader is about to wrap
(``build_pretraining_data_loader``) by ``PackedWindows`` over the same split's documents: the
documents in a seeded order (as ``megatron-slim train`` orders them), cut into ``seq_length``
samples and packed per iteration by ``plan/pack/fixed_windows`` into exactly
``global_batch_size / dp`` windows per DP rank. Megatron's ``MegatronPretrainingSampler`` hands
index ``i`` to DP rank ``i % dp`` (micro-batch size 1), microbatch ``(i // dp) % per_rank`` of
iteration ``i // (dp * per_rank)``, which is the window the plan puts there.

Each window carries ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (``train/packed.py``'s
``window_batch``) and ``document_lengths``; the loader's collate keeps the lengths a tuple of ints,
and the SlimPipe data iterator records them before ``pretrain_gpt.get_batch`` drops the key (0.16's TP
broadcast; from 0.19 the launcher's ``get_batch_on_this_cp_rank`` wrapper takes it out).
Middle pipeline stages build no dataset and read no batch: the schedule adapter hands them the
first stage's lengths (``SlimPipeSettings.share_documents``, ``runtime/pipeline/stage_lengths``).
Validation and test splits stay Megatron's own windows.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy
import torch

from megatron_slim.plan.pack.fixed_windows import FixedWindowPlanner
from megatron_slim.plan.pack.training import cut_samples
from megatron_slim.plan.schema import ConfigError


class SplitDocuments:
    """The documents of one split of a Megatron dataset, in a seeded order (read lazily)."""

    def __init__(self, indexed: Any, indices: Sequence[int], seed: int) -> None:
        order = numpy.random.RandomState(seed).permutation(len(indices))
        self.indexed = indexed
        self.ids = numpy.asarray(indices)[order]
        self.lengths = [int(n) for n in numpy.asarray(indexed.sequence_lengths)[self.ids]]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, d: int) -> numpy.ndarray:
        return numpy.asarray(self.indexed[int(self.ids[d])], dtype=numpy.int64)


class PackedWindows(torch.utils.data.Dataset):
    """Window ``i`` of the run: DP rank ``i % dp``'s microbatch ``(i // dp) % per_rank`` of
    iteration ``i // (dp * per_rank)``, as a ``[1, seq_length]`` batch with ``document_lengths``."""

    def __init__(self, documents: Any, planner: FixedWindowPlanner, length: int) -> None:
        self.documents, self.planner, self.length = documents, planner, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        from megatron_slim.train.packed import window_batch

        p = self.planner
        iteration, j = divmod(int(i), p.dp * p.windows_per_rank)
        microbatch, rank = divmod(j, p.dp)
        packing = p.iteration(iteration)
        return window_batch(packing.windows[rank][microbatch], packing.samples, self.documents, p.seq_length)


def collate_window(items: list) -> dict:
    """The one window of a micro-batch, its ``document_lengths`` left a tuple of ints."""
    if len(items) != 1:
        raise ConfigError(f"--micro-batch-size {len(items)}: a packed window is one row; allowed: 1")
    return items[0]


def packed_windows(train_dataset: Any, args: Any) -> PackedWindows:
    """``PackedWindows`` over the documents of Megatron's train split ``train_dataset``."""
    from megatron_slim.megatron.launch.args import recipe_from_megatron_args
    from megatron_slim.plan.cost.model import CostModel
    from megatron_slim.plan.pack.costs import fit_slice_costs

    if not (hasattr(train_dataset, "dataset") and hasattr(train_dataset, "indices")):
        raise ConfigError(
            f"--slimpipe-packing {args.slimpipe_packing}: the train dataset is a {type(train_dataset).__name__}; "
            "packing reads the documents of one dataset's split; allowed: one --data-path prefix (no blend)"
        )
    seq, dp = args.seq_length, args.data_parallel_size
    documents = SplitDocuments(train_dataset.dataset, train_dataset.indices, args.seed)
    samples = cut_samples(range(len(documents)), documents.lengths, seq)
    costs = fit_slice_costs(CostModel(recipe_from_megatron_args(args)), seq, seq)
    per_rank = args.global_batch_size // (args.micro_batch_size * dp)
    planner = FixedWindowPlanner(args.slimpipe_packing, samples, costs, dp, seq, per_rank)
    return PackedWindows(documents, planner, len(train_dataset))


def is_train_split(dataset: Any) -> bool:
    from megatron.core.datasets.utils import Split

    return getattr(dataset, "index_split", getattr(dataset, "split", None)) == Split.train


def with_packed_windows(original: Callable, args_getter: Callable[[], Any]) -> Callable:
    """``build_pretraining_data_loader`` that, under ``--slimpipe-packing``, loads packed windows for
    the train split with Megatron's own sampler (so resumption by consumed samples still works)."""

    def build_pretraining_data_loader(dataset, consumed_samples, *args: Any, **kwargs: Any):
        parsed = args_getter()
        method = getattr(parsed, "slimpipe_packing", "none") if parsed is not None else "none"
        if method == "none" or dataset is None or not is_train_split(dataset):
            return original(dataset, consumed_samples, *args, **kwargs)
        packed = packed_windows(dataset, parsed)
        loader = original(packed, consumed_samples, *args, **kwargs)
        if int(getattr(parsed, "rank", 0) or 0) == 0:
            first = packed.planner.iteration(0)
            print(
                f"megatron-slim: {first.summary()}, {first.document_tokens} document tokens, "
                f"{first.loss_tokens} loss tokens (iteration 1)",
                flush=True,
            )
        return torch.utils.data.DataLoader(
            packed,
            batch_sampler=loader.batch_sampler,
            num_workers=loader.num_workers,
            persistent_workers=loader.persistent_workers,
            collate_fn=collate_window,
        )

    return build_pretraining_data_loader
