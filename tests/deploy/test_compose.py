"""compose.yaml and the Dockerfile agree with the code, checked without Docker.

Every Python service's command goes through the real argument parser of the module it
runs; paths under the image's /app are mapped back to the repo (the Dockerfile copies the
repo there); URL hosts and depends_on must name services.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from broker_config.auth import (
    AUTH_CONF,
    DISPATCHER_USER,
    FRONT_USER,
    SEED_SUFFIX,
    WORKER_USER,
    registered_tenants,
)
from broker_config.config import load_config
from broker_config.server import MIN_NATS_SERVER, parse_version
from dispatcher import __main__ as dispatcher_main
from producers import cli
from producers.openai_front import __main__ as front_main
from workers import __main__ as workers_main

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
AUTH_FILE = REPO / "compose.auth.yaml"  # merged over COMPOSE_FILE: broker users
CLUSTER_FILE = REPO / "compose.cluster.yaml"  # merged over COMPOSE_FILE: 3 NATS nodes
NODES = ["nats", "nats-2", "nats-3"]
CLUSTER_CONF = REPO / "deploy" / "nats" / "cluster.conf"
APP_ROOT = PurePosixPath("/app")  # where the Dockerfile copies the repo

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "dispatcher": dispatcher_main.build_parser,
    "workers": workers_main.build_parser,
    "producers.openai_front": front_main.build_parser,
}
# Python service -> the module its command runs.
PYTHON_SERVICES = {
    "dispatcher": "dispatcher",
    "dispatcher-standby": "dispatcher",
    "worker-1": "workers",
    "worker-2": "workers",
    "front": "producers.openai_front",
}
DISPATCHERS = [name for name, module in PYTHON_SERVICES.items() if module == "dispatcher"]
WORKERS = [name for name, module in PYTHON_SERVICES.items() if module == "workers"]


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(compose, dict) and isinstance(compose.get("services"), dict)
    return compose["services"]


@pytest.fixture(scope="module")
def volumes() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text()).get("volumes") or {}


def command_argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    assert isinstance(command, str), f"expected a string command, got {command!r}"
    return shlex.split(command)


def parse_python_command(service: dict[str, Any], module: str) -> argparse.Namespace:
    argv = command_argv(service)
    assert argv[:3] == ["python", "-m", module], argv
    try:
        return PARSERS[module]().parse_args(argv[3:])
    except SystemExit as exc:  # argparse reports bad arguments by exiting
        pytest.fail(f"`python -m {module}` rejects {argv[3:]} (exit {exc.code})")


def repo_path(image_path: Path | str) -> Path:
    path = PurePosixPath(image_path)
    assert path.is_relative_to(APP_ROOT), f"{path} is not inside the image's {APP_ROOT}"
    return REPO / path.relative_to(APP_ROOT)


def container_ports(service: dict[str, Any]) -> set[int]:
    """Container side of `ports` entries written as "HOST:CONTAINER"."""
    return {int(str(entry).rsplit(":", 1)[-1]) for entry in service.get("ports", [])}


def test_expected_services_exist(services: dict[str, dict[str, Any]]) -> None:
    assert {"nats", "redis", "prometheus", "grafana", *PYTHON_SERVICES} <= set(services)


@pytest.mark.parametrize("name", PYTHON_SERVICES)
def test_python_services_build_the_repo_dockerfile(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    build = services[name]["build"]
    assert (COMPOSE_FILE.parent / build["context"]).resolve() == REPO
    assert (REPO / build.get("dockerfile", "Dockerfile")).is_file()


@pytest.mark.parametrize("name", PYTHON_SERVICES)
def test_python_commands_parse_and_name_existing_configs(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    args = parse_python_command(services[name], PYTHON_SERVICES[name])
    assert args.config is not None, "the image has no repo-relative default; name the config"
    load_config(repo_path(args.config))


def test_the_front_listens_on_all_addresses_on_its_published_port(
    services: dict[str, dict[str, Any]],
) -> None:
    front = services["front"]
    args = parse_python_command(front, "producers.openai_front")
    assert args.host == "0.0.0.0" and args.port in container_ports(front)


def test_dispatcher_metrics_are_reachable_from_outside(services: dict[str, dict[str, Any]]) -> None:
    dispatcher = services["dispatcher"]
    args = parse_python_command(dispatcher, "dispatcher")
    assert args.metrics_port in container_ports(dispatcher)
    # 127.0.0.1 inside a container is unreachable through the published port.
    assert args.metrics_host == "0.0.0.0"


def test_workers_serve_configured_endpoints_with_distinct_ids(
    services: dict[str, dict[str, Any]],
) -> None:
    ids = []
    for name in WORKERS:
        args = parse_python_command(services[name], "workers")
        args.config = repo_path(args.config)
        # Checks the endpoint exists in the config and builds the engine, like startup does.
        options = workers_main.parse_options(args)
        ids.append((options.endpoint, options.worker_id))
    assert len(set(ids)) == len(ids), ids


def test_url_hosts_are_services(services: dict[str, dict[str, Any]]) -> None:
    hosts = set()
    for name in PYTHON_SERVICES:
        for arg in command_argv(services[name]):
            if "://" in arg:
                hosts.add(urlsplit(arg).hostname)
    assert hosts == {"nats", "redis"}
    assert hosts <= set(services)


def depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Compose allows a list of names or a mapping of name -> options."""
    deps = service.get("depends_on") or {}
    return {name: {} for name in deps} if isinstance(deps, list) else deps


