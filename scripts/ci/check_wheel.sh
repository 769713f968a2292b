#!/usr/bin/env bash
# A normal (non-editable) install works: build a wheel from this checkout, install it into a fresh
# venv and run the CLI from that venv in a temporary folder, where the checkout is not importable.
#
#   bash scripts/ci/check_wheel.sh          (or `make check-wheel`; `.ci/run` calls it after the tests)
#
# Steps, each timed: copy the checkout's files (git ls-files: no stale build/ or egg-info); make a
# fresh venv; build the wheel with its pip; check that the wheel holds every file of megatron_slim/
# (modules, recipes, hardware profiles, py.typed) and nothing else; install torch==2.13.0 (pinned:
# anything else pulls GBs of CUDA packages), then the wheel with its dependencies (pip's cache is
# used as usual); then, from the temporary folder, `megatron-slim recipes` (must list every shipped
# recipe and hardware profile), `megatron-slim simulate` of a shipped recipe (and, matplotlib being
# the `plot` extra, its `--plot` refused naming it) and a 2-iteration
# `megatron-slim train` of tiny-cpu (4 CPU ranks; it first tokenizes the Python standard library
# into a fresh cache, ~10-20 s on 2 cores).
#
# Environment: PYTHON (default python3) makes the venv; the work folder is new under $TMPDIR (or
# /tmp) and removed at the end unless KEEP=1. The CLI runs without PYTHONPATH, user site-packages
# or $MEGATRON_SLIM_CONFIGS, so only the wheel counts. Fails loudly on the first error.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/megatron-slim-wheel.XXXXXX")
VENV=$WORK/venv
SRC=$WORK/src
DIST=$WORK/dist
RUN=$WORK/run
SIM_RECIPE=llama2-7b-64k

