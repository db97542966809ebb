#!/usr/bin/env bash
# The CUDA checks, in a few minutes, on a machine with a GPU (no network needed):
#   bash scripts/gpu_check.sh [OUT_DIR]
# 1. the tests marked `cuda`; 2. the overhead benchmark on CUDA (quick); results under OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg WANDB_MODE=offline
python - <<'PY' | tee "$out/env.txt"
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
PY
status=0
timeout 300 python -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$out/pytest_cuda.txt" || status=1
if [ -f benchmarks/overhead.py ]; then
  timeout 240 python benchmarks/overhead.py --device cuda --quick --json "$out/overhead_cuda.json" 2>&1 | tee "$out/overhead_cuda.txt" || status=1
fi
exit $status
