#!/usr/bin/env bash
# Installs what the project needs (scripts/install.sh) and runs the default test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k engine
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/install.sh" | tail -n 1)"
cd "$root"
exec "$venv/bin/python" -m pytest "$@"
