#!/usr/bin/env bash
# The GPU check, run on a machine with an NVIDIA GPU, PyTorch and torchrun:
#   benchmarks/gpu_check.sh OUT_DIR
# Starts the real daemon and a 2-rank torchrun job whose ranks hold 2 and 3 GiB on GPU 0,
# then saves what trainwatch exported (/metrics, /ranks), what torch reported and what
# nvidia-smi lists, for comparison. Needs the runtime dependencies importable.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
torchrun_bin=${TORCHRUN:-torchrun}
{ uname -a; nvidia-smi -L; cat /proc/self/cgroup; grep cgroup /proc/self/mountinfo; grep NSpid /proc/self/status; } > "$out/machine.txt" 2>&1
"$py" -m sidecar --attach-torchrun --port 0 --interval 0.5 --postmortem-dir /tmp/tw-pm > "$out/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do grep -q 'serving http' "$out/daemon.log" && break; sleep 0.2; done
base=$(grep -o 'http://[0-9.:]*' "$out/daemon.log" | head -1)
rm -f "$out/stop"
"$torchrun_bin" --standalone --nproc-per-node=2 tests/workloads/gpu_rank.py "$out" > "$out/torchrun.log" 2>&1 &
job=$!
for _ in $(seq 300); do [ -f "$out/torch_rank0.json" ] && [ -f "$out/torch_rank1.json" ] && break; sleep 0.2; done
# until the daemon has sampled both ranks' GPU memory (NVML is read every round)
for _ in $(seq 120); do
  curl -s "$base/metrics" > "$out/metrics.txt"
  [ "$(grep -c '^trainwatch_rank_gpu_memory_bytes{' "$out/metrics.txt")" -ge 2 ] && break
  sleep 0.5
done
curl -s "$base/ranks" > "$out/ranks.json"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits > "$out/nvidia-smi-apps.csv" 2>&1
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits > "$out/nvidia-smi-gpu.csv" 2>&1
touch "$out/stop"
wait "$job"; echo "torchrun exit $?" >> "$out/torchrun.log"
sleep 2
curl -s "$base/metrics" > "$out/metrics-after.txt"
kill -TERM "$daemon"; wait "$daemon"; echo "daemon exit $?" >> "$out/daemon.log"
grep -E 'gpu_memory|rank_info' "$out/metrics.txt"
cat "$out"/torch_rank*.json; echo; cat "$out/nvidia-smi-apps.csv" "$out/nvidia-smi-gpu.csv"; tail -3 "$out/daemon.log"
"$py" benchmarks/gpu_summary.py "$out"
