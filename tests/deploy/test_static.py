"""The deployment files: Compose, Dockerfile, Grafana dashboard, Prometheus config and
the Kubernetes manifests, checked with the real tools (docker-compose, kubectl
kustomize, promtool, the offline Kubernetes schemas of kubernetes-validate).

Programs missing from PATH fail these tests with a pointer to
scripts/install-system-deps.sh; nothing is skipped.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmcache.client.vllm._releases import PLUGIN_RELEASES
from mmcache.server import ServerConfig
from mmcache.server._config import SETTINGS
from tests.deploy.checks import (
    COMPOSE_FILE,
    DASHBOARD,
    DOCKERFILE,
    K8S,
    KUBERNETES_VERSIONS,
    PROMETHEUS_CONFIG,
    ROOT,
    TARGET_LABELS,
    build_context_files,
    compose_check,
    compose_config,
    compose_local_paths,
    container_env,
    dashboard_exprs,
    dashboard_panels,
    dockerfile_instructions,
    dockerignore_rules,
    dockerignored,
    kustomizations,
    kustomize,
    load_dashboard,
    pod_specs,
    promql_label_names,
    promql_metric_names,
    promtool_check_exprs,
    quantity_bytes,
    require,
    required_memory_bytes,
    run,
    series_names,
    validate_object,
    validate_objects,
)
from tests.deploy.prometheus_harness import free_port

GRPC_PORT = ServerConfig.port
METRICS_PORT = ServerConfig.metrics_port
SETTING = {setting.env: setting for setting in SETTINGS}
# The server's defaults (`mmcache serve`, server/_config.py) the image spells out.
SPELLED_OUT = (
    "MMCACHE_HOST",
    "MMCACHE_PORT",
    "MMCACHE_METRICS_PORT",
    "MMCACHE_CAPACITY_GB",
    "MMCACHE_GRACE_S",
    "MMCACHE_REFLECTION",
    "MMCACHE_LOG_LEVEL",
)
ENV_DEFAULTS = {name: SETTING[name].default_text() for name in SPELLED_OUT}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# ---------------------------------------------------------------- system deps


def test_install_script_finds_every_program_and_installs_nothing_more() -> None:
    script = ROOT / "scripts" / "install-system-deps.sh"
    assert os.access(script, os.X_OK), f"{script} is not executable"
    start = time.monotonic()
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # A second run has nothing to do: no apt-get, and quick.
    again = subprocess.run([str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "all present" in again.stdout
    assert "apt-get" not in again.stdout + again.stderr
    assert time.monotonic() - start < 600
    for program in ("kubectl", "docker-compose", "prometheus", "promtool", "redis-server",
                    "podman", "mmdebstrap", "podman-compose"):  # fmt: skip
        require(program)
    assert run([require("kubectl"), "kustomize", "--help"]).returncode == 0


# ---------------------------------------------------------------- compose


def test_compose_config_is_accepted() -> None:
    done = compose_check()
    assert done.returncode == 0, done.stderr


def test_compose_check_rejects_an_invalid_file(tmp_path: Path) -> None:
    """The check above can fail: docker-compose refuses an unknown option."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("stop_grace_period:", "stop_grace_periodd:"))
    done = run([require("docker-compose"), "-f", str(broken), "config", "-q"])
    assert done.returncode != 0
    assert "stop_grace_periodd" in done.stderr


def test_the_tls_override_mounts_generated_certificates_as_secrets(tmp_path: Path) -> None:
    certs = tmp_path / "tls"
    subprocess.run([str(ROOT / "deploy/tls/make-certs.sh"), str(certs)], check=True)
    override = ROOT / "deploy/tls/docker-compose.tls.yml"
    files = ["-f", str(COMPOSE_FILE), "-f", str(override), "config"]
    env = {**os.environ, "MMCACHE_TLS_DIR": str(certs), "MMCACHE_UID": "1234"}
    done = run([require("docker-compose"), *files], env=env)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    mmcache = config["services"]["mmcache"]
    secrets = {name: Path(spec["file"]) for name, spec in config["secrets"].items()}
    assert all(path.is_file() for path in secrets.values())
    mounted = {s if isinstance(s, str) else s["source"] for s in mmcache["secrets"]}
    assert mounted == secrets.keys()
    environment = mmcache["environment"]
    for variable in ("MMCACHE_TLS_CERT", "MMCACHE_TLS_KEY", "MMCACHE_TLS_CLIENT_CA",
                     "MMCACHE_TOKENS_FILE"):  # fmt: skip
        name = environment[variable].removeprefix("/run/secrets/")
        assert name in mounted, variable
    assert oct((certs / "server.key").stat().st_mode & 0o777) == "0o600"
    assert str(mmcache["user"]) == "1234"  # the keys' owner reads them
    assert mmcache["healthcheck"]["test"][-1] == f"127.0.0.1:{environment['MMCACHE_HEALTH_PORT']}"
    # Without MMCACHE_UID Compose refuses, saying what to export.
    del env["MMCACHE_UID"]
    refused = run([require("docker-compose"), *files, "-q"], env=env)
    assert refused.returncode != 0 and "export MMCACHE_UID" in refused.stderr


