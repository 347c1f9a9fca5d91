#!/usr/bin/env bash
# rlake's GPU checks on one CUDA machine, as run on the H200 (docs/gpu.md): the `gpu` tests,
# sync vs async of configs/gpu.yaml, the engine (CUDA graph vs eager vs HF generate) at 0.5B.
# Run from the project root with .gpu-bundle/ beside it (../shared/gpu/README.md); results in
# $OUT (default ./gpu-out); T1..T3 bound each step in seconds.
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
test -d /tmp/site/deltalake || { mkdir -p /tmp/site && tar -xJf .gpu-bundle/part1.tar.xz -C /tmp/site; }
test -d /tmp/site/prefect || tar -xJf .gpu-bundle/part2.tar.xz -C /tmp/site
date -u > "$OUT"/info.txt; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT"/info.txt
nproc >> "$OUT"/info.txt
python3 -c "import torch,transformers,sys;print(sys.version, torch.__version__, torch.version.cuda, transformers.__version__)" >> "$OUT"/info.txt 2>&1
s=$SECONDS
timeout ${T1:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rs > "$OUT"/pytest_gpu.txt 2>&1; echo "rc=$? $((SECONDS-s))s" >> "$OUT"/pytest_gpu.txt
tail -5 "$OUT"/pytest_gpu.txt
s=$SECONDS
timeout ${T2:-220} python3 bench/async.py --config configs/gpu.yaml --iterations 30 --seeds 1 --home /tmp/ab > "$OUT"/async_bench.txt 2>&1; echo "rc=$? $((SECONDS-s))s" >> "$OUT"/async_bench.txt
grep -v '^{' "$OUT"/async_bench.txt | tail -6
s=$SECONDS
timeout ${T3:-150} python3 -m bench.gpu --engine-only --shapes 0.5b > "$OUT"/bench_engine.txt 2>&1; echo "rc=$? $((SECONDS-s))s" >> "$OUT"/bench_engine.txt
tail -3 "$OUT"/bench_engine.txt
