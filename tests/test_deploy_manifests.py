"""deploy/kubernetes: valid for Kubernetes, consistent with each other and with the server.

The manifests are checked against the Kubernetes API schemas that the
``kubernetes-validate`` package ships (no network needed), in strict mode
(unknown fields are errors). The preStop hook is run against a live server.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import RealtimeClient, http_get, live_server, run

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes"
PRESTOP = KUBE / "prestop-drain.sh"
DOCKERFILE = REPO / "Dockerfile"


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every document of every ``deploy/kubernetes/*.yaml``, with its file name."""
    docs = []
    for path in sorted(KUBE.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in manifests() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} manifests"
    return found[0]


def container() -> dict[str, Any]:
    (c,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"]}


def validator() -> Any:
    try:
        import kubernetes_validate
    except ImportError:  # a missing test dependency is a failure, not a skip
        pytest.fail("kubernetes-validate is not installed (pip install kubernetes-validate): CI needs it")
    return kubernetes_validate


# --- validation -------------------------------------------------------------------


def test_every_manifest_is_valid_for_the_oldest_and_newest_kubernetes_the_validator_knows() -> None:
    kv = validator()
    versions = kv.utils.all_versions()
    docs = manifests()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for name, doc in docs:
        for version in (versions[0], versions[-1]):
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{name}: {doc['kind']} is not valid for Kubernetes {version}: {exc.message}")


def test_the_validator_rejects_a_misspelt_field() -> None:
    # Proof that the check above can fail.
    kv = validator()
    broken = one("Deployment")
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.utils.latest_version(), strict=True)


# --- the manifests agree with each other and with the server ------------------------


def test_readiness_probes_readyz_and_liveness_probes_healthz_on_the_port_the_server_listens_on() -> None:
    c = container()
    port = int(env()["S2S_RT_PORT"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert ports["http"] == port
    assert env()["S2S_RT_HOST"] == "0.0.0.0"


def test_termination_grace_covers_the_drain_wait_and_the_servers_grace_period() -> None:
    grace = one("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain_wait, server_grace = float(env()["S2S_DRAIN_WAIT_S"]), float(env()["S2S_RT_GRACE_PERIOD_S"])
    assert drain_wait + server_grace + 5 <= grace <= drain_wait + server_grace + 30


def test_prestop_runs_the_drain_script_that_the_dockerfile_installs() -> None:
    (command,) = container()["lifecycle"]["preStop"]["exec"]["command"]
    copy = re.search(r"^COPY .*deploy/kubernetes/prestop-drain\.sh (\S+)$", DOCKERFILE.read_text(), re.M)
    assert copy and copy.group(1) == command


def test_hpa_scales_the_deployment_on_the_metric_the_server_exports_via_the_adapter_rule() -> None:
    hpa = one("HorizontalPodAutoscaler")
    deployment = one("Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "s2s-rt"}
    assert deployment["metadata"]["name"] == "s2s-rt"
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    # Below the pool size, or the pods are full before the autoscaler reacts.
    assert 0 < float(metric["pods"]["target"]["averageValue"]) < int(env()["S2S_RT_POOL_SIZE"])

    rules = yaml.safe_load(one("ConfigMap", "adapter-config")["data"]["config.yaml"])["rules"]
    assert [r["name"]["as"] for r in rules] == [name]
    assert name in rules[0]["seriesQuery"]

    async def exported() -> str:
        async with live_server() as server:
            return (await http_get(server, "/metrics"))[1]

    assert re.search(rf"^{name} \d+$", run(exported(), timeout=20), re.M)


def test_services_select_the_deployments_pods_on_its_named_port() -> None:
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    services = [d for _, d in manifests() if d["kind"] == "Service"]
    assert services
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_gpu_is_a_build_argument_and_a_commented_resource_request() -> None:
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.1\d", dockerfile, re.M)
    assert "--build-arg BASE_IMAGE=nvidia/cuda:" in dockerfile
    assert re.search(r"^\s+# nvidia\.com/gpu: 1$", (KUBE / "deployment.yaml").read_text(), re.M)


# --- the preStop hook against a live server ---------------------------------------------


async def prestop(port: int, wait_s: float) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        "sh",
        str(PRESTOP),
        # python3 is the one running the tests, as it is the image's in the pod.
        env={"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "S2S_RT_PORT": str(port)}
        | {"S2S_DRAIN_WAIT_S": str(wait_s)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


def test_prestop_drains_and_returns_once_the_last_session_has_ended() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2) as server, RealtimeClient.connect(server) as client:
            await client.until("session.created")
            hook = await prestop(server.port, wait_s=30)
            try:
                while (await http_get(server, "/readyz"))[0] != 503:
                    assert hook.returncode is None
                    await asyncio.sleep(0.05)
                # Draining, not stopping: the running session is still served.
                assert (await client.say_text("one more thing"))["response"]["status"] == "completed"
                assert hook.returncode is None
                await client.ws.close()
                output, _ = await asyncio.wait_for(hook.communicate(), 10)
                assert hook.returncode == 0, output
                assert b"no session left" in output
            finally:
                if hook.returncode is None:
                    hook.kill()
                    await hook.wait()

    run(scenario(), timeout=30)


def test_prestop_gives_up_after_the_drain_wait_and_leaves_the_rest_to_sigterm() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1) as server, RealtimeClient.connect(server) as client:
            await client.until("session.created")
            started = time.monotonic()
            hook = await prestop(server.port, wait_s=1)
            try:
                output, _ = await asyncio.wait_for(hook.communicate(), 10)
            finally:
                if hook.returncode is None:
                    hook.kill()
                    await hook.wait()
            assert hook.returncode == 0 and b"1 sessions still running" in output
            assert 1 <= time.monotonic() - started < 5
            assert (await client.say_text("still here"))["response"]["status"] == "completed"

    run(scenario(), timeout=30)


def test_prestop_returns_at_once_when_no_server_listens() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            port = server.port  # free again once the server has closed
        hook = await prestop(port, wait_s=30)
        output, _ = await asyncio.wait_for(hook.communicate(), 10)
        assert hook.returncode == 0 and b"cannot drain" in output

    run(scenario(), timeout=20)
