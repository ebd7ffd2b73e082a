#!/usr/bin/env bash
# Builds the Dockerfile with buildah and runs the image the way a team would: the server with a host directory as
# its /data volume, the health check's URL, the published model from its installed package, a generation that stores
# a run, a restart that still finds the run, and the non-root user. Takes minutes (the dependencies are installed
# from PyPI); not part of the test suite.
#
# Needs root, buildah and debootstrap (Debian: apt-get install buildah debootstrap). Where the Dockerfile's base
# image (python:3.11-slim-bookworm) cannot be pulled, a Debian bookworm base with Python 3.11 is made with
# debootstrap and tagged with that name, so the Dockerfile is built unchanged.
#
# KVLAB_WHEELS (optional): a directory of wheels to install first (mounted into the build, passed as
# PIP_FIND_LINKS), e.g. a CPU build of torch already on this machine. KVLAB_CA_BUNDLE (default: $PIP_CERT): a CA
# bundle for pip behind a proxy that inspects TLS (mounted into the build, passed as PIP_CERT). KVLAB_SMOKE_PORT:
# the port the server listens on (default 8501, the image's).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="python:3.11-slim-bookworm"
image="localhost/kvlab:smoke"
port="${KVLAB_SMOKE_PORT:-8501}"
wheels="${KVLAB_WHEELS:-}"
ca_bundle="${KVLAB_CA_BUNDLE:-${PIP_CERT:-}}"
export STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}"  # overlay mounts are not allowed everywhere; vfs works everywhere

