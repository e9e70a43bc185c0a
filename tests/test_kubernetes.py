"""deploy/kubernetes/: valid against the Kubernetes API schemas (offline) and in agreement with the code."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from engine.__main__ import main as engine_main
from engine.config import EngineConfig
from engine.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME
from engine.http.server import ServerOptions, served_names
from gateway.cli import main as gateway_cli
from gateway.config.policy import EngineBackend, Policy, load_policy
from gateway.config.settings import GatewaySettings
from gateway.telemetry import metrics as gateway_metrics

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
# The oldest release the manifests support (lifecycle.preStop.sleep is on by default from 1.30)
# and the newest the validator knows.
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
WORKLOADS = ("Deployment", "StatefulSet", "Job")


# ----------------------------------------------------------------------------- reading the files
def kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return data


def objects() -> list[dict[str, Any]]:
    """Every object of every file the kustomization lists."""
    found = []
    for name in kustomization()["resources"]:
        found += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str | None = None, init: bool = False) -> dict[str, Any]:
    """The workload's (only, or named) container."""
    found = pod_spec(workload)["initContainers" if init else "containers"]
    if name is None:
        assert len(found) == 1
        return dict(found[0])
    return dict(next(c for c in found if c["name"] == name))


def option(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def secret_template() -> dict[str, str]:
    """KEY=value lines of secrets.env.example: the Secret's keys (with placeholder values)."""
    values = {}
    for line in (K8S / "secrets.env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value or f"{key.lower()}-value"
    return values


def environment(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment with the Secret's keys filled from the template."""
    secrets = secret_template()
    env = {}
    for item in c.get("env") or []:
        ref = (item.get("valueFrom") or {}).get("secretKeyRef")
        env[item["name"]] = secrets[ref["key"]] if ref else str(item["value"])
    return env


def set_environment(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith(("GATEWAY_", "SWITCHBOARD_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def engine_cli(monkeypatch: pytest.MonkeyPatch) -> tuple[EngineConfig, ServerOptions]:
    """What the engine's own CLI builds from the StatefulSet's command and environment."""
    engine = container(one("StatefulSet", "engine"))
    set_environment(environment(engine), monkeypatch)
    captured: list[tuple[EngineConfig, ServerOptions]] = []

    def run_server(config: EngineConfig, options: ServerOptions) -> int:
        captured.append((config, options))
        return 0

    monkeypatch.setattr("engine.http.server.run_server", run_server)
    assert engine["command"][:4] == ["python", "-m", "engine", "serve"]
    assert engine_main(engine["command"][3:]) == 0
    return captured[0]


def policy() -> Policy:
    """The policy the gateways serve: the ConfigMap's file, through their mount, loaded by the gateway."""
    gateway = container(one("Deployment", "gateway"))
    path = PurePosixPath(option(gateway["command"], "--policy") or "")
    mount = next(m for m in gateway["volumeMounts"] if path.is_relative_to(m["mountPath"]))
    volume = next(v for v in pod_spec(one("Deployment", "gateway"))["volumes"] if v["name"] == mount["name"])
    generator = next(
        g for g in kustomization()["configMapGenerator"] if g["name"] == volume["configMap"]["name"]
    )
    assert path.relative_to(mount["mountPath"]).as_posix() in generator["files"]
    return load_policy(K8S / path.name)


# ------------------------------------------------------------------------------------- the tests
def test_the_kustomization_lists_every_manifest_and_its_generators_files_exist() -> None:
    listed = set(kustomization()["resources"])
    generated = {"policy.yaml"}  # a ConfigMap's content, not an object
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} - generated
    assert listed == on_disk, f"not listed: {on_disk - listed}; missing: {listed - on_disk}"
    for generator in kustomization()["configMapGenerator"]:
        assert all((K8S / f).is_file() for f in generator["files"])
    for generator in kustomization()["secretGenerator"]:
        for env_file in generator["envs"]:  # the operator's copy of the committed template
            assert (K8S / f"{env_file}.example").is_file()
            assert f"deploy/kubernetes/{env_file}" in (REPO / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    kinds = set()
    for obj in objects():
        kubernetes_validate.validate(obj, version, strict=True)  # strict: an unknown field is an error
        kinds.add(obj["kind"])
    wanted = {"Namespace", "Service", "StatefulSet", "Deployment", "Job", "HorizontalPodAutoscaler"}
    assert wanted | {"PodDisruptionBudget"} <= kinds


def test_the_schema_check_refuses_a_misspelt_field_and_a_wrong_type() -> None:
    engine = one("StatefulSet", "engine")
    typo = copy.deepcopy(engine)
    typo["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = typo["spec"]["template"]["spec"][
        "containers"
    ][0].pop("livenessProbe")
    wrong = copy.deepcopy(engine)
    wrong["spec"]["replicas"] = "2"
    for broken in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


def test_services_select_their_pods_and_target_ports_the_containers_open() -> None:
    workloads = [o for o in objects() if o["kind"] in WORKLOADS]
    for service in [
        o for o in objects() if o["kind"] == "Service" and o["spec"].get("type") != "ExternalName"
    ]:
        selector = service["spec"]["selector"]
        pods = [
            w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(pods) == 1, f"Service {service['metadata']['name']} selects {len(pods)} workloads"
        ports = {p["name"]: p["containerPort"] for c in pod_spec(pods[0])["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']}: no port {port['targetPort']}"
    engine = one("StatefulSet", "engine")
    headless = one("Service", engine["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None", "replica DNS names need a headless Service"


def test_engine_command_is_accepted_by_the_engine_cli_on_its_port_with_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config, options = engine_cli(monkeypatch)
    engine = container(one("StatefulSet", "engine"))
    assert config.device.startswith("cuda") and options.host == "0.0.0.0"
    assert [p["containerPort"] for p in engine["ports"]] == [options.port]
    for kind in ("requests", "limits"):
        assert engine["resources"][kind]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("name", ["engine", "gateway"])
def test_probes_and_scrape_annotations_name_the_health_and_metrics_routes_on_the_serving_port(
    name: str,
) -> None:
    workload = one("StatefulSet" if name == "engine" else "Deployment", name)
    c = container(workload)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {"readinessProbe", "livenessProbe"} <= set(c)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in c:
            assert c[probe]["httpGet"]["path"] == "/health", f"{name} {probe}"
            assert c[probe]["httpGet"]["port"] in ports
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) in ports.values()
    assert int(option(c["command"], "--port") or 0) in ports.values()


def test_engine_drains_within_the_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    _, options = engine_cli(monkeypatch)
    engine = one("StatefulSet", "engine")
    pre_stop = container(engine)["lifecycle"]["preStop"]["sleep"]["seconds"]
    # preStop, then SIGTERM: requests in flight get shutdown_timeout, uvicorn its graceful timeout
    needed = pre_stop + options.shutdown_timeout + options.limits.timeout_graceful_shutdown
    assert pod_spec(engine)["terminationGracePeriodSeconds"] > needed


def test_model_cache_is_the_engine_volume_and_the_gateway_tokenizer_is_the_default_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config, _ = engine_cli(monkeypatch)
    engine = one("StatefulSet", "engine")
    cache = environment(container(engine))["SWITCHBOARD_MODEL_CACHE"]
    claims = {t["metadata"]["name"] for t in engine["spec"]["volumeClaimTemplates"]}
    assert any(m["mountPath"] == cache and m["name"] in claims for m in container(engine)["volumeMounts"])
    gateway = one("Deployment", "gateway")
    prepare = container(gateway, "tokenizer", init=True)
    assert prepare["command"] == ["python", "-m", "engine", "prepare-model"]
    gateway_cache = environment(prepare)["SWITCHBOARD_MODEL_CACHE"]
    volume = next(m["name"] for m in prepare["volumeMounts"] if m["mountPath"] == gateway_cache)
    assert any(
        m["name"] == volume and m["mountPath"] == gateway_cache for m in container(gateway)["volumeMounts"]
    )
    for spec in policy().backends.values():
        if (
            isinstance(spec, EngineBackend)
            and spec.tokenizer is not None
            and config.model == DEFAULT_MODEL_ALIAS
        ):
            assert PurePosixPath(spec.tokenizer) == PurePosixPath(gateway_cache) / DEFAULT_MODEL_NAME


def test_every_secret_reference_is_a_key_of_the_secret_and_required_ones_are_not_optional() -> None:
    secret = kustomization()["secretGenerator"][0]["name"]
    keys = set(secret_template())
    used = set()
    for workload in [o for o in objects() if o["kind"] in WORKLOADS]:
        spec = pod_spec(workload)
        for c in spec.get("initContainers", []) + spec["containers"]:
            for item in c.get("env") or []:
                ref = (item.get("valueFrom") or {}).get("secretKeyRef")
                if ref is None:
                    assert not item["name"].endswith(("_KEY", "_SECRET", "_TOKEN")), (
                        f"{item['name']} in the clear"
                    )
                    continue
                assert ref["name"] == secret and ref["key"] in keys, f"{c['name']}: {ref}"
                used.add(ref["key"])
                required = ref["key"].startswith("GATEWAY_")
                assert ref.get("optional", False) is not required, (
                    f"{ref['key']}: optional must be {not required}"
                )
    assert used == keys, f"keys nobody reads: {keys - used}"


def test_gateway_environment_names_settings_that_exist_and_its_settings_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = environment(container(one("Deployment", "gateway")))
    fields = set(GatewaySettings.model_fields)
    for name in env:
        if name.startswith("GATEWAY_"):
            assert name.removeprefix("GATEWAY_").lower() in fields, f"{name} is not a gateway setting"
    set_environment(env, monkeypatch)
    settings = GatewaySettings()
    settings.require_secrets()
    assert settings.metrics_token is not None
    assert settings.database_url is not None and settings.database_url.startswith("postgresql+asyncpg://")
    assert settings.redis_url is not None
    for url, service in ((settings.database_url, "postgres"), (settings.redis_url, "redis")):
        external = one("Service", service)
        assert urlsplit(url).hostname == service and external["spec"]["type"] == "ExternalName"
        assert urlsplit(url).port in {p["port"] for p in external["spec"]["ports"]}
    for spec in policy().backends.values():
        assert spec.api_key_env is None or spec.api_key_env in env, f"the gateway lacks {spec.api_key_env}"


def test_policy_lists_every_engine_replica_the_autoscaler_may_run_on_the_engine_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config, options = engine_cli(monkeypatch)
    engine, hpa = one("StatefulSet", "engine"), one("HorizontalPodAutoscaler", "engine")
    loaded = policy()
    pools = {name: spec for name, spec in loaded.backends.items() if isinstance(spec, EngineBackend)}
    assert len(pools) == 1
    ((backend, spec),) = pools.items()
    names = [
        f"{engine['metadata']['name']}-{i}.{engine['spec']['serviceName']}"
        for i in range(hpa["spec"]["maxReplicas"])
    ]
    assert [urlsplit(u).hostname for u in spec.urls] == names
    assert {urlsplit(u).port for u in spec.urls} == {options.port}
    assert spec.balance == "prefix_affinity"
    assert (spec.autoscale.min_replicas, spec.autoscale.max_replicas) == (
        hpa["spec"]["minReplicas"],
        hpa["spec"]["maxReplicas"],
    )
    assert hpa["spec"]["minReplicas"] <= engine["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    for model, route in loaded.models.items():
        if route.backend == backend:
            assert loaded.upstream_model(model) in served_names(config, options)
    # the engine HPA reads the gauge the gateway exports, for this pool
    metric = hpa["spec"]["metrics"][0]["external"]["metric"]
    assert metric["selector"]["matchLabels"] == {"backend": backend}
    assert f'"{metric["name"]}"' in Path(gateway_metrics.__file__).read_text()


def test_autoscalers_and_disruption_budgets_point_at_workloads_that_exist() -> None:
    for hpa in [o for o in objects() if o["kind"] == "HorizontalPodAutoscaler"]:
        target = hpa["spec"]["scaleTargetRef"]
        one(target["kind"], target["name"])
    for pdb in [o for o in objects() if o["kind"] == "PodDisruptionBudget"]:
        selector = pdb["spec"]["selector"]["matchLabels"]
        matched = [o for o in objects() if o["kind"] in ("Deployment", "StatefulSet")
                   and selector.items() <= o["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert len(matched) == 1, f"PDB {pdb['metadata']['name']} selects {len(matched)} workloads"


def test_migration_job_upgrades_and_gateways_wait_for_it_on_the_same_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = container(one("Job", "gateway-migrate"))
    waiter = container(one("Deployment", "gateway"), "wait-for-schema", init=True)
    gateway = container(one("Deployment", "gateway"))
    url = environment(gateway)["GATEWAY_DATABASE_URL"]
    assert environment(job) == {"GATEWAY_DATABASE_URL": url} == environment(waiter)  # no other secret
    calls: list[tuple[str, str]] = []

    async def current_revision(u: str) -> str:
        return "head"

    async def wait_for_schema(u: str, timeout: float) -> str:
        calls.append(("wait", u))
        return "head"

    monkeypatch.setattr(gateway_cli, "upgrade", lambda u, revision: calls.append(("upgrade", u)))
    monkeypatch.setattr(gateway_cli, "current_revision", current_revision)
    monkeypatch.setattr(gateway_cli, "wait_for_schema", wait_for_schema)
    for c in (job, waiter):
        set_environment(environment(c), monkeypatch)
        assert c["command"][:3] == ["python", "-m", "gateway"]
        assert gateway_cli.main(c["command"][3:]) == 0
    assert calls == [("upgrade", url), ("wait", url)]
    assert pod_spec(one("Job", "gateway-migrate"))["restartPolicy"] in ("OnFailure", "Never")


def test_every_container_runs_the_kustomized_image_as_the_images_user_without_privileges() -> None:
    images = {i["name"] for i in kustomization()["images"]}
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    uid = re.search(r"useradd .*--uid (\d+)", dockerfile)
    assert uid is not None
    for workload in [o for o in objects() if o["kind"] in WORKLOADS]:
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == int(
            uid.group(1)
        )
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["image"] in images, f"{c['name']}: {c['image']} is not the kustomized image"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_every_volume_mount_names_a_volume_of_its_pod() -> None:
    for workload in [o for o in objects() if o["kind"] in WORKLOADS]:
        spec = pod_spec(workload)
        volumes = {v["name"] for v in spec.get("volumes") or []}
        volumes |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates") or []}
        for c in spec.get("initContainers", []) + spec["containers"]:
            for mount in c.get("volumeMounts") or []:
                assert mount["name"] in volumes, (
                    f"{workload['metadata']['name']}/{c['name']}: {mount['name']}"
                )
