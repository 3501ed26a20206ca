#!/usr/bin/env bash
# On the GPU machine: real GPU failures under `trainwatch run`, their output, postmortems
# and flight-recorder dumps written under $OUT (kept as test fixtures). One rank each:
#   1. an NCCL all_reduce that cannot finish within 5 s (flight recorder on)
#   2. a CUDA out-of-memory
# Then the fallback and run e2e tests on that machine's cgroup version.
set -uo pipefail
OUT=${OUT:-/tmp/trainwatch-gpu-failures}
mkdir -p "$OUT/fr"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PYTHON:-python3}
torchrun=$(dirname "$(command -v "$py")")/torchrun
uname -r > "$OUT/uname.txt"; nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$py" -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())' > "$OUT/versions.txt" 2>&1

run() {  # name, then the workload's arguments
  local name=$1; shift
  local start=$SECONDS
  TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE="$OUT/fr/nccl_trace_rank_" \
  TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=10000 \
    "$py" -m sidecar run --port 0 --postmortem-dir "$OUT/pm-$name" -- \
      "$torchrun" --standalone --nproc-per-node=1 --monitor-interval=0.1 tests/workloads/gpu_failures.py "$@" \
      > "$OUT/$name.stdout" 2> "$OUT/$name.stderr"
  echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  for f in "$OUT/pm-$name"/*.json; do
    [ -e "$f" ] && "$py" -m sidecar postmortem "$f" > "$OUT/$name.postmortem.txt"
  done
}
run nccl-timeout --mode nccl-timeout
run cuda-oom --mode cuda-oom
ls -la "$OUT/fr" >> "$OUT/summary.txt"
"$py" -m sidecar doctor > "$OUT/doctor.txt" 2>&1
timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/test_e2e_run.py tests/test_e2e_fallbacks.py \
  tests/test_fallback_units.py tests/test_rank_output_units.py > "$OUT/pytest.txt" 2>&1
echo "pytest: exit $?" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/pytest.txt"