say() { printf '[image-smoke] %s\n' "$*"; }
fail() { say "FAILED: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || fail "run as root (buildah's chroot isolation and debootstrap need it)."
for tool in buildah debootstrap curl; do
  command -v "$tool" >/dev/null || fail "$tool is not installed (Debian: apt-get install buildah debootstrap curl)."
done
if curl -fsS "http://127.0.0.1:$port/_stcore/health" >/dev/null 2>&1; then
  fail "something already listens on port $port; stop it or set KVLAB_SMOKE_PORT."
fi

work="$(mktemp -d /tmp/kvlab-smoke.XXXXXX)"
containers=()
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill -- "-$server_pid" 2>/dev/null || true
  for container in "${containers[@]}"; do buildah rm "$container" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT

began=$(date +%s)
say "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "$(buildah --version)"

# 1. The base image: pulled if a registry serves it, else made with debootstrap under the same name.
if buildah inspect --type image "$base" >/dev/null 2>&1; then
  say "base image $base: already here"
elif buildah pull --quiet "docker.io/library/$base" >/dev/null 2>&1; then
  say "base image $base: pulled"
else
  say "base image $base: cannot be pulled; making it with debootstrap (Debian bookworm, Python 3.11)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log"; fail "debootstrap could not make the base image."; }
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
  ln -sf /usr/bin/python3 "$work/rootfs/usr/local/bin/python"
  scratch="$(buildah from scratch)"
  containers+=("$scratch")
  buildah copy --quiet "$scratch" "$work/rootfs" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd python3 "$scratch"
  buildah commit --quiet "$scratch" "localhost/$base" >/dev/null
  say "base image $base: made ($(chroot "$work/rootfs" python3 --version))"
  rm -rf "$work/rootfs"
fi

# 2. The image, from the unchanged Dockerfile (docker format, which keeps the HEALTHCHECK).
build_args=(--isolation chroot --pull-never --format docker -t "$image")
if [ -n "$wheels" ]; then
  build_args+=(-v "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
fi
if [ -n "$ca_bundle" ]; then
  build_args+=(-v "$ca_bundle:/etc/ssl/certs/build-ca-bundle.crt:ro" --build-arg PIP_CERT=/etc/ssl/certs/build-ca-bundle.crt)
fi
started=$(date +%s)
buildah bud "${build_args[@]}" "$root" >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; fail "the build failed."; }
say "built $image in $(( $(date +%s) - started )) s; size $(buildah images --format '{{.Size}}' "$image" | head -n 1)"

# The image's configuration: its user, its command and its health check, each word on a line of its own.
config="$work/config.json"
buildah inspect --type image "$image" >"$config"
words() { python3 -c "import json, sys; c = json.load(open(sys.argv[1]))['Docker']['config']; print(*($1), sep='\n')" "$config"; }
mapfile -t command < <(words 'c["Cmd"]' | sed "s/--server.port=8501/--server.port=$port/")
mapfile -t health < <(words 'c["Healthcheck"]["Test"][1:]' | sed "s/8501/$port/")
say "image user: $(words '[c["User"]]'); command: ${command[*]}"

data="$work/data"
mkdir -p "$data"
chown 10001:10001 "$data"

# Commands run in one container of the image with the host directory as /data, as the image's user; the server
# runs in containers of its own, a new one for the restart.
tools="$(buildah from "$image")"
containers+=("$tools")
in_image() { buildah run --isolation chroot -v "$data:/data" "$tools" -- "$@"; }

start_server() {
  local container
  container="$(buildah from "$image")"
  containers+=("$container")
  setsid buildah run --isolation chroot -v "$data:/data" "$container" -- "${command[@]}" >"$work/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 180); do
    if curl -fsS "http://127.0.0.1:$port/_stcore/health" 2>/dev/null | grep -q ok; then
      say "server up: http://127.0.0.1:$port/_stcore/health says ok"
      in_image "${health[@]}" || fail "the image's HEALTHCHECK command failed."
      say "the image's HEALTHCHECK command passes"
      return 0
    fi
    kill -0 "$server_pid" 2>/dev/null || { tail -n 30 "$work/server.log"; fail "the server exited."; }
    sleep 1
  done
  tail -n 30 "$work/server.log"
  fail "the health check's URL did not answer within 180 s."
}

stop_server() {
  kill -- "-$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}

# 3. The server, a stored run, a restart.
start_server
[ "$(in_image id -u)" = "10001" ] || fail "the image does not run as uid 10001."
[ "$(in_image id -un)" = "kvlab" ] || fail "the image's user is not kvlab."
say "runs as $(in_image id)"
in_image kvlab models >"$work/models.log" 2>&1 || { cat "$work/models.log"; fail "kvlab models failed in the image."; }
grep -q "^SmolLM2-135M-Instruct.Q4_1.gguf" "$work/models.log" || fail "the published model is not installed in the image."
in_image kvlab generate --model SmolLM2-135M-Instruct.Q4_1.gguf --prompt "What is the capital of France?" \
  --max-new-tokens 8 >"$work/answer.txt" 2>"$work/generate.log" || { cat "$work/generate.log"; fail "the published model did not generate."; }
say "the published model, from its package in the image, answers: $(head -n 1 "$work/answer.txt")"
in_image kvlab sweep --policies h2o --keep 0.5 --contexts 256 --depths 0.5 --trials 1 --quiet \
  >"$work/sweep.log" 2>&1 || { cat "$work/sweep.log"; fail "the generation inside the image failed."; }
say "stored a run: $(tail -n 1 "$work/sweep.log")"
[ -f "$kvlab/data/runs.duckdb" ] || fail "no runs.duckdb in the host directory mounted as /data."
owner="$(stat -c %u "$kvlab/data/runs.duckdb")"
[ "$owner" = "10001" ] || fail "runs.duckdb on the host belongs to uid $owner, not the image's user."
say "the host directory holds runs.duckdb, owned by uid $owner"
stop_server
say "server stopped"

start_server
tools="$(buildah from "$image")"  # a new container too: the run must come from the volume, not a container's state
containers+=("$tools")
in_image kvlab runs >"$work/runs.log" 2>&1 || { cat "$work/runs.log"; fail "kvlab runs failed after the restart."; }
grep -q "h2o" "$work/runs.log" || { cat "$work/runs.log"; fail "the run is not in the volume after the restart."; }
say "after the restart the volume still holds the run:"
sed 's/^/[image-smoke]   /' "$work/runs.log"
curl -fsS "http://127.0.0.1:$port/" | grep -qi "<html" || fail "the server did not serve the dashboard."
# The charts draw with kvlab's bundle of plotly.js, which the server serves from static/ beside app.py.
curl -fsSI "http://127.0.0.1:$port/app/static/plotly-kvlab-$(in_image python -c 'from plotly.offline import get_plotlyjs_version; print(get_plotlyjs_version())').min.js" \
    | grep -qiE "^content-type: (text|application)/javascript" || fail "the server did not serve kvlab's bundle of plotly.js."
# The server answers with its page shell; the pages' own code runs only for a browser's session. Streamlit's AppTest
# runs it in the image as a session would: the Overview must show the shipped runs, the Runs page the stored run.
in_image python -c '
from streamlit.testing.v1 import AppTest
app = AppTest.from_file("/app/app.py", default_timeout=120)
app.run()
assert not app.exception and app.title[0].value == "Overview", app.exception
charts = [element for element in app.get("html") if 'class="kvlab-chart"' in element.proto.body]
assert len(charts) >= 4, "the Overview has no shipped runs to show"
print("the Overview shows", len(charts), "charts of the shipped runs")
app.switch_page("views/runs.py")
app.run()
assert not app.exception, app.exception
captions = [caption.value for caption in app.caption]
assert any(caption.startswith("1 of 1 runs") for caption in captions), captions
print("the Runs page lists", captions[0].split(".")[0])
' >"$work/page.log" 2>&1 || { cat "$work/page.log"; fail "the Runs page failed in the image."; }
sed 's/^/[image-smoke] /' "$work/page.log" | tail -n 2
stop_server
say "PASSED in $(( $(date +%s) - began )) s"
