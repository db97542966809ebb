#!/usr/bin/env bash
# The CUDA checks, in a few minutes, on a machine with a GPU (no network needed):
#   bash scripts/gpu_check.sh [OUT_DIR]
# 1. the tests marked `cuda` (device layer, Lightning phases, snapshots, auto_snapshot: threshold,
#    alloc retries, real OOM, policies, two ranks on one GPU); 2. a small real CUDA snapshot for
#    tests/data (copy OUT_DIR/cuda_recorded_snapshot.* there); 3. the overhead benchmark on CUDA
#    (quick); 4. the step-time cost of each auto_snapshot policy (quick). Results under OUT_DIR.
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
timeout 240 python -m pytest -q -m cuda -p no:cacheprovider -rs tests 2>&1 | tee "$out/pytest_cuda.txt" || status=1
timeout 60 python scripts/record_cuda_snapshot.py "$out" 2>&1 | tee "$out/record_cuda_snapshot.txt" || status=1
timeout 150 python benchmarks/overhead.py --device cuda --quick --json "$out/overhead_cuda.json" 2>&1 | tee "$out/overhead_cuda.txt" || status=1
timeout 120 python benchmarks/snapshot_policies.py --device cuda --quick --json "$out/snapshot_policies.json" 2>&1 | tee "$out/snapshot_policies.txt" || status=1
exit $status
