"""docker-compose.yml and the files it mounts, checked statically (no Docker engine here).

Every llmgw service's command must parse with the real `llmgw` parser, every
LLMGW_* variable must be a key of that service's config, every mounted file must
exist, host ports must not collide, the routers must be reachable only through
the load balancer, and the health checks, Prometheus targets and Grafana
provisioning must agree with the ports the services listen on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from llmgw import config
from llmgw.dev import servers as localservers

from .deploy_checks import (
    DEPLOY,
    ROOT,
    check_environment,
    http_port,
    metric_names_in_code,
    parse_command,
)

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict = COMPOSE["services"]
IMAGE_REF = re.compile(r"\$\{(LLMGW_\w*IMAGE):-([^}]+)\}")


def _image(svc: dict) -> str:
    """The image a plain `docker compose up` runs: the ${VAR:-default}'s default."""
    ref = IMAGE_REF.fullmatch(svc.get("image", ""))
    return ref.group(2) if ref else svc.get("image", "")


LLMGW = {name: svc for name, svc in SERVICES.items() if _image(svc).startswith("llmgw")}


def _argv(svc: dict) -> list[str]:
    cmd = svc.get("command")
    assert isinstance(cmd, list), "use the list form for commands: no shell parsing surprises"
    return [str(x) for x in cmd]


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _by_command(sub: str) -> dict[str, dict]:
    return {n: s for n, s in LLMGW.items() if _argv(s)[0] == sub}


def _listen_port(svc: dict, key: str, default: str) -> int:
    _, port = config.host_port(_env(svc).get(key, default), 0)
    return port


def test_the_cluster_has_every_part_the_issue_names():
    commands = [_argv(s)[0] for s in LLMGW.values()]
    assert commands.count("reconciler") == 2
    assert commands.count("router") == 2
    assert commands.count("agent") == 2
    assert {"migrate", "apply"} <= set(commands)
    images = {_image(s).split(":")[0] for s in SERVICES.values()}
    assert {"nats", "postgres", "nginx", "prom/prometheus", "grafana/grafana"} <= images
    # One image for every llmgw process, built from the Dockerfile.
    assert {_image(s) for s in LLMGW.values()} == {"llmgw:dev"}
    assert all(s["build"]["dockerfile"] == "deploy/Dockerfile" for s in LLMGW.values())


@pytest.mark.parametrize("name", sorted(LLMGW))
def test_command_is_a_real_subcommand_with_accepted_flags(name):
    parse_command(_argv(LLMGW[name]))


@pytest.mark.parametrize("name", sorted(LLMGW))
def test_llmgw_variables_are_config_keys_of_their_service(name):
    svc = LLMGW[name]
    check_environment(_argv(svc)[0], _env(svc), f"docker-compose service {name}")


def _host_paths(svc: dict) -> list[str]:
    out = []
    for vol in svc.get("volumes") or []:
        source = vol.split(":", 1)[0] if isinstance(vol, str) else vol.get("source", "")
        if source.startswith((".", "/")):
            out.append(source)
    return out


def test_every_mounted_file_exists():
    named = set(COMPOSE.get("volumes") or {})
    for name, svc in SERVICES.items():
        for vol in svc.get("volumes") or []:
            source = vol.split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in named, f"{name}: volume {source!r} is not declared"
        for path in _host_paths(svc):
            assert (ROOT / path).exists(), f"{name} mounts {path}, which does not exist"
        if "build" in svc:
            assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()


def test_published_ports_do_not_collide():
    seen: dict[int, str] = {}
    for name, svc in SERVICES.items():
        for spec in svc.get("ports") or []:
            host = int(str(spec).split(":")[-2])
            assert host not in seen, f"host port {host}: {seen.get(host)} and {name}"
            seen[host] = name


def _nginx_upstreams() -> set[str]:
    text = (DEPLOY / "nginx" / "nginx.conf").read_text()
    block = re.search(r"upstream\s+\S+\s*\{(.*?)\}", text, re.S)
    assert block, "nginx.conf has no upstream block"
    return set(re.findall(r"^\s*server\s+(\S+?)[\s;]", block.group(1), re.M))


def test_routers_sit_behind_the_load_balancer():
    routers = _by_command("router")
    expected = {
        f"{n}:{_listen_port(s, 'LLMGW_LISTEN', '127.0.0.1:8080')}" for n, s in routers.items()
    }
    assert _nginx_upstreams() == expected
    for name, svc in routers.items():
        assert not svc.get("ports"), f"{name} is published directly, bypassing the load balancer"
        assert _env(svc)["LLMGW_LISTEN"].startswith("0.0.0.0:"), (
            f"{name} must listen beyond loopback"
        )
    lb = SERVICES["lb"]
    assert any(str(p).endswith(":8080") for p in lb["ports"])
    mounted = {v.split(":")[1] for v in lb["volumes"]}
    assert "/etc/nginx/nginx.conf" in mounted
    assert set(lb["depends_on"]) == set(routers)


