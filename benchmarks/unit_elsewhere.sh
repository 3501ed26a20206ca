#!/usr/bin/env bash
# The unit suite on another machine (issue 30: "holds on any machine"):
#   benchmarks/unit_elsewhere.sh OUT_DIR [pytest args...]
# Records what the machine is (kernel, cores, page size, capabilities, cgroup version, what
# of /proc, /dev/kmsg and tracefs it has) and runs `pytest -m "not slow"` with a verbose
# log and a JUnit file; `python benchmarks/unit_summary.py OUT_DIR NAME --commit C` turns them
# into benchmarks/results/NAME.json (benchmarks/results/unit-gpu-machine.json is one).
# Needs the test dependencies importable (on the GPU machine: carried wheels, see README).
set -uo pipefail
out=${1:?usage: unit_elsewhere.sh OUT_DIR [pytest args...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
{
  echo "## uname"; uname -a
  echo "## cpu"; grep -m1 '^model name' /proc/cpuinfo
  echo "## memory"; grep '^MemTotal:' /proc/meminfo
  echo "## nproc"; nproc
  echo "## page size"; getconf PAGESIZE
  echo "## id"; id
  echo "## capabilities"; grep -E '^Cap(Eff|Bnd)' /proc/self/status
  echo "## cgroup"; cat /proc/self/cgroup; grep cgroup /proc/self/mountinfo
  echo "## /dev/kmsg"; ls -la /dev/kmsg
  echo "## tracefs"; ls -d /sys/kernel/tracing/events /sys/kernel/debug/tracing/events
  echo "## /proc sizes (bytes read)"
  for f in /proc/vmstat /proc/meminfo /proc/self/status /proc/self/smaps_rollup /proc/self/stat /proc/pressure/memory; do
    printf '%s %s\n' "$f" "$(cat "$f" 2>/dev/null | wc -c)"
  done
  echo "## python"; "$py" -c 'import sys, platform; print(sys.version); print(platform.platform())'
  "$py" -c 'import torch; print("torch", torch.__version__)'
  echo "## gpu"; nvidia-smi -L
} > "$out/machine.txt" 2>&1
start=$(date +%s)
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$py" -m pytest -m "not slow" -v -rfEs -p no:cacheprovider \
  --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/unit.log" | grep -E '(FAILED|ERROR)|^=+ .* in [0-9]' 
echo "exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$out/unit.log"
