#!/usr/bin/env bash
# The GPU checks and the GPU-relevant benchmarks in one run of about 9 minutes on one GPU, each command under its own
# time limit, every output kept under $OUT (default: runs/gpu_session):
#
#     OUT=/tmp/gpu-out bash tools/gpu_session.sh
#
# Run it from the repository root with the GPU machine's own Python (GPU_PY, default python3). `make gpu-check`
# installs the wheels `make gpu-wheels` put into .whl/ beside that Python's packages (GPU_SITE); the benchmarks after
# it import them from there. A command that fails or overruns is recorded in $OUT/summary.txt and the next one runs.
set -u
OUT=${OUT:-runs/gpu_session}
GPU_PY=${GPU_PY:-python3}
GPU_SITE=${GPU_SITE:-/tmp/disttrain-gpu-site}
mkdir -p "$OUT"
export PYTHONPATH="src:$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
: > "$OUT/summary.txt"

# step NAME SECONDS COMMAND...: COMMAND's output into $OUT/NAME.log, its exit status and seconds into summary.txt.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name (at most ${limit} s): $*" | tee -a "$OUT/summary.txt"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [ "$rc" = 124 ] && rc="124 (stopped at ${limit} s)"
    echo "   exit $rc after $(( $(date +%s) - start )) s; last lines:" | tee -a "$OUT/summary.txt"
    tail -n 15 "$OUT/$name.log" | sed 's/^/   | /' | tee -a "$OUT/summary.txt"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
# gpu_check's own budget is 240 s; the rest is the wheels' install, its workers' start and the report.
step gpu_check 300 make gpu-check GPU_PY="$GPU_PY" GPU_SITE="$GPU_SITE" GPU_OUT="$OUT/gpu_check" \
    GPU_ARGS="--budget 240"
# One process per GPU (--devices defaults to the GPUs, at most 2); --smoke: the tiny ViT, eager vs compiled.
step compile_speed 90 "$GPU_PY" bench/compile_speed.py --device cuda --smoke --out-dir "$OUT/bench"
# CPU processes, but with CUDA present the staging buffers are pinned: the path that failed on a second save.
step async_checkpoint 60 "$GPU_PY" bench/async_checkpoint.py --devices 1 --hidden 512 --layers 4 --seq 64 \
    --every 2 --saves 2 --rounds 1
# 2 CPU processes over gloo on the loopback interface (both ranks are on this machine), the schedules on CPU stages.
step pipeline_bubble 90 env GLOO_SOCKET_IFNAME=lo "$GPU_PY" bench/pipeline_bubble.py --device cpu --hidden 256 \
    --layers 4 --seq 64 --microbatches 2,4 --compare 4 --steps 2 --no-tp --out-dir "$OUT/bench"
echo "summary: $OUT/summary.txt"
