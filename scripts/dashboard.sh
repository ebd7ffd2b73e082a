#!/usr/bin/env bash
# Installs what the project needs (scripts/install.sh) and starts the dashboard on http://localhost:8501
# Extra arguments go to `streamlit run`, e.g. scripts/dashboard.sh --server.port 8600
# torch computes on all but one of the machine's cores (OMP_NUM_THREADS, unless it is set already), so that a
# browser on the same machine keeps a core to draw with: on a small machine, torch threads spinning against a
# browser drawing WebGL slow both down several times over.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/install.sh" | tail -n 1)"
cores="$(nproc 2>/dev/null || echo 2)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((cores > 1 ? cores - 1 : 1))}"
cd "$root"
exec "$venv/bin/python" -m streamlit run app.py "$@"