def test_nginx_config_is_valid(tmp_path):
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if nginx is None:
        pytest.skip("nginx is not installed here (the static upstream check still runs)")
    # Compose service names do not resolve outside compose: check against loopback.
    text = re.sub(r"router-\d+:", "127.0.0.1:", (DEPLOY / "nginx" / "nginx.conf").read_text())
    conf = tmp_path / "nginx.conf"
    conf.write_text(text)
    res = subprocess.run(
        [nginx, "-t", "-q", "-c", str(conf), "-p", str(tmp_path), "-e", "stderr"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr


def test_nats_config_is_valid_for_nats_server():
    res = subprocess.run(
        [localservers.nats_server_binary(), "-t", "-c", str(DEPLOY / "nats" / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_demo_catalog_is_valid_for_llmgw_apply():
    mounted = [v for v in SERVICES["apply"]["volumes"] if v.endswith(":/etc/llmgw/catalog.yaml:ro")]
    assert mounted, "the apply job must mount the catalog it is told to apply"
    data = yaml.safe_load((ROOT / mounted[0].split(":")[0]).read_text())
    try:
        from llmgw.reconciler.catalog import spec as catalog
    except ImportError:
        pytest.xfail("module llmgw.reconciler.catalog.spec is missing")
    parsed = catalog.parse(data)  # raises CatalogError naming every problem
    assert len(parsed.models) == 2 and len({t.band for t in parsed.tenants}) == 2


def test_depends_on_conditions_can_be_met():
    for name, svc in SERVICES.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            condition = cond["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep}'s health: none"
            elif condition == "service_completed_successfully":
                assert SERVICES[dep].get("restart") in ("no", "on-failure"), (
                    f"{dep} is a one-shot job: it must not restart forever"
                )


def test_health_checks_probe_the_admin_ports_the_services_listen_on():
    probes = {
        "router": ("/readyz", "127.0.0.1:9090"),
        "reconciler": ("/healthz", "127.0.0.1:9300"),
        "agent": ("/readyz", "127.0.0.1:9410"),
    }
    for sub, (path, default) in probes.items():
        for name, svc in _by_command(sub).items():
            test = " ".join(svc["healthcheck"]["test"])
            url = re.search(r"http://[^'\" ]+", test).group(0)
            assert url.endswith(path), f"{name} health check: {url}"
            assert http_port(url) == _listen_port(svc, "LLMGW_ADMIN_LISTEN", default), name


def test_prometheus_scrapes_every_router_reconciler_and_agent_admin_port():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    admin = (("router", "127.0.0.1:9090"), ("reconciler", "127.0.0.1:9300"))
    for sub, default in (*admin, ("agent", "127.0.0.1:9410")):
        for name, svc in _by_command(sub).items():
            assert f"{name}:{_listen_port(svc, 'LLMGW_ADMIN_LISTEN', default)}" in targets
    for target in targets:
        host = target.split(":")[0]
        assert host == "localhost" or host in SERVICES, f"scrape target {target}: no such service"


def test_grafana_provisioning_points_at_the_dashboard_and_datasource():
    graf = SERVICES["grafana"]
    mounts = dict(v.split(":")[:2] for v in graf["volumes"])
    prov = ROOT / mounts["./deploy/grafana/provisioning"].replace(
        "/etc/grafana/provisioning", "deploy/grafana/provisioning"
    )
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((prov / "dashboards" / "llmgw.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == mounts["./deploy/grafana/dashboards"]
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "llmgw.json").read_text())
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == ds["uid"], panel["title"]


def _dashboard_metrics() -> set[str]:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "llmgw.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"llmgw_[a-z0-9_]+", exprs)}


def test_dashboard_has_the_panels_the_issue_lists():
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "llmgw.json").read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for words in (
        "request rate",
        "time to first token",
        "inter-token latency",
        "saturation per pool",
        "queue depth per band",
        "rejections",
        "node liveness",
    ):
        assert words in titles, f"no panel for {words}"


def test_dashboard_queries_only_metrics_the_services_export():
    missing = sorted(_dashboard_metrics() - metric_names_in_code())
    assert missing == [], f"the dashboard queries metrics no service exports: {missing}"


def test_dockerfile_is_multi_stage_non_root_with_llmgw_entrypoint():
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+(?:\s+AS\s+(\S+))?", text, re.M | re.I)
    assert len(stages) >= 2, "expected a build stage and a runtime stage"
    final = text[text.rfind("\nFROM ") :]
    user = re.findall(r"^USER\s+(\S+)", final, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0"), "the runtime stage runs as root"
    assert re.search(r'^ENTRYPOINT\s+\["llmgw"\]', final, re.M)
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for src in re.findall(r"^COPY\s+(?!--from)(.+)\s+\S+$", text, re.M):
        for path in src.split():
            if re.search(r"[*?[]", path):
                continue  # a pattern may match nothing (wheelhouse/ for offline builds)
            assert (ROOT / path).exists(), f"COPY {path}: no such file"
            assert path not in ignored, f"COPY {path}, but .dockerignore excludes it"


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default}, for the one form this file uses."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), value)


def test_reconcilers_take_the_operator_token_hash_from_env_and_stay_closed_without_it():
    from llmgw import keys
    from llmgw.reconciler.api import auth
    from llmgw.reconciler.config import ReconcilerConfig, validate

    token = keys.new_key()
    for name, svc in _by_command("reconciler").items():
        assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"]), name
        raw = _env(svc)["LLMGW_API_TOKENS"]
        for env in ({}, {"OPERATOR_TOKEN_HASH": keys.hash_key(token)}):
            cfg = config.load(ReconcilerConfig, env={"LLMGW_API_TOKENS": _interpolate(raw, env)})
            assert validate(cfg) == [], name
            checker = auth.Authorizer(cfg.api_auth, cfg.api_tokens)
            opened = checker.check(f"Bearer {token}", auth.ADMIN) is None
            assert opened == bool(env), name


def test_every_image_is_overridable_with_todays_public_image_as_default():
    variables = {}
    for name, svc in SERVICES.items():
        ref = IMAGE_REF.fullmatch(svc["image"])
        assert ref, f"{name}: image {svc['image']!r} is not ${{LLMGW_..._IMAGE:-default}}"
        variables.setdefault(ref.group(1), set()).add(ref.group(2))
    assert all(len(defaults) == 1 for defaults in variables.values()), variables
    # The local images (tests/deploy) cover every variable but Grafana's.
    res = subprocess.run(
        ["bash", str(DEPLOY / "local" / "build-images.sh"), "compose-env"],
        capture_output=True,
        text=True,
        check=True,
    )
    local = dict(line.split("=", 1) for line in res.stdout.split())
    assert set(local) == set(variables) - {"LLMGW_GRAFANA_IMAGE"}
    public = {d for defaults in variables.values() for d in defaults}
    assert not public & set(local.values()), "a local image must never take a public name"


def test_nats_stops_in_lame_duck_mode_within_its_grace_period():
    nats = SERVICES["nats"]
    assert nats["stop_signal"] == "SIGUSR2", "SIGTERM makes nats-server exit at once"
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    duck = int(re.search(r"^lame_duck_duration:\s*(\d+)s", conf, re.M).group(1))
    assert duck < int(nats["stop_grace_period"].rstrip("s"))


def test_state_lives_in_named_volumes():
    named = set(COMPOSE["volumes"])
    for name, path in (
        ("nats", "/data"),
        ("postgres", "/var/lib/postgresql/data"),
        ("prometheus", "/prometheus"),
    ):
        sources = {v.split(":")[0] for v in SERVICES[name]["volumes"] if v.split(":")[1] == path}
        assert sources and sources <= named, f"{name}: {path} is not a named volume"


def test_nginx_gives_up_on_an_unreachable_router_fast_and_never_resends_a_post():
    text = (DEPLOY / "nginx" / "nginx.conf").read_text()
    timeout = re.search(r"^\s*proxy_connect_timeout\s+(\d+)(ms|s);", text, re.M)
    assert timeout, "without it nginx waits 60 s on a stopped router's address"
    assert int(timeout.group(1)) / (1000 if timeout.group(2) == "ms" else 1) <= 1
    servers = re.findall(r"^\s*server\s+router-\S+\s+(.*);", text, re.M)
    assert servers and all("max_fails=1" in s for s in servers), servers
    assert re.search(r"^\s*zone\s+\S+", text, re.M), "workers must share failure state"
    retry = re.search(r"^\s*proxy_next_upstream\s+([^;]+);", text, re.M).group(1).split()
    assert set(retry) <= {"error", "timeout"}, retry  # no non_idempotent, no http_5xx/429


def test_the_compose_test_publishes_on_loopback_only():
    class Tagged(yaml.SafeLoader):
        pass

    # Compose's merge tags: !override replaces a list, !reset empties it.
    Tagged.add_constructor("!override", lambda loader, node: loader.construct_sequence(node))
    Tagged.add_constructor("!reset", lambda loader, node: [])
    override = yaml.load((ROOT / "tests" / "deploy" / "compose.test.yml").read_text(), Tagged)
    for name, svc in SERVICES.items():
        if "ports" not in svc or "grafana" in (override["services"][name].get("profiles") or []):
            continue
        for spec in override["services"][name]["ports"]:
            assert spec.startswith("127.0.0.1:"), f"{name}: {spec}"
