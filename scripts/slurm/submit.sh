#!/bin/bash
# Submit a recipe: scripts/slurm/submit.sh RECIPE [sbatch options...]
# Computes the node count from the recipe and RECIPE_SET; every pretrain_gpt.sbatch variable passes through.
set -euo pipefail
RECIPE=${1:?usage: submit.sh RECIPE [sbatch options...] (RECIPE: a shipped recipe name or a recipe .yaml)}; shift
MEGATRON_SLIM=${MEGATRON_SLIM:-megatron-slim}
set_args=()
for kv in ${RECIPE_SET:-}; do set_args+=(--set "$kv"); done
nodes=$($MEGATRON_SLIM megatron-args --recipe "$RECIPE" "${set_args[@]}" --nodes)
here=$(cd "$(dirname "$0")" && pwd)
RECIPE=$RECIPE exec sbatch --nodes="$nodes" --job-name="slim-$RECIPE" "$@" "$here/pretrain_gpt.sbatch"