def test_depends_on_references_exist(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dependency, options in depends_on(service).items():
            assert dependency in services and dependency != name, (name, dependency)
            if options.get("condition") == "service_healthy":
                assert "healthcheck" in services[dependency], (name, dependency)
    for name in DISPATCHERS:
        assert set(depends_on(services[name])) == {"nats", "redis"}
    for name in WORKERS:
        assert "dispatcher" in depends_on(services[name])


def test_redis_persists_append_only_on_a_volume(
    services: dict[str, dict[str, Any]], volumes: dict[str, Any]
) -> None:
    redis = services["redis"]
    argv = command_argv(redis)
    assert argv[argv.index("--appendonly") + 1] == "yes"
    data_dir = argv[argv.index("--dir") + 1]
    mounts = dict(reversed(str(v).split(":")[:2]) for v in redis["volumes"])
    assert mounts.get(data_dir) in volumes, f"Redis data {data_dir} is not on a volume"


def test_nats_runs_jetstream_on_a_volume(
    services: dict[str, dict[str, Any]], volumes: dict[str, Any]
) -> None:
    nats = services["nats"]
    argv = command_argv(nats)
    assert "-js" in argv
    store_dir = argv[argv.index("-sd") + 1]
    mounts = dict(reversed(str(v).split(":")[:2]) for v in nats["volumes"])
    assert store_dir in mounts, f"JetStream store {store_dir} is not on a volume"
    assert mounts[store_dir] in volumes
    assert 4222 in container_ports(nats)


def image_version(image: str) -> tuple[int, int, int]:
    """The version an image's tag pins ("nats:2.11-alpine" -> (2, 11, 0)); a tag that
    pins no version (none, "latest", "alpine") is an error: compose must pin one."""
    name, _, tag = image.partition(":")
    assert name == "nats" and tag, f"expected the official nats image with a tag, got {image!r}"
    try:
        return parse_version(tag)
    except ValueError:
        pytest.fail(f"{image}: the tag pins no version", pytrace=False)


def test_nats_image_is_at_least_the_minimum_the_code_declares(
    services: dict[str, dict[str, Any]],
) -> None:
    assert image_version(services["nats"]["image"]) >= MIN_NATS_SERVER
    # The check has teeth: 2.10 (no batch direct gets) is refused, the minimum's line is not.
    assert image_version("nats:2.10-alpine") < MIN_NATS_SERVER
    assert image_version("nats:2.10.29") < MIN_NATS_SERVER
    assert image_version("nats:2.11-alpine") >= MIN_NATS_SERVER
    with pytest.raises(pytest.fail.Exception, match="pins no version"):
        image_version("nats:latest")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def test_dockerfile_installs_the_project_at_app_root() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    workdir = PurePosixPath("/")
    copied = installed = False
    user = "root"
    for keyword, rest in instructions:
        if keyword == "WORKDIR":
            workdir = workdir / rest
        elif keyword == "COPY":
            *sources, dest = shlex.split(rest)
            copied = copied or (sources == ["."] and workdir / dest == APP_ROOT)
        elif keyword == "RUN" and "pip install" in rest:
            argv = shlex.split(rest)
            installed = copied and workdir == APP_ROOT and "." in argv[argv.index("install") :]
        elif keyword == "USER":
            user = rest
    assert copied, f"no `COPY . {APP_ROOT}` (the compose paths assume the repo is there)"
    assert installed, f"no `pip install .` in {APP_ROOT} after the COPY"
    assert user not in ("root", "0"), "the services should not run as root"


# -- Prometheus and Grafana ----------------------------------------------------------------


def mounted(service: dict[str, Any], inside: str) -> Path:
    """The repo path a service mounts at `inside`; it must exist."""
    for volume in service.get("volumes", []):
        source, target, *_ = str(volume).split(":")
        if target == inside:
            path = (COMPOSE_FILE.parent / source).resolve()
            assert path.exists(), f"{source} is mounted but missing"
            return path
    raise AssertionError(f"nothing is mounted at {inside}: {service.get('volumes')}")


def test_prometheus_scrapes_the_dispatchers_metrics_port(
    services: dict[str, dict[str, Any]],
) -> None:
    config = yaml.safe_load(
        mounted(services["prometheus"], "/etc/prometheus/prometheus.yml").read_text()
    )
    (job,) = config["scrape_configs"]
    targets = [
        f"{name}:{parse_python_command(services[name], 'dispatcher').metrics_port}"
        for name in DISPATCHERS
    ]
    assert job["static_configs"][0]["targets"] == targets  # the standby, once it serves


def test_grafana_is_provisioned_with_the_prometheus_and_the_dashboard(
    services: dict[str, dict[str, Any]],
) -> None:
    grafana = services["grafana"]
    provisioning = mounted(grafana, "/etc/grafana/provisioning")
    dashboards = mounted(grafana, "/var/lib/grafana/dashboards")
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus" and url.port in container_ports(services["prometheus"])
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "fairq.yaml").read_text())[
        "providers"
    ]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((dashboards / "fairq.json").read_text())
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home).name == "fairq.json"
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert panels and all(panel["datasource"]["uid"] == source["uid"] for panel in panels)
    assert all(
        target["datasource"]["uid"] == source["uid"]
        for panel in panels
        for target in panel["targets"]
    )