def test_every_file_compose_builds_from_or_mounts_exists() -> None:
    paths = compose_local_paths(compose_config())
    missing = [f"{what}: {path}" for what, path in paths if not path.exists()]
    assert not missing, missing
    used = {path.resolve() for _, path in paths}
    # The walk above found what the stack is made of (so it is not vacuous).
    for expected in (
        ROOT,
        DOCKERFILE,
        PROMETHEUS_CONFIG,
        ROOT / "deploy/grafana/provisioning",
        DASHBOARD.parent,
    ):
        assert expected.resolve() in used, f"compose does not use {expected}"


def _mount_target(service: dict[str, Any], source: Path) -> str:
    for volume in service["volumes"]:
        if isinstance(volume, str):
            host, target = volume.split(":")[:2]
        else:
            host, target = volume.get("source", ""), volume["target"]
        if host and Path(host).resolve() == source.resolve():
            return target
    raise AssertionError(f"{source} is not mounted")


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ms|s|m|h)", str(duration)))


def _container_port(port: str | dict[str, Any]) -> int:
    """The container side of a compose port: "127.0.0.1:9470:9470/tcp" or the long form."""
    if isinstance(port, dict):
        return int(port["target"])
    return int(port.rsplit(":", 1)[-1].split("/")[0])


def test_compose_services_are_wired_together() -> None:
    config = compose_config()
    services = config["services"]
    assert {"mmcache", "prometheus", "grafana"} <= services.keys()
    mmcache = services["mmcache"]
    env = {**ENV_DEFAULTS, **{k: str(v) for k, v in mmcache.get("environment", {}).items()}}

    # Prometheus scrapes the mmcache service on its metrics port.
    prom_config = load_yaml(PROMETHEUS_CONFIG)
    prometheus = services["prometheus"]
    assert _mount_target(prometheus, PROMETHEUS_CONFIG) in " ".join(prometheus["command"])
    targets = [
        target
        for job in prom_config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    ]
    assert f"mmcache:{env['MMCACHE_METRICS_PORT']}" in targets

    # The published ports are the ones mmcache listens on.
    published = {_container_port(p) for p in mmcache["ports"]}
    assert {int(env["MMCACHE_PORT"]), int(env["MMCACHE_METRICS_PORT"])} <= published

    # Docker waits longer than the server's grace before SIGKILL.
    assert _seconds(mmcache["stop_grace_period"]) > float(env["MMCACHE_GRACE_S"])

    # Grafana: the data source points at the prometheus service; the dashboard
    # provider reads the folder compose mounts the dashboards into.
    grafana = services["grafana"]
    provisioning = ROOT / "deploy/grafana/provisioning"
    assert _mount_target(grafana, provisioning) == "/etc/grafana/provisioning"
    [datasource] = [
        ds
        for path in sorted((provisioning / "datasources").glob("*.yml"))
        for ds in load_yaml(path)["datasources"]
    ]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    providers = [
        p
        for path in sorted((provisioning / "dashboards").glob("*.yml"))
        for p in load_yaml(path)["providers"]
    ]
    assert [p["options"]["path"] for p in providers] == [_mount_target(grafana, DASHBOARD.parent)]


def test_prometheus_config_is_valid() -> None:
    done = run([require("promtool"), "check", "config", str(PROMETHEUS_CONFIG)])
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- dashboard


