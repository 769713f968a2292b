"""``megatron-slim train --profile DIR``: a torch profiler trace of one iteration, one file per rank.

Every rank profiles the same iteration (``--profile-iteration N``, 1-based as the log counts;
default: the run's last) and writes ``DIR/rank_<global rank, 3 digits>.trace.json``, a Chrome trace
(open in https://ui.perfetto.dev). The schedule interpreter labels each action with its IR string
(``F3.2``, ``1B0.7``, ``SEND_F3.2``: the simulator's event names). The trace's top-level
``megatron_slim`` entry says whose it is: the rank's place (pp/tp/cp/dp rank), the recipe, the
schedule digest, the iteration and a run id shared by the run's ranks, which
``megatron-slim overlay`` uses to lay it beside the simulated timeline. Files are written whole
(written beside, then renamed).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_slim.plan.schema import ConfigError

METADATA_KEY = "megatron_slim"


def trace_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank:03d}.trace.json"


@dataclass(frozen=True)
class ProfileOptions:
    directory: str
    iteration: int
    run_id: str


def profile_options(args, recipe) -> Optional[ProfileOptions]:
    """``--profile``/``--profile-iteration``, checked before any work: the iteration must be one this
    run trains (after any checkpoint it resumes from, up to ``--exit-interval``)."""
    if args.profile is None:
        if args.profile_iteration is not None:
            raise ConfigError(
                f"--profile-iteration {args.profile_iteration}: takes effect only with --profile DIR; "
                "allowed: add --profile DIR, or drop it"
            )
        return None
    last = recipe.train.iters
    if args.exit_interval and 0 < args.exit_interval < last:
        last = args.exit_interval
    first = _resumed_from(args) + 1
    iteration = last if args.profile_iteration is None else args.profile_iteration
    where = f" (it resumes from the checkpoint at iteration {first - 1})" if first > 1 else ""
    if first > last:
        raise ConfigError(
            f"--profile {args.profile}: this run trains no iteration{where}; allowed: a run that "
            "trains, e.g. with --no-resume or a larger train.iters"
        )
    if not first <= iteration <= last:
        raise ConfigError(
            f"--profile-iteration {iteration}: this run trains iterations {first}..{last}{where}; "
            f"allowed: {first}..{last}"
        )
    return ProfileOptions(args.profile, iteration, uuid.uuid4().hex[:12])


def _resumed_from(args) -> int:
    if not args.checkpoint_dir or args.no_resume:
        return 0
    from pathlib import Path

    from megatron_slim.train.checkpoint.layout import choose_iteration

    if not Path(args.checkpoint_dir).is_dir():
        return 0
    return choose_iteration(args.checkpoint_dir).iteration or 0


class IterationProfiler:
    """``before(i)``/``after(i)`` around each iteration; profiles only the chosen one."""

    def __init__(self, options: Optional[ProfileOptions], rank: int, recipe, groups) -> None:
        self.options, self.rank = options, rank
        self._prof: Any = None  # a torch.profiler.profile while one iteration is traced
        p = recipe.parallel
        self.identity = {
            "rank": rank,
            "world_size": p.world_size,
            "pp_rank": groups.pp_rank,
            "tp_rank": groups.tp_rank,
            "cp_rank": groups.cp_rank,
            "dp_rank": groups.dp_rank,
            "recipe": recipe.to_dict(),
            "run_id": options.run_id if options else "",
        }

    def before(self, iteration: int) -> None:
        if self.options is None or iteration != self.options.iteration:
            return
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.start()

    def after(self, iteration: int, schedule_digest: str) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.add_metadata_json(
            METADATA_KEY, json.dumps({**self.identity, "iteration": iteration, "schedule_digest": schedule_digest})
        )
        prof.stop()
        assert self.options is not None  # a trace was started for it
        path = trace_path(self.options.directory, self.rank)
        partial = path.with_name(path.name + f".tmp{os.getpid()}")
        prof.export_chrome_trace(str(partial))
        os.replace(partial, path)