# -- compose.auth.yaml: broker users ---------------------------------------------------------


def merged_with_auth() -> dict[str, Any]:
    return merged_with(AUTH_FILE)


def merged_with(override: Path) -> dict[str, Any]:
    """compose.yaml with `override` over it, as `docker compose -f A -f B` merges them:
    `command` replaced, `volumes` merged by mount point, `depends_on` joined."""
    base = yaml.safe_load(COMPOSE_FILE.read_text())
    over = yaml.safe_load(override.read_text())
    services = {name: dict(spec) for name, spec in base["services"].items()}
    for name, spec in over["services"].items():
        merged = services.setdefault(name, {})
        for key, value in spec.items():
            if key == "volumes":
                mounts = {mount(v)["target"]: v for v in merged.get("volumes", [])}
                mounts |= {mount(v)["target"]: v for v in value}
                merged["volumes"] = list(mounts.values())
            elif key == "depends_on":
                merged["depends_on"] = depends_on(merged) | depends_on(spec)
            else:
                merged[key] = value
    return {
        "services": services,
        "volumes": {**base.get("volumes", {}), **(over.get("volumes") or {})},
    }


def mount(volume: str | dict[str, Any]) -> dict[str, Any]:
    """A `volumes` entry in the long syntax's terms (source, target, read_only, subpath)."""
    if isinstance(volume, dict):
        return {
            "source": volume["source"],
            "target": volume["target"],
            "read_only": volume.get("read_only", False),
            "subpath": volume.get("volume", {}).get("subpath"),
        }
    source, target, *mode = volume.split(":")
    return {"source": source, "target": target, "read_only": mode == ["ro"], "subpath": None}


def auth_mounts(service: dict[str, Any], volumes: dict[str, Any]) -> list[dict[str, Any]]:
    """How `service` mounts the auth volume."""
    assert "auth" in volumes
    return [m for m in map(mount, service.get("volumes", [])) if m["source"] == "auth"]


def test_auth_variant_renders_users_before_nats_starts_with_them() -> None:
    compose = merged_with_auth()
    services, volumes = compose["services"], compose["volumes"]
    init = services["fairq-auth"]
    argv = command_argv(init)
    assert argv[:2] == ["fairq", "auth"]
    args = cli.build_parser("auth").parse_args(argv[1:])
    (out,) = auth_mounts(init, volumes)
    assert out == {"source": "auth", "target": str(args.out), "read_only": False, "subpath": None}
    assert registered_tenants(load_config(repo_path(args.config)))
    nats = services["nats"]
    assert depends_on(nats)["fairq-auth"]["condition"] == "service_completed_successfully"
    nats_argv = command_argv(nats)
    # nats-server reads auth.conf alone (public keys), none of the seeds next to it.
    (conf,) = auth_mounts(nats, volumes)
    assert conf["subpath"] == AUTH_CONF and conf["read_only"]
    assert nats_argv[nats_argv.index("-c") + 1] == conf["target"]
    assert "-js" in nats_argv and "nats-data:/data" in nats["volumes"]


