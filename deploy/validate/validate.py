#!/usr/bin/env python3
"""Validates glance's deployment files. Run through scripts/validate-deploy.sh, which provides the
pinned tools (deploy/validate/requirements.txt) and a kustomize renderer.

1. Kubernetes: renders deploy/k8s/base and every deploy/k8s/overlays/* with kustomize, validates
   every core object strictly (unknown fields are errors) against the Kubernetes OpenAPI schemas
   bundled by kubernetes-validate, for each --k8s-version; the CRD kinds the manifests use
   (ServiceMonitor, PrometheusRule, ScaledObject, Certificate, Issuer) against the strict schema
   subsets in deploy/validate/*.schema.json; any other kind fails. Then checks what a schema
   cannot: selectors that select, ports that exist, probes (native gRPC, or `glance health` over
   TLS), security context, GPU requests and node affinity, drain arithmetic (grace >= preStop +
   drain timeout + margin; the drafter preStop covers DNS propagation), autoscaling arithmetic
   (targets reachable with the shipped concurrency), versioned model paths and fingerprints, the
   model-loader Job, TLS wiring and certificate names, Secrets that exist or are issued, alert
   metric names, registries, storage classes, and so on.
2. Compose: docker-compose.yml and deploy/compose/gpu.yml against the Compose specification's JSON
   schema (as written and after ${VAR:-default} interpolation with an empty environment), plus
   cross-checks with the collector and Prometheus configs, the default model paths (also those the
   READMEs name), `glance health` checks and drain versus stop_grace_period.
3. Dockerfiles: parsed with the BuildKit parser, then checked (base images as ARGs with pinned
   defaults, non-root user, stage references, cargo packages and binaries that exist, the torch pin
   of scripts/setup.sh, the CUDA constraints file, `glance` in both service images, and
   .dockerignore files that keep every build input).
4. Grafana: deploy/grafana/glance-dashboard.json parses, and every metric it queries is one the
   services export (METRICS below, itself checked against the services' metrics.rs).
5. Canaries: known-bad documents must be rejected, so a vacuous validator cannot pass.

Prints one line per check and a summary; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import dockerfile
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import yaml

# kubernetes-validate re-reads and re-parses the (large) schema files on every call: cache them.
kv_utils.schema_contents = functools.lru_cache(maxsize=None)(kv_utils.schema_contents)

GPU = "nvidia.com/gpu"
EXPECTED_READINESS = {"verifier": "glance.v1.Generation", "drafter": "glance.drafter.v1.Drafter"}
DEVICE_ENV = {"verifier": "GLANCE_DEVICE", "drafter": "GLANCE_DRAFTER_DEVICE"}
LISTEN_ENV = {"verifier": "GLANCE_LISTEN", "drafter": "GLANCE_DRAFTER_LISTEN"}
METRICS_ENV = {"verifier": "GLANCE_METRICS_LISTEN", "drafter": "GLANCE_DRAFTER_METRICS_LISTEN"}
COMPONENT = "app.kubernetes.io/component"
DRAIN_ENV = {"verifier": "GLANCE_DRAIN_TIMEOUT_S", "drafter": "GLANCE_DRAFTER_DRAIN_TIMEOUT_S"}
# What the services' clap flags default to when the variable is not set.
DRAIN_DEFAULT_S = 120.0
# terminationGracePeriodSeconds >= preStop sleep + drain timeout + this: ending the streams the
# drain cut, flushing the last spans and exiting (deploy/README.md, "Drain").
DRAIN_MARGIN_S = 15
# How long a deleted drafter pod may still be dialed by a verifier: endpoint propagation to CoreDNS
# (budget) + the headless record's TTL (CoreDNS kubernetes plugin default) + the verifier's
# re-resolve period (verifier-svc). The drafter's preStop must cover it.
ENDPOINT_PROPAGATION_S, DNS_TTL_S, RERESOLVE_S = 5, 5, 5
# The HPA's default tolerance: no scaling while |current/target - 1| <= 0.1.
HPA_TOLERANCE = 0.1
# Secrets the operator creates (deploy/README.md); every other Secret a pod mounts must be rendered
# or issued by a rendered cert-manager Certificate.
OPERATOR_SECRETS = {"glance-api-keys": "the API keys (components/tls)",
                    "glance-model-source": "object-store credentials (components/model-source-object-store)"}
# The CUDA 13 builds of torch 2.13 need an NVIDIA driver of branch R580 or newer.
MIN_DRIVER_MAJOR = 580
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.schema.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.schema.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.schema.json",
    ("cert-manager.io/v1", "Certificate"): "certificate.schema.json",
    ("cert-manager.io/v1", "Issuer"): "issuer.schema.json",
}

# Every metric the services export, by type (verifier-svc/src/metrics.rs, drafter-svc/src/metrics.rs;
# check_metric_list() compares). Dashboards, alerts, autoscaler rules and queries may use only these
# (histograms with their _bucket, _sum and _count series).
METRICS = {
    # verifier-svc
    "glance_requests_total": "counter",
    "glance_queue_size": "gauge",
    "glance_requests_running": "gauge",
    "glance_time_to_first_token_seconds": "histogram",
    "glance_inter_token_latency_seconds": "histogram",
    "glance_generated_tokens_total": "counter",
    "glance_spec_decode_num_drafts_total": "counter",
    "glance_spec_decode_num_draft_tokens_total": "counter",
    "glance_spec_decode_num_accepted_tokens_total": "counter",
    "glance_spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "glance_spec_decode_mean_accepted_length": "gauge",
    "glance_spec_decode_fallback_rounds_total": "counter",
    "glance_spec_decode_rejected_trees_total": "counter",
    "glance_auto_greedy_steps_total": "counter",
    "glance_auto_overlapped_steps_total": "counter",
    "glance_auto_stale_trees_total": "counter",
    "glance_auto_declined_trees_total": "counter",
    "glance_auto_verified_nodes_total": "counter",
    "glance_auto_lookup_rounds_total": "counter",
    "glance_auto_lookup_accepted_tokens_total": "counter",
    "glance_auto_grafted_lookup_accepted_tokens_total": "counter",
    "glance_auto_known_instruction_requests_total": "counter",
    "glance_auto_calibration_error": "gauge",
    "glance_drafter_round_latency_seconds": "histogram",
    "glance_drafter_hop_bytes_total": "counter",
    "glance_drafter_connected": "gauge",
    "glance_drafter_mismatches_total": "counter",
    # drafter-svc
    "glance_drafter_sessions_open": "gauge",
    "glance_drafter_sessions_limit": "gauge",
    "glance_drafter_sessions_refused_total": "counter",
    "glance_drafter_rounds_total": "counter",
    "glance_drafter_failed_rounds_total": "counter",
    "glance_drafter_draft_seconds": "histogram",
}
METRIC_SOURCES = ["verifier-svc/src/metrics.rs", "drafter-svc/src/metrics.rs"]


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []  # (status, section, name, detail)

    def add(self, section: str, name: str, ok: bool, detail: str = "") -> bool:
        status = "PASS" if ok else "FAIL"
        self.rows.append((status, section, name, detail))
        line = f"{status}  [{section}] {name}"
        if detail:
            line += f": {detail}"
        print(line, flush=True)
        return ok

    def warn(self, section: str, name: str, detail: str) -> None:
        self.rows.append(("WARN", section, name, detail))
        print(f"WARN  [{section}] {name}: {detail}", flush=True)

    def expect(self, section: str, name: str, problems: list[str], ok_detail: str = "") -> bool:
        """One check from a list of problems found (empty = pass)."""
        return self.add(section, name, not problems, "; ".join(problems) if problems else ok_detail)


# --------------------------------------------------------------------------------------- helpers


def load_yaml_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def port_of(addr: str) -> int | None:
    m = re.fullmatch(r"(?:\[[^\]]*\]|[^:]*):(\d+)", addr or "")
    return int(m.group(1)) if m else None


def env_map(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", []) if "name" in e}


def expand_vars(value: str, env: dict[str, str | None]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables expand, $$ escapes, the rest stays as is."""
    def rep(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        v = env.get(m.group(1))
        return v if v is not None else m.group(0)
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", rep, value)


def resolved_env(container: dict, configmaps: dict[str, dict]) -> dict[str, str | None]:
    """The environment the kubelet builds: envFrom ConfigMaps first, then env in order with $(VAR)
    expanded from what is defined so far; ConfigMap keys are looked up in the rendered ConfigMaps.
    Values only known at run time (fieldRef, resourceFieldRef, Secrets) are None."""
    env: dict[str, str | None] = {}
    for ef in container.get("envFrom", []):
        cm = (ef.get("configMapRef") or {}).get("name")
        for k, v in (configmaps.get(cm) or {}).items():
            env[ef.get("prefix", "") + k] = v
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand_vars(str(e["value"]), env)
        elif (e.get("valueFrom") or {}).get("configMapKeyRef"):
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = (configmaps.get(ref.get("name")) or {}).get(ref.get("key"))
        else:
            env[e["name"]] = None
    return env


def promql_metrics(expr: str) -> set[str]:
    """The glance_* metric names a PromQL expression (or a Grafana query) reads."""
    return set(re.findall(r"\bglance_[a-z0-9_]+\b", expr))


def unknown_metrics(names: set[str]) -> list[str]:
    """Names that are neither a metric of METRICS nor a histogram's _bucket/_sum/_count series."""
    bad = []
    for n in sorted(names):
        if n in METRICS and METRICS[n] != "histogram":
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", n)
        if base != n and METRICS.get(base) == "histogram":
            continue
        bad.append(n if n not in METRICS else f"{n} (a histogram: use _bucket, _sum or _count)")
    return bad


def parse_duration_s(text) -> float | None:
    """'1m30s', '45s', '2h' (Go/compose durations) or a number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    if re.fullmatch(r"\d+(\.\d+)?", str(text).strip()):
        return float(text)
    m = re.fullmatch(r"((?:\d+(?:\.\d+)?(?:h|ms|m|s|us|ns))+)", str(text).strip())
    if not m:
        return None
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    return sum(float(v) * units[u] for v, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|ns)", str(text)))


def fnv1a(h: int, data: bytes) -> int:
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def target_fingerprint(model_dir: Path) -> str:
    """An independent Python rendering of common/models/src/weights.rs target_fingerprint: FNV-1a
    (64-bit) over "<model_type>;hidden_size=..;num_hidden_layers=..;vocab_size=..;" (the text
    config's values) and the f32 little-endian bytes of row 0 of the input embedding."""
    import struct
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    summary = (f"{cfg['model_type']};hidden_size={text['hidden_size']};"
               f"num_hidden_layers={text['num_hidden_layers']};vocab_size={text['vocab_size']};")
    h = fnv1a(0xCBF29CE484222325, summary.encode())
    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    names = ["model.language_model.embed_tokens.weight", "model.embed_tokens.weight"]
    for f in files:
        with open(model_dir / f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            for name in names:
                if name in header:
                    e = header[name]
                    cols = e["shape"][1]
                    fh.seek(8 + n + e["data_offsets"][0])
                    if e["dtype"] == "BF16":
                        raw = fh.read(2 * cols)
                        row = b"".join(b"\0\0" + raw[2 * i:2 * i + 2] for i in range(cols))
                    elif e["dtype"] == "F16":
                        row = b"".join(struct.pack("<f", v) for v in struct.unpack(f"<{cols}e", fh.read(2 * cols)))
                    elif e["dtype"] == "F32":
                        row = fh.read(4 * cols)
                    else:
                        raise ValueError(f"embedding dtype {e['dtype']} not handled here")
                    return f"{fnv1a(h, row):016x}"
    raise ValueError(f"no input embedding in {model_dir}")


def head_version(head_dir: Path) -> str:
    """What the model loader calls a head's version: the first 16 hex digits of its weights' sha256."""
    return hashlib.sha256((head_dir / "model.safetensors").read_bytes()).hexdigest()[:16]


def matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against a label set."""
    if not selector:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def plain_selector_matches(selector: dict, labels: dict) -> bool:
    """A Service's plain map selector."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def quantity(q) -> float:
    """A Kubernetes resource quantity as a float (enough to compare)."""
    s = str(q)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
                "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3}
    for suf, mul in suffixes.items():
        if s.endswith(suf):
            return float(s[: -len(suf)]) * mul
    return float(s)


def dockerignore_regexes(path: Path) -> list[tuple[bool, re.Pattern]]:
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line[1:] if negate else line
        pat = pat.strip().lstrip("/").rstrip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif pat.startswith("**", i):
                rx += ".*"
                i += 2
            elif pat[i] == "*":
                rx += "[^/]*"
                i += 1
            elif pat[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(pat[i])
                i += 1
        rules.append((negate, re.compile(rx + "(?:/.*)?$")))
    return rules


def dockerignored(rules: list[tuple[bool, re.Pattern]], rel: str) -> bool:
    excluded = False
    for negate, rx in rules:
        if rx.match(rel):
            excluded = not negate
    return excluded


# ------------------------------------------------------------------------------------ kubernetes


def render(renderer: list[str], path: Path) -> tuple[bool, str, str]:
    proc = subprocess.run(renderer + [str(path)], capture_output=True, text=True)
    return proc.returncode == 0, proc.stdout, proc.stderr.strip()


def schema_check_k8s(rep: Report, section: str, objs: list[dict], versions: list[str],
                     crd_schemas: dict[tuple[str, str], dict]) -> None:
    for obj in objs:
        kind, name = obj.get("kind"), (obj.get("metadata") or {}).get("name")
        key = (obj.get("apiVersion"), kind)
        label = f"{kind}/{name}"
        if key in crd_schemas:
            errors = sorted(jsonschema.Draft202012Validator(crd_schemas[key]).iter_errors(obj),
                            key=lambda e: list(e.absolute_path))
            rep.expect(section, f"schema {label} (embedded CRD schema, strict)",
                       [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors])
            continue
        problems, validated = [], []
        for v in versions:
            try:
                validated.append(kubernetes_validate.validate(obj, v, strict=True))
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path) or "<root>"
                problems.append(f"k8s {v}: {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"k8s {v}: no schema for {obj.get('apiVersion')} {kind} "
                                "(not a core kind, and no embedded CRD schema)")
        rep.expect(section, f"schema {label} (strict)", problems,
                   "k8s " + ", ".join(dict.fromkeys(validated)))


def load_crd_schemas(root: Path) -> dict[tuple[str, str], dict]:
    return {key: json.loads((root / "deploy/validate" / f).read_text()) for key, f in CRD_SCHEMAS.items()}


def pod_problems(pod: dict, sas: set[str]) -> list[str]:
    """The restricted Pod Security Standard plus a read-only root fs, for every container of a pod
    (init containers included); long-running containers also need a writable /tmp."""
    problems = []
    psc = pod.get("securityContext", {})
    if psc.get("runAsNonRoot") is not True:
        problems.append("pod runAsNonRoot is not true")
    if psc.get("runAsUser", 1) == 0:
        problems.append("runs as uid 0")
    if pod.get("automountServiceAccountToken") is not False:
        problems.append("automountServiceAccountToken is not false")
    if pod.get("enableServiceLinks") is not False:
        problems.append("enableServiceLinks is not false (service env vars would enter GLANCE_*)")
    if pod.get("serviceAccountName", "default") not in sas | {"default"}:
        problems.append(f"serviceAccountName {pod.get('serviceAccountName')} is not rendered")
    for k in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(k):
            problems.append(f"{k} is set")
    for v in pod.get("volumes", []):
        if "hostPath" in v:
            problems.append(f"hostPath volume {v['name']}")
    for ct, init in [(c, False) for c in pod.get("containers", [])] + [(c, True) for c in pod.get("initContainers", [])]:
        csc = ct.get("securityContext", {})
        seccomp = csc.get("seccompProfile") or psc.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{ct['name']}: no RuntimeDefault seccomp profile")
        if csc.get("runAsUser", 1) == 0:
            problems.append(f"{ct['name']}: runs as uid 0")
        if any("hostPort" in p for p in ct.get("ports", [])):
            problems.append(f"{ct['name']}: hostPort")
        if csc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{ct['name']}: allowPrivilegeEscalation is not false")
        if csc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{ct['name']}: readOnlyRootFilesystem is not true")
        if "ALL" not in (csc.get("capabilities", {}).get("drop") or []):
            problems.append(f"{ct['name']}: capabilities do not drop ALL")
        if csc.get("privileged"):
            problems.append(f"{ct['name']}: privileged")
        if not init and not any(m.get("mountPath") == "/tmp" for m in ct.get("volumeMounts", [])):
            problems.append(f"{ct['name']}: no writable /tmp with a read-only root fs")
    return problems


def file_source(pod: dict, container: dict, path: str) -> tuple[str | None, str | None, str | None]:
    """Where a file the container reads comes from: (problem, secret name, key). The problem is set
    when no mount provides the path."""
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(mp):
            continue
        rel = path[len(mp):]
        v = vols.get(m["name"], {})
        sources = []
        if "secret" in v:
            sources = [{"secret": {"name": v["secret"].get("secretName"), "items": v["secret"].get("items")}}]
        elif "projected" in v:
            sources = v["projected"].get("sources", [])
        elif "configMap" in v:
            sources = [{"configMap": v["configMap"]}]
        else:
            return None, None, None
        for src in sources:
            ref = src.get("secret") or src.get("configMap") or {}
            items = ref.get("items")
            if items is None:
                if "secret" in src:
                    return None, ref.get("name"), rel
                return None, None, None
            for it in items:
                if it["path"] == rel:
                    return None, ref.get("name") if "secret" in src else None, it["key"]
        return f"no item of volume {m['name']} provides {path}", None, None
    return f"no volume is mounted at {path}", None, None


def glance_probe(probe: dict) -> dict | None:
    """A `glance health` exec probe: {'scheme', 'port', 'service', 'flags'}; None for anything else."""
    argv = ((probe or {}).get("exec") or {}).get("command") or []
    if not argv or argv[0].rsplit("/", 1)[-1] != "glance" or "health" not in argv:
        return None
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    u = urlparse(flags.get("--addr", "http://127.0.0.1:50051"))
    return {"scheme": u.scheme, "port": u.port, "host": u.hostname, "service": flags.get("--service", ""),
            "flags": flags}


def probe_problems(pod: dict, c: dict, comp: str, env: dict) -> tuple[list[str], str]:
    """Probes: native gRPC (plaintext), or `glance health` over TLS when the server serves TLS (the
    kubelet's gRPC probes cannot speak TLS); the right health names; the gRPC port."""
    problems = []
    cports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    grpc_port = cports.get("grpc")
    if grpc_port is None:
        problems.append("no container port named grpc")
    tls_cert = env.get("GLANCE_TLS_CERT" if comp == "verifier" else "GLANCE_DRAFTER_TLS_CERT")
    client_ca = env.get("GLANCE_TLS_CLIENT_CA" if comp == "verifier" else "GLANCE_DRAFTER_TLS_CLIENT_CA")
    want = {"startupProbe": "", "livenessProbe": "", "readinessProbe": EXPECTED_READINESS.get(comp)}
    kinds = set()
    for k, service in want.items():
        p = c.get(k)
        g = glance_probe(p)
        if not p:
            problems.append(f"no {k}")
            continue
        if "grpc" in p:
            kinds.add("gRPC")
            if tls_cert:
                problems.append(f"{k} is a native gRPC probe, but the server serves TLS (the kubelet's "
                                "gRPC probes are plaintext): use `glance health` over https")
            if p["grpc"].get("port") != grpc_port:
                problems.append(f"{k} probes port {p['grpc'].get('port')}, the gRPC port is {grpc_port}")
            got = p["grpc"].get("service", "")
        elif g:
            kinds.add("glance health")
            if g["port"] != grpc_port or g["host"] not in ("127.0.0.1", "localhost", "::1"):
                problems.append(f"{k}: --addr {g['flags'].get('--addr')} is not this container's gRPC port {grpc_port}")
            if tls_cert and g["scheme"] != "https":
                problems.append(f"{k}: the server serves TLS but the probe dials {g['scheme']}")
            if not tls_cert and g["scheme"] != "http":
                problems.append(f"{k}: the probe dials {g['scheme']} but the server serves plaintext")
            if g["scheme"] == "https" and "--tls-ca" not in g["flags"]:
                problems.append(f"{k}: https without --tls-ca")
            if client_ca and comp == "drafter" and not {"--tls-cert", "--tls-key"} <= set(g["flags"]):
                problems.append(f"{k}: the drafter requires client certificates (mTLS) but the probe presents none")
            for flag in ("--tls-ca", "--tls-cert", "--tls-key"):
                if flag in g["flags"]:
                    problem, _, _ = file_source(pod, c, g["flags"][flag])
                    if problem:
                        problems.append(f"{k}: {flag}: {problem}")
            got = g["service"]
        else:
            problems.append(f"{k} is neither a gRPC probe nor `glance health`")
            continue
        if got != service:
            problems.append(f"{k} asks for health name {got!r}, expected {service!r}")
    budget = 0
    sp = c.get("startupProbe")
    if sp:
        budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) + sp.get("initialDelaySeconds", 0)
        if budget < 60:
            problems.append(f"startupProbe allows only {budget} s for the model load")
    detail = (f"{'/'.join(sorted(kinds))}: readiness {EXPECTED_READINESS.get(comp)}, liveness \"\", "
              f"start-up budget {budget} s")
    return problems, detail


def prestop_seconds(c: dict) -> int | None:
    pre = ((c.get("lifecycle") or {}).get("preStop") or {})
    cmd = (pre.get("exec") or {}).get("command") or []
    if len(cmd) == 2 and cmd[0].rsplit("/", 1)[-1] == "sleep":
        return int(cmd[1])
    if "sleep" in pre:
        return int(pre["sleep"].get("seconds", 0))
    return None


def drain_problems(comp: str, grace: int, prestop: int | None, drain_s: float | None) -> list[str]:
    """terminationGracePeriodSeconds >= preStop + drain timeout + margin, and a drafter preStop that
    outlasts the verifiers' view of the pool (endpoint propagation + DNS TTL + re-resolve)."""
    problems = []
    if prestop is None:
        problems.append("no preStop sleep to leave the endpoints before SIGTERM")
        prestop = 0
    if drain_s is None:
        problems.append(f"{DRAIN_ENV[comp]} is not set (the server would drain for its default "
                        f"{DRAIN_DEFAULT_S:.0f} s, unrelated to the grace period)")
        drain_s = DRAIN_DEFAULT_S
    need = prestop + drain_s + DRAIN_MARGIN_S
    if grace < need:
        problems.append(f"terminationGracePeriodSeconds {grace} < preStop {prestop} + drain {drain_s:g} + "
                        f"margin {DRAIN_MARGIN_S} = {need:g}: the kubelet would SIGKILL a draining server")
    dns = ENDPOINT_PROPAGATION_S + DNS_TTL_S + RERESOLVE_S
    if comp == "drafter" and prestop < dns:
        problems.append(f"drafter preStop {prestop} s < endpoint propagation {ENDPOINT_PROPAGATION_S} + DNS TTL "
                        f"{DNS_TTL_S} + verifier re-resolve {RERESOLVE_S} = {dns} s: verifiers would still "
                        "open sessions on a draining pod")
    return problems


def autoscaling_problems(v: dict, d: dict, concurrency: int, max_queue: int, max_sessions: int) -> tuple[list[str], str]:
    """The autoscalers' targets are reachable with the shipped concurrency (deploy/README.md,
    "Autoscaling"). v, d: {'min', 'max', 'target'} of the verifier and drafter scalers. Each running
    speculative generation holds one drafter session, so sessions S <= verifiers x concurrency; the
    drafter scaler wants ceil(S / T) pods, and acts only beyond the 10% tolerance."""
    problems = []
    s_max = v["max"] * concurrency
    tol = 1 + HPA_TOLERANCE
    t, dmin, dmax = d["target"], d["min"], d["max"]
    if not v["target"] < max_queue:
        problems.append(f"verifier target {v['target']:g} waiting per pod is not below GLANCE_MAX_QUEUE {max_queue}: "
                        "pods refuse requests before the autoscaler reacts")
    if not s_max > t * dmin * tol:
        problems.append(f"drafter never scales up: at most {v['max']} verifiers x GLANCE_MAX_CONCURRENT {concurrency} = "
                        f"{s_max} sessions, but leaving {dmin} pods needs more than {t:g} x {dmin} x {tol:g} = {t * dmin * tol:g}")
    elif not s_max > t * (dmax - 1) * tol:
        problems.append(f"drafter maxReplicas {dmax} is unreachable: reaching it needs more than {t:g} x {dmax - 1} x "
                        f"{tol:g} = {t * (dmax - 1) * tol:g} sessions, the verifiers hold at most {s_max}")
    if dmin * max_sessions < s_max:
        problems.append(f"{dmin} drafters x GLANCE_DRAFTER_MAX_SESSIONS {max_sessions} < {s_max} sessions: the pool "
                        "at its floor refuses sessions")
    detail = (f"sessions <= {v['max']} x {concurrency} = {s_max}; drafter {dmin}-{dmax} pods at {t:g}/pod "
              f"(scales up above {t * dmin * tol:g}, reaches {dmax} above {t * (dmax - 1) * tol:g})")
    return problems, detail


def scaler_of(obj: dict) -> tuple[str, dict, list[str]]:
    """(target Deployment, {'min','max','target','metrics'}, problems) of an HPA or a ScaledObject."""
    problems = []
    if obj["kind"] == "HorizontalPodAutoscaler":
        spec = obj["spec"]
        target, metrics = None, []
        for m in spec.get("metrics", []):
            if m["type"] not in ("Pods", "External", "Object"):
                problems.append(f"scales on a {m['type']} metric (utilisation), not queue depth")
                continue
            mm = m[m["type"].lower()]
            metrics.append(mm["metric"]["name"])
            t = mm.get("target", {})
            if t.get("type") == "AverageValue":
                target = quantity(t["averageValue"])
        return spec["scaleTargetRef"]["name"], {"min": spec.get("minReplicas", 1), "max": spec["maxReplicas"],
                                                "target": target, "metrics": metrics,
                                                "down": (spec.get("behavior") or {}).get("scaleDown") or {}}, problems
    spec = obj["spec"]
    target, metrics = None, []
    for trig in spec.get("triggers", []):
        md = trig.get("metadata", {})
        if trig.get("type") != "prometheus":
            problems.append(f"trigger type {trig.get('type')} (expected prometheus on the services' metrics)")
            continue
        if trig.get("metricType", "AverageValue") != "AverageValue":
            problems.append(f"trigger {trig.get('name')}: metricType {trig.get('metricType')} (AverageValue makes "
                            "threshold a per-pod target like the HPA's)")
        q = md.get("query", "")
        used = promql_metrics(q)
        metrics += sorted(used)
        problems += [f"query reads unknown metric {n}" for n in unknown_metrics(used)]
        ns = re.findall(r'namespace="([^"]*)"', q)
        if ns != [obj["metadata"].get("namespace")]:
            problems.append(f"query selects namespace {ns}, the ScaledObject is in {obj['metadata'].get('namespace')!r}")
        if not re.match(r"^https?://[^/]+", md.get("serverAddress", "")):
            problems.append(f"serverAddress {md.get('serverAddress')!r} is not an http(s) URL")
        try:
            target = float(md.get("threshold", ""))
        except ValueError:
            problems.append(f"threshold {md.get('threshold')!r} is not a number")
    down = ((spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get("behavior", {}).get("scaleDown") or {}
    return spec["scaleTargetRef"]["name"], {"min": spec.get("minReplicaCount", 0), "max": spec.get("maxReplicaCount", 100),
                                            "target": target, "metrics": metrics, "down": down}, problems


def semantic_check_k8s(rep: Report, section: str, objs: list[dict], expect_gpu: bool,
                       adapter_metrics: set[str], root: Path, is_overlay: bool) -> None:
    by_kind: dict[str, list[dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)

    def names(kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in by_kind.get(kind, [])}

    deployments = by_kind.get("Deployment", [])
    jobs = by_kind.get("Job", [])
    services = by_kind.get("Service", [])
    hpas = by_kind.get("HorizontalPodAutoscaler", [])
    scaled = by_kind.get("ScaledObject", [])
    pdbs = by_kind.get("PodDisruptionBudget", [])
    certificates = by_kind.get("Certificate", [])
    configmaps, pvcs, sas = names("ConfigMap"), names("PersistentVolumeClaim"), names("ServiceAccount")
    cm_data = {o["metadata"]["name"]: o.get("data") or {} for o in by_kind.get("ConfigMap", [])}
    cert_by_secret = {c["spec"]["secretName"]: c for c in certificates}

    comps = sorted(d["spec"]["template"]["metadata"]["labels"].get(COMPONENT, "?") for d in deployments)
    rep.expect(section, "one Deployment per service",
               [] if comps == ["drafter", "verifier"] else [f"Deployments by component: {comps}"],
               "verifier, drafter")

    # Namespace and labels.
    namespaces = by_kind.get("Namespace", [])
    problems = []
    ns = None
    if len(namespaces) == 1:
        ns = namespaces[0]["metadata"]["name"]
        for o in objs:
            if o["kind"] != "Namespace" and o["metadata"].get("namespace") != ns:
                problems.append(f"{o['kind']}/{o['metadata']['name']} is in namespace "
                                f"{o['metadata'].get('namespace')!r}, not {ns!r}")
        if namespaces[0]["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") != "restricted":
            problems.append("the Namespace does not enforce the restricted Pod Security Standard")
    else:
        problems.append(f"expected one Namespace, found {len(namespaces)}")
    for o in objs:
        if "app.kubernetes.io/part-of" not in (o["metadata"].get("labels") or {}):
            problems.append(f"{o['kind']}/{o['metadata']['name']} lacks app.kubernetes.io/part-of")
    rep.expect(section, "namespace, Pod Security Standard and labels", problems)

    pod_labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"].get("labels", {})
                  for d in deployments}
    scaler_targets = {h["spec"]["scaleTargetRef"]["name"] for h in hpas + scaled}
    envs: dict[str, dict] = {}

    for d in deployments:
        dname = d["metadata"]["name"]
        pod = d["spec"]["template"]["spec"]
        labels = pod_labels[dname]
        comp = labels.get(COMPONENT, "?")
        containers = pod.get("containers", [])
        c = containers[0] if containers else {}
        env = env_map(c)
        renv = resolved_env(c, cm_data)
        envs[comp] = renv
        cports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        sec = f"{dname}"

        # Selector, replicas.
        problems = []
        if not matches(d["spec"].get("selector", {}), labels):
            problems.append("spec.selector does not match the pod template labels")
        if dname in scaler_targets and "replicas" in d["spec"]:
            problems.append("spec.replicas is set although an autoscaler owns the replica count")
        if len(containers) != 1:
            problems.append(f"{len(containers)} containers (expected 1)")
        rep.expect(section, f"{sec}: selector, replicas, containers", problems)

        rep.expect(section, f"{sec}: security context (non-root, read-only root fs, no privileges)",
                   pod_problems(pod, sas), f"{len(containers)} container(s), {len(pod.get('initContainers', []))} init")

        # Image.
        problems = []
        for ct in containers + pod.get("initContainers", []):
            image = ct.get("image", "")
            if "@sha256:" not in image:
                tag = image.rsplit("/", 1)[-1].partition(":")[2]
                if not tag or tag == "latest":
                    problems.append(f"{ct['name']}: image {image!r} is not pinned to a tag or digest")
        rep.expect(section, f"{sec}: image pinned", problems, c.get("image", ""))

        # Resources, GPU and GPU node affinity.
        problems = []
        req, lim = c.get("resources", {}).get("requests", {}), c.get("resources", {}).get("limits", {})
        for k in ("cpu", "memory"):
            if k not in req:
                problems.append(f"no {k} request")
        if "memory" not in lim:
            problems.append("no memory limit")
        elif "memory" in req and quantity(lim["memory"]) < quantity(req["memory"]):
            problems.append("memory limit below request")
        has_gpu_toleration = any(t.get("key") == GPU for t in pod.get("tolerations", []) or [])
        device = env.get(DEVICE_ENV.get(comp, ""), "")
        if expect_gpu:
            if str(req.get(GPU)) != "1" or str(lim.get(GPU)) != "1":
                problems.append(f"{GPU} request/limit is {req.get(GPU)}/{lim.get(GPU)}, expected 1/1")
            if not has_gpu_toleration:
                problems.append(f"no toleration for the {GPU} taint")
            if not device.startswith("cuda"):
                problems.append(f"{DEVICE_ENV.get(comp)}={device!r} on a GPU pod")
        else:
            if GPU in req or GPU in lim:
                problems.append(f"{GPU} requested in a CPU-only overlay")
            if has_gpu_toleration:
                problems.append("GPU toleration in a CPU-only overlay")
            if device != "cpu":
                problems.append(f"{DEVICE_ENV.get(comp)}={device!r} in a CPU-only overlay")
        terms = ((((pod.get("affinity") or {}).get("nodeAffinity") or {})
                  .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [])
        driver_keys = ("nvidia.com/cuda.driver-version.major", "nvidia.com/cuda.driver.major")
        gpu_terms = [t for t in terms if any(e["key"].startswith("nvidia.com/") for e in t.get("matchExpressions", []))]
        for t in gpu_terms:
            drv = [e for e in t.get("matchExpressions", []) if e["key"] in driver_keys]
            ok = bool(drv) and all(
                (e["operator"] == "Gt" and int(e["values"][0]) >= MIN_DRIVER_MAJOR - 1)
                or (e["operator"] == "In" and all(int(x) >= MIN_DRIVER_MAJOR for x in e["values"]))
                for e in drv)
            if not ok:
                problems.append(f"a GPU node selector term admits drivers older than R{MIN_DRIVER_MAJOR} "
                                "(the CUDA 13 build of torch needs them)")
        if gpu_terms and not expect_gpu:
            problems.append("GPU node affinity in a CPU-only overlay")
        gpu_note = f"{GPU}={req.get(GPU, 0)}, {DEVICE_ENV.get(comp)}={device}"
        if gpu_terms:
            gpu_note += f", {len(gpu_terms)} GPU node term(s), driver >= R{MIN_DRIVER_MAJOR}"
        rep.expect(section, f"{sec}: resources ({'GPU' if expect_gpu else 'CPU-only'})", problems, gpu_note)

        # Probes: native gRPC, or `glance health` over TLS.
        problems, detail = probe_problems(pod, c, comp, renv)
        rep.expect(section, f"{sec}: health probes", problems, detail)

        # Listen addresses agree with the ports.
        problems = []
        grpc_port = cports.get("grpc")
        if port_of(env.get(LISTEN_ENV.get(comp, ""), "")) != grpc_port:
            problems.append(f"{LISTEN_ENV.get(comp)}={env.get(LISTEN_ENV.get(comp, ''))!r} is not the grpc port {grpc_port}")
        metrics_addr = env.get(METRICS_ENV.get(comp, ""), "")
        if port_of(metrics_addr) != cports.get("metrics") or not metrics_addr.startswith("0.0.0.0:"):
            problems.append(f"{METRICS_ENV.get(comp)}={metrics_addr!r} does not bind 0.0.0.0 on the metrics port {cports.get('metrics')}")
        if not env.get("OTEL_SERVICE_NAME"):
            problems.append("no OTEL_SERVICE_NAME")
        rep.expect(section, f"{sec}: listen addresses and telemetry env", problems)

        # Env: $(VAR) references resolve (defined earlier), envFrom and volumes exist.
        problems = []
        for ct in containers + pod.get("initContainers", []):
            seen: set[str] = set()
            for e in ct.get("env", []):
                for ref in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value") or ""):
                    if ref not in seen:
                        problems.append(f"{ct['name']}: {e['name']} references $({ref}) before it is defined")
                seen.add(e["name"])
                ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                if ref and not ref.get("optional") and ref.get("key") not in (cm_data.get(ref.get("name")) or {}):
                    problems.append(f"{ct['name']}: {e['name']}: ConfigMap {ref.get('name')} has no key {ref.get('key')}")
            for ef in ct.get("envFrom", []):
                cm = (ef.get("configMapRef") or {}).get("name")
                if cm and cm not in configmaps:
                    problems.append(f"{ct['name']}: envFrom ConfigMap {cm} is not rendered")
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        for ct in containers + pod.get("initContainers", []):
            for m in ct.get("volumeMounts", []):
                if m["name"] not in vols:
                    problems.append(f"{ct['name']}: volumeMount {m['name']} has no volume")
                elif m.get("mountPath") == "/models" and not m.get("readOnly"):
                    problems.append(f"{ct['name']}: /models is not mounted read-only")
        for v in vols.values():
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and claim not in pvcs:
                problems.append(f"PVC {claim} is not rendered")
        rep.expect(section, f"{sec}: env references, ConfigMaps, volumes", problems)

        # Graceful drain.
        grace = pod.get("terminationGracePeriodSeconds", 30)
        pre_s = prestop_seconds(c)
        drain_raw = renv.get(DRAIN_ENV.get(comp, ""))
        drain_s = float(drain_raw) if drain_raw not in (None, "") else None
        rep.expect(section, f"{sec}: SIGTERM drain fits the grace period", drain_problems(comp, grace, pre_s, drain_s),
                   f"grace {grace} s >= preStop {pre_s} + drain {drain_raw} + margin {DRAIN_MARGIN_S}")

    # Secrets: rendered, issued by a rendered Certificate, or documented as the operator's.
    problems = []
    secrets_used = set()
    for o in deployments + jobs:
        pod = o["spec"]["template"]["spec"]
        refs = []
        for v in pod.get("volumes", []):
            if "secret" in v:
                refs.append((v["secret"].get("secretName"), v["secret"].get("optional", False)))
            for src in (v.get("projected") or {}).get("sources", []):
                if "secret" in src:
                    refs.append((src["secret"].get("name"), src["secret"].get("optional", False)))
        for ct in pod.get("containers", []) + pod.get("initContainers", []):
            for ef in ct.get("envFrom", []):
                if "secretRef" in ef:
                    refs.append((ef["secretRef"].get("name"), ef["secretRef"].get("optional", False)))
            for e in ct.get("env", []):
                sk = (e.get("valueFrom") or {}).get("secretKeyRef")
                if sk:
                    refs.append((sk.get("name"), sk.get("optional", False)))
        for name, optional in refs:
            secrets_used.add(name)
            if name not in names("Secret") and name not in cert_by_secret and name not in OPERATOR_SECRETS:
                problems.append(f"{o['kind']}/{o['metadata']['name']} needs Secret {name}, which is neither rendered, "
                                "issued by a rendered Certificate, nor a documented operator Secret"
                                + (" (optional)" if optional else ""))
    for cert in certificates:
        iref = cert["spec"]["issuerRef"]
        if iref.get("kind", "Issuer") == "Issuer" and iref["name"] not in names("Issuer"):
            problems.append(f"Certificate {cert['metadata']['name']}: Issuer {iref['name']} is not rendered")
    for iss in by_kind.get("Issuer", []):
        ca = (iss["spec"].get("ca") or {}).get("secretName")
        if ca and ca not in cert_by_secret and ca not in names("Secret"):
            problems.append(f"Issuer {iss['metadata']['name']}: CA Secret {ca} is neither rendered nor issued")
    if secrets_used or certificates:
        rep.expect(section, "Secrets exist or are issued; Certificates have their Issuers", problems,
                   ", ".join(f"{n} ({'issued' if n in cert_by_secret else 'operator' if n in OPERATOR_SECRETS else 'rendered'})"
                             for n in sorted(secrets_used)))

    # Services select exactly one Deployment, and their target ports exist.
    for s in services:
        sname = s["metadata"]["name"]
        problems = []
        targets = [dn for dn, lbl in pod_labels.items() if plain_selector_matches(s["spec"].get("selector", {}), lbl)]
        if len(targets) != 1:
            problems.append(f"selects Deployments {targets}, expected exactly one")
        else:
            c = next(d for d in deployments if d["metadata"]["name"] == targets[0])["spec"]["template"]["spec"]["containers"][0]
            cports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for p in s["spec"].get("ports", []):
                tp = p.get("targetPort", p["port"])
                if (isinstance(tp, str) and tp not in cports) or (isinstance(tp, int) and tp not in cports.values()):
                    problems.append(f"port {p.get('name')}: targetPort {tp} is not a container port")
        rep.expect(section, f"Service {sname}: selects one Deployment, ports exist", problems,
                   ("headless" if s["spec"].get("clusterIP") == "None" else s["spec"].get("type", "ClusterIP")))

    # The verifier reaches the drafter through the headless Service, over TLS if the drafter serves it.
    problems = []
    verifier = next((d for d in deployments if pod_labels[d["metadata"]["name"]].get(COMPONENT) == "verifier"), None)
    drafter = next((d for d in deployments if pod_labels[d["metadata"]["name"]].get(COMPONENT) == "drafter"), None)
    hop = ""
    if verifier and drafter:
        venv, denv = envs["verifier"], envs["drafter"]
        vpod, dpod = verifier["spec"]["template"]["spec"], drafter["spec"]["template"]["spec"]
        vc, dc = vpod["containers"][0], dpod["containers"][0]
        url = venv.get("GLANCE_DRAFTER_URL") or ""
        u = urlparse(url)
        host = (u.hostname or "").split(".")[0]
        svc = next((s for s in services if s["metadata"]["name"] == host), None)
        if u.scheme not in ("http", "https") or not u.port:
            problems.append(f"GLANCE_DRAFTER_URL {url!r} is not http(s)://host:port")
        elif svc is None:
            problems.append(f"GLANCE_DRAFTER_URL host {host!r} is not a rendered Service")
        else:
            if svc["spec"].get("clusterIP") != "None":
                problems.append(f"Service {host} is not headless (gRPC clients could not see every drafter pod)")
            if not plain_selector_matches(svc["spec"].get("selector", {}), pod_labels[drafter["metadata"]["name"]]):
                problems.append(f"Service {host} does not select the drafter pods")
            if u.port not in [p["port"] for p in svc["spec"].get("ports", [])]:
                problems.append(f"Service {host} has no port {u.port}")
            if svc["spec"].get("publishNotReadyAddresses"):
                problems.append(f"Service {host} publishes drafters that are not ready")
        drafter_tls = bool(denv.get("GLANCE_DRAFTER_TLS_CERT"))
        hop = "https (mTLS)" if denv.get("GLANCE_DRAFTER_TLS_CLIENT_CA") else u.scheme
        if drafter_tls != (u.scheme == "https"):
            problems.append(f"the drafter {'serves' if drafter_tls else 'does not serve'} TLS but GLANCE_DRAFTER_URL is {u.scheme}")
        if u.scheme == "https":
            for var in ("GLANCE_DRAFTER_CA",) + (("GLANCE_DRAFTER_CLIENT_CERT", "GLANCE_DRAFTER_CLIENT_KEY")
                                                 if denv.get("GLANCE_DRAFTER_TLS_CLIENT_CA") else ()):
                if not venv.get(var):
                    problems.append(f"the drafter hop is https{' with mTLS' if 'CLIENT' in var else ''} but the verifier has no {var}")
            domain = venv.get("GLANCE_DRAFTER_TLS_DOMAIN") or u.hostname
            _, secret, _ = file_source(dpod, dc, denv.get("GLANCE_DRAFTER_TLS_CERT") or "")
            cert = cert_by_secret.get(secret)
            if cert:
                dns = cert["spec"].get("dnsNames", [])
                want = [domain, f"{host}.{ns}.svc", f"{host}.{ns}.svc.cluster.local"]
                missing = [n for n in want if n not in dns]
                if missing:
                    problems.append(f"Certificate {cert['metadata']['name']} lacks {missing} (verifiers check {domain!r})")
                if "server auth" not in cert["spec"].get("usages", ["server auth"]):
                    problems.append(f"Certificate {cert['metadata']['name']} lacks usage server auth")
            cc = venv.get("GLANCE_DRAFTER_CLIENT_CERT")
            if cc:
                _, secret, _ = file_source(vpod, vc, cc)
                cert = cert_by_secret.get(secret)
                if cert and "client auth" not in cert["spec"].get("usages", ["client auth"]):
                    problems.append(f"Certificate {cert['metadata']['name']} (the verifiers' client identity) lacks usage client auth")
        # Every TLS file a server reads is mounted; the probes' server names are in the certificates.
        for comp, dep, env_ in (("verifier", verifier, venv), ("drafter", drafter, denv)):
            pod = dep["spec"]["template"]["spec"]
            cont = pod["containers"][0]
            for var, path in sorted(env_.items()):
                if path and re.fullmatch(r"GLANCE_(DRAFTER_)?(TLS_CERT|TLS_KEY|TLS_CLIENT_CA|CA|CLIENT_CERT|CLIENT_KEY)|GLANCE_API_KEY_FILE", var):
                    problem, _, _ = file_source(pod, cont, path)
                    if problem:
                        problems.append(f"{comp}: {var}: {problem}")
            serving = env_.get("GLANCE_TLS_CERT" if comp == "verifier" else "GLANCE_DRAFTER_TLS_CERT")
            if serving:
                _, secret, _ = file_source(pod, cont, serving)
                cert = cert_by_secret.get(secret)
                g = glance_probe(cont.get("readinessProbe"))
                if cert and g and g["flags"].get("--tls-domain") not in cert["spec"].get("dnsNames", []):
                    problems.append(f"{comp}: the probes check the name {g['flags'].get('--tls-domain')!r}, which "
                                    f"Certificate {cert['metadata']['name']} does not carry")
                if cert and g and "--tls-cert" in g["flags"] and "client auth" not in cert["spec"].get("usages", ["client auth"]):
                    problems.append(f"{comp}: the probes present Certificate {cert['metadata']['name']}, which lacks usage client auth")
    else:
        problems.append("verifier or drafter Deployment missing")
    rep.expect(section, "verifier -> drafter: the headless drafter Service, TLS files and certificate names agree",
               problems, hop)

    # Models: versioned paths from the glance-model ConfigMap, expected fingerprints, the loader Job.
    claim = None
    if verifier and drafter:
        problems = []
        venv, denv = envs["verifier"], envs["drafter"]
        versioned = re.compile(r"^/models/([^/@]+)@([0-9a-f]{16})$")
        model, head = venv.get("GLANCE_MODEL") or "", denv.get("GLANCE_DRAFTER_HEAD") or ""
        fp = venv.get("GLANCE_EXPECT_FINGERPRINT")
        mm, hm = versioned.match(model), versioned.match(head)
        if not mm:
            problems.append(f"GLANCE_MODEL {model!r} is not /models/<name>@<16 hex digits>")
        if not hm:
            problems.append(f"GLANCE_DRAFTER_HEAD {head!r} is not /models/<name>@<16 hex digits>")
        if mm and fp != mm.group(2):
            problems.append(f"GLANCE_EXPECT_FINGERPRINT {fp!r} is not the fingerprint in GLANCE_MODEL ({mm.group(2)})")
        if denv.get("GLANCE_DRAFTER_TARGET") != model:
            problems.append(f"the drafter reads the target from {denv.get('GLANCE_DRAFTER_TARGET')!r}, the verifier serves {model!r}")
        if denv.get("GLANCE_DRAFTER_EXPECT_TARGET_FINGERPRINT") != fp:
            problems.append(f"GLANCE_DRAFTER_EXPECT_TARGET_FINGERPRINT {denv.get('GLANCE_DRAFTER_EXPECT_TARGET_FINGERPRINT')!r} "
                            f"differs from the verifier's {fp!r}")
        # The ConfigMap both read, and the wait-for-model init containers.
        cms = set()
        for dep in (verifier, drafter):
            for ct in dep["spec"]["template"]["spec"]["containers"]:
                cms |= {(e.get("valueFrom") or {}).get("configMapKeyRef", {}).get("name") for e in ct.get("env", [])} - {None}
        model_cm = sorted(n for n in cms if n.startswith("glance-model"))
        if len(model_cm) != 1:
            problems.append(f"the Deployments read the model from ConfigMaps {model_cm}, expected one glance-model")
        for dep in (verifier, drafter):
            inits = dep["spec"]["template"]["spec"].get("initContainers", [])
            if not any(any((ef.get("configMapRef") or {}).get("name") in model_cm for ef in i.get("envFrom", []))
                       and any(m.get("mountPath") == "/models" for m in i.get("volumeMounts", [])) for i in inits):
                problems.append(f"{dep['metadata']['name']}: no init container waits for the model version on /models")
        # The loader Job.
        loader = next((j for j in jobs if j["spec"]["template"]["metadata"].get("labels", {}).get(COMPONENT) == "model-loader"), None)
        vpod = verifier["spec"]["template"]["spec"]
        claim = next(((v.get("persistentVolumeClaim") or {}).get("claimName") for v in vpod.get("volumes", [])
                      if v["name"] in {m["name"] for m in vpod["containers"][0].get("volumeMounts", []) if m["mountPath"] == "/models"}), None)
        if loader is None:
            problems.append("no model-loader Job fills the model volume")
        else:
            lpod = loader["spec"]["template"]["spec"]
            lc = lpod.get("initContainers", []) + lpod.get("containers", [])
            lvols = {v["name"]: v for v in lpod.get("volumes", [])}
            for ct in lc:
                mount = next((m for m in ct.get("volumeMounts", []) if m["mountPath"] == "/models"), None)
                vol = lvols.get(mount["name"], {}) if mount else {}
                if not mount or (vol.get("persistentVolumeClaim") or {}).get("claimName") != claim:
                    problems.append(f"loader {ct['name']}: does not mount the serving pods' volume {claim} at /models")
                elif mount.get("readOnly") or (vol.get("persistentVolumeClaim") or {}).get("readOnly"):
                    problems.append(f"loader {ct['name']}: /models is read-only")
                if not any((ef.get("configMapRef") or {}).get("name") in model_cm for ef in ct.get("envFrom", [])):
                    problems.append(f"loader {ct['name']}: does not read the Deployments' ConfigMap {model_cm}")
                cmd = " ".join(ct.get("command", []) + ct.get("args", []))
                m = re.search(r"(\S+/load\.sh)", cmd)
                if not m:
                    problems.append(f"loader {ct['name']}: does not run load.sh")
                else:
                    problem, _, _ = file_source(lpod, ct, m.group(1))
                    vname = next((mm_["name"] for mm_ in ct.get("volumeMounts", []) if m.group(1).startswith(mm_["mountPath"])), None)
                    cmname = ((lvols.get(vname) or {}).get("configMap") or {}).get("name")
                    if problem or cmname not in configmaps or "load.sh" not in cm_data.get(cmname, {}):
                        problems.append(f"loader {ct['name']}: {m.group(1)} is not provided by a rendered ConfigMap")
            publish = lpod.get("containers", [{}])[0]
            if publish.get("image") != vpod["containers"][0].get("image"):
                problems.append(f"the loader verifies with image {publish.get('image')!r}, not the verifier's "
                                f"{vpod['containers'][0].get('image')!r} (the fingerprint must come from the serving code)")
            problems += [f"loader: {p}" for p in pod_problems(lpod, sas)]
        # A model the repository ships must carry its real fingerprint and head version.
        data = cm_data.get(model_cm[0], {}) if len(model_cm) == 1 else {}
        checked = []
        for key_name, key_ver, fn, what in (("MODEL_NAME", "MODEL_FINGERPRINT", target_fingerprint, "fingerprint"),
                                            ("HEAD_NAME", "HEAD_VERSION", head_version, "head version")):
            d = root / "models" / str(data.get(key_name, ""))
            if data.get(key_name) and d.is_dir():
                actual = fn(d)
                checked.append(f"{key_name}=models/{data[key_name]} ({actual})")
                if actual != data.get(key_ver):
                    problems.append(f"{key_ver} {data.get(key_ver)} is not the {what} of models/{data[key_name]}: {actual}")
        rep.expect(section, "models: versioned paths, expected fingerprints, the model-loader Job", problems,
                   f"{model} + {head}" + (f"; matches {', '.join(checked)}" if checked else ""))
        if is_overlay and "0" * 16 in (mm.group(2) if mm else "", hm.group(2) if hm else ""):
            rep.warn(section, "models", "MODEL_FINGERPRINT / HEAD_VERSION are still the all-zero placeholders: "
                     "set them before deploying (the loader prints the real values)")

    # Storage: overlays name a storage class; several pods on several nodes need ReadWriteMany.
    if is_overlay:
        problems = []
        multi = bool(hpas or scaled)
        for pvc in by_kind.get("PersistentVolumeClaim", []):
            spec = pvc["spec"]
            if not spec.get("storageClassName"):
                problems.append(f"PersistentVolumeClaim {pvc['metadata']['name']} names no storageClassName "
                                "(the default class is usually ReadWriteOnce block storage)")
            if pvc["metadata"]["name"] == claim and multi and "ReadWriteMany" not in spec.get("accessModes", []):
                problems.append(f"{pvc['metadata']['name']} is not ReadWriteMany but the pools scale across nodes")
        rep.expect(section, "storage: every PVC names a storage class; the shared model volume is RWX", problems,
                   ", ".join(f"{p['metadata']['name']}={p['spec'].get('storageClassName')}"
                             f"/{'+'.join(p['spec'].get('accessModes', []))}" for p in by_kind.get("PersistentVolumeClaim", [])))

        # Images come from an explicit registry: never the implicit docker.io/glance/*.
        problems = []
        images = set()
        for o in deployments + jobs:
            pod = o["spec"]["template"]["spec"]
            for ct in pod.get("containers", []) + pod.get("initContainers", []):
                images.add(ct.get("image", ""))
        for image in sorted(images):
            first = image.split("/", 1)[0] if "/" in image else ""
            if not ("." in first or ":" in first or first == "localhost"):
                problems.append(f"{image}: no registry host (it would mean docker.io)")
            elif first in ("docker.io", "index.docker.io") and image.split("/")[1] == "glance":
                problems.append(f"{image}: docker.io/glance is not this project's namespace")
        rep.expect(section, "images: explicit registries (the kustomize images: parameter)", problems,
                   ", ".join(sorted({i.split("/", 1)[0] for i in images})))

    # Autoscalers: queue metrics, never utilisation; one per Deployment; targets reachable.
    scalers = {}
    if hpas or scaled:
        for d in deployments:
            tgt = [s for s in hpas + scaled if s["spec"]["scaleTargetRef"]["name"] == d["metadata"]["name"]]
            if len(tgt) != 1:
                rep.add(section, f"autoscaler for {d['metadata']['name']}", False,
                        f"{len(tgt)} autoscalers target it ({', '.join(s['kind'] for s in tgt) or 'none'}), expected one")
    for h in hpas + scaled:
        name, sc, problems = scaler_of(h)
        if name not in pod_labels:
            problems.append(f"scaleTargetRef {name} is not a rendered Deployment")
        else:
            scalers[pod_labels[name].get(COMPONENT)] = sc
        if h["kind"] == "HorizontalPodAutoscaler":
            problems += [f"metric {m} is not served by the prometheus-adapter rules" for m in sc["metrics"] if m not in adapter_metrics]
        if sc["target"] is None:
            problems.append("no AverageValue target")
        if sc["min"] < 2:
            problems.append("minReplicas < 2 (no redundancy)")
        if sc["down"].get("stabilizationWindowSeconds", 300) < 300:
            problems.append("scale-down stabilisation under 5 min for GPU pods that take minutes to load")
        rep.expect(section, f"{h['kind']} {h['metadata']['name']}: scales on queue metrics", problems,
                   ", ".join(sc["metrics"]) + f" (target {sc['target']:g}/pod, {sc['min']}-{sc['max']})" if sc["target"] is not None else "")
    if {"verifier", "drafter"} <= set(scalers) and verifier and drafter:
        venv, denv = envs["verifier"], envs["drafter"]
        problems, detail = autoscaling_problems(scalers["verifier"], scalers["drafter"],
                                                int(venv.get("GLANCE_MAX_CONCURRENT") or 1),
                                                int(venv.get("GLANCE_MAX_QUEUE") or 32),
                                                int(denv.get("GLANCE_DRAFTER_MAX_SESSIONS") or 64))
        rep.expect(section, "autoscaling arithmetic: targets reachable with the shipped concurrency", problems, detail)

    # PDBs.
    problems = []
    for d in deployments:
        dn = d["metadata"]["name"]
        cover = [p for p in pdbs if matches(p["spec"].get("selector", {}), pod_labels[dn])]
        if len(cover) != 1:
            problems.append(f"{dn} is covered by {len(cover)} PodDisruptionBudgets")
    for p in pdbs:
        if p["spec"].get("unhealthyPodEvictionPolicy") != "AlwaysAllow":
            problems.append(f"{p['metadata']['name']}: unhealthyPodEvictionPolicy is not AlwaysAllow")
    rep.expect(section, "PodDisruptionBudgets: one per Deployment", problems)

    # ServiceMonitors select Services with the named port; every metrics port is scraped.
    monitors = by_kind.get("ServiceMonitor", [])
    problems = []
    scraped = set()
    for sm in monitors:
        sel = sm["spec"].get("selector", {})
        chosen = [s for s in services if s["metadata"].get("namespace") == sm["metadata"].get("namespace")
                  and matches(sel, s["metadata"].get("labels", {}))]
        if not chosen:
            problems.append(f"{sm['metadata']['name']} selects no Service")
        for s in chosen:
            sports = {p.get("name") for p in s["spec"].get("ports", [])}
            for ep in sm["spec"].get("endpoints", []):
                if ep.get("port") and ep["port"] not in sports:
                    problems.append(f"{sm['metadata']['name']}: Service {s['metadata']['name']} has no port {ep['port']}")
                else:
                    scraped.add(s["metadata"]["name"])
    if monitors:
        for s in services:
            if any(p.get("name") == "metrics" for p in s["spec"].get("ports", [])) and s["metadata"]["name"] not in scraped:
                problems.append(f"Service {s['metadata']['name']} has a metrics port no ServiceMonitor scrapes")
        rep.expect(section, "ServiceMonitors: select Services with a metrics port", problems,
                   f"{len(monitors)} ServiceMonitors")

    # Prometheus Operator objects carry the selector label; alerts read only exported metrics.
    rules = by_kind.get("PrometheusRule", [])
    if monitors or rules:
        problems = []
        releases = {(o["metadata"].get("labels") or {}).get("release") for o in monitors + rules}
        if None in releases or "" in releases:
            problems.append("a ServiceMonitor or PrometheusRule has no `release` label (kube-prometheus-stack "
                            "selects by it; the parameter is in components/monitoring)")
        if len(releases - {None, ""}) > 1:
            problems.append(f"different release labels {sorted(releases - {None, ''})}")
        problems += alert_problems(rules) if rules else ["no PrometheusRule next to the ServiceMonitors"]
        rep.expect(section, "monitoring: selector label, alert rules on exported metrics", problems,
                   f"release={'/'.join(sorted(r for r in releases if r))}, "
                   f"{sum(len(g.get('rules', [])) for r in rules for g in r['spec'].get('groups', []))} rules")

    # NetworkPolicy: verifiers may reach the drafter's gRPC port.
    for np in by_kind.get("NetworkPolicy", []):
        problems = []
        sel = np["spec"].get("podSelector", {})
        targets = [dn for dn, lbl in pod_labels.items() if matches(sel, lbl)]
        if not targets:
            problems.append("selects no pods")
        if drafter and verifier and drafter["metadata"]["name"] in targets:
            dport = {p.get("name"): p["containerPort"] for p in drafter["spec"]["template"]["spec"]["containers"][0].get("ports", [])}
            vlabels = pod_labels[verifier["metadata"]["name"]]
            ok = any(any(matches(f.get("podSelector", {}), vlabels) and "namespaceSelector" not in f for f in r.get("from", []))
                     and any(p.get("port") in (dport.get("grpc"), "grpc") for p in r.get("ports", []))
                     for r in np["spec"].get("ingress", []))
            if not ok:
                problems.append("verifier pods may not reach the drafter's gRPC port")
        rep.expect(section, f"NetworkPolicy {np['metadata']['name']}: verifiers reach the drafter", problems)


# Metrics the alert rules must cover (the issue's list): drafter disconnected, queue depth,
# RESOURCE_EXHAUSTED rate, fallback rounds, drafter mismatches.
REQUIRED_ALERT_METRICS = {"glance_drafter_connected", "glance_queue_size", "glance_requests_total",
                          "glance_spec_decode_fallback_rounds_total", "glance_drafter_mismatches_total"}


def alert_problems(rules: list[dict]) -> list[str]:
    problems = []
    used: set[str] = set()
    exprs = []
    for r in rules:
        for g in r["spec"].get("groups", []):
            for rule in g.get("rules", []):
                expr = str(rule.get("expr", ""))
                exprs.append(expr)
                names = promql_metrics(expr)
                used |= names
                label = rule.get("alert") or rule.get("record")
                problems += [f"{label}: unknown metric {n}" for n in unknown_metrics(names)]
                if "alert" in rule:
                    if not (rule.get("labels") or {}).get("severity"):
                        problems.append(f"{label}: no severity label")
                    if not (rule.get("annotations") or {}).get("summary"):
                        problems.append(f"{label}: no summary annotation")
                    if not rule.get("for"):
                        problems.append(f"{label}: no `for` (fires on one bad scrape)")
                    if not names:
                        problems.append(f"{label}: reads no glance metric")
    missing = sorted(REQUIRED_ALERT_METRICS - used)
    if missing:
        problems.append(f"no alert on {missing}")
    if not any(re.search(r'outcome\s*=~?\s*"[^"]*rejected', e) for e in exprs):
        problems.append('no alert on glance_requests_total{outcome="rejected"} (RESOURCE_EXHAUSTED)')
    return problems


def kustomize_components(target: Path) -> set[Path]:
    """Every component a kustomization uses, through the kustomizations it includes as resources."""
    kz = yaml.safe_load((target / "kustomization.yaml").read_text())
    comps = {(target / c).resolve() for c in kz.get("components", [])}
    for r in kz.get("resources", []):
        sub = (target / r)
        if (sub / "kustomization.yaml").exists():
            comps |= kustomize_components(sub.resolve())
    return comps


def check_metric_list(rep: Report, root: Path) -> None:
    """METRICS (what dashboards, alerts and autoscalers may use) is exactly what the services export."""
    declared = set()
    for rel in METRIC_SOURCES:
        declared |= set(re.findall(r'pub const [A-Z_0-9]+: &str = "(glance_[a-z0-9_]+)";', (root / rel).read_text()))
    problems = [f"{n} is exported ({' or '.join(METRIC_SOURCES)}) but not in METRICS" for n in sorted(declared - set(METRICS))]
    problems += [f"{n} is in METRICS but no service exports it" for n in sorted(set(METRICS) - declared)]
    rep.expect("k8s", "known metric names = the services' metrics.rs", problems, f"{len(METRICS)} metrics")


def kubernetes_section(rep: Report, root: Path, renderer: list[str], versions: list[str],
                       out_dir: Path) -> None:
    k8s = root / "deploy" / "k8s"
    crd_schemas = load_crd_schemas(root)
    check_metric_list(rep, root)
    adapter = yaml.safe_load((k8s / "prometheus-adapter" / "values.yaml").read_text())
    adapter_metrics = set()
    problems = []
    for rule in (adapter.get("rules") or {}).get("custom") or []:
        name = (rule.get("name") or {}).get("as")
        if not name or not rule.get("seriesQuery") or not rule.get("metricsQuery"):
            problems.append(f"incomplete rule {rule}")
        elif name not in rule["seriesQuery"]:
            problems.append(f"rule {name}: seriesQuery does not select {name}")
        else:
            adapter_metrics.add(name)
        problems += [f"rule {name}: unknown metric {n}" for n in unknown_metrics(promql_metrics(rule.get("seriesQuery", "")))]
        over = (rule.get("resources") or {}).get("overrides") or {}
        if {"namespace", "pod"} - set(over):
            problems.append(f"rule {name}: namespace and pod labels are not mapped to resources")
    rep.expect("k8s", "prometheus-adapter rules (deploy/k8s/prometheus-adapter/values.yaml)", problems,
               ", ".join(sorted(adapter_metrics)))

    targets = [k8s / "base"] + sorted(p for p in (k8s / "overlays").iterdir() if (p / "kustomization.yaml").exists())
    used_components: set[Path] = set()
    out_dir.mkdir(parents=True, exist_ok=True)
    for target in targets:
        rel = target.relative_to(root)
        section = str(target.relative_to(k8s))
        comps = kustomize_components(target)
        used_components |= comps
        ok, out, err = render(renderer, target)
        detail = err.splitlines()[-1] if (err and not ok) else ""
        if ok and err:
            ok, detail = False, f"renderer warnings: {err}"
        if not rep.add(section, f"render {rel}", ok, detail):
            continue
        (out_dir / f"{section.replace('/', '_')}.yaml").write_text(out)
        objs = load_yaml_docs(out)
        rep.add(section, "rendered objects", bool(objs),
                ", ".join(f"{k} x{n}" for k, n in sorted(
                    {o['kind']: sum(1 for x in objs if x['kind'] == o['kind']) for o in objs}.items())))
        schema_check_k8s(rep, section, objs, versions, crd_schemas)
        expect_gpu = (k8s / "components" / "cpu-only").resolve() not in comps
        semantic_check_k8s(rep, section, objs, expect_gpu, adapter_metrics, root, section != "base")
    all_components = {p.resolve() for p in (k8s / "components").iterdir() if (p / "kustomization.yaml").exists()}
    unused = sorted(str(p.relative_to(root.resolve())) for p in all_components - used_components)
    rep.expect("k8s", "every component is rendered by some overlay", [f"{u} is used by no overlay" for u in unused])


# --------------------------------------------------------------------------------------- compose

VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str], unset: set[str]):
    if isinstance(value, dict):
        return {k: interpolate(v, env, unset) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, unset) for v in value]
    if not isinstance(value, str):
        return value

    def rep(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4) or ""
        val = env.get(name)
        if op is None:
            if val is None:
                unset.add(name)
            return val or ""
        if op == ":-":
            return val if val else interpolate(arg, env, unset)
        if op == "-":
            return val if val is not None else interpolate(arg, env, unset)
        if op in (":?", "?"):
            if (op == ":?" and not val) or (op == "?" and val is None):
                unset.add(name)
            return val or ""
        if op == ":+":
            return interpolate(arg, env, unset) if val else ""
        return interpolate(arg, env, unset) if val is not None else ""

    return VAR.sub(rep, value)


def compose_schema() -> tuple[dict, str]:
    ref = importlib.resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    raw = ref.read_bytes()
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def compose_section(rep: Report, root: Path) -> None:
    schema, digest = compose_schema()
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    files = [root / "docker-compose.yml"] + sorted((root / "deploy" / "compose").glob("*.yml"))
    files = [f for f in files if f.exists()]
    docs = {}
    for f in files:
        rel = str(f.relative_to(root))
        try:
            doc = yaml.safe_load(f.read_text())
        except yaml.YAMLError as e:
            rep.add("compose", f"parse {rel}", False, str(e).replace("\n", " "))
            continue
        if not isinstance(doc, dict) or "services" not in doc or ("receivers" in doc or "scrape_configs" in doc):
            continue  # collector / Prometheus configs live beside the override files
        docs[rel] = doc
        unset: set[str] = set()
        interpolated = interpolate(copy.deepcopy(doc), {}, unset)
        for label, d in (("as written", doc), ("interpolated, empty environment", interpolated)):
            errors = sorted(validator.iter_errors(d), key=lambda e: list(e.absolute_path))
            rep.expect("compose", f"{rel} against the Compose specification ({label})",
                       [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:10]],
                       f"compose-spec.json sha256 {digest[:12]}")
        rep.expect("compose", f"{rel}: every ${{VAR}} has a default",
                   [f"${{{n}}} has no default" for n in sorted(unset)])

    main = docs.get("docker-compose.yml")
    if not main:
        rep.add("compose", "docker-compose.yml present", False, "missing or unparsable")
        return
    svc = interpolate(copy.deepcopy(main), {}, set())["services"]
    problems = []
    for need in ("verifier", "drafter", "otel-collector", "jaeger", "prometheus"):
        if need not in svc:
            problems.append(f"no service {need}")
    rep.expect("compose", "services: verifier, drafter, otel-collector, jaeger, prometheus", problems)
    if problems:
        return

    # Files the compose file points at.
    problems = []
    for name, s in svc.items():
        b = s.get("build")
        if isinstance(b, dict):
            df = root / b.get("context", ".") / b.get("dockerfile", "Dockerfile")
            if not df.exists():
                problems.append(f"{name}: Dockerfile {df.relative_to(root)} missing")
        for v in s.get("volumes", []):
            if isinstance(v, dict) and v.get("type") == "bind":
                src = v["source"]
                if not src.startswith("/") and not (root / src).exists():
                    problems.append(f"{name}: bind source {src} does not exist (compose would stop with "
                                    "\"bind source path does not exist\")")
    rep.expect("compose", "build files exist; every bind source resolves (defaults, empty environment)", problems)

    # The default model paths: what a fresh clone serves with no variable set.
    problems, found = [], []
    model_vars = {"verifier": [("GLANCE_MODEL", "config.json")],
                  "drafter": [("GLANCE_DRAFTER_TARGET", "config.json"), ("GLANCE_DRAFTER_HEAD", "model.safetensors")]}
    for name, wanted in model_vars.items():
        env = svc[name].get("environment", {})
        binds = [v for v in svc[name].get("volumes", []) if isinstance(v, dict) and v.get("type") == "bind"]
        for var, marker in wanted:
            path = str(env.get(var, ""))
            bind = next((b for b in binds if path.startswith(b["target"].rstrip("/") + "/")), None)
            if bind is None:
                problems.append(f"{name}: {var}={path!r} is under no bind mount")
                continue
            host = (root / bind["source"] / path[len(bind["target"].rstrip("/")) + 1:]).resolve()
            if not (host / marker).is_file():
                problems.append(f"{name}: {var}={path} is {host.relative_to(root) if host.is_relative_to(root) else host} "
                                f"on the host, which has no {marker}")
                continue
            unreadable = [f for f in host.rglob("*") if f.is_file() and not f.stat().st_mode & 0o004]
            if unreadable:
                problems.append(f"{name}: {len(unreadable)} file(s) under {host.relative_to(root)} are not "
                                f"world-readable (the containers run as uid 10001), e.g. {unreadable[0].name}")
            found.append(f"{var}={host.relative_to(root)}")
    rep.expect("compose", "default model paths exist and are readable by uid 10001", problems, ", ".join(found))
    doc_model_paths(rep, root)

    # Health checks: `glance health` (no libtorch) on each service's own port and health name, with
    # the binary its image ships; drain timeouts inside stop_grace_period.
    problems, details = [], []
    for name, listen_var, service, dockerfile_ in (
            ("verifier", "GLANCE_LISTEN", EXPECTED_READINESS["verifier"], "verifier-svc.Dockerfile"),
            ("drafter", "GLANCE_DRAFTER_LISTEN", EXPECTED_READINESS["drafter"], "drafter-svc.Dockerfile")):
        env = svc[name].get("environment", {})
        test = (svc[name].get("healthcheck") or {}).get("test") or []
        argv = test[1:] if test and test[0] in ("CMD", "CMD-SHELL") else test
        g = glance_probe({"exec": {"command": argv}})
        if g is None:
            problems.append(f"{name}: the health check is not `glance health`: {test}")
        else:
            if g["port"] != port_of(env.get(listen_var, "")):
                problems.append(f"{name}: the health check dials port {g['port']}, {listen_var} is {env.get(listen_var)!r}")
            if g["service"] != service:
                problems.append(f"{name}: the health check asks for {g['service']!r}, expected {service!r}")
            text = (root / "deploy/docker" / dockerfile_).read_text()
            if not re.search(r"/usr/local/bin/glance\b", text):
                problems.append(f"{name}: deploy/docker/{dockerfile_} does not install glance")
        drain = parse_duration_s(env.get(DRAIN_ENV[name], DRAIN_DEFAULT_S))
        grace = parse_duration_s(svc[name].get("stop_grace_period", "10s"))
        if drain is None or grace is None or grace < drain + DRAIN_MARGIN_S:
            problems.append(f"{name}: stop_grace_period {svc[name].get('stop_grace_period', '10s')} < "
                            f"{DRAIN_ENV[name]} {drain} + {DRAIN_MARGIN_S} s: Docker would SIGKILL a draining server")
        details.append(f"{name}: {g['service'] if g else '?'}, drain {drain} s of {grace} s")
    rep.expect("compose", "health checks are `glance health`; drains fit stop_grace_period", problems, "; ".join(details))

    # Ports publish on 127.0.0.1 only; hardening on our services.
    problems = []
    for name, s in svc.items():
        for p in s.get("ports", []):
            if isinstance(p, str) and not p.startswith("127.0.0.1:"):
                problems.append(f"{name}: port {p} is not bound to 127.0.0.1")
            if isinstance(p, dict) and p.get("host_ip") != "127.0.0.1":
                problems.append(f"{name}: port {p} is not bound to 127.0.0.1")
    for name in ("verifier", "drafter"):
        s = svc[name]
        if not s.get("read_only"):
            problems.append(f"{name}: root fs not read-only")
        if str(s.get("user", "0")).split(":")[0] in ("0", "root"):
            problems.append(f"{name}: runs as root")
        if "ALL" not in (s.get("cap_drop") or []):
            problems.append(f"{name}: capabilities not dropped")
        if not any(isinstance(v, dict) and v.get("type") == "tmpfs" and v.get("target") == "/tmp" for v in s.get("volumes", [])):
            problems.append(f"{name}: no tmpfs /tmp")
        if not any(isinstance(v, dict) and v.get("target") == "/models" and v.get("read_only") for v in s.get("volumes", [])):
            problems.append(f"{name}: models not mounted read-only at /models")
        if "healthcheck" not in s:
            problems.append(f"{name}: no healthcheck")
    rep.expect("compose", "localhost-only ports; services non-root, read-only, models read-only", problems)

    # Wiring: verifier -> drafter, services -> collector -> Jaeger, Prometheus -> /metrics.
    problems = []
    venv, denv = svc["verifier"].get("environment", {}), svc["drafter"].get("environment", {})
    u = urlparse(venv.get("GLANCE_DRAFTER_URL", ""))
    if u.hostname != "drafter" or u.port != port_of(denv.get("GLANCE_DRAFTER_LISTEN", "")):
        problems.append(f"GLANCE_DRAFTER_URL {venv.get('GLANCE_DRAFTER_URL')!r} does not reach drafter's "
                        f"GLANCE_DRAFTER_LISTEN {denv.get('GLANCE_DRAFTER_LISTEN')!r}")
    for name, env in (("verifier", venv), ("drafter", denv)):
        if env.get("GLANCE_MODEL", env.get("GLANCE_DRAFTER_TARGET", "")).split("/")[1:2] != ["models"]:
            problems.append(f"{name}: the target model is not under /models")
    collector = yaml.safe_load((root / "deploy/compose/otel-collector.yaml").read_text())
    grpc_ep = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    for name, env in (("verifier", venv), ("drafter", denv)):
        ep = urlparse(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
        if ep.hostname != "otel-collector" or ep.port != port_of(grpc_ep):
            problems.append(f"{name}: OTEL_EXPORTER_OTLP_ENDPOINT {ep.geturl()!r} is not the collector's OTLP/gRPC receiver {grpc_ep}")
        if not env.get("OTEL_SERVICE_NAME"):
            problems.append(f"{name}: no OTEL_SERVICE_NAME")
    # The collector's pipelines use only defined components; traces reach Jaeger.
    for pname, p in collector["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for comp in p.get(kind, []):
                if comp not in (collector.get(kind) or {}):
                    problems.append(f"collector pipeline {pname}: {kind[:-1]} {comp} is not defined")
    jaeger_exporters = [e for e in collector["service"]["pipelines"]["traces"]["exporters"]
                        if (collector["exporters"][e] or {}).get("endpoint", "").split(":")[0] == "jaeger"]
    if not jaeger_exporters:
        problems.append("the traces pipeline does not export to the jaeger service")
    prom = yaml.safe_load((root / "deploy/compose/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    for name, env, var in (("verifier", venv, "GLANCE_METRICS_LISTEN"), ("drafter", denv, "GLANCE_DRAFTER_METRICS_LISTEN")):
        want = f"{name}:{port_of(env.get(var, ''))}"
        if want not in targets:
            problems.append(f"Prometheus does not scrape {want} ({var}={env.get(var)!r})")
        if not str(env.get(var, "")).startswith("0.0.0.0:"):
            problems.append(f"{name}: {var} does not bind 0.0.0.0")
    rep.expect("compose", "wiring: verifier->drafter, OTLP->collector->Jaeger, Prometheus->/metrics", problems)


def doc_model_paths(rep: Report, root: Path) -> None:
    """Repository model paths (models/..., ./models/...) that the deployment docs name exist.
    deploy/README.md and docker-compose.yml fail; the top-level README.md, edited outside deploy/,
    only warns."""
    rx = re.compile(r"(?<![\w/.-])(?:\./)?models/[A-Za-z0-9_.@{},-]+(?:/[A-Za-z0-9_.-]+)*")

    def expand(token: str) -> list[str]:
        m = re.search(r"\{([^{}]*)\}", token)
        if not m:
            return [token]
        return [x for alt in m.group(1).split(",") for x in expand(token[:m.start()] + alt + token[m.end():])]

    for rel, strict in (("deploy/README.md", True), ("docker-compose.yml", True), ("README.md", False)):
        f = root / rel
        if not f.exists():
            continue
        missing, seen = [], set()
        for lineno, line in enumerate(f.read_text().splitlines(), 1):
            for tok in rx.findall(line):
                for path in expand(tok.rstrip(".,")):
                    seen.add(path)
                    if not (root / path).exists():
                        missing.append(f"line {lineno}: {path}")
        if strict or not missing:
            rep.expect("compose", f"{rel}: the model paths it names exist", missing, f"{len(seen)} paths")
        else:
            rep.warn("compose", f"{rel}: model paths that do not exist", "; ".join(missing))


# ------------------------------------------------------------------------------------ dockerfiles


def workspace_packages(root: Path) -> dict[str, set[str]]:
    """package name -> its binary names."""
    ws = tomllib.loads((root / "Cargo.toml").read_text())
    out = {}
    for member in ws.get("workspace", {}).get("members", []):
        mdir = root / member
        manifest = tomllib.loads((mdir / "Cargo.toml").read_text())
        pname = manifest["package"]["name"]
        bins = {b["name"] for b in manifest.get("bin", [])}
        if (mdir / "src/main.rs").exists():
            bins.add(pname)
        bins |= {p.stem for p in (mdir / "src/bin").glob("*.rs")} if (mdir / "src/bin").is_dir() else set()
        out[pname] = bins
    return out


SERVICE_DOCKERFILES = {"verifier-svc.Dockerfile": "verifier", "drafter-svc.Dockerfile": "drafter"}
CONSTRAINTS = "deploy/docker/constraints.txt"


def constraints_problems(root: Path, torch_pin: str | None) -> tuple[list[str], str]:
    """deploy/docker/constraints.txt: exact pins only, torch at scripts/setup.sh's pin, and (where the
    project's .venv exists) every pin torch's metadata states exactly, and every nvidia-*/cuda-*/
    triton wheel installed there, at the installed version."""
    problems = []
    f = root / CONSTRAINTS
    if not f.exists():
        return [f"{CONSTRAINTS} is missing"], ""
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
    pins = {}
    for line in f.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)", line)
        if not m:
            problems.append(f"{line!r} is not an exact pin (name==version)")
            continue
        pins[norm(m.group(1))] = m.group(2)
    if torch_pin and pins.get("torch") != torch_pin:
        problems.append(f"torch=={pins.get('torch')} but scripts/setup.sh installs torch=={torch_pin}")

    def same(a: str, b: str) -> bool:  # PEP 440 release equality, enough for these versions
        pad = lambda v: [int(x) for x in re.findall(r"\d+", v.split("+")[0])]
        x, y = pad(a), pad(b)
        n = max(len(x), len(y))
        return x + [0] * (n - len(x)) == y + [0] * (n - len(y))

    venv_meta = sorted(root.glob(f".venv/lib/python3*/site-packages/torch-{torch_pin}*.dist-info/METADATA"))
    detail = f"{len(pins)} pins"
    if venv_meta:
        site = venv_meta[0].parent.parent
        for line in venv_meta[0].read_text().splitlines():
            m = re.match(r"Requires-Dist: ([A-Za-z0-9._-]+)(?:\[[^\]]*\])?\s*==\s*([0-9][^;\s]*)\s*(?:;(.*))?$", line)
            if m and "extra ==" not in (m.group(3) or ""):
                name, ver = norm(m.group(1)), m.group(2)
                if name not in pins:
                    problems.append(f"torch requires {name}=={ver}, not pinned")
                elif not same(pins[name], ver):
                    problems.append(f"{name}=={pins[name]} but torch {torch_pin} requires =={ver}")
        installed = {}
        for d in site.glob("*.dist-info"):
            m = re.fullmatch(r"(.+?)-([0-9][^-]*)\.dist-info", d.name)
            if m:
                installed[norm(m.group(1))] = m.group(2)
        for name, ver in sorted(installed.items()):
            if re.match(r"(nvidia-|cuda-|triton$)", name) and not same(pins.get(name, "-1"), ver):
                problems.append(f"{name} is {ver} in .venv (what torch resolved to) but pinned {pins.get(name)}")
        detail += f"; agree with {venv_meta[0].parent.name} and the wheels installed in .venv"
    return problems, detail


def dockerfile_section(rep: Report, root: Path) -> None:
    files = sorted((root / "deploy" / "docker").glob("*.Dockerfile"))
    rep.add("docker", "a Dockerfile per service", {f.name for f in files} >= set(SERVICE_DOCKERFILES),
            ", ".join(f.name for f in files))
    packages = workspace_packages(root)
    setup = (root / "scripts/setup.sh").read_text()
    m = re.search(r"torch==([0-9][0-9.]*)", setup)
    torch_pin = m.group(1) if m else None
    ignore = dockerignore_regexes(root / ".dockerignore")

    # .dockerignore keeps every build input.
    needed = ["Cargo.toml", "Cargo.lock", "build-support/link_libtorch.rs", CONSTRAINTS]
    ws = tomllib.loads((root / "Cargo.toml").read_text())
    for member in ws["workspace"]["members"]:
        needed.append(f"{member}/Cargo.toml")
        for p in sorted((root / member).rglob("*")):
            rel = str(p.relative_to(root))
            if p.is_file() and (rel.endswith((".rs", ".proto")) or p.name == "build.rs") and "/target/" not in rel \
                    and "fixtures" not in rel and "/tests/" not in rel:
                needed.append(rel)
    dropped = [n for n in needed if dockerignored(ignore, n)]
    kept_out = [n for n in ("target", ".venv", ".git", "tests/fixtures", "models") if not dockerignored(ignore, n + "/x")]
    rep.expect("docker", ".dockerignore keeps the workspace and drops target/, .venv, .git, fixtures, models",
               [f"excludes build input {d}" for d in dropped[:10]] + [f"does not exclude {k}" for k in kept_out],
               f"{len(needed)} build inputs kept")

    problems, detail = constraints_problems(root, torch_pin)
    rep.expect("docker", f"{CONSTRAINTS}: torch and the CUDA wheels pinned exactly", problems, detail)

    for f in files:
        rel = str(f.relative_to(root))
        text = f.read_text()
        try:
            cmds = dockerfile.parse_string(text)
        except dockerfile.GoParseError as e:
            rep.add("docker", f"parse {rel}", False, str(e))
            continue
        rep.add("docker", f"parse {rel} (BuildKit parser)", True, f"{len(cmds)} instructions")
        svc = SERVICE_DOCKERFILES.get(f.name)
        problems = []
        if not text.startswith("# syntax=docker/dockerfile:1"):
            problems.append("no '# syntax=docker/dockerfile:1' directive (RUN --mount needs BuildKit's frontend)")
        args: dict[str, str] = {}
        stage_args: dict[str, str] = {}
        stages: list[str] = []
        final_user = None
        final_entry = None
        exposes: set[int] = set()
        runtime_runs: list[str] = []
        installed: set[str] = set()
        pip_constrained = False
        for c in cmds:
            if c.cmd == "ARG":
                for v in c.value:
                    k, _, d = v.partition("=")
                    (args if len(stages) == 0 else stage_args)[k] = d
            elif c.cmd == "FROM":
                raw = c.value[0]
                image = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda mm: args.get(mm.group(1), "?"), raw)
                if image not in stages:
                    tag = image.rsplit("/", 1)[-1].partition(":")[2]
                    if "@sha256:" not in image and (not tag or tag == "latest" or "?" in image):
                        problems.append(f"base image {image!r} is not pinned")
                    if not raw.startswith("$"):
                        problems.append(f"base image {raw!r} is not a build argument (a release pins it by digest "
                                        "with --build-arg, without editing the Dockerfile)")
                stages.append(c.value[2] if len(c.value) >= 3 and c.value[1].upper() == "AS" else str(len(stages)))
                final_user, final_entry, exposes, runtime_runs = None, None, set(), []
                stage_args = {}
            elif c.cmd in ("COPY", "ADD"):
                for fl in c.flags:
                    if fl.startswith("--from=") and fl[7:] not in stages[:-1]:
                        problems.append(f"line {c.start_line}: {fl} names no earlier stage")
                if not any(fl.startswith("--from=") for fl in c.flags):
                    for src in c.value[:-1]:
                        src = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda mm: stage_args.get(mm.group(1), args.get(mm.group(1), "?")), src)
                        if src not in (".", "./") and not (root / src).exists():
                            problems.append(f"line {c.start_line}: COPY source {src} does not exist in the context")
            elif c.cmd == "USER":
                final_user = c.value[0]
            elif c.cmd == "ENTRYPOINT":
                final_entry = c
            elif c.cmd == "EXPOSE":
                exposes |= {int(v.split("/")[0]) for v in c.value}
            elif c.cmd == "RUN":
                body = " ".join(c.value)
                runtime_runs.append(body)
                installed |= set(re.findall(r"install -D -m \d+ \S+ /out(/usr/local/bin/\S+)", body))
                for fl in c.flags:
                    mm = re.match(r"--mount=type=bind,source=([^,]+),target=([^,]+)", fl)
                    if mm and not (root / mm.group(1)).exists():
                        problems.append(f"line {c.start_line}: bind-mount source {mm.group(1)} does not exist")
                    if mm and mm.group(1) == CONSTRAINTS and re.search(r"pip install\b[^&;]*(--constraint|-c) " + re.escape(mm.group(2)), body):
                        pip_constrained = True
                for cm in re.finditer(r"cargo build([^&;]*)", body):
                    cargs = cm.group(1).split()
                    if "--locked" not in cargs:
                        problems.append(f"line {c.start_line}: cargo build without --locked")
                    pkgs = [cargs[i + 1] for i, a in enumerate(cargs[:-1]) if a == "-p"]
                    binaries = [cargs[i + 1] for i, a in enumerate(cargs[:-1]) if a == "--bin"]
                    for p in pkgs:
                        if p not in packages:
                            problems.append(f"line {c.start_line}: -p {p} is not a workspace package")
                    for b in binaries:
                        if not any(b in packages.get(p, set()) for p in pkgs):
                            problems.append(f"line {c.start_line}: --bin {b} is not a binary of {pkgs}")
        if final_user is None or final_user.split(":")[0] in ("0", "root"):
            problems.append(f"the runtime stage runs as {final_user or 'root (no USER)'}")
        if svc:
            if args.get("TORCH_VERSION") != torch_pin and torch_pin and f"torch=={torch_pin}" not in text:
                problems.append(f"torch pin differs from scripts/setup.sh (torch=={torch_pin})")
            if not pip_constrained:
                problems.append(f"pip does not install torch with --constraint {CONSTRAINTS} (bind-mounted)")
            if final_entry is None or not final_entry.json:
                problems.append("no exec-form ENTRYPOINT in the runtime stage (SIGTERM must reach the server)")
            want_ports = {"verifier": {50051, 9090}, "drafter": {50061, 9091}}[svc]
            if not want_ports <= exposes:
                problems.append(f"EXPOSE {sorted(exposes)} lacks {sorted(want_ports - exposes)}")
            # Both images ship the `glance` client: the compose health checks and the TLS probes run it.
            if "/usr/local/bin/glance" not in installed:
                problems.append("the image does not install /usr/local/bin/glance (compose health checks, TLS probes)")
            if not any(re.search(r"\bglance --version\b", r) for r in runtime_runs):
                problems.append("the runtime stage does not run `glance --version` (a missing library would "
                                "only show when a health check runs)")
            label = f"{rel}: pinned bases, non-root runtime, real cargo targets, torch=={torch_pin} with constraints, glance"
        else:
            # Another image built from the repository (the model bundle): its own .dockerignore must
            # admit what it copies.
            own = f.with_name(f.name + ".dockerignore")
            if own.exists():
                own_rules = dockerignore_regexes(own)
                for k in ("TARGET_DIR", "HEAD_DIR"):
                    d = stage_args.get(k) or args.get(k)
                    if d:
                        kept = [p for p in (root / d).rglob("*") if p.is_file()]
                        if not kept:
                            problems.append(f"{k} default {d} has no files")
                        dropped_ = [str(p.relative_to(root)) for p in kept if dockerignored(own_rules, str(p.relative_to(root)))]
                        if dropped_:
                            problems.append(f"{own.name} excludes {dropped_[:3]} that the image copies")
                if not dockerignored(own_rules, ".git/x") or not dockerignored(own_rules, "target/x"):
                    problems.append(f"{own.name} does not exclude .git and target/")
            label = f"{rel}: pinned bases, non-root, sources in its build context"
        rep.expect("docker", label, problems, f"stages {stages}, USER {final_user}")


# ------------------------------------------------------------------------------------ env names


def env_declarations(rep: Report, root: Path, strict: bool) -> None:
    """GLANCE_* variables the deployment sets that no clap flag declares (yet)."""
    declared = set()
    for rs in root.rglob("*.rs"):
        if "target" in rs.parts:
            continue
        declared |= set(re.findall(r'env\s*=\s*"(GLANCE_[A-Z0-9_]+)"', rs.read_text(errors="replace")))
    used: dict[str, set[str]] = {}
    sources = [root / "docker-compose.yml", *sorted((root / "deploy").rglob("*.yaml")),
               *sorted((root / "deploy").rglob("*.yml")), *sorted((root / "deploy").rglob("*.Dockerfile"))]
    for f in sources:
        for n in re.findall(r"\b(GLANCE_[A-Z0-9_]+)\b", f.read_text()):
            used.setdefault(n, set()).add(str(f.relative_to(root)))
    # Compose-only interpolation variables (host side) are not service flags.
    compose_vars = set(re.findall(r"\$\{(GLANCE_[A-Z0-9_]+)", (root / "docker-compose.yml").read_text()))
    compose_vars |= set(re.findall(r"\$\{(GLANCE_[A-Z0-9_]+)", "".join(
        p.read_text() for p in (root / "deploy/compose").glob("*.yml"))))
    missing = sorted(n for n in used if n not in declared and n not in compose_vars)
    if not missing:
        rep.add("env", "every GLANCE_* variable set is a declared flag", True, f"{len(declared)} declared")
    elif strict:
        rep.add("env", "every GLANCE_* variable set is a declared flag", False, ", ".join(missing))
    else:
        rep.warn("env", "GLANCE_* variables set but not (yet) declared by any clap flag", ", ".join(missing))


# ------------------------------------------------------------------------------------- grafana

DASHBOARD = "deploy/grafana/glance-dashboard.json"
# What the dashboard must show (the issue's list): throughput, TTFT and ITL quantiles, queue size,
# requests by outcome, tau, fallback rate, drafter sessions, drafter connected, mismatches.
REQUIRED_DASHBOARD_METRICS = {
    "glance_generated_tokens_total", "glance_time_to_first_token_seconds_bucket",
    "glance_inter_token_latency_seconds_bucket", "glance_queue_size", "glance_requests_total",
    "glance_spec_decode_num_accepted_tokens_total", "glance_spec_decode_num_drafts_total",
    "glance_spec_decode_fallback_rounds_total", "glance_drafter_sessions_open", "glance_drafter_connected",
    "glance_drafter_mismatches_total"}


def dashboard_problems(dash: dict) -> tuple[list[str], str]:
    """A Grafana dashboard reads only exported metrics, through the datasource variable, and covers
    REQUIRED_DASHBOARD_METRICS; histogram quantiles aggregate by le."""
    problems = []
    panels = []
    for p in dash.get("panels", []):
        panels.append(p)
        panels += p.get("panels", [])  # collapsed rows hold their panels
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append("panel ids are missing or not unique")
    variables = {v.get("name"): v for v in (dash.get("templating") or {}).get("list", [])}
    if (variables.get("datasource") or {}).get("type") != "datasource":
        problems.append("no `datasource` template variable (the dashboard would be tied to one Prometheus)")
    used: set[str] = set()
    n_queries = 0
    for p in panels:
        if p.get("type") == "row":
            continue
        if not p.get("targets"):
            problems.append(f"panel {p.get('title')!r} has no queries")
        if p.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"panel {p.get('title')!r} does not use ${{datasource}}")
        for t in p.get("targets", []):
            expr = t.get("expr", "")
            n_queries += 1
            names = promql_metrics(expr)
            used |= names
            problems += [f"panel {p.get('title')!r}: unknown metric {n}" for n in unknown_metrics(names)]
            if not names:
                problems.append(f"panel {p.get('title')!r}: a query reads no glance metric: {expr}")
            if "histogram_quantile" in expr and not re.search(r"by \([^)]*\ble\b", expr):
                problems.append(f"panel {p.get('title')!r}: histogram_quantile without `by (le)`")
    missing = sorted(REQUIRED_DASHBOARD_METRICS - used)
    if missing:
        problems.append(f"no panel shows {missing}")
    return problems, f"{len(panels)} panels, {n_queries} queries, {len(used)} series"


def grafana_section(rep: Report, root: Path) -> None:
    f = root / DASHBOARD
    try:
        dash = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        rep.add("grafana", f"parse {DASHBOARD}", False, str(e))
        return
    rep.add("grafana", f"parse {DASHBOARD}", True, dash.get("title", ""))
    problems, detail = dashboard_problems(dash)
    rep.expect("grafana", "every queried metric is exported; the required panels exist", problems, detail)


# ------------------------------------------------------------------------------------ canaries


def canaries(rep: Report, root: Path, versions: list[str]) -> None:
    """Known-bad documents must fail: the validators are not vacuous."""
    dep = yaml.safe_load((root / "deploy/k8s/base/verifier-deployment.yaml").read_text())
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    typo = copy.deepcopy(dep)
    typo["spec"]["minReadySeconds"] = "ten"
    for label, doc in (("an unknown field", bad), ("a wrong type", typo)):
        caught = []
        for v in versions:
            try:
                kubernetes_validate.validate(doc, v, strict=True)
            except kubernetes_validate.ValidationError:
                caught.append(v)
        rep.add("canary", f"strict Kubernetes validation rejects {label}", caught == versions,
                f"rejected for {caught}" if caught == versions else f"accepted for {sorted(set(versions) - set(caught))}")
    schema, _ = compose_schema()
    doc = {"services": {"x": {"image": "a:1", "imagee": "typo"}}}
    rep.add("canary", "Compose schema rejects an unknown service key",
            not jsonschema.Draft202012Validator(schema).is_valid(doc))
    crd = load_crd_schemas(root)

    def rejects(key: tuple[str, str], doc: dict) -> bool:
        return not jsonschema.Draft202012Validator(crd[key]).is_valid(doc)

    def accepts(key: tuple[str, str], doc: dict) -> bool:
        return jsonschema.Draft202012Validator(crd[key]).is_valid(doc)

    meta = {"name": "x"}
    sm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
          "spec": {"selector": {}, "endpoints": [{"port": "metrics", "intervall": "15s"}]}}
    rep.add("canary", "ServiceMonitor schema rejects an unknown endpoint field",
            rejects(("monitoring.coreos.com/v1", "ServiceMonitor"), sm))
    pr_key = ("monitoring.coreos.com/v1", "PrometheusRule")
    good_rule = {"alert": "A", "expr": "glance_queue_size > 1", "for": "5m"}
    pr = lambda rule: {"apiVersion": pr_key[0], "kind": pr_key[1], "metadata": meta,
                       "spec": {"groups": [{"name": "g", "rules": [rule]}]}}
    rep.add("canary", "PrometheusRule schema rejects an unknown rule field, a bad duration and alert+record",
            accepts(pr_key, pr(good_rule)) and rejects(pr_key, pr(good_rule | {"exprr": "x"}))
            and rejects(pr_key, pr(good_rule | {"for": "5 minutes"})) and rejects(pr_key, pr(good_rule | {"record": "r"})))
    so_key = ("keda.sh/v1alpha1", "ScaledObject")
    so = lambda trig, extra=None: {"apiVersion": so_key[0], "kind": so_key[1], "metadata": meta,
                                   "spec": {"scaleTargetRef": {"name": "d"}, "triggers": [trig]} | (extra or {})}
    trig = {"type": "prometheus", "metadata": {"serverAddress": "http://p:9090", "query": "q", "threshold": "2"}}
    rep.add("canary", "ScaledObject schema rejects a numeric threshold and an unknown spec field",
            accepts(so_key, so(trig)) and rejects(so_key, so(trig | {"metadata": trig["metadata"] | {"threshold": 2}}))
            and rejects(so_key, so(trig, {"minReplicas": 2})))
    cert_key = ("cert-manager.io/v1", "Certificate")
    cert = {"apiVersion": cert_key[0], "kind": cert_key[1], "metadata": meta,
            "spec": {"secretName": "s", "dnsNames": ["a"], "usages": ["server auth"], "issuerRef": {"name": "i"}}}
    rep.add("canary", "Certificate schema rejects an unknown usage and an unknown field",
            accepts(cert_key, cert)
            and rejects(cert_key, cert | {"spec": cert["spec"] | {"usages": ["serverauth"]}})
            and rejects(cert_key, cert | {"spec": cert["spec"] | {"dnsName": ["a"]}}))
    iss_key = ("cert-manager.io/v1", "Issuer")
    iss = lambda spec: {"apiVersion": iss_key[0], "kind": iss_key[1], "metadata": meta, "spec": spec}
    rep.add("canary", "Issuer schema rejects two issuer types and a CA issuer without its Secret",
            accepts(iss_key, iss({"ca": {"secretName": "c"}})) and rejects(iss_key, iss({"ca": {"secretName": "c"}, "selfSigned": {}}))
            and rejects(iss_key, iss({"ca": {}})))

    # The arithmetic and name checks reject what they are for.
    rep.add("canary", "drain check rejects a grace period shorter than preStop + drain + margin, and a short drafter preStop",
            bool(drain_problems("verifier", 180, 10, 170.0)) and not drain_problems("verifier", 145, 10, 120.0)
            and bool(drain_problems("drafter", 200, 10, 120.0)) and bool(drain_problems("verifier", 180, 10, None)))
    v, d = {"min": 2, "max": 8, "target": 2}, {"min": 2, "max": 8, "target": 16}
    rep.add("canary", "autoscaling check rejects the old drafter target (16 sessions/pod x 2 pods > 8 sessions)",
            bool(autoscaling_problems(v, d, 1, 32, 64)[0])
            and not autoscaling_problems(v, d | {"target": 2, "max": 4}, 1, 32, 64)[0]
            and bool(autoscaling_problems(v, d | {"target": 2, "max": 6}, 1, 32, 64)[0]))
    rep.add("canary", "alert and dashboard checks reject an unknown metric name",
            any("glance_spec_decode_num_drafts " in p or "unknown metric" in p for p in alert_problems(
                [pr({"alert": "A", "expr": "rate(glance_spec_decode_num_drafts[5m]) > 0", "for": "5m"})]))
            and any("unknown metric" in p for p in dashboard_problems(
                {"panels": [{"id": 1, "type": "timeseries", "title": "t", "datasource": {"uid": "${datasource}"},
                             "targets": [{"expr": "glance_queue_size + glance_queue_depth"}]}],
                 "templating": {"list": [{"name": "datasource", "type": "datasource"}]}})[0]))
    tls_pod = {"containers": [{"name": "verifier", "ports": [{"name": "grpc", "containerPort": 50051}],
                               "startupProbe": {"grpc": {"port": 50051, "service": ""}, "failureThreshold": 60},
                               "livenessProbe": {"grpc": {"port": 50051, "service": ""}},
                               "readinessProbe": {"grpc": {"port": 50051, "service": "glance.v1.Generation"}}}]}
    rep.add("canary", "probe check rejects native gRPC probes on a TLS port",
            bool(probe_problems(tls_pod, tls_pod["containers"][0], "verifier", {"GLANCE_TLS_CERT": "/x"})[0])
            and not probe_problems(tls_pod, tls_pod["containers"][0], "verifier", {})[0])


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--renderer", required=True, help="e.g. 'kubectl kustomize' or 'kustomize build'")
    ap.add_argument("--k8s-version", action="append", required=True)
    ap.add_argument("--out", type=Path, required=True, help="where rendered overlays are written")
    ap.add_argument("--strict-env", action="store_true",
                    help="fail (not warn) on GLANCE_* variables no clap flag declares")
    a = ap.parse_args()
    root = a.root.resolve()
    started = time.monotonic()
    rep = Report()
    versions = a.k8s_version
    renderer = shlex.split(a.renderer)
    tools = {n: importlib.metadata.version(n) for n in ("kubernetes-validate", "check-jsonschema", "jsonschema", "dockerfile", "PyYAML")}
    print("tools: " + ", ".join(f"{k} {v}" for k, v in tools.items()) + f"; renderer: {a.renderer}")
    print(f"Kubernetes versions: {', '.join(versions)} (strict schemas)\n")

    sections = [
        ("k8s", lambda: kubernetes_section(rep, root, renderer, versions, a.out)),
        ("compose", lambda: compose_section(rep, root)),
        ("docker", lambda: dockerfile_section(rep, root)),
        ("grafana", lambda: grafana_section(rep, root)),
        ("env", lambda: env_declarations(rep, root, a.strict_env)),
        ("canary", lambda: canaries(rep, root, versions)),
    ]
    for name, fn in sections:
        try:
            fn()
        except Exception as e:  # a crash is a failure of that section, not of the summary
            rep.add(name, "section ran to completion", False, f"{type(e).__name__}: {e}")

    passed = sum(1 for r in rep.rows if r[0] == "PASS")
    failed = [r for r in rep.rows if r[0] == "FAIL"]
    warned = [r for r in rep.rows if r[0] == "WARN"]
    print("\n==== summary ====")
    by_section: dict[str, list[int]] = {}
    for status, section, _, _ in rep.rows:
        s = by_section.setdefault(section, [0, 0, 0])
        s[("PASS", "FAIL", "WARN").index(status)] += 1
    for section, (p, f, w) in by_section.items():
        print(f"  {section:<20} {p:>3} passed  {f:>3} failed" + (f"  {w} warning(s)" if w else ""))
    for status, section, name, detail in failed + warned:
        print(f"  {status} [{section}] {name}: {detail}")
    print(f"  rendered manifests: {a.out}")
    print(f"  {time.monotonic() - started:.1f} s")
    print(f"deploy: {passed} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
