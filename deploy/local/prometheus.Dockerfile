# Stands in for prom/prometheus: Debian's Prometheus, with the official image's
# paths (config in /etc/prometheus, data in /prometheus) and arguments.
ARG BASE
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o prometheus -g prometheus /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.console.libraries=/usr/share/prometheus/console_libraries", \
     "--web.console.templates=/usr/share/prometheus/consoles"]
