#!/bin/bash
# Submit a recipe: scripts/slurm/submit.sh RECIPE [sbatch options...]
# Computes the node count from the recipe; every pretrain_gpt.sbatch variable passes through.
set -euo pipefail
RECIPE=${1:?usage: submit.sh RECIPE [sbatch options...]}; shift
MEGATRON_SLIM=${MEGATRON_SLIM:-megatron-slim}
nodes=$($MEGATRON_SLIM megatron-args --recipe "$RECIPE" --nodes)
here=$(cd "$(dirname "$0")" && pwd)
RECIPE=$RECIPE exec sbatch --nodes="$nodes" --job-name="slim-$RECIPE" "$@" "$here/pretrain_gpt.sbatch"
