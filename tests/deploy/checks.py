"""Static checks of the deployment files, shared by tests/deploy and scripts/check_deploy.sh.

External programs (docker-compose, kubectl, promtool, prometheus) come from Debian
packages; scripts/install-system-deps.sh installs the missing ones. A check that needs
one fails with `MissingProgramError` naming that script - it never skips.

    python -m tests.deploy.checks      # what scripts/check_deploy.sh runs
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "mmcache.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
K8S = ROOT / "deploy" / "k8s"
INSTALL_HINT = "scripts/install-system-deps.sh"

# Kubernetes versions the rendered manifests are validated against, offline, with the
# schemas kubernetes-validate ships: 1.29 is the first with native sidecars on by
# default (initContainers[].restartPolicy: Always); 1.33 made them GA.
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")

# Kinds defined by CRDs, absent from the core schemas: skipped by the schema check on
# purpose (kubernetes-validate would only warn "no schema"), and checked by hand in
# tests/deploy/test_static.py instead. Any other kind without a schema is an error.
CRD_KINDS = frozenset({("monitoring.coreos.com/v1", "ServiceMonitor")})

# The server's metric contract (docs/metrics.md): name -> label names.
CONTRACT_METRICS: Mapping[str, frozenset[str]] = {
    name: frozenset(labels)
    for name, labels in {
        "mmcache_queries_total": {"modality"},
        "mmcache_hits_total": {"modality"},
        "mmcache_resends_total": {"modality"},
        "mmcache_uncached_total": {"modality"},
        "mmcache_evictions_total": set(),
        "mmcache_evicted_bytes_total": set(),
        "mmcache_items": set(),
        "mmcache_stored_bytes": set(),
        "mmcache_capacity_bytes": set(),
        "mmcache_inflight_bytes": set(),
        "mmcache_received_bytes_total": set(),
        "mmcache_sent_bytes_total": set(),
        "mmcache_leases": set(),
        "mmcache_leased_bytes": set(),
        "mmcache_lease_expiries_total": set(),
        "mmcache_upload_waits_total": set(),
        "mmcache_claims_total": set(),
        "mmcache_claim_expiries_total": set(),
        "mmcache_feed_subscribers": set(),
        "mmcache_feed_snapshots_total": {"reason"},
        "mmcache_namespaces": set(),
        "mmcache_shm_bytes_total": {"direction"},
        "mmcache_shm_leased_bytes": set(),
        "mmcache_shm_resident_bytes": set(),
        "mmcache_l2_hits_total": set(),
        "mmcache_l2_misses_total": set(),
        "mmcache_l2_read_bytes_total": set(),
        "mmcache_l2_written_bytes_total": set(),
        "mmcache_l2_writes_total": {"result"},
        "mmcache_l2_errors_total": {"op"},
        "mmcache_l2_flight_waits_total": {"result"},
        "mmcache_l2_latency_seconds": {"op"},
        "mmcache_l2_queued_items": set(),
        "mmcache_l2_up": set(),
        "mmcache_l2_nodes_down": set(),
        "mmcache_build_info": {"version", "python", "grpcio"},
        "grpc_server_started_total": {"grpc_method", "grpc_service", "grpc_type"},
        "grpc_server_handled_total": {"grpc_code", "grpc_method", "grpc_service", "grpc_type"},
        "grpc_server_handling_seconds": {"grpc_method", "grpc_service", "grpc_type"},
        "mmcache_encoder_cache_size_tokens": {"engine"},
        "mmcache_encoder_free_tokens": {"engine"},
        "mmcache_encoder_evictable_tokens": {"engine"},
        "mmcache_encoder_referenced_tokens": {"engine"},
        "mmcache_encoder_entries": {"engine"},
        "mmcache_encoder_allocations_total": {"engine"},
        "mmcache_encoder_evictions_total": {"engine"},
        "mmcache_encoder_hits_total": {"engine"},
    }.items()
}
HISTOGRAMS = frozenset({"grpc_server_handling_seconds", "mmcache_l2_latency_seconds"})
# Labels Prometheus attaches to every scraped series, and the histogram bucket label.
TARGET_LABELS = frozenset({"instance", "job", "service", "le"})


def series_names() -> dict[str, frozenset[str]]:
    """Every series name a query may use, with the labels it may use."""
    names: dict[str, frozenset[str]] = {}
    for name, labels in CONTRACT_METRICS.items():
        if name in HISTOGRAMS:
            names[f"{name}_bucket"] = labels | {"le"}
            names[f"{name}_sum"] = labels
            names[f"{name}_count"] = labels
        else:
            names[name] = labels
    return names


# ------------------------------------------------------------------ programs


class MissingProgramError(RuntimeError):
    pass


def require(program: str) -> str:
    """The path of an external program, or a failure that says how to install it."""
    path = shutil.which(program)
    if path is None:
        raise MissingProgramError(
            f"`{program}` is not on PATH: run {INSTALL_HINT} (as root; it installs the "
            "Debian packages kubernetes-client, docker-compose and prometheus when missing)"
        )
    return path


def run(
    args: list[str],
    *,
    input: str | None = None,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
        env=None if env is None else dict(env),
    )


# ------------------------------------------------------------------ compose


def compose_check() -> subprocess.CompletedProcess[str]:
    """`docker-compose config -q`: the file is valid for Compose (no Docker engine needed)."""
    return run([require("docker-compose"), "-f", str(COMPOSE_FILE), "config", "-q"])


def compose_config(compose_file: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The compose file as Compose resolves it (absolute paths, long forms)."""
    done = run([require("docker-compose"), "-f", str(compose_file), "config"])
    if done.returncode != 0:
        raise AssertionError(f"docker-compose config failed:\n{done.stderr}")
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def compose_local_paths(config: Mapping[str, Any]) -> list[tuple[str, Path]]:
    """(what, path) for every local file or folder the resolved compose config uses."""
    paths: list[tuple[str, Path]] = []
    for name, service in config["services"].items():
        build = service.get("build")
        if build is not None:
            context = Path(build["context"])
            paths.append((f"{name}: build context", context))
            paths.append((f"{name}: dockerfile", context / build.get("dockerfile", "Dockerfile")))
        for volume in service.get("volumes", []):
            if isinstance(volume, str):
                source = volume.split(":", 1)[0]
                if source.startswith(("/", ".")):
                    paths.append((f"{name}: bind mount", Path(source)))
            elif volume.get("type") == "bind":
                paths.append((f"{name}: bind mount", Path(volume["source"])))
        for env_file in service.get("env_file", []):
            paths.append((f"{name}: env_file", Path(env_file)))
    return paths


