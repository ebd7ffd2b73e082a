#!/usr/bin/env bash
# Installs kvlab and its extras into .venv (scripts/install.sh), checks lint, formatting and types
# (scripts/lint.sh), then runs the default test suite. Extra arguments go to pytest, e.g. scripts/test.sh -k engine
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/install.sh" | tail -n 1)"
bash "$root/scripts/lint.sh"
cd "$root"
exec "$venv/bin/python" -m pytest "$@"
