"""The Helm chart (deploy/helm/edgegw): linted and rendered by helm, every rendered object
validated offline against Kubernetes' own schemas (kubernetes-validate --strict; a warning,
such as an unknown apiVersion, fails), the ServiceMonitor against prometheus-operator's, the
rendered gateway configuration by `edgegw check-config`; then the rendered Deployment run by
`podman kube play` against the chart's trial Redis pod, answering a request.

Not exercised here (no cluster): scheduling, Services and their DNS, probes, the HPA,
the PDB, NetworkPolicy enforcement, rolling updates, preStop. README "Kubernetes" says so.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from tests.deploy.conftest import ROOT, TOOLS, free_port, run, unique, wait_ready

CHART = ROOT / "deploy" / "helm" / "edgegw"
EVERYTHING = ROOT / "tests" / "deploy" / "values-everything.yaml"
MODELS = TOOLS / "node" / "node_modules" / "@kubernetes-models" / "prometheus-operator"
KEY = "sk-kube-play-test-1"


def render(helm: str, *args: str, release: str = "t") -> list[dict]:
    out = run(helm, "template", release, str(CHART), *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} rendered"
    return found[0]


def gateway_config(docs: list[dict]) -> dict:
    return yaml.safe_load(find(docs, "ConfigMap")["data"]["config.yaml"])


def kubernetes_validate(docs: list[dict], tmp_path: Path) -> str:
    """kubernetes-validate --strict over ``docs``: fails on any error or warning (it only
    warns when it has no schema for an apiVersion/kind: that must not pass)."""
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: run scripts/install-k8s-tools.sh", pytrace=False)
    path = tmp_path / f"rendered-{len(docs)}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = run(sys.executable, "-m", "kubernetes_validate", "--strict", str(path), check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "WARN" not in output and "ERROR" not in output, output
    assert output.count(" passed for resource ") == len(docs), output
    return output


def validate_servicemonitors(docs: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    if not (MODELS / "package.json").exists():
        pytest.fail("@kubernetes-models/prometheus-operator is missing: run scripts/install-k8s-tools.sh", pytrace=False)
    path = tmp_path / "servicemonitors.json"
    path.write_text(json.dumps(docs))
    return run(
        "node", str(ROOT / "tests" / "deploy" / "validate_servicemonitor.mjs"), str(path),
        env={**os.environ, "MODELS": str(MODELS)}, check=False,
    )


def validate_everything(docs: list[dict], tmp_path: Path) -> None:
    monitors = [d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"]
    kubernetes_validate([d for d in docs if d not in monitors], tmp_path)
    if monitors:
        result = validate_servicemonitors(monitors, tmp_path)
        assert result.returncode == 0 and result.stdout.count("PASS") == len(monitors), result.stdout + result.stderr
    # the gateway itself accepts the configuration the chart renders
    config = tmp_path / "config.yaml"
    config.write_text(find(docs, "ConfigMap")["data"]["config.yaml"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = run(sys.executable, "-m", "gateway", "check-config", str(config), env=env)
    assert ": ok" in out.stdout


# -- lint, render, validate ------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], ["-f", str(EVERYTHING)]], ids=["defaults", "everything"])
def test_lint(helm, values):
    out = run(helm, "lint", "--strict", str(CHART), *values)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["-f", str(EVERYTHING)],
        ["--set", "replicaCount=1", "--set", "redis.url=rediss://:pw@redis.example:6380/2", "--set", "resources.limits.cpu=1500m"],
    ],
    ids=["defaults", "everything", "external-redis"],
)
def test_every_rendered_object_validates(helm, values, tmp_path):
    docs = render(helm, *values)
    validate_everything(docs, tmp_path)


def test_the_validators_reject_what_a_cluster_would(helm, tmp_path):
    """The checks above can fail: an unknown field, an unknown apiVersion and a mistyped
    ServiceMonitor are each refused."""
    docs = render(helm, "-f", str(EVERYTHING))
    deployment = json.loads(json.dumps(find(docs, "Deployment", "t-edgegw")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/readyz"}
    with pytest.raises(AssertionError, match="httpGett"):
        kubernetes_validate([deployment], tmp_path)
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(AssertionError, match="WARN"):
        kubernetes_validate([unknown], tmp_path)
    monitor = json.loads(json.dumps(find(docs, "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["port"] = 8000  # a port *name* is a string
    result = validate_servicemonitors([monitor], tmp_path)
    assert result.returncode == 1 and "FAIL" in result.stdout


def test_defaults(helm):
    docs = render(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"]
    deployment = find(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert container["image"] == "edgegw:0.1.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    config = gateway_config(docs)
    # the grace period covers the preStop sleep and the gateway's whole drain
    assert pod["terminationGracePeriodSeconds"] >= 5 + config["limits"]["drain_timeout_s"]
    assert config["limits"]["drain_timeout_s"] == 30
    assert config["listen"] == {"host": "0.0.0.0", "port": 8000, "workers": 2, "log_level": "info", "access_log": False}
    assert config["edge"] == {"enabled": True, "num_threads": 2}  # sized from the CPU limit, not the node's CPUs
    assert "cache" not in config  # the gateway's default (memory) without Redis
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["automountServiceAccountToken"] is False
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/edgegw"] == "config"  # the directory: a changed ConfigMap reaches the file
    assert {"name": "config", "configMap": {"name": "t-edgegw"}} in pod["volumes"]
    zones = [c for c in pod["topologySpreadConstraints"] if c["topologyKey"] == "topology.kubernetes.io/zone"]
    assert zones and zones[0]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    service = find(docs, "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert find(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert "nvidia.com/gpu" not in json.dumps(deployment)


@pytest.mark.parametrize(
    ("cpu", "workers"), [("1500m", 1), ("500m", 1), ("4", 4), ("2.5", 2), ("16", 16)]
)
def test_workers_and_engine_threads_follow_the_cpu_limit(helm, cpu, workers):
    config = gateway_config(render(helm, "--set-string", f"resources.limits.cpu={cpu}"))
    assert config["listen"]["workers"] == workers
    assert config["edge"]["num_threads"] == workers


def test_explicit_workers_threads_and_engine_cpus(helm):
    config = gateway_config(
        render(helm, "--set", "gateway.workers=3", "--set", "edge.numThreads=1", "--set-string", "edge.cpus=0")
    )
    assert config["listen"]["workers"] == 3
    assert config["edge"] == {"enabled": True, "num_threads": 1, "cpus": "0", "process": True}


def test_grace_period_shorter_than_the_drain_is_refused(helm):
    result = run(
        helm, "template", "t", str(CHART), "--set", "drain.terminationGracePeriodSeconds=20", check=False
    )
    assert result.returncode != 0 and "must be at least" in result.stderr
    docs = render(helm, "--set", "drain.timeoutSeconds=120", "--set", "drain.preStopSeconds=10")
    assert find(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 135
    assert gateway_config(docs)["limits"]["drain_timeout_s"] == 120


def test_everything(helm):
    docs = render(helm, "-f", str(EVERYTHING))
    deployment = find(docs, "Deployment", "t-edgegw")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    hpa = find(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "t-edgegw"}
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert metrics["Pods"]["pods"]["metric"]["name"] == "edgegw_in_flight_requests"

    # tenant keys: in the Secret and the environment, never in the ConfigMap
    secret = find(docs, "Secret")
    assert base64.b64decode(secret["data"]["EDGEGW_KEYS_ACME"]).decode() == "sk-acme-test-1,sk-acme-test-2"
    configmap_text = json.dumps(find(docs, "ConfigMap"))
    assert "sk-acme-test" not in configmap_text
    config = gateway_config(docs)
    assert [t["keys_env"] for t in config["tenants"]] == ["EDGEGW_KEYS_ACME", "EDGEGW_KEYS_GLOBEX_EU"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert env["EDGEGW_KEYS_ACME"] == {"name": "t-edgegw-keys", "key": "EDGEGW_KEYS_ACME"}
    assert env["EDGEGW_KEYS_GLOBEX_EU"] == {"name": "globex-keys", "key": "keys"}
    assert env["CENTRAL_API_KEY"] == {"name": "central", "key": "api-key"}
    assert "checksum/keys" in deployment["spec"]["template"]["metadata"]["annotations"]

    # the trial Redis, and every Redis user pointed at it
    redis_url = "redis://t-edgegw-redis:6379/0"
    assert config["cache"] == {"backend": "tiered", "redis_url": redis_url}
    assert config["rate_limits"] == {"backend": "redis", "redis_url": redis_url}
    assert config["slo"] == {"redis_url": redis_url}
    redis_service = find(docs, "Service", "t-edgegw-redis")
    redis_pod = find(docs, "Deployment", "t-edgegw-redis")["spec"]["template"]
    assert redis_service["spec"]["selector"] == redis_pod["metadata"]["labels"]

    # GPU edge nodes
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["runtimeClassName"] == "nvidia"
    assert container["image"] == "edgegw:0.1.0-cuda"
    assert config["edge"]["device"] == "cuda"
    assert config["listen"]["workers"] == 4

    # the ServiceMonitor finds the Service's port; the NetworkPolicies
    monitor = find(docs, "ServiceMonitor")
    service = find(docs, "Service", "t-edgegw")
    labels = service["metadata"]["labels"]
    assert labels | monitor["spec"]["selector"]["matchLabels"] == labels  # the selector picks the Service
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    policy = find(docs, "NetworkPolicy", "t-edgegw")
    assert policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "apps"}
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    redis_policy = find(docs, "NetworkPolicy", "t-edgegw-redis")
    assert redis_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


# -- the rendered Deployment under podman kube play ----------------------------------------------


def _test_copy(deployment: dict) -> dict:
    """kube play publishes every containerPort on the host's 0.0.0.0 at the same number: the
    test copy publishes each on a free port of 127.0.0.1 instead."""
    copy = json.loads(json.dumps(deployment))
    for container in copy["spec"]["template"]["spec"]["containers"]:
        for port in container.get("ports", []):
            port["hostPort"], port["hostIP"] = free_port(), "127.0.0.1"
    return copy


def _play(podman: str, docs: list[dict], path: Path) -> str:
    path.write_text(yaml.safe_dump_all(docs))
    out = run(podman, "kube", "play", str(path)).stdout.split()
    return out[out.index("Pod:") + 1]  # the pod's id


def test_rendered_deployment_runs_under_podman_kube_play(podman, helm, image, redis_image, tmp_path):
    release = unique("kp")
    repository, tag = image.rsplit(":", 1)
    redis_repository, redis_tag = redis_image.rsplit(":", 1)
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "replicaCount": 1,
        "redis": {"enabled": True, "image": {"repository": redis_repository, "tag": redis_tag, "pullPolicy": "Never"}},
        "tenants": [{"name": "ci", "keys": [KEY]}],
        "config": {"auth": {"mode": "required"}},
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    docs = render(helm, "-f", str(tmp_path / "values.yaml"), release=release)
    validate_everything(docs, tmp_path)
    fullname = f"{release}-edgegw"
    redis_deployment = _test_copy(find(docs, "Deployment", f"{fullname}-redis"))
    gateway = _test_copy(find(docs, "Deployment", fullname))
    config_map, secret = find(docs, "ConfigMap"), find(docs, "Secret")
    redis_port = redis_deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["hostPort"]
    gateway_port = gateway["spec"]["template"]["spec"]["containers"][0]["ports"][0]["hostPort"]
    pods: list[str] = []
    try:
        pods.append(_play(podman, [redis_deployment], tmp_path / "redis.yaml"))
        client = redis.Redis(host="127.0.0.1", port=redis_port, socket_timeout=5)
        for _ in range(120):  # bounded: Redis answers within moments of its start
            try:
                if client.ping():
                    break
            except redis.RedisError:
                time.sleep(0.5)
        infra = run(podman, "pod", "inspect", "--format", "{{.InfraContainerID}}", pods[0]).stdout.strip()
        redis_ip = run(
            podman, "inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", infra
        ).stdout.strip()
        assert redis_ip
        # kube play has no Services: the Redis Service's name is made to resolve to the Redis
        # pod, as the Service's cluster IP would route to it
        gateway["spec"]["template"]["spec"]["hostAliases"] = [{"ip": redis_ip, "hostnames": [f"{fullname}-redis"]}]
        # podman 4.3's kube play reads a secretKeyRef from a podman secret holding the Secret's
        # data as JSON (a Secret document given to it is stored in a form its own lookup cannot
        # read): the rendered Secret's data, as is
        run(podman, "secret", "create", secret["metadata"]["name"], "-", input=json.dumps(secret["data"]))
        pods.append(_play(podman, [config_map, gateway], tmp_path / "gateway.yaml"))
        containers = json.loads(run(podman, "pod", "inspect", pods[1]).stdout)
        containers = containers[0] if isinstance(containers, list) else containers
        edgegw = next(c["Name"] for c in containers["Containers"] if c["Name"].endswith("-edgegw"))

        def alive() -> str | None:
            state = json.loads(run(podman, "inspect", edgegw).stdout)[0]
            if state["State"]["Status"] != "running" or state.get("RestartCount", 0):
                logs = run(podman, "logs", edgegw, check=False)
                return f"{edgegw}: {state['State']['Status']}, restarts {state.get('RestartCount')}:\n{(logs.stdout + logs.stderr)[-4000:]}"
            return None

        base = f"http://127.0.0.1:{gateway_port}"
        wait_ready(base, alive)
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        }
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600).status_code == 401
        headers = {"authorization": f"Bearer {KEY}"}  # from the Secret, through the environment
        first = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=600)
        assert first.status_code == 200, first.text
        assert "Paris" in first.json()["choices"][0]["message"]["content"]
        assert first.headers["x-cache"].lower().startswith("miss")
        second = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=600)
        assert second.headers["x-cache"].lower().startswith("hit")
        assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        # the answer and the tenant's rate-limit counters are in the Redis pod
        assert list(client.scan_iter("edgegw*", count=1000)), "nothing written to the Redis pod"
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert 'edgegw_requests_total{api="chat",status="200",tenant="ci"} 2.0' in metrics
        # the node: two relay workers (CPU limit 2) and the engine in a process of its own
        assert "edgegw_workers_scraped 2.0" in metrics
    finally:
        for pod in reversed(pods):
            run(podman, "pod", "rm", "--force", pod, check=False)
        run(podman, "secret", "rm", secret["metadata"]["name"], check=False)


ADMIN = ["--set", "admin.port=9090", "--set", "admin.keys={adm-test-1,adm-test-2}", "--set", "tenantKeysAsFiles=true", "--set", "rollOnConfigChange=false"]


def test_admin_port_admin_keys_and_tenant_keys_as_files_for_live_reload(helm, tmp_path):
    """``admin.port``/``admin.keys`` (listen.admin, admin.keys_file) and ``tenantKeysAsFiles``
    with ``rollOnConfigChange: false``: keys and configuration are files the gateway reloads
    live, and nothing rolls the pods when they change."""
    docs = render(helm, "-f", str(EVERYTHING), *ADMIN)
    monitors = [d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"]
    kubernetes_validate([d for d in docs if d not in monitors], tmp_path)
    result = validate_servicemonitors(monitors, tmp_path)
    assert result.returncode == 0 and result.stdout.count("PASS") == 1, result.stdout + result.stderr
    deployment = find(docs, "Deployment", "t-edgegw")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {"name": "admin", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    annotations = deployment["spec"]["template"]["metadata"].get("annotations") or {}
    assert "checksum/config" not in annotations and "checksum/keys" not in annotations  # reloaded, not rolled
    config = gateway_config(docs)
    assert config["listen"]["admin"] == {"port": 9090}
    assert config["admin"] == {"keys_file": "/etc/edgegw-admin/keys"}
    assert [t["keys_file"] for t in config["tenants"]] == ["/etc/edgegw-keys/EDGEGW_KEYS_ACME", "/etc/edgegw-keys/EDGEGW_KEYS_GLOBEX_EU"]
    assert not any("keys_env" in t for t in config["tenants"]) and "EDGEGW_KEYS_ACME" not in json.dumps(container.get("env", []))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/edgegw-keys"] == "tenant-keys" and mounts["/etc/edgegw-admin"] == "admin-keys"
    volumes = {v["name"]: v for v in pod["volumes"]}
    sources = [s["secret"] for s in volumes["tenant-keys"]["projected"]["sources"]]
    assert sources == [
        {"name": "t-edgegw-keys", "items": [{"key": "EDGEGW_KEYS_ACME", "path": "EDGEGW_KEYS_ACME"}]},
        {"name": "globex-keys", "items": [{"key": "keys", "path": "EDGEGW_KEYS_GLOBEX_EU"}]},
    ]
    admin_secret = find(docs, "Secret", "t-edgegw-admin")
    assert base64.b64decode(admin_secret["data"]["keys"]).decode() == "adm-test-1,adm-test-2"
    assert "adm-test" not in json.dumps(find(docs, "ConfigMap"))
    # the ServiceMonitor scrapes the admin Service's port with the first key; the API's Service has no admin port
    admin_service = find(docs, "Service", "t-edgegw-admin")
    labels = admin_service["metadata"]["labels"]
    (monitor,) = monitors
    assert labels | monitor["spec"]["selector"]["matchLabels"] == labels
    api_labels = find(docs, "Service", "t-edgegw")["metadata"]["labels"]
    assert api_labels | monitor["spec"]["selector"]["matchLabels"] != api_labels
    assert monitor["spec"]["endpoints"][0]["port"] == admin_service["spec"]["ports"][0]["name"] == "admin"
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"] == {"name": "t-edgegw-admin", "key": "scrape"}
    assert [p["port"] for p in find(docs, "Service", "t-edgegw")["spec"]["ports"]] == [8000]
    policy = find(docs, "NetworkPolicy", "t-edgegw")
    assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]] == ["http", "admin"]
    # the gateway accepts the rendered configuration (with the mounted files made here)
    text = find(docs, "ConfigMap")["data"]["config.yaml"]
    for path in ("/etc/edgegw-admin/keys", "/etc/edgegw-keys/EDGEGW_KEYS_ACME", "/etc/edgegw-keys/EDGEGW_KEYS_GLOBEX_EU"):
        local = tmp_path / path.rsplit("/", 1)[1]
        local.write_text("k-1\n")
        text = text.replace(path, str(local))
    (tmp_path / "config.yaml").write_text(text)
    out = run(sys.executable, "-m", "gateway", "check-config", str(tmp_path / "config.yaml"), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ": ok" in out.stdout