@pytest.mark.parametrize(
    "name, user",
    [
        ("dispatcher", DISPATCHER_USER),
        ("dispatcher-standby", DISPATCHER_USER),
        ("worker-1", WORKER_USER),
        ("worker-2", WORKER_USER),
        ("front", FRONT_USER),
    ],
)
def test_auth_variant_runs_each_service_as_its_own_user(name: str, user: str) -> None:
    compose = merged_with_auth()
    service = compose["services"][name]
    args = parse_python_command(service, PYTHON_SERVICES[name])
    load_config(repo_path(args.config))
    # Its own seed file and nothing else of the auth volume, read-only.
    (seed,) = auth_mounts(service, compose["volumes"])
    assert seed == {
        "source": "auth",
        "target": str(args.nkey),
        "read_only": True,
        "subpath": f"{user}{SEED_SUFFIX}",
    }
    if name in DISPATCHERS:
        assert args.tenant_inboxes is True
    # The merge keeps what the plain stack checks (dependencies, hosts).
    assert depends_on(service) == depends_on(
        yaml.safe_load(COMPOSE_FILE.read_text())["services"][name]
    )


def test_only_the_auth_init_service_mounts_the_whole_auth_volume() -> None:
    compose = merged_with_auth()
    whole = [
        name
        for name, service in compose["services"].items()
        for m in auth_mounts(service, compose["volumes"])
        if m["subpath"] is None
    ]
    assert whole == ["fairq-auth"]


def test_secrets_stay_out_of_the_image() -> None:
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert {"**/*.nk", "**/*.creds", "auth/"} <= set(ignored)


def test_every_fairq_service_reads_the_hosts_config_so_tenants_reload(
    services: dict[str, dict[str, Any]],
) -> None:
    """Tenants change by editing configs/ on the host and reloading the dispatcher; a
    config baked into the image could not change without a rebuild."""
    with_auth = merged_with_auth()["services"]
    for name in PYTHON_SERVICES:
        assert mounted(services[name], "/app/configs") == COMPOSE_FILE.parent / "configs"
        assert mounted(with_auth[name], "/app/configs") == COMPOSE_FILE.parent / "configs"
    assert mounted(with_auth["fairq-auth"], "/app/configs") == COMPOSE_FILE.parent / "configs"
    for name in ("dispatcher", "fairq-auth"):
        assert mount(
            next(v for v in with_auth[name]["volumes"] if mount(v)["target"] == "/app/configs")
        )["read_only"]


# -- compose.cluster.yaml: a 3-node NATS cluster ---------------------------------------------


def test_cluster_variant_runs_three_nodes_routed_to_each_other(
    nats_binary: Path, tmp_path: Path
) -> None:
    compose = merged_with(CLUSTER_FILE)
    services, volumes = compose["services"], compose["volumes"]
    names, stores = [], []
    for node in NODES:
        service = services[node]
        argv = command_argv(service)
        mounts = {m["target"]: m for m in map(mount, service["volumes"])}
        conf = mounts[argv[argv.index("-c") + 1]]
        assert conf["read_only"] and (REPO / conf["source"]).resolve() == CLUSTER_CONF
        names.append(argv[argv.index("--server_name") + 1])
        stores.append(mounts["/data"]["source"])
        assert "healthcheck" in service
    assert len(set(names)) == len(set(stores)) == len(NODES)
    assert set(stores) <= set(volumes)
    text = CLUSTER_CONF.read_text()
    assert "store_dir: /data" in text and "sync_interval: always" in text
    assert text.count("nats-route://") == len(NODES)
    for node in NODES:
        assert f"nats-route://{node}:6222" in text
    # The real nats-server takes the file (hosts are resolved only when it runs).
    checked = subprocess.run(
        [str(nats_binary), "-c", str(CLUSTER_CONF), "--server_name", "n1", "-t"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("name", list(PYTHON_SERVICES))
def test_cluster_variant_services_list_every_node(name: str) -> None:
    compose = merged_with(CLUSTER_FILE)
    service = compose["services"][name]
    args = parse_python_command(service, PYTHON_SERVICES[name])
    urls = [urlsplit(url) for url in args.nats.split(",")]
    assert [(url.hostname, url.port) for url in urls] == [(node, 4222) for node in NODES]
    if name in DISPATCHERS:
        assert args.replicas == len(NODES)
        assert set(NODES) | {"redis"} <= set(depends_on(service))
