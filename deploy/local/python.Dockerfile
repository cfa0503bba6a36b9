# Stands in for python:3.11-slim: Debian's own Python 3.11, with venv and `python`.
ARG BASE
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
