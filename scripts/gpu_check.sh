#!/usr/bin/env bash
# The CUDA checks in one lease (about 6 minutes, no network, installs nothing):
#   bash scripts/gpu_check.sh [OUT_DIR]
# Stages, each under its own timeout, all logged to OUT_DIR/gpu_check.log:
#   1. the cuda-marked tests, files named explicitly (an import error in one file does not hide the rest)
#   2. a small real CUDA snapshot for tests/data (copy OUT_DIR/cuda_recorded_snapshot.* there)
#   3. the cost of one phase boundary's stats read (benchmarks/cuda_boundary.py)
#   4. the monitor's per-step overhead on a CUDA step (benchmarks/overhead.py --quick)
#   5. the step-time cost of each auto_snapshot policy (benchmarks/snapshot_policies.py --quick)
#   6. pre-flight predictions against torch.cuda.max_memory_allocated, when benchmarks/preflight.py exists
# At most 7 files come back: gpu_check.log, three JSON results, the snapshot pair, preflight JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg WANDB_MODE=offline
unset PYTORCH_CUDA_ALLOC_CONF  # the tests assume the default allocator
status=0
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  echo "===== $name (timeout ${seconds}s): $*" >> "$log"
  local t0=$SECONDS
  timeout "$seconds" "$@" >> "$log" 2>&1
  local rc=$?
  echo "===== $name: rc=$rc in $((SECONDS - t0))s" >> "$log"
  [ $rc -eq 0 ] || status=1
}
stage env 30 python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')"
cuda_tests=$(grep -l "pytest.mark.cuda\|mark.cuda" tests/test_*.py | tr '\n' ' ')
stage pytest_cuda 150 python -m pytest -q -m cuda -p no:cacheprovider -rs $cuda_tests
stage record_snapshot 40 python scripts/record_cuda_snapshot.py "$out"
stage boundary_cost 30 python benchmarks/cuda_boundary.py --json "$out/cuda_boundary.json"
stage overhead 60 python benchmarks/overhead.py --device cuda --quick --json "$out/overhead_cuda.json"
stage snapshot_policies 60 python benchmarks/snapshot_policies.py --device cuda --quick --json "$out/snapshot_policies.json"
if [ -f benchmarks/preflight.py ]; then
  stage preflight 45 python benchmarks/preflight.py --device cuda --quick --json "$out/preflight_cuda.json"
fi
echo "gpu_check: status=$status; files:" >> "$log"
ls -la "$out" >> "$log"
cat "$log"
exit $status
