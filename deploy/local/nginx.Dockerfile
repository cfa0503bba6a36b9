# Stands in for nginx:1.27-alpine: Debian's nginx, in the foreground, logging to stderr.
ARG BASE
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends nginx-light wget \
 && rm -rf /var/lib/apt/lists/*
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off; error_log stderr;"]
