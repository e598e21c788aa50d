#!/usr/bin/env bash
# Step benchmark (scripts/bench/step_bench.py) on a one-GPU machine with torch and transformers
# but no megatron-core, no verl and no internet: the presets 4L (with --breakdown) then 12L, then
# packed vs padded micro-batches on the 4L layers (scripts/bench/packed_layers.py), each under a
# timeout (240 + 165 + 120 s; STEP_BENCH_T4L / STEP_BENCH_T12L / STEP_BENCH_TPACKED override
# them, for a shorter lease) so the whole script stays under ~10 minutes. JSON goes to
# ${OUT:-.}/step_4L.json and step_12L.json (rewritten after each system, so a timeout still
# leaves the systems done so far) and packed_4L.json, logs to step_*.log / packed_4L.log there;
# the JSON documents are printed at the end.
#
# megatron-core travels as a wheel in .whl/ at the repository root (git-ignored). Download it
# first, on a machine with internet (the version pinned in pyproject.toml):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl megatron-core==0.16.1
#
#   bash scripts/bench/step_bench_device.sh

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
    || echo "megatron-core wheel not installed: the mcore systems will record import errors" >&2

set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=${PYTHONPATH:-$PWD}
OUT_DIR=${OUT:-.}
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

run_preset() {  # preset, timeout in seconds, extra flags
    local preset=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" python3 -m scripts.bench.step_bench --preset "$preset" "$@" \
        --out "$OUT_DIR/step_$preset.json" >/dev/null 2>"$OUT_DIR/step_$preset.log"
    echo "== preset $preset: exit $? after $((SECONDS - start)) s (124 = timed out)"
    tr '\r' '\n' <"$OUT_DIR/step_$preset.log" | grep -v -e "systems:" -e "^[[:space:]]*$" | tail -n 8  # per-system lines, last error
}

run_packed() {  # preset, timeout in seconds: packed vs padded forward + backward, same rows
    local preset=$1 limit=$2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" python3 -m scripts.bench.packed_layers --preset "$preset" \
        --device cuda --out "$OUT_DIR/packed_$preset.json" >/dev/null 2>"$OUT_DIR/packed_$preset.log"
    echo "== packed vs padded $preset: exit $? after $((SECONDS - start)) s (124 = timed out)"
    grep "^\[packed_layers\]" "$OUT_DIR/packed_$preset.log" | tail -n 4
    tail -n 3 "$OUT_DIR/packed_$preset.log"  # the error, if it failed
}

run_preset 4L "${STEP_BENCH_T4L:-240}" --breakdown
run_preset 12L "${STEP_BENCH_T12L:-165}"
run_packed 4L "${STEP_BENCH_TPACKED:-120}"

for preset in 4L 12L; do
    echo "== $OUT_DIR/step_$preset.json"
    cat "$OUT_DIR/step_$preset.json" 2>/dev/null || echo "(not written)"
done
echo "== $OUT_DIR/packed_4L.json"
cat "$OUT_DIR/packed_4L.json" 2>/dev/null || echo "(not written)"
