#!/usr/bin/env bash
# On the GPU machine: real GPU failures under `trainwatch run`; their output, postmortems
# (JSON and text) and flight-recorder dumps go into one archive, $OUT/gpu-failures.tar.gz
# (kept as test fixtures under tests/fixtures/device-h200/). One rank each:
#   1. an NCCL all_reduce that cannot finish within 5 s (flight recorder on)
#   2. a CUDA out-of-memory
# Then the run, fallback and rank-output tests on that machine's cgroup version.
set -uo pipefail
OUT=${OUT:-/tmp/trainwatch-gpu-failures}
W=$(mktemp -d)/gpu-failures
mkdir -p "$W/fr"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PYTHON:-python3}
torchrun=$(dirname "$(command -v "$py")")/torchrun
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null
uname -r > "$W/uname.txt"; nvidia-smi > "$W/nvidia-smi.txt" 2>&1
"$py" -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())' > "$W/versions.txt" 2>&1

run() {  # name, then the workload's arguments
  local name=$1; shift
  local start=$SECONDS
  # The heartbeat monitor kills a rank whose watchdog is stuck after this long (default
  # 480 s): with the GPU busy the dump can hang, and 8 minutes is more than a call allows.
  TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE="$W/fr/nccl_trace_rank_" \
  TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=30 \
    "$py" -m sidecar run --port 0 --postmortem-dir "$W/pm-$name" -- \
      "$torchrun" --standalone --nproc-per-node=1 --monitor-interval=0.1 tests/workloads/gpu_failures.py "$@" \
      > "$W/$name.stdout" 2> "$W/$name.stderr"
  echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$W/summary.txt"
  for f in "$W/pm-$name"/*.json; do
    [ -e "$f" ] && "$py" -m sidecar postmortem "$f" > "$W/$name.postmortem.txt"
  done
}
run nccl-timeout --mode nccl-timeout
run cuda-oom --mode cuda-oom
ls -la "$W/fr" >> "$W/summary.txt"
"$py" -m sidecar doctor > "$W/doctor.txt" 2>&1
timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/e2e/test_run.py tests/e2e/test_fallbacks.py \
  tests/unit/parse/test_torchrun.py tests/unit/parse/test_oomd.py tests/unit/parse/test_ranks.py \
  tests/unit/watch/test_pidfds.py tests/unit/probes/test_outputs.py tests/unit/autopsy/test_said.py \
  > "$W/pytest.txt" 2>&1
echo "pytest: exit $?" | tee -a "$W/summary.txt"
tail -3 "$W/pytest.txt"
cat "$W/summary.txt"
mkdir -p "$OUT" && tar -C "$(dirname "$W")" -czf "$OUT/gpu-failures.tar.gz" gpu-failures
