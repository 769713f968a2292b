"""Stand-ins for SLURM's ``sbatch`` and ``srun`` that run a batch script on this machine, and a
``megatron-slim`` that runs this checkout's CLI: the SLURM scripts' tests and the README-path test
put them first on PATH."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

# runs the batch script at once with the requested node count; --export=ALL[,K=V...] as SLURM's
SBATCH = r"""#!/bin/bash
nodes=1; export_spec=ALL
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes=*) nodes=${1#--nodes=} ;;
    --export=*) export_spec=${1#--export=} ;;
    --*) ;;
    *) break ;;
  esac
  shift
done
script=$1; shift
if [ "${export_spec%%,*}" != ALL ]; then echo "sbatch stand-in: only --export=ALL[,K=V...]" >&2; exit 3; fi
IFS=, read -r -a kvs <<< "${export_spec#ALL}"
for kv in "${kvs[@]}"; do if [ -n "$kv" ]; then export "$kv"; fi; done
SLURM_NNODES=$nodes @RUN@ exec bash "$script" "$@"
"""
# one task on this machine (the batch script asks for one per node)
SRUN = r"""#!/bin/bash
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""


def write_standins(bin_dir: Path, dry_run: bool, srun: bool = False) -> Path:
    """``sbatch`` (as a dry run of the batch script when ``dry_run``), ``megatron-slim`` and, with
    ``srun``, ``srun`` in ``bin_dir``; returns ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "sbatch").write_text(SBATCH.replace("@RUN@", "DRY_RUN=1" if dry_run else "SLURM_JOB_ID=standin"))
    (bin_dir / "megatron-slim").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m megatron_slim.cli "$@"\n')
    if srun:
        (bin_dir / "srun").write_text(SRUN)
    for f in bin_dir.iterdir():
        if f.is_file() and not f.is_symlink():
            f.chmod(0o755)
    return bin_dir
