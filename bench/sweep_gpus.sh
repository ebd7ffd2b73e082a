#!/usr/bin/env bash
# One sweep on one GPU and on every GPU: the README's sweep command run with `--workers 1` (in one process, no Ray)
# and with `--workers 2` (two Ray workers, one GPU and one loaded model each), each into a fresh store, each timed
# by the wall clock from the command's start to its end (Python, model loading and Ray's start included).
#
#   bench/sweep_gpus.sh RESULTS_DIR
#
# Writes RESULTS_DIR/workers1.duckdb, RESULTS_DIR/workers2.duckdb and RESULTS_DIR/summary.json (also printed): both
# wall times and their ratio, the trials in each store (equal when both sweeps ran the whole grid), the trials whose
# answers are the same in both, the device each store's runs were filed under, and the GPUs nvidia-smi names.
# Needs a machine with two GPUs and Ray installed (kvlab[ray]).
#
# Environment (the default grid is the README's with more trials, sized to take a few minutes on one GPU so that
# loading the model and starting Ray do not dominate):
#   PYTHON                 the interpreter that runs kvlab (default python3)
#   KVLAB_BENCH_MODEL      the model (default the shipped kvlab-tiny-llama; e.g. SmolLM2-135M-Instruct.Q4_1.gguf)
#   KVLAB_BENCH_POLICIES   default h2o,streaming,snapkv,random
#   KVLAB_BENCH_KEEP       default 0.1,0.3,0.5
#   KVLAB_BENCH_MODES      default prefill,streaming
#   KVLAB_BENCH_CONTEXTS   default 1024,2048
#   KVLAB_BENCH_TRIALS     items per depth (5 depths), default 24
#   KVLAB_BENCH_BATCH      default 8
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 RESULTS_DIR" >&2
  exit 2
fi
mkdir -p "$1"
out="$(cd "$1" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-python3}"
model="${KVLAB_BENCH_MODEL:-kvlab-tiny-llama}"
grid=(
  --model "$model"
  --policies "${KVLAB_BENCH_POLICIES:-h2o,streaming,snapkv,random}"
  --keep "${KVLAB_BENCH_KEEP:-0.1,0.3,0.5}"
  --mode "${KVLAB_BENCH_MODES:-prefill,streaming}"
  --contexts "${KVLAB_BENCH_CONTEXTS:-1024,2048}"
  --depths 0,0.25,0.5,0.75,1
  --trials "${KVLAB_BENCH_TRIALS:-24}"
  --batch-size "${KVLAB_BENCH_BATCH:-8}"
  --seed 0
  --quiet
)

sweep() {  # $1: workers; prints the wall seconds
  local db="$out/workers$1.duckdb"
  rm -f "$db" "$db.wal"
  local start end
  start="$(date +%s.%N)"
  "$python" -m kvlab sweep "${grid[@]}" --workers "$1" --db "$db" >&2
  end="$(date +%s.%N)"
  "$python" -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$start" "$end"
}

one="$(sweep 1)"
two="$(sweep 2)"
gpus="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true)"

"$python" - "$out" "$one" "$two" "$gpus" "${grid[*]}" <<'EOF'
import json
import sys
from pathlib import Path

from kvlab.store import open_store

out, one, two, gpus, grid = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]


def answers(workers: int) -> tuple[dict, list[str]]:
    """Each stored trial's answer by its run's identity and key, and the devices the runs were filed under."""
    with open_store(out / f"workers{workers}.duckdb", read_only=True) as store:
        runs = store.list_runs()
        keys = dict(zip(runs["run_id"], runs["run_key"]))
        trials = store.trials_frame()
        rows = zip(trials["run_id"], trials["trial_key"], trials["output"])
        return {(keys[run], key): output for run, key, output in rows}, sorted(set(runs["device"]))


first, first_devices = answers(1)
second, second_devices = answers(2)
summary = {
    "gpus": [name.strip() for name in gpus.splitlines() if name.strip()],
    "command": f"python3 -m kvlab sweep {grid} --workers N --db RESULTS_DIR/workersN.duckdb",
    "workers_1": {"wall_s": one, "trials": len(first), "devices": first_devices},
    "workers_2": {"wall_s": two, "trials": len(second), "devices": second_devices},
    "speedup": one / two,
    "trials_equal": len(first) == len(second) and set(first) == set(second),
    "same_answers": sum(first[key] == second.get(key) for key in first),
}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
if not summary["trials_equal"]:
    sys.exit("the two stores hold different trials")
EOF
