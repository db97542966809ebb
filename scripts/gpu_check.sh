#!/usr/bin/env bash
# The CUDA checks in one lease (at most 7.5 minutes, no network, installs nothing, needs only bash,
# coreutils' timeout and python3 with torch):
#   bash scripts/gpu_check.sh [OUT_DIR]
# Stages, each under its own timeout, all logged to OUT_DIR/gpu_check.log (the stage budget, the
# seconds after each stage name below, adds up to 405 s; each stage is sent SIGINT at its timeout,
# so pytest prints its summary and the benchmarks stop cleanly, and SIGKILL KILL_AFTER s later):
#   1. env (15 s): python, torch, CUDA and the device's name
#   2. oom (45 s): out of memory, explained, on CUDA (tests/oom/test_oom_cuda.py: OutOfMemoryError under a
#      per-process fraction, the OOM observer's snapshot linked, reserved and the largest free block, fragmentation;
#      README's plain loop without `with`, its OOM explained by the chained excepthook after the traceback; the batch
#      an explanation proposes after a jump runs under the same fraction and twice it does not)
#   3. pytest_cuda (120 s): the other cuda-marked tests, files named explicitly;
#      --continue-on-collection-errors: an import error in one file does not stop the others
#      (without it pytest runs nothing after a collection error); -rfEs: every failure, error and skip reason
#      is summarized at the end; --durations=20: the slowest tests; -o faulthandler_timeout=60:
#      a test running past 60 s gets every thread's stack dumped into the log (pytest-timeout is
#      not installed: nothing kills a single test, the stage timeout ends the run)
#   4. record_snapshot (30 s): a small real CUDA snapshot for tests/data (copy
#      OUT_DIR/cuda_recorded_snapshot.* there; the script checks its own recording and fails the stage if wrong)
#   5. boundary_cost (20 s): the cost of one phase boundary's stats read (benchmarks/cuda_boundary.py)
#   6. overhead (50 s): the monitor's per-step overhead on a CUDA step (benchmarks/overhead.py
#      --quick: on CUDA about 2,750 synchronized steps in 17 fits); the JSON is rewritten after
#      every fit, so a timeout keeps what was measured ("complete": false)
#   7. snapshot_policies (35 s): the step-time cost of each auto_snapshot policy
#      (benchmarks/snapshot_policies.py --quick)
#   8. preflight (60 s, imports transformers): pre-flight predictions against
#      torch.cuda.max_memory_allocated (benchmarks/preflight.py --quick), a row written per model
#   9. host_channel (30 s): a host-only Python-object leak on a CUDA run is found as host_growth
#      (type and holder named) while device memory is flat and no device growth is raised
#      (scripts/host_channel_check.py; tests/host/test_host_channel_check.py runs it on CPU)
# At most 7 files come back: gpu_check.log, three JSON results, the snapshot pair, preflight JSON.
#
# The pytest plugin: registered through its pytest11 entry point where memcallbacks is
# pip-installed; on a plain checkout (no entry point: the egg-info is git-ignored, this machine
# installs nothing) through PYTEST_PLUGINS=memcallbacks.pytest_plugin. Never both: pluggy refuses
# to register one module twice ("Plugin already registered under a different name").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg WANDB_MODE=offline
# the tests assume the default allocator; torch >= 2.9 reads PYTORCH_ALLOC_CONF first, older ones the CUDA name
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
# shellcheck source=scripts/pytest_plugin_env.sh
. scripts/pytest_plugin_env.sh
memcallbacks_pytest_plugin_env
echo "pytest plugin: ${PYTEST_PLUGINS:-through the pytest11 entry point}" >> "$log"
KILL_AFTER=5
status=0
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  echo "===== $name (timeout ${seconds}s): $*" >> "$log"
  local t0=$SECONDS
  timeout --signal=INT --kill-after="$KILL_AFTER" "$seconds" "$@" >> "$log" 2>&1
  local rc=$?
  echo "===== $name: rc=$rc in $((SECONDS - t0))s$( { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo ' (timed out)')" >> "$log"
  [ $rc -eq 0 ] || status=1
}
stage env 15 python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')"
stage oom 45 python3 -m pytest -q -m cuda -p no:cacheprovider -rfEs tests/oom/test_oom_cuda.py
cuda_tests=$(grep -rl --include="test_*.py" "pytest.mark.cuda\|mark.cuda" tests | grep -v "tests/oom/test_oom_cuda.py" | tr '\n' ' ')
# shellcheck disable=SC2086  # one argument per file
stage pytest_cuda 120 python3 -m pytest -q -m cuda -p no:cacheprovider --continue-on-collection-errors -rfEs --durations=20 -o faulthandler_timeout=60 $cuda_tests
stage record_snapshot 30 python3 scripts/record_cuda_snapshot.py "$out"
stage boundary_cost 20 python3 benchmarks/cuda_boundary.py --json "$out/cuda_boundary.json"
stage overhead 50 python3 benchmarks/overhead.py --device cuda --quick --json "$out/overhead_cuda.json"
stage snapshot_policies 35 python3 benchmarks/snapshot_policies.py --device cuda --quick --json "$out/snapshot_policies.json"
stage preflight 60 python3 benchmarks/preflight.py --device cuda --quick --json "$out/preflight_cuda.json"
stage host_channel 30 python3 scripts/host_channel_check.py --device cuda
echo "gpu_check: status=$status; files:" >> "$log"
ls -la "$out" >> "$log"
cat "$log"
exit $status