CURRENT=""
TIMES=()
finish() {
    local rc=$?
    if ((${#TIMES[@]})); then
        echo "check-wheel step times:"
        printf '  %s\n' "${TIMES[@]}"
    fi
    if [[ $rc -ne 0 ]]; then
        echo "check-wheel: FAILED (exit $rc) in step: ${CURRENT:-setup}" >&2
    fi
    if [[ ${KEEP:-0} == 1 ]]; then
        echo "check-wheel: work folder kept: $WORK"
    else
        rm -rf "$WORK"  # a venv with torch is about 1 GB; KEEP=1 keeps it for a look
    fi
    exit "$rc"
}
trap finish EXIT

die() { echo "check-wheel: $*" >&2; exit 1; }

now() { if [[ -n ${EPOCHREALTIME:-} ]]; then echo "${EPOCHREALTIME/,/.}"; else date +%s.%N; fi; }

# step NAME CMD...: run CMD, print and record its wall time.
step() {
    CURRENT=$1
    shift
    echo "=== $CURRENT"
    local began
    began=$(now)
    "$@"
    local seconds
    seconds=$(awk -v a="$began" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    echo "=== $CURRENT: ${seconds}s"
    TIMES+=("$(printf '%-28s %7ss' "$CURRENT" "$seconds")")
}

copy_sources() {
    mkdir -p "$SRC"
    if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        # Tracked files and untracked ones git does not ignore, as they are in the working tree.
        (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
            | xargs -0 sh -c 'for f; do if [ -e "$f" ]; then printf "%s\0" "$f"; fi; done' sh \
            | tar --null -cf - -T -) | tar -xf - -C "$SRC"
    else
        tar -C "$ROOT" --exclude=./.venv --exclude=./build --exclude=./dist --exclude='*.egg-info' \
            --exclude=__pycache__ --exclude=./.git -cf - . | tar -xf - -C "$SRC"
    fi
    [[ -f $SRC/pyproject.toml ]] || die "no pyproject.toml in $ROOT"
}

make_venv() {
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -c 'import sys; print("venv:", sys.prefix, sys.version.split()[0])'
}

build_wheel() {
    "$VENV/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$DIST" "$SRC"
    local wheels=("$DIST"/megatron_slim-*.whl)
    [[ ${#wheels[@]} -eq 1 && -f ${wheels[0]} ]] || die "expected one megatron_slim wheel in $DIST, found: ${wheels[*]}"
    WHEEL=${wheels[0]}
    echo "built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB)"
}

# Every file of the source package (Python or data) is in the wheel, and nothing else is.
check_contents() {
    "$VENV/bin/python" - "$WHEEL" "$SRC" <<'EOF'
import os
import sys
import zipfile

wheel, src = sys.argv[1], sys.argv[2]
in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("megatron_slim/")}
in_tree = set()
for dirpath, dirnames, filenames in os.walk(os.path.join(src, "megatron_slim")):
    dirnames[:] = [d for d in dirnames if d != "__pycache__"]
    for name in filenames:
        if not name.endswith((".pyc", ".pyo")):
            in_tree.add(os.path.relpath(os.path.join(dirpath, name), src).replace(os.sep, "/"))
missing, extra = sorted(in_tree - in_wheel), sorted(in_wheel - in_tree)
for label, names in (("missing from the wheel", missing), ("in the wheel but not the source tree", extra)):
    for name in names:
        print(f"  {label}: {name}", file=sys.stderr)
if missing or extra:
    sys.exit(f"wheel contents differ from megatron_slim/ ({len(missing)} missing, {len(extra)} extra): "
             "add an __init__.py or a package-data glob in pyproject.toml")
configs = sorted(n for n in in_wheel if n.startswith("megatron_slim/configs/"))
print(f"wheel holds all {len(in_tree)} files of megatron_slim/, {len(configs)} of them under configs/")
if not configs:
    sys.exit("the wheel ships no configs")
EOF
}

install_torch() { "$VENV/bin/python" -m pip install --quiet torch==2.13.0; }

install_wheel() {
    "$VENV/bin/python" -m pip install --quiet "$WHEEL"
    mkdir -p "$RUN"
    local where
    where=$(cd "$RUN" && isolated "$VENV/bin/python" -c \
        'import megatron_slim; print(megatron_slim.__file__)')
    echo "megatron_slim imports from $where"
    [[ $where == "$VENV"/* ]] || die "megatron_slim imported from $where, not from the venv $VENV"
}

# Run from $RUN, with nothing but the venv to import from: the checkout is neither the working
# folder nor on any path, and the shipped configs are the ones found.
isolated() { env -u PYTHONPATH -u PYTHONHOME -u MEGATRON_SLIM_CONFIGS PYTHONNOUSERSITE=1 "$@"; }
cli() { (cd "$RUN" && isolated "$VENV/bin/megatron-slim" "$@"); }

run_recipes() {
    cli recipes | tee "$RUN/recipes.txt"
    local names=() name
    for f in "$SRC"/megatron_slim/configs/*.yaml "$SRC"/megatron_slim/configs/hardware/*.yaml; do
        if [[ -f $f ]]; then names+=("$(basename "$f" .yaml)"); fi
    done
    ((${#names[@]})) || die "the source tree has no recipes in megatron_slim/configs/"
    for name in "${names[@]}"; do
        grep -Eq "^  $name " "$RUN/recipes.txt" || die "'megatron-slim recipes' does not list $name"
    done
    echo "listed all ${#names[@]} shipped recipes and hardware profiles"
}

run_simulate() {
    cli simulate --recipe "$SIM_RECIPE" --json "$RUN/simulate.json"
    "$VENV/bin/python" - "$RUN/simulate.json" <<'EOF'
import json, sys
out = json.load(open(sys.argv[1]))
if not (out.get("iteration_time_s", 0) > 0 and out.get("ranks")):
    sys.exit(f"simulate wrote no timing: {out}")
print(f"simulated one iteration: {out['iteration_time_s']:.3f} s, {len(out['ranks'])} ranks")
EOF
    # matplotlib is the `plot` extra: a bare install refuses --plot before any work, naming it
    local refused
    if isolated "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("matplotlib") is None)'; then
        echo "matplotlib came with another dependency: the --plot refusal is not checked here"
    elif refused=$(cli simulate --recipe "$SIM_RECIPE" --plot "$RUN/timeline.png" 2>&1); then
        die "simulate --plot ran without matplotlib installed"
    else
        [[ $refused == *"pip install 'megatron-slim[plot]'"* ]] || die "--plot without matplotlib: $refused"
        [[ ! -e $RUN/timeline.png ]] || die "--plot without matplotlib wrote $RUN/timeline.png"
        echo "--plot without matplotlib is refused, naming the plot extra"
    fi
    # the shipped calibrations load by name from the installed package
    cli simulate --recipe "$SIM_RECIPE" --calibration hopper-cudnn --json "$RUN/simulate-calibrated.json" > /dev/null
    echo "simulated with the shipped calibration hopper-cudnn"
}

run_train() {
    MEGATRON_SLIM_CACHE=$WORK/cache cli train --set train.iters=2 --json "$RUN/train.json"
    "$VENV/bin/python" - "$RUN/train.json" <<'EOF'
import json, math, sys
out = json.load(open(sys.argv[1]))
losses = out["losses"]
if not (len(losses) == 2 and all(math.isfinite(x) for x in losses)):
    sys.exit(f"expected 2 finite losses, got {losses}")
print(f"trained 2 iterations, losses {losses}")
EOF
}

echo "check-wheel: $ROOT -> $WORK"
step "copy sources" copy_sources
step "fresh venv" make_venv
step "build wheel" build_wheel
step "wheel contents" check_contents
step "install torch==2.13.0" install_torch
step "install wheel" install_wheel
step "megatron-slim recipes" run_recipes
step "megatron-slim simulate" run_simulate
step "megatron-slim train (2 it)" run_train
CURRENT=""
echo "check-wheel: OK"