# ------------------------------------------------------------------ kustomize


def kustomizations() -> list[Path]:
    """deploy/k8s/base and every overlay."""
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR`, parsed. (A modern kubectl warns on stderr that the
    overlays' `bases:` is deprecated: kept for Debian's kubectl 1.20, see
    deploy/k8s/overlays/servicemonitor/kustomization.yaml.)"""
    done = run([require("kubectl"), "kustomize", str(directory)])
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def validate_object(obj: Mapping[str, Any], version: str) -> str | None:
    """None when `obj` validates strictly (no unknown fields) against the core schemas
    of Kubernetes `version`, or when its kind is a known CRD (CRD_KINDS); else why not."""
    import kubernetes_validate  # type: ignore[import-untyped]

    what = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')} (k8s {version})"
    if (obj.get("apiVersion"), obj.get("kind")) in CRD_KINDS:
        return None
    try:
        kubernetes_validate.validate(dict(obj), version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        return f"{what}: {path}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:
        return f"{what}: {exc.message} (a CRD? add it to CRD_KINDS with a hand check)"
    return None


def validate_objects(objects: list[dict[str, Any]]) -> list[str]:
    return [
        problem
        for obj in objects
        for version in KUBERNETES_VERSIONS
        if (problem := validate_object(obj, version)) is not None
    ]


_QUANTITY = re.compile(r"^([0-9.]+)([EPTGMK]i?|[munk]|)$")
_FACTORS = {
    "": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip


def quantity_bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity ("6400Mi", "5G", 1024) in bytes."""
    match = _QUANTITY.match(str(quantity))
    if match is None or match.group(2) not in _FACTORS:
        raise ValueError(f"unsupported quantity {quantity!r}")
    return math.ceil(float(match.group(1)) * _FACTORS[match.group(2)])


def required_memory_bytes(capacity_gb: float, max_inflight_gb: float, shm_mb: float = 0) -> int:
    """The sizing rule of docs/deploy.md: 1.25 x capacity + max-inflight + the
    shared-memory region + 256 MiB."""
    gib, mib = 2**30, 2**20
    fixed = int(shm_mb * mib) + 256 * mib
    return math.ceil(1.25 * int(capacity_gb * gib)) + int(max_inflight_gb * gib) + fixed


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj.get("kind") in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}:
            yield f"{obj['kind']}/{obj['metadata']['name']}", obj["spec"]["template"]["spec"]


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


# ------------------------------------------------------------------ Dockerfile


@dataclass(frozen=True)
class Instruction:
    stage: int  # index of the FROM it follows
    keyword: str  # upper case
    args: str  # continuation lines joined


def dockerfile_instructions(text: str) -> list[Instruction]:
    instructions: list[Instruction] = []
    stage = -1
    buffer = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        keyword, _, args = buffer.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(stage, keyword, " ".join(args.split())))
        buffer = ""
    return instructions


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker (moby/patternmatcher) reads it."""
    pattern = os.path.normpath(pattern.strip()).lstrip("/")
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(f"^{out}$")


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _dockerignore_regex(line[1:] if negate else line)))
    return rules


def dockerignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker leaves `path` (relative, with /) out of the build context: the
    last rule matching the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, regex in rules:
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def build_context_files(root: Path = ROOT) -> list[str]:
    """The files `docker build` with context `root` sends, after .dockerignore."""
    rules = dockerignore_rules((root / ".dockerignore").read_text())
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        # Never descend into the venv or git: fast, and always ignored.
        dirnames[:] = [d for d in dirnames if d not in {".git", ".venv"}]
        for filename in filenames:
            rel = filename if rel_dir == "." else f"{rel_dir}/{filename}".replace(os.sep, "/")
            if not dockerignored(rel, rules):
                files.append(rel)
    return sorted(files)


# ------------------------------------------------------------------ PromQL


PROMQL_KEYWORDS = frozenset(
    {
        "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
        "and", "or", "unless", "offset", "inf", "nan", "atan2", "start", "end",
    }
)  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", re.IGNORECASE
)
_MATCHERS = re.compile(r"\{([^}]*)\}")
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?")


def _strip(expr: str) -> str:
    expr = _GRAFANA_VARIABLE.sub("X", _STRING.sub('""', expr))
    return _RANGE.sub("", expr)


def promql_metric_names(expr: str) -> set[str]:
    """The series names an expression selects. Functions (an identifier before "("),
    keywords, label names (in {...} and in by/without/on/ignoring/group_* (...)),
    strings, durations and numbers are not names."""
    expr = _strip(expr)
    expr = _GROUPING.sub(" ", expr)
    expr = _MATCHERS.sub(" ", expr)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def promql_label_names(expr: str) -> set[str]:
    """Label names an expression uses in matchers and grouping clauses."""
    expr = _strip(expr)
    labels = set()
    for match in _GROUPING.finditer(expr):
        labels |= {label.strip() for label in match.group(2).split(",") if label.strip()}
    for match in _MATCHERS.finditer(expr):
        for matcher in match.group(1).split(","):
            name = re.match(r"\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)", matcher)
            if name:
                labels.add(name.group(1))
    return labels


def dashboard_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard: panel targets and the
    metric of label_values(...) template variables."""
    exprs = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                exprs.append(
                    (f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"])
                )
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query or "")
        if match:  # label_values(series, label): the series part is PromQL
            exprs.append((f"variable {variable['name']}", match.group(1)))
        elif query:
            exprs.append((f"variable {variable['name']}", query))
    return exprs


def promtool_check_exprs(exprs: list[str], tmp_dir: Path) -> subprocess.CompletedProcess[str]:
    """Parse each expression with Prometheus' own parser (`promtool check rules` on a
    rules file with one recording rule per expression). Grafana variables become
    regex-safe placeholders first."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": _GRAFANA_VARIABLE.sub(".*", expr)}
                    for i, expr in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_dir / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return run([require("promtool"), "check", "rules", str(path)])


# ------------------------------------------------------------------ CLI


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def main() -> int:
    """The quick form of tests/deploy/test_static.py, for scripts/check_deploy.sh."""
    import tempfile

    failures = 0

    def report(ok: bool, what: str, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f"\n{detail}" if detail and not ok else ""))

    try:
        done = compose_check()
        report(done.returncode == 0, "docker-compose config -q docker-compose.yml", done.stderr)
        for directory in kustomizations():
            objects = kustomize(directory)
            problems = validate_objects(objects)
            report(
                not problems,
                f"kubectl kustomize {directory.relative_to(ROOT)} | kubernetes-validate --strict "
                f"(k8s {', '.join(KUBERNETES_VERSIONS)}; {len(objects)} objects)",
                "\n".join(problems),
            )
        done = run([require("promtool"), "check", "config", str(PROMETHEUS_CONFIG)])
        report(
            done.returncode == 0,
            "promtool check config deploy/prometheus/prometheus.yml",
            done.stdout + done.stderr,
        )
        dashboard = load_dashboard()
        exprs = dashboard_exprs(dashboard)
        allowed = series_names()
        unknown = {
            f"{where}: {name}"
            for where, expr in exprs
            for name in promql_metric_names(expr)
            if name not in allowed
        }
        report(
            not unknown,
            f"dashboard: {len(exprs)} queries name only contract metrics",
            "\n".join(sorted(unknown)),
        )
        with tempfile.TemporaryDirectory() as tmp:
            done = promtool_check_exprs([e for _, e in exprs], Path(tmp))
        report(
            done.returncode == 0,
            "dashboard: promtool parses every query",
            done.stdout + done.stderr,
        )
    except MissingProgramError as exc:
        report(False, "external programs", str(exc))
    print(f"{failures} failed" if failures else "all deploy checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
