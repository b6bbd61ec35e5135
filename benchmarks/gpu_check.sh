#!/usr/bin/env bash
# The device check, as one command on a lent GPU machine (a bare image with torch and
# transformers): tests/gpu, then a narrowed bench on CUDA; logs and tables land in $OUT.
#   device run: bash benchmarks/gpu_check.sh            (timeout_s 580: tests 150 s, bench 390 s at most)
# BATCHES (default "1 32") and REPS (default 2) size the bench; DEVICE=cpu tries it without a GPU.
set -o pipefail
OUT=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/machine.txt"
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 150 $PY -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests_gpu.log"
tests=$?
timeout 390 $PY benchmarks/gpu_check.py --device ${DEVICE:-cuda} --out "$OUT" --batches ${BATCHES:-1 32} --reps ${REPS:-2} 2>&1 | tee "$OUT/bench.log"
bench=$?
echo "tests/gpu exit $tests, bench exit $bench"
exit $(( tests || bench ))
