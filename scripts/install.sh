#!/usr/bin/env bash
# Creates .venv (or the directory in KVLAB_VENV) and installs requirements.txt into it.
# Used by the test and dashboard commands, by CI and by the Docker image, so all four install alike.
# Idempotent and quick on a machine where it already ran: pip only checks what is there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVLAB_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.kvlab-requirements"
if [ ! -f "$stamp" ] || ! cmp -s "$root/requirements.txt" "$stamp"; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet -r "$root/requirements.txt"
  cp "$root/requirements.txt" "$stamp"
fi
echo "$venv"