def test_metric_name_extraction() -> None:
    """The extractor the dashboard test relies on: names, not functions or labels."""
    assert promql_metric_names(
        "histogram_quantile(0.99, sum by (le, grpc_method) "
        '(rate(grpc_server_handling_seconds_bucket{instance=~"$instance"}[5m])))'
    ) == {"grpc_server_handling_seconds_bucket"}
    assert promql_metric_names(
        "sum without (modality) (rate(mmcache_hits_total[5m] offset 1h)) "
        "/ on (instance) group_left sum(rate(mmcache_queries_total[$__rate_interval])) > bool 0.5"
    ) == {"mmcache_hits_total", "mmcache_queries_total"}
    assert promql_metric_names('label_replace(up, "dst", "$1", "src", "(.*)")') == {"up"}
    assert promql_metric_names('{__name__="x"} * 2e3 + inf') == set()
    assert promql_metric_names("sum(mmcache_hitz_total) / mmcache_items") == {
        "mmcache_hitz_total",
        "mmcache_items",
    }
    assert promql_label_names(
        'sum by (grpc_code) (rate(grpc_server_handled_total{grpc_code!="OK", job=~"a|b"}[5m]))'
    ) == {"grpc_code", "job"}


def test_dashboard_queries_name_only_contract_metrics_and_labels() -> None:
    dashboard = load_dashboard()
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 10
    allowed = series_names()
    used: set[str] = set()
    problems = []
    for where, expr in exprs:
        names = promql_metric_names(expr)
        if not names:
            problems.append(f"{where}: names no metric: {expr}")
        for name in names - allowed.keys():
            problems.append(f"{where}: {name} is not a metric of the contract")
        labels = TARGET_LABELS.union(*(allowed.get(n, frozenset()) for n in names))
        for label in promql_label_names(expr) - labels:
            problems.append(f"{where}: label {label} is not a label of {sorted(names)}")
        used |= names
    assert not problems, "\n".join(problems)

    # The panels the dashboard exists for.
    for needed in (
        "mmcache_hits_total",
        "mmcache_queries_total",
        "mmcache_stored_bytes",
        "mmcache_capacity_bytes",
        "mmcache_evictions_total",
        "mmcache_resends_total",
        "grpc_server_started_total",
        "grpc_server_handled_total",
        "grpc_server_handling_seconds_bucket",
        "mmcache_encoder_free_tokens",
        "mmcache_encoder_referenced_tokens",
        "mmcache_leased_bytes",
        "mmcache_lease_expiries_total",
        "mmcache_feed_snapshots_total",
    ):
        assert needed in used, f"no panel shows {needed}"


def _normalise(expr: str) -> str:
    return re.sub(r"\s+", "", re.sub(r'\{instance=~"\$instance"\}', "", expr))


def test_dashboard_has_hit_rate_and_p99_latency_queries() -> None:
    exprs = {_normalise(expr) for _, expr in dashboard_exprs(load_dashboard())}
    hit_rate = "sum(rate(mmcache_hits_total[5m])) / sum(rate(mmcache_queries_total[5m]))"
    by_modality = (
        "sum by (modality) (rate(mmcache_hits_total[5m])) "
        "/ sum by (modality) (rate(mmcache_queries_total[5m]))"
    )
    p99 = (
        "histogram_quantile(0.99, sum by (le, grpc_method) "
        "(rate(grpc_server_handling_seconds_bucket[5m])))"
    )
    for expected in (hit_rate, by_modality, p99):
        assert _normalise(expected) in exprs


def test_dashboard_queries_parse_with_promtool(tmp_path: Path) -> None:
    exprs = [expr for _, expr in dashboard_exprs(load_dashboard())]
    done = promtool_check_exprs(exprs, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(exprs)} rules found" in done.stdout
    broken = promtool_check_exprs(["sum(rate(mmcache_hits_total[5m])"], tmp_path)
    assert broken.returncode != 0


def test_dashboard_panels_use_the_provisioned_prometheus() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "mmcache"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dashboard_panels(dashboard) if p["type"] != "row"]
    ids = [p["id"] for p in dashboard_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]


# ---------------------------------------------------------------- kubernetes


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {str(d.relative_to(K8S)): kustomize(d) for d in kustomizations()}


def test_kustomizations_include_base_and_servicemonitor_overlay() -> None:
    found = {str(d.relative_to(K8S)) for d in kustomizations()}
    assert {"base", "overlays/servicemonitor", "overlays/tls", "overlays/l2"} <= found


