#!/usr/bin/env bash
# Creates .venv (or the directory in KVLAB_VENV) and installs requirements.txt into it.
# Used by the test and dashboard commands, by CI and by the Docker image, so all four install alike.
# Idempotent and quick on a machine where it already ran: pip only checks what is there.
# KVLAB_TORCH_INDEX (optional) is a package index to take torch from first, e.g.
# https://download.pytorch.org/whl/cpu for a CPU-only install without the CUDA libraries.
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
  if [ -n "${KVLAB_TORCH_INDEX:-}" ]; then
    "$venv/bin/python" -m pip install --quiet --index-url "$KVLAB_TORCH_INDEX" "$(grep '^torch==' "$root/requirements.txt")"
  fi
  "$venv/bin/python" -m pip install --quiet -r "$root/requirements.txt"
  cp "$root/requirements.txt" "$stamp"
fi
echo "$venv"
