#!/usr/bin/env python3
"""Validates glance's deployment files. Run through scripts/validate-deploy.sh, which provides the
pinned tools (deploy/validate/requirements.txt) and a kustomize renderer.

1. Kubernetes: renders deploy/k8s/base and every deploy/k8s/overlays/* with kustomize, validates
   every core object strictly (unknown fields are errors) against the Kubernetes OpenAPI schemas
   bundled by kubernetes-validate, for each --k8s-version; ServiceMonitors (a CRD the bundle does
   not know) against deploy/validate/servicemonitor.schema.json; any other kind fails. Then checks
   what a schema cannot: selectors that select, ports that exist, probes, security context, GPU
   requests, HPA metrics that the prometheus-adapter rules serve, and so on.
2. Compose: docker-compose.yml and deploy/compose/gpu.yml against the Compose specification's JSON
   schema (as written and after ${VAR:-default} interpolation with an empty environment), plus
   cross-checks with the collector and Prometheus configs.
3. Dockerfiles: parsed with the BuildKit parser, then checked (pinned bases, non-root user, stage
   references, cargo packages and binaries that exist, the torch pin of scripts/setup.sh, and a
   .dockerignore that keeps every build input).
4. Canaries: known-bad documents must be rejected, so a vacuous validator cannot pass.

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


def semantic_check_k8s(rep: Report, section: str, objs: list[dict], expect_gpu: bool,
                       adapter_metrics: set[str]) -> None:
    by_kind: dict[str, list[dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)

    def names(kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in by_kind.get(kind, [])}

    deployments = by_kind.get("Deployment", [])
    services = by_kind.get("Service", [])
    hpas = by_kind.get("HorizontalPodAutoscaler", [])
    pdbs = by_kind.get("PodDisruptionBudget", [])
    configmaps, pvcs, sas = names("ConfigMap"), names("PersistentVolumeClaim"), names("ServiceAccount")

    comps = sorted(d["spec"]["template"]["metadata"]["labels"].get(COMPONENT, "?") for d in deployments)
    rep.expect(section, "one Deployment per service",
               [] if comps == ["drafter", "verifier"] else [f"Deployments by component: {comps}"],
               "verifier, drafter")

    # Namespace and labels.
    namespaces = by_kind.get("Namespace", [])
    problems = []
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
    hpa_targets = {h["spec"]["scaleTargetRef"]["name"] for h in hpas}

    for d in deployments:
        dname = d["metadata"]["name"]
        pod = d["spec"]["template"]["spec"]
        labels = pod_labels[dname]
        comp = labels.get(COMPONENT, "?")
        containers = pod.get("containers", [])
        c = containers[0] if containers else {}
        env = env_map(c)
        cports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        sec = f"{dname}"

        # Selector, replicas.
        problems = []
        if not matches(d["spec"].get("selector", {}), labels):
            problems.append("spec.selector does not match the pod template labels")
        if dname in hpa_targets and "replicas" in d["spec"]:
            problems.append("spec.replicas is set although an HPA owns the replica count")
        if len(containers) != 1:
            problems.append(f"{len(containers)} containers (expected 1)")
        rep.expect(section, f"{sec}: selector, replicas, containers", problems)

        # Security context (restricted Pod Security Standard and read-only root fs).
        problems = []
        psc = pod.get("securityContext", {})
        if psc.get("runAsNonRoot") is not True:
            problems.append("pod runAsNonRoot is not true")
        if psc.get("runAsUser", 1) == 0 or (c.get("securityContext", {}).get("runAsUser", 1) == 0):
            problems.append("runs as uid 0")
        seccomp = (c.get("securityContext", {}).get("seccompProfile") or psc.get("seccompProfile") or {})
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append("no RuntimeDefault seccomp profile")
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
        for ct in containers:
            if any("hostPort" in p for p in ct.get("ports", [])):
                problems.append(f"{ct['name']}: hostPort")
            csc = ct.get("securityContext", {})
            if csc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{ct['name']}: allowPrivilegeEscalation is not false")
            if csc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{ct['name']}: readOnlyRootFilesystem is not true")
            if "ALL" not in (csc.get("capabilities", {}).get("drop") or []):
                problems.append(f"{ct['name']}: capabilities do not drop ALL")
            if csc.get("privileged"):
                problems.append(f"{ct['name']}: privileged")
            if not any(m.get("mountPath") == "/tmp" for m in ct.get("volumeMounts", [])):
                problems.append(f"{ct['name']}: no writable /tmp with a read-only root fs")
        rep.expect(section, f"{sec}: security context (non-root, read-only root fs, no privileges)", problems)

        # Image.
        problems = []
        for ct in containers:
            image = ct.get("image", "")
            if "@sha256:" not in image:
                tag = image.rsplit("/", 1)[-1].partition(":")[2]
                if not tag or tag == "latest":
                    problems.append(f"{ct['name']}: image {image!r} is not pinned to a tag or digest")
        rep.expect(section, f"{sec}: image pinned", problems, c.get("image", ""))

        # Resources and GPU.
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
        gpu_note = f"{GPU}={req.get(GPU, 0)}, {DEVICE_ENV.get(comp)}={device}"
        rep.expect(section, f"{sec}: resources ({'GPU' if expect_gpu else 'CPU-only'})", problems, gpu_note)

        # Probes: native gRPC against grpc.health.v1.
        problems = []
        grpc_port = cports.get("grpc")
        if grpc_port is None:
            problems.append("no container port named grpc")
        probes = {k: c.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")}
        for k, p in probes.items():
            if not p or "grpc" not in p:
                problems.append(f"{k} is not a gRPC probe")
            elif p["grpc"].get("port") != grpc_port:
                problems.append(f"{k} probes port {p['grpc'].get('port')}, the gRPC port is {grpc_port}")
        if probes["livenessProbe"] and probes["livenessProbe"].get("grpc", {}).get("service", "") != "":
            problems.append("livenessProbe must use the empty service name")
        if probes["readinessProbe"] and (probes["readinessProbe"].get("grpc", {}).get("service")
                                         != EXPECTED_READINESS.get(comp)):
            problems.append(f"readinessProbe service is {probes['readinessProbe']['grpc'].get('service')!r}, "
                            f"expected {EXPECTED_READINESS.get(comp)!r}")
        budget = 0
        if probes["startupProbe"]:
            sp = probes["startupProbe"]
            budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) + sp.get("initialDelaySeconds", 0)
            if budget < 60:
                problems.append(f"startupProbe allows only {budget} s for the model load")
        rep.expect(section, f"{sec}: gRPC health probes", problems,
                   f"readiness {EXPECTED_READINESS.get(comp)}, liveness \"\", start-up budget {budget} s")

        # Listen addresses agree with the ports.
        problems = []
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
        seen: set[str] = set()
        for e in c.get("env", []):
            for ref in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value") or ""):
                if ref not in seen:
                    problems.append(f"{e['name']} references $({ref}) before it is defined")
            seen.add(e["name"])
        for ef in c.get("envFrom", []):
            cm = (ef.get("configMapRef") or {}).get("name")
            if cm and cm not in configmaps:
                problems.append(f"envFrom ConfigMap {cm} is not rendered")
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            if m["name"] not in vols:
                problems.append(f"volumeMount {m['name']} has no volume")
            elif m.get("mountPath") == "/models" and not m.get("readOnly"):
                problems.append("/models is not mounted read-only")
        for v in vols.values():
            claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and claim not in pvcs:
                problems.append(f"PVC {claim} is not rendered")
        rep.expect(section, f"{sec}: env references, ConfigMaps, volumes", problems)

        # Graceful drain.
        problems = []
        grace = pod.get("terminationGracePeriodSeconds", 30)
        pre = ((c.get("lifecycle") or {}).get("preStop") or {})
        pre_s = 0
        cmd = (pre.get("exec") or {}).get("command") or []
        if len(cmd) == 2 and cmd[0] == "sleep":
            pre_s = int(cmd[1])
        elif "sleep" in pre:
            pre_s = int(pre["sleep"].get("seconds", 0))
        if not pre:
            problems.append("no preStop hook to leave the endpoints before SIGTERM")
        if grace < pre_s + 20:
            problems.append(f"terminationGracePeriodSeconds {grace} leaves < 20 s to drain after the {pre_s} s preStop")
        rep.expect(section, f"{sec}: SIGTERM drain", problems, f"grace {grace} s, preStop {pre_s} s")

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

    # The verifier reaches the drafter through the headless Service.
    problems = []
    verifier = next((d for d in deployments if pod_labels[d["metadata"]["name"]].get(COMPONENT) == "verifier"), None)
    drafter = next((d for d in deployments if pod_labels[d["metadata"]["name"]].get(COMPONENT) == "drafter"), None)
    if verifier and drafter:
        url = env_map(verifier["spec"]["template"]["spec"]["containers"][0]).get("GLANCE_DRAFTER_URL", "")
        u = urlparse(url)
        host = (u.hostname or "").split(".")[0]
        svc = next((s for s in services if s["metadata"]["name"] == host), None)
        if u.scheme != "http" or not u.port:
            problems.append(f"GLANCE_DRAFTER_URL {url!r} is not http://host:port")
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
    else:
        problems.append("verifier or drafter Deployment missing")
    rep.expect(section, "verifier -> drafter: GLANCE_DRAFTER_URL names the headless drafter Service", problems)

    # HPAs: scale on queue metrics the adapter serves, never on CPU/GPU utilisation.
    if hpas:
        for d in deployments:
            if d["metadata"]["name"] not in hpa_targets:
                rep.add(section, f"HPA for {d['metadata']['name']}", False, "no HorizontalPodAutoscaler targets it")
    for h in hpas:
        problems = []
        ref = h["spec"]["scaleTargetRef"]
        if ref.get("kind") != "Deployment" or ref.get("name") not in pod_labels:
            problems.append(f"scaleTargetRef {ref} is not a rendered Deployment")
        used = []
        for m in h["spec"].get("metrics", []):
            if m["type"] not in ("Pods", "External", "Object"):
                problems.append(f"scales on a {m['type']} metric (utilisation), not queue depth")
                continue
            mname = m[m["type"].lower()]["metric"]["name"]
            used.append(mname)
            if mname not in adapter_metrics:
                problems.append(f"metric {mname} is not served by the prometheus-adapter rules")
        if h["spec"].get("minReplicas", 1) < 2:
            problems.append("minReplicas < 2 (no redundancy)")
        down = (h["spec"].get("behavior") or {}).get("scaleDown") or {}
        if down.get("stabilizationWindowSeconds", 300) < 300:
            problems.append("scale-down stabilisation under 5 min for GPU pods that take minutes to load")
        rep.expect(section, f"HPA {h['metadata']['name']}: scales on queue metrics", problems, ", ".join(used))

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


def kubernetes_section(rep: Report, root: Path, renderer: list[str], versions: list[str],
                       out_dir: Path) -> None:
    k8s = root / "deploy" / "k8s"
    crd_schemas = {("monitoring.coreos.com/v1", "ServiceMonitor"):
                   json.loads((root / "deploy/validate/servicemonitor.schema.json").read_text())}
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
        kz = yaml.safe_load((target / "kustomization.yaml").read_text())
        comps = {(target / c).resolve() for c in kz.get("components", [])}
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
        semantic_check_k8s(rep, section, objs, expect_gpu, adapter_metrics)
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
                if src.startswith("./deploy/") and not (root / src).exists():
                    problems.append(f"{name}: bind source {src} missing")
    rep.expect("compose", "build files and mounted configs exist", problems)

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


def dockerfile_section(rep: Report, root: Path) -> None:
    files = sorted((root / "deploy" / "docker").glob("*.Dockerfile"))
    rep.add("docker", "a Dockerfile per service", {f.name for f in files} >= {"verifier-svc.Dockerfile", "drafter-svc.Dockerfile"},
            ", ".join(f.name for f in files))
    packages = workspace_packages(root)
    setup = (root / "scripts/setup.sh").read_text()
    m = re.search(r"torch==([0-9][0-9.]*)", setup)
    torch_pin = m.group(1) if m else None
    ignore = dockerignore_regexes(root / ".dockerignore")

    # .dockerignore keeps every build input.
    needed = ["Cargo.toml", "Cargo.lock", "build-support/link_libtorch.rs"]
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

    for f in files:
        rel = str(f.relative_to(root))
        text = f.read_text()
        try:
            cmds = dockerfile.parse_string(text)
        except dockerfile.GoParseError as e:
            rep.add("docker", f"parse {rel}", False, str(e))
            continue
        rep.add("docker", f"parse {rel} (BuildKit parser)", True, f"{len(cmds)} instructions")
        problems = []
        if not text.startswith("# syntax=docker/dockerfile:1"):
            problems.append("no '# syntax=docker/dockerfile:1' directive (RUN --mount needs BuildKit's frontend)")
        args: dict[str, str] = {}
        stages: list[str] = []
        final_user = None
        final_entry = None
        exposes: set[int] = set()
        for c in cmds:
            if c.cmd == "ARG" and len(stages) == 0:
                for v in c.value:
                    k, _, d = v.partition("=")
                    args[k] = d
            elif c.cmd == "FROM":
                image = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda mm: args.get(mm.group(1), "?"), c.value[0])
                if image not in stages:
                    tag = image.rsplit("/", 1)[-1].partition(":")[2]
                    if "@sha256:" not in image and (not tag or tag == "latest" or "?" in image):
                        problems.append(f"base image {image!r} is not pinned")
                stages.append(c.value[2] if len(c.value) >= 3 and c.value[1].upper() == "AS" else str(len(stages)))
                final_user, final_entry, exposes = None, None, set()
            elif c.cmd in ("COPY", "ADD"):
                for fl in c.flags:
                    if fl.startswith("--from=") and fl[7:] not in stages[:-1]:
                        problems.append(f"line {c.start_line}: {fl} names no earlier stage")
            elif c.cmd == "USER":
                final_user = c.value[0]
            elif c.cmd == "ENTRYPOINT":
                final_entry = c
            elif c.cmd == "EXPOSE":
                exposes |= {int(v.split("/")[0]) for v in c.value}
            elif c.cmd == "RUN":
                body = " ".join(c.value)
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
        if args.get("TORCH_VERSION") != torch_pin and torch_pin and f"torch=={torch_pin}" not in text:
            problems.append(f"torch pin differs from scripts/setup.sh (torch=={torch_pin})")
        if final_user is None or final_user.split(":")[0] in ("0", "root"):
            problems.append(f"the runtime stage runs as {final_user or 'root (no USER)'}")
        if final_entry is None or not final_entry.json:
            problems.append("no exec-form ENTRYPOINT in the runtime stage (SIGTERM must reach the server)")
        svc = "verifier" if f.name.startswith("verifier") else "drafter"
        want_ports = {"verifier": {50051, 9090}, "drafter": {50061, 9091}}[svc]
        if not want_ports <= exposes:
            problems.append(f"EXPOSE {sorted(exposes)} lacks {sorted(want_ports - exposes)}")
        rep.expect("docker", f"{rel}: pinned bases, non-root runtime, real cargo targets, torch=={torch_pin}",
                   problems, f"stages {stages}, USER {final_user}")


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
    sm_schema = json.loads((root / "deploy/validate/servicemonitor.schema.json").read_text())
    sm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"},
          "spec": {"selector": {}, "endpoints": [{"port": "metrics", "intervall": "15s"}]}}
    rep.add("canary", "ServiceMonitor schema rejects an unknown endpoint field",
            not jsonschema.Draft202012Validator(sm_schema).is_valid(sm))


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