def _mounted_secret(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The secret volume `path` lies in, mounted read-only in `container`."""
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            assert mount.get("readOnly"), (path, mount)
            [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert "secret" in volume, (path, volume)
            secret: dict[str, Any] = volume["secret"]
            return secret
    raise AssertionError(f"{path} is on no mounted volume of {container['name']}")


def test_the_tls_overlay_mounts_its_secrets_unreadable_to_others(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    pod = _pod(rendered["overlays/tls"])
    sidecar = _sidecar(pod)
    env = container_env(sidecar)
    for variable in ("MMCACHE_TLS_CERT", "MMCACHE_TLS_KEY", "MMCACHE_TLS_CLIENT_CA",
                     "MMCACHE_TOKENS_FILE"):  # fmt: skip
        secret = _mounted_secret(pod, sidecar, env[variable])
        assert secret["defaultMode"] & 0o007 == 0, (variable, oct(secret["defaultMode"]))
    # The server's group may read them: its files are the fsGroup's.
    assert pod["securityContext"]["fsGroup"] == sidecar["securityContext"]["runAsGroup"]
    [engine] = pod["containers"]
    engine_env = {e["name"]: e for e in engine["env"]}
    for variable in ("MMCACHE_TLS_CA", "MMCACHE_TLS_CERT", "MMCACHE_TLS_KEY"):
        _mounted_secret(pod, engine, engine_env[variable]["value"])
    # The engine's token comes from a Secret, never a literal in the manifest.
    assert "secretKeyRef" in engine_env["MMCACHE_TOKEN"]["valueFrom"]


def test_every_rendered_object_validates(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, objects in rendered.items():
        kinds = sorted(obj["kind"] for obj in objects)
        assert {"Deployment", "Service"} <= set(kinds), (name, kinds)
        problems = validate_objects(objects)
        assert not problems, f"{name} against k8s {KUBERNETES_VERSIONS}:\n" + "\n".join(problems)


def test_schema_validation_can_fail(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Strict: a misspelt field, a wrong type, and a kind with no schema are caught."""
    [deployment] = [copy.deepcopy(o) for o in rendered["base"] if o["kind"] == "Deployment"]
    assert validate_object(deployment, KUBERNETES_VERSIONS[0]) is None
    sidecar = deployment["spec"]["template"]["spec"]["initContainers"][0]
    sidecar["livenessProbe"]["periodSecond"] = 5
    problem = validate_object(deployment, KUBERNETES_VERSIONS[0])
    assert problem is not None
    assert "periodSecond" in problem
    del sidecar["livenessProbe"]["periodSecond"]
    sidecar["livenessProbe"]["grpc"]["port"] = "grpc"  # grpc probes take a number only
    assert validate_object(deployment, KUBERNETES_VERSIONS[0]) is not None
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    problem = validate_object(unknown, KUBERNETES_VERSIONS[0])
    assert problem is not None
    assert "Widget" in problem


def _pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's Pod (an overlay may add others: the L2 tier's Redis)."""
    [pod] = [pod for name, pod in pod_specs(objects) if name == "Deployment/vllm"]
    return pod


def _service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [service] = [
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "mmcache"
    ]
    return service


def _sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    sidecars: list[dict[str, Any]] = [
        c for c in pod.get("initContainers", []) if c["name"] == "mmcache"
    ]
    assert len(sidecars) == 1, "mmcache must be one of the initContainers"
    return sidecars[0]


def test_the_engine_is_a_vllm_the_plugin_supports_with_mmcache_in_it(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    recipe = (ROOT / "deploy" / "docker" / "engine.Dockerfile").read_text()
    base = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\d+)\.(\d+)\.\d+$", recipe, re.M)
    assert base is not None and (int(base[1]), int(base[2])) in PLUGIN_RELEASES
    assert 'pip install --no-cache-dir ".[client]"' in recipe
    for name, objects in rendered.items():
        images = [c["image"] for c in _pod(objects)["containers"]]
        assert images == ["mmcache-vllm:0.2.0"], name


def test_mmcache_is_a_native_sidecar_with_grpc_probes(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for name, objects in rendered.items():
        pod = _pod(objects)
        assert "mmcache" not in [c["name"] for c in pod["containers"]], name
        assert pod["containers"], f"{name}: no engine container"
        sidecar = _sidecar(pod)
        assert sidecar["restartPolicy"] == "Always", name
        env = {**ENV_DEFAULTS, **container_env(sidecar)}
        assert int(env["MMCACHE_PORT"]) == GRPC_PORT
        ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
        expected = {"grpc": GRPC_PORT, "metrics": int(env["MMCACHE_METRICS_PORT"])}
        for port, variable in (("events", "MMCACHE_EVENTS_ENDPOINT"),
                               ("events-replay", "MMCACHE_EVENTS_REPLAY_ENDPOINT")):  # fmt: skip
            if variable in env:
                expected[port] = int(env[variable].rsplit(":", 1)[1])
        # A TLS server's probes use the plaintext health-only port (kubelets speak no TLS).
        probed = int(env.get("MMCACHE_HEALTH_PORT", GRPC_PORT))
        if "MMCACHE_TLS_CERT" in env:
            assert probed != GRPC_PORT, f"{name}: probes cannot reach a TLS port"
            expected["health"] = probed
        assert ports == expected, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = sidecar[probe]
            assert spec["grpc"]["port"] == probed, (name, probe)
            assert spec["grpc"].get("service", "") == "", (name, probe)  # the whole server
            assert not {"httpGet", "tcpSocket", "exec"} & spec.keys(), (name, probe)
        # The pod's grace covers the server's own (plus the engine's drain before it).
        assert pod["terminationGracePeriodSeconds"] > float(env["MMCACHE_GRACE_S"]), name
        # The engine reaches the sidecar over loopback.
        [engine] = pod["containers"]
        assert container_env(engine).get("MMCACHE_TARGET") == f"127.0.0.1:{GRPC_PORT}"


def test_sidecar_memory_follows_the_sizing_rule(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for name, objects in rendered.items():
        sidecar = _sidecar(_pod(objects))
        env = container_env(sidecar)
        assert "MMCACHE_CAPACITY_GB" in env, f"{name}: pass the capacity via env"
        capacity = float(env["MMCACHE_CAPACITY_GB"])
        inflight = float(
            env.get("MMCACHE_MAX_INFLIGHT_GB", SETTING["MMCACHE_MAX_INFLIGHT_GB"].default_text())
        )
        shm = 0.0 if env.get("MMCACHE_SHM") in ("0", "off") else float(env["MMCACHE_SHM_MB"])
        resources = sidecar["resources"]
        request = quantity_bytes(resources["requests"]["memory"])
        limit = quantity_bytes(resources["limits"]["memory"])
        assert request >= required_memory_bytes(capacity, inflight, shm), (name, request)
        assert shm in (0.0, capacity * 1024 / 4), f"{name}: the region is a quarter of the capacity"
        assert limit >= request, name
        assert "cpu" in resources["requests"], name
    # The rule itself: 1.25 x 4 GiB + 1 GiB + the region + 256 MiB.
    assert required_memory_bytes(4, 1, 1024) == quantity_bytes("7424Mi")
    assert required_memory_bytes(0.5, 1, 0) == quantity_bytes("1920Mi")


def test_the_region_is_a_memory_emptydir_both_containers_mount_at_one_path(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for name, objects in rendered.items():
        pod = _pod(objects)
        sidecar = _sidecar(pod)
        directory = container_env(sidecar)["MMCACHE_SHM_DIR"]
        [engine] = pod["containers"]
        mounts = {
            c["name"]: {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            for c in (sidecar, engine)
        }
        volume_name = mounts["mmcache"].get(directory)
        assert volume_name is not None, f"{name}: {directory} is not mounted in the sidecar"
        assert mounts[engine["name"]].get(directory) == volume_name, f"{name}: nor in the engine"
        [volume] = [v for v in pod["volumes"] if v["name"] == volume_name]
        assert volume["emptyDir"]["medium"] == "Memory", name
        limit = quantity_bytes(volume["emptyDir"]["sizeLimit"])
        assert limit >= float(container_env(sidecar)["MMCACHE_SHM_MB"]) * 2**20, name
        # The region is 0660 to the Pod's group, and only with one.
        group = container_env(sidecar)["MMCACHE_SHM_GROUP"]
        assert str(pod["securityContext"]["fsGroup"]) == group, name


def test_service_and_scrape_annotations_point_at_mmcache(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for name, objects in rendered.items():
        [deployment] = [o for o in objects if o["kind"] == "Deployment"]
        template = deployment["spec"]["template"]
        sidecar = _sidecar(template["spec"])
        container_ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert int(annotations["prometheus.io/port"]) == container_ports["metrics"] == METRICS_PORT
        assert annotations["prometheus.io/path"] == "/metrics"

        service = _service(objects)
        selector = service["spec"]["selector"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports["grpc"]["port"] == GRPC_PORT
        assert ports["metrics"]["port"] == METRICS_PORT
        for port in ports.values():  # named target ports exist on the sidecar
            assert port["targetPort"] in container_ports, (name, port)


def test_servicemonitor_overlay_selects_the_metrics_port(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The CRD the schema check skips, checked by hand."""
    assert "ServiceMonitor" not in {o["kind"] for o in rendered["base"]}
    objects = rendered["overlays/servicemonitor"]
    [monitor] = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    [service] = [o for o in objects if o["kind"] == "Service"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"], "no endpoints"
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["port"] == "metrics"
        assert endpoint.get("path", "/metrics") == "/metrics"
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "honorLabels"}


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_runtime_contract() -> None:
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder and a runtime"
    args = dict(i.args.split("=", 1) for i in instructions if i.keyword == "ARG" and "=" in i.args)
    runtime_stage = froms[-1].stage
    runtime_image = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], froms[-1].args.split()[0])
    assert runtime_image == "docker.io/library/python:3.11-slim"

    def last(keyword: str) -> str:
        found = [i.args for i in instructions if i.keyword == keyword and i.stage == runtime_stage]
        assert found, f"no {keyword} in the runtime stage"
        return found[-1]

    # Exec form, under tini: PID 1 passes SIGTERM on (tests/deploy/test_image.py runs it).
    assert json.loads(last("ENTRYPOINT")) == ["tini", "--", "mmcache", "serve"]
    healthcheck = last("HEALTHCHECK")
    assert json.loads(healthcheck.split(" CMD ", 1)[1]) == ["mmcache", "health", "127.0.0.1:50051"]
    user = last("USER").split(":")[0]
    assert user not in {"root", "0"}
    assert {"50051", "9470"} <= set(last("EXPOSE").split())
    env: dict[str, str] = {}
    for i in instructions:
        if i.keyword == "ENV" and i.stage == runtime_stage:
            for pair in i.args.split():
                key, _, value = pair.partition("=")
                env[key] = value
    for name in SPELLED_OUT:
        assert name in env, name
        assert SETTING[name].parse(env[name]) == SETTING[name].default, name

    builder_runs = " ".join(
        i.args for i in instructions if i.keyword == "RUN" and i.stage < runtime_stage
    )
    runtime_runs = " ".join(
        i.args for i in instructions if i.keyword == "RUN" and i.stage == runtime_stage
    )
    assert "pip wheel --no-deps" in builder_runs
    assert "pip install -c /tmp/constraints.txt" in runtime_runs
    assert "torch" not in runtime_runs
    assert "[client]" not in runtime_runs


