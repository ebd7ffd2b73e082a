#!/usr/bin/env bash
# Installs what the project needs (scripts/install.sh) and starts the dashboard on http://localhost:8501
# Extra arguments go to `streamlit run`, e.g. scripts/dashboard.sh --server.port 8600
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/install.sh" | tail -n 1)"
cd "$root"
exec "$venv/bin/python" -m streamlit run app.py "$@"
