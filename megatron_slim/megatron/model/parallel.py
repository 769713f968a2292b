"""Set up megatron-core's ``parallel_state`` on CPU gloo ranks and hand the groups out explicitly.

``init_model_parallel`` runs inside a default process group that already exists (e.g. one made by
:func:`megatron_slim.runtime.spawn.run_ranks`). megatron-core 0.16.1's
``initialize_model_parallel`` needs no CUDA as long as SHARP is off and no NCCL communicator
config is given: every ``new_group`` it creates then gets ``backend=None``, i.e. the default
group's backend (gloo here). The only adjustment is ``create_gloo_process_groups=False``: with a
gloo world the extra "gloo copies" of the data-parallel groups would be duplicates.

The groups come back as :class:`ParallelGroups`, a small frozen value that callers pass on
explicitly; it converts itself into whichever process-group dataclass the installed megatron-core
expects (``ProcessGroupCollection`` 0.15+, ``ModelCommProcessGroups`` 0.14).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch.distributed as dist

from megatron_slim.megatron import compat
from megatron_slim.megatron.model.rng import checkpoint_rng_without_cuda, reset_rng_tracker, seed_model_parallel_rng


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's process groups. ``None`` means "this rank is not in such a group" (``embd``,
    ``pos_embd`` off the first/last stage) or "not created" (``hcp``)."""

    tp: Any
    pp: Any
    cp: Any
    dp: Any
    dp_cp: Any
    tp_cp: Any
    mp: Any
    embd: Any = None
    pos_embd: Any = None
    hcp: Optional[tuple] = None
    vpp: int = 1

    @staticmethod
    def _size(group: Any) -> int:
        return 1 if group is None else dist.get_world_size(group)

    @staticmethod
    def _rank(group: Any) -> int:
        return 0 if group is None else dist.get_rank(group)

    tp_size = property(lambda self: self._size(self.tp))
    tp_rank = property(lambda self: self._rank(self.tp))
    pp_size = property(lambda self: self._size(self.pp))
    pp_rank = property(lambda self: self._rank(self.pp))
    cp_size = property(lambda self: self._size(self.cp))
    cp_rank = property(lambda self: self._rank(self.cp))
    dp_size = property(lambda self: self._size(self.dp))
    dp_rank = property(lambda self: self._rank(self.dp))

    def as_megatron(self, cls: Optional[type] = None) -> Any:
        """These groups as megatron's process-group dataclass ``cls`` (default: the installed
        ``ProcessGroupCollection``, or ``ModelCommProcessGroups`` on 0.14)."""
        if cls is None:
            cls = compat.model_groups_class()
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "vpp"}
        values["hcp"] = list(self.hcp) if self.hcp is not None else None
        return compat.fill_groups_dataclass(cls, values)


def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def _check_sizes(world_size: int, tp: int, pp: int, cp: int, vpp: int, dp: Optional[int]) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("vpp", vpp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: allowed values are integers >= 1")
    model_size = tp * pp * cp
    if world_size % model_size:
        raise ValueError(
            f"tp*pp*cp={model_size} does not divide the world size {world_size}; "
            f"allowed: sizes whose product divides {world_size}"
        )
    if dp is not None and dp != world_size // model_size:
        raise ValueError(f"dp={dp!r}: allowed value is world_size/(tp*pp*cp)={world_size // model_size}")
    if vpp > 1 and pp == 1:
        raise ValueError(f"vpp={vpp}: allowed only with pp > 1 (interleaving needs several stages)")


def groups_from_parallel_state(vpp: int = 1) -> ParallelGroups:
    """Read this rank's groups out of an initialised ``parallel_state``."""
    ps = _parallel_state()

    def get(getter, **kwargs):
        return compat.call_with_supported(getter, check_initialized=False, **kwargs)

    hcp = get(ps.get_hierarchical_context_parallel_groups)
    return ParallelGroups(
        tp=get(ps.get_tensor_model_parallel_group),
        pp=get(ps.get_pipeline_model_parallel_group),
        cp=get(ps.get_context_parallel_group),
        dp=get(ps.get_data_parallel_group, with_context_parallel=False),
        dp_cp=get(ps.get_data_parallel_group, with_context_parallel=True),
        tp_cp=get(ps.get_tensor_and_context_parallel_group),
        mp=get(ps.get_model_parallel_group),
        embd=get(ps.get_embedding_group),
        pos_embd=get(ps.get_position_embedding_group),
        hcp=tuple(hcp) if hcp else None,
        vpp=vpp,
    )


def init_model_parallel(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int = 1,
    dp: Optional[int] = None,
    seed: Optional[int] = None,
    timeout: timedelta = timedelta(minutes=10),
) -> ParallelGroups:
    """Initialise megatron-core's ``parallel_state`` for (tp, pp, cp, dp, vpp) on this rank.

    Must run on every rank of an initialised default process group. ``dp`` is implied by the world
    size and only checked when given. With ``seed``, also seeds the model-parallel RNGs (see
    :func:`megatron_slim.megatron.model.rng.seed_model_parallel_rng`). Undo with :func:`teardown`.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "init_model_parallel needs torch.distributed initialised first "
            "(e.g. inside megatron_slim.runtime.spawn.run_ranks)"
        )
    _check_sizes(dist.get_world_size(), tp, pp, cp, vpp, dp)
    ps = _parallel_state()
    if ps.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel_state is already initialised; call teardown() first")
    compat.call_with_supported(
        ps.initialize_model_parallel,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=max(1, int(timeout.total_seconds() // 60)),
    )
    groups = groups_from_parallel_state(vpp)
    checkpoint_rng_without_cuda()
    if seed is not None:
        seed_model_parallel_rng(seed, tp_rank=groups.tp_rank)
    return groups


def teardown() -> None:
    """Forget megatron's parallel state and RNG tracker so ``init_model_parallel`` can run again.

    The torch process groups themselves stay alive until the default group is destroyed.
    """
    ps = _parallel_state()
    ps.destroy_model_parallel()
    reset_rng_tracker()


@contextlib.contextmanager
def model_parallel(**sizes: Any) -> Iterator[ParallelGroups]:
    """``with model_parallel(tp=.., pp=.., seed=..) as groups:`` init, yield, teardown."""
    groups = init_model_parallel(**sizes)
    try:
        yield groups
    finally:
        teardown()