def test_dockerignore_keeps_what_the_build_copies() -> None:
    context = build_context_files()
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    sources = [
        source
        for i in instructions
        if i.keyword == "COPY" and "--from=" not in i.args
        for source in i.args.split()[:-1]
    ]
    assert sources
    for source in sources:
        source = source.rstrip("/")
        assert source in context or any(f.startswith(source + "/") for f in context), (
            f"COPY {source}: not in the build context (.dockerignore)"
        )
    # The wheel's sources are all there; the rest of the repository is not.
    for needed in ("pyproject.toml", "README.md", "constraints.txt", "core/__init__.py",
                   "server/__init__.py", "proto/mmcache/v1/cache_pb2.py"):  # fmt: skip
        assert needed in context
    assert not [f for f in context if f.startswith(("tests/", ".venv/", ".git/", "deploy/k8s/"))]
    assert not [f for f in context if "__pycache__" in f]
    # The matcher follows Docker's rules: last match wins, parents count.
    rules = dockerignore_rules("*\n!core/\ncore/secret*\n**/*.pyc\n")
    assert dockerignored("tests/x.py", rules)
    assert not dockerignored("core/a.py", rules)
    assert dockerignored("core/secret.txt", rules)
    assert dockerignored("core/sub/a.pyc", rules)


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_dockerfile_install_steps_work_in_a_fresh_venv(tmp_path: Path) -> None:
    """The image's pip steps, replayed: a wheel of the build context (no deps), installed
    with constraints.txt and no torch into a fresh venv; then the image's ENTRYPOINT and
    HEALTHCHECK commands, and SIGTERM."""
    src = tmp_path / "src"
    for rel in build_context_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=60)
    bin_ = venv / "bin"
    pip = [str(bin_ / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]

    # Only the venv: nothing from this checkout on the path.
    clean_env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}

    def step(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=tmp_path,
            env=clean_env,
        )
        assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
        return done

    wheels = tmp_path / "wheels"
    step([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(src)])
    [wheel] = wheels.glob("mmcache-*.whl")
    step([*pip, "install", "-c", str(src / "constraints.txt"), str(wheel)])

    installed = step([str(bin_ / "python"), "-m", "pip", "list", "--format=json"]).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert "mmcache" in names
    assert "torch" not in names, "the server install pulled in torch"
    step([str(bin_ / "python"), "-c", "import mmcache.server"])

    # ENTRYPOINT ["mmcache", "serve"] with the image's env, HEALTHCHECK's command.
    port, metrics_port = free_port(), free_port()
    env = {**clean_env, **ENV_DEFAULTS, "MMCACHE_HOST": "127.0.0.1", "MMCACHE_PORT": str(port),
           "MMCACHE_METRICS_PORT": str(metrics_port), "MMCACHE_CAPACITY_GB": "0.0625",
           "MMCACHE_GRACE_S": "2", "PATH": f"{bin_}:{os.environ['PATH']}"}  # fmt: skip
    health = [str(bin_ / "mmcache"), "health", f"127.0.0.1:{port}", "--timeout", "1"]

    def healthy() -> bool:
        return subprocess.run(health, env=env, capture_output=True, timeout=10).returncode == 0

    assert not healthy(), "health says SERVING with no server"
    log = (tmp_path / "serve.log").open("w+")
    server = subprocess.Popen(
        [str(bin_ / "mmcache"), "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        assert _wait(healthy, 30), "never SERVING:\n" + (tmp_path / "serve.log").read_text()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0, (tmp_path / "serve.log").read_text()
        assert not healthy()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


# ---------------------------------------------------------------- the L2 tier


def _l2_masters(url: str) -> list[str]:
    assert url.startswith("redis://"), url
    return [node.rsplit(":", 1)[0] for node in url.removeprefix("redis://").split(",")]


def test_the_l2_overlay_points_every_sidecar_at_its_redis_cluster(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["overlays/l2"]
    env = container_env(_sidecar(_pod(objects)))
    [statefulset] = [o for o in objects if o["kind"] == "StatefulSet"]
    [headless] = [o for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP")]
    assert headless["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == headless["metadata"]["name"]
    name, replicas = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
    assert replicas >= 3  # Redis Cluster's fewest masters
    expected = [f"{name}-{i}.{headless['metadata']['name']}" for i in range(replicas)]
    assert _l2_masters(env["MMCACHE_L2"]) == expected
    [redis] = statefulset["spec"]["template"]["spec"]["containers"]
    args = redis["command"]
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert flags["--cluster-enabled"] == "yes"
    assert flags["--maxmemory-policy"] == "allkeys-lru" and flags["--maxmemory"]
    assert flags["--cluster-require-full-coverage"] == "no"
    assert quantity_bytes(redis["resources"]["limits"]["memory"]) > quantity_bytes(
        flags["--maxmemory"].replace("gb", "Gi")
    )
    [job] = [o for o in objects if o["kind"] == "Job"]
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "--cluster-create" not in script and "--cluster create" in script
    assert env["MMCACHE_EVENTS_ENDPOINT"].endswith(":5557")


def test_the_l2_compose_override_forms_a_cluster_the_sidecar_uses() -> None:
    override = ROOT / "deploy/l2/docker-compose.l2.yml"
    done = run([require("docker-compose"), "-f", str(COMPOSE_FILE), "-f", str(override), "config"])
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    masters = _l2_masters(services["mmcache"]["environment"]["MMCACHE_L2"])
    assert len(masters) >= 3 and all(m in services for m in masters)
    for master in masters:
        args = services[master]["command"]
        assert "allkeys-lru" in args and "--maxmemory" in args and "--cluster-enabled" in args
    create = services["redis-cluster"]
    assert set(masters) <= set(create["depends_on"])
    assert "redis-cluster" in services["mmcache"]["depends_on"]
