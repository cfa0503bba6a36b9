"""deploy/k8s: the kustomize base and the NATS chart values, rendered and checked.

No cluster here: the base is resolved the way kustomize does (its resources
list), each object is checked for the fields the API server requires and for
references that must agree (selectors, probe ports, volumes, Secrets), and
every container's command and LLMGW_* environment is held against the code.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from llmgw import certs, config, natsconfig

from .deploy_checks import DEPLOY, check_environment, parse_command

BASE = DEPLOY / "k8s" / "base"
KUSTOMIZATION = yaml.safe_load((BASE / "kustomization.yaml").read_text())


def _objects() -> list[dict]:
    out = []
    for res in KUSTOMIZATION["resources"]:
        out += [d for d in yaml.safe_load_all((BASE / res).read_text()) if d]
    return out


OBJECTS = _objects()
WORKLOADS = {
    o["metadata"]["name"]: o
    for o in OBJECTS
    if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
}


def _one(kind: str, name: str) -> dict:
    found = [o for o in OBJECTS if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


CONTAINERS = [(name, c["name"]) for name, w in sorted(WORKLOADS.items()) for c in _containers(w)]


def test_every_resource_has_the_fields_the_api_server_requires():
    assert {o["kind"] for o in OBJECTS} >= {
        "Deployment",
        "DaemonSet",
        "StatefulSet",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    for obj in OBJECTS:
        assert obj.get("apiVersion") and obj.get("kind"), obj
        assert obj["metadata"].get("name"), obj
        if obj["kind"] != "Namespace":
            assert "namespace" not in obj["metadata"], "the kustomization sets the namespace"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_references_agree(name):
    w = WORKLOADS[name]
    selector = w["spec"]["selector"]["matchLabels"]
    labels = w["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), "the selector must match the pod template"
    pod = w["spec"]["template"]["spec"]
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for c in _containers(w):
        assert c.get("name") and c.get("image"), c
        ports = {p["name"] for p in c.get("ports", [])}
        for p in c.get("ports", []):
            assert isinstance(p.get("containerPort"), int), f"{c['name']}: port entry {p}"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                port = c[probe]["httpGet"]["port"]
                assert port in ports or isinstance(port, int), f"{c['name']}.{probe}: {port}"
        for e in c.get("env", []):
            assert ("value" in e) != ("valueFrom" in e), f"{c['name']}: env {e}"
            assert isinstance(e.get("value", ""), str), f"{c['name']}: {e['name']} must be a string"
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{c['name']} mounts undeclared volume {m['name']}"


@pytest.mark.parametrize("workload,container", CONTAINERS)
def test_container_command_is_a_real_subcommand(workload, container):
    c = next(x for x in _containers(WORKLOADS[workload]) if x["name"] == container)
    assert "command" not in c, "keep the image's entrypoint (llmgw); pass the subcommand as args"
    parse_command([str(a) for a in c["args"]])


@pytest.mark.parametrize("workload,container", CONTAINERS)
def test_container_llmgw_variables_are_config_keys(workload, container):
    c = next(x for x in _containers(WORKLOADS[workload]) if x["name"] == container)
    # Values from the downward API or a Secret are only known in the cluster: any string.
    env = {k: e.get("value", "from-the-cluster") for k, e in _env(c).items()}
    check_environment(c["args"][0], env, f"{workload}/{container}")


def test_services_select_pods_and_ports_that_exist():
    for svc in (o for o in OBJECTS if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        targets = [
            w
            for w in WORKLOADS.values()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert targets, f"Service {svc['metadata']['name']} selects no pods"
        ports = {p["name"] for w in targets for c in _containers(w) for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"{svc['metadata']['name']}: {p['targetPort']}"


def test_router_drains_on_sigterm_behind_readiness_hpa_and_pdb():
    router = _one("StatefulSet", "llmgw-router")
    pod = router["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["lifecycle"]["preStop"], "a preStop pause lets the Service drop the pod first"
    grace = float(_env(c)["LLMGW_SHUTDOWN_GRACE_SECONDS"]["value"])
    assert pod["terminationGracePeriodSeconds"] > grace + 5, "SIGKILL would cut the drain short"
    labels = router["spec"]["template"]["metadata"]["labels"]
    hpa = _one("HorizontalPodAutoscaler", "llmgw-router")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "llmgw-router",
    }
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = _one("PodDisruptionBudget", "llmgw-router")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] >= 1
    # Routers keep no state: pods start and stop together, not one ordinal at a time.
    assert router["spec"]["podManagementPolicy"] == "Parallel"
    assert router["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def test_each_router_pod_joins_the_bus_with_a_certificate_of_its_own():
    # The bus lets a router publish only its own demand summary and presence key, by
    # the certificate's name (docs/security.md): pods sharing one would count as one
    # router. So each pod reads the certificate stored under its own (stable) name.
    router = _one("StatefulSet", "llmgw-router")
    c = router["spec"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in c["env"]]
    env = _env(c)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for key, suffix in (("LLMGW_NATS_TLS__CERT", ".crt"), ("LLMGW_NATS_TLS__KEY", ".key")):
        assert env[key]["value"].endswith(f"/$(POD_NAME){suffix}")
        # Kubernetes expands $(VAR) only from variables defined earlier in the list.
        assert names.index("POD_NAME") < names.index(key)
    tls = next(v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "nats-tls")
    assert tls["secret"]["secretName"] == "llmgw-nats-routers"


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_every_secret_volume_is_readable_by_its_pod_and_no_one_else(workload):
    # A key the process cannot read fails only at start, on a real cluster: runAsUser
    # 10001 with root-owned 0400 files is exactly that. As the kubelet writes a Secret
    # volume: files owned by root, mode defaultMode (0644 unset); with the pod's
    # fsGroup they belong to that group, which is among every container's groups.
    pod = WORKLOADS[workload]["spec"]["template"]["spec"]
    pod_ctx = pod.get("securityContext", {})
    fs_group = pod_ctx.get("fsGroup")
    owner_groups = {fs_group} if fs_group is not None else {0}
    for volume in pod.get("volumes", []):
        if "secret" not in volume:
            continue
        mode = volume["secret"].get("defaultMode", 0o644)
        assert mode & 0o007 == 0, f"{workload}: {volume['name']} is readable by others"
        for container in _containers(WORKLOADS[workload]):
            if not any(m["name"] == volume["name"] for m in container.get("volumeMounts", [])):
                continue
            ctx = {**pod_ctx, **container.get("securityContext", {})}
            uid = ctx.get("runAsUser")
            groups = {ctx.get("runAsGroup", 0), *ctx.get("supplementalGroups", [])}
            if fs_group is not None:
                groups.add(fs_group)
            readable = (uid == 0 and mode & 0o400) or (groups & owner_groups and mode & 0o040)
            assert readable, (
                f"{workload}/{container['name']}: {volume['name']} (mode {mode:04o}, owned by "
                f"root, group {sorted(owner_groups)}) is not readable by uid {uid}, "
                f"groups {sorted(groups)}"
            )


def test_reconciler_runs_two_replicas_with_the_dsn_from_a_secret():
    rec = _one("Deployment", "llmgw-reconciler")
    assert rec["spec"]["replicas"] == 2
    for c in _containers(rec):
        dsn = _env(c)["LLMGW_DATABASE_URL"]
        assert dsn["valueFrom"]["secretKeyRef"] == {"name": "llmgw-postgres", "key": "dsn"}
    init = rec["spec"]["template"]["spec"]["initContainers"]
    assert [c["args"][0] for c in init] == ["migrate"]


def test_agent_daemonset_runs_on_gpu_nodes_with_the_node_name_as_id():
    agent = _one("DaemonSet", "llmgw-agent")
    pod = agent["spec"]["template"]["spec"]
    assert pod["nodeSelector"], "agents belong on GPU nodes only"
    assert pod["runtimeClassName"] == "nvidia"
    env = _env(pod["containers"][0])
    assert env["LLMGW_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Its NATS identity is the node's own certificate on the host, never a shared Secret.
    tls = next(v for v in pod["volumes"] if v["name"] == "nats-tls")
    assert "hostPath" in tls
    # Probes and scrapes reach the admin listener on the port it listens on.
    c = pod["containers"][0]
    admin = next(p["containerPort"] for p in c["ports"] if p["name"] == "admin")
    assert config.host_port(env["LLMGW_ADMIN_LISTEN"]["value"], 0) == ("0.0.0.0", admin)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    annotations = agent["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(admin)


def test_nats_chart_values_make_a_three_node_jetstream_cluster_with_mtls():
    values = yaml.safe_load((DEPLOY / "k8s" / "nats" / "values.yaml").read_text())
    cfg = values["config"]
    assert cfg["cluster"]["enabled"] and cfg["cluster"]["replicas"] == 3
    assert cfg["jetstream"]["enabled"] and cfg["jetstream"]["fileStore"]["pvc"]["enabled"]
    assert cfg["nats"]["tls"]["enabled"] and cfg["nats"]["tls"]["merge"]["verify_and_map"]
    assert values["tlsCA"]["enabled"]
    # The reconciler asks for three replicas of the log and buckets, matching the cluster.
    rec = _one("Deployment", "llmgw-reconciler")
    env = _env(rec["spec"]["template"]["spec"]["containers"][0])
    assert int(env["LLMGW_BUS__REPLICAS"]["value"]) == cfg["cluster"]["replicas"]


def test_generated_user_values_merge_into_the_chart_config(tmp_path):
    certs.init(tmp_path, ["gpu-node-1"], routers=1)
    text = natsconfig.render_helm_values(certs.read_identities(tmp_path))
    users = yaml.safe_load(text)["config"]["merge"]["authorization"]["users"]
    assert {u["user"] for u in users} == {
        "CN=agent-gpu-node-1,O=llmgw",
        "CN=router-1,O=llmgw",
        "CN=reconciler,O=llmgw",
        "CN=operator,O=llmgw",
    }
    static = yaml.safe_load((DEPLOY / "k8s" / "nats" / "values.yaml").read_text())
    assert "authorization" not in static["config"].get("merge", {}), "users come from the generator"


def test_kubectl_renders_the_base():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here (the structural checks above still run)")
    res = subprocess.run(
        [kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    rendered = [d for d in yaml.safe_load_all(res.stdout) if d]
    assert len(rendered) == len(OBJECTS)
    for obj in rendered:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == KUSTOMIZATION["namespace"]
