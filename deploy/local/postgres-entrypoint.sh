#!/bin/sh
# The official image's first start, reduced to what docker-compose.yml uses: an
# empty $PGDATA is initialised with POSTGRES_USER/POSTGRES_PASSWORD owning
# POSTGRES_DB, reachable by password from the compose network.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    "$bin/initdb" -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" -A scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    "$bin/postgres" --single -D "$PGDATA" -j postgres >/dev/null <<SQL
CREATE DATABASE "$POSTGRES_DB" OWNER "$POSTGRES_USER";
SQL
fi
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*'
