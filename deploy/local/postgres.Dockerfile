# Stands in for postgres:16-alpine: Debian's PostgreSQL, with the official image's
# data directory and its POSTGRES_USER/PASSWORD/DB first-start initialisation.
ARG BASE
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data \
 && install -d -o postgres -g postgres /var/run/postgresql
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PGDATA=/var/lib/postgresql/data
USER postgres
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["postgres-entrypoint"]
