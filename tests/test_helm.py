"""The Helm chart (helm/kvbus): lint, render, Kubernetes schemas, values schema, scaling, NATS config.

Everything here runs `helm template` (no cluster). The rendered nats.conf is also run on a real
nats-server, with a real coordinator, group scheduler and `kvbus selftest` logging in as the
chart's users, so the permissions it writes are the ones kvbus needs.

Needs the `helm` binary: env KVBUS_HELM, else `helm` on PATH, else ./.tools/helm (what
`scripts/install-helm.sh` installs); the module is skipped without it.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvbus"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "kvbus"
NAMESPACE = "agents"
#: Kubernetes version the manifests are validated against (kubernetes-validate's schemas).
K8S_VERSION = "1.35"


def _find_helm() -> str | None:
    for candidate in (os.environ.get("KVBUS_HELM"), shutil.which("helm"), str(ROOT / ".tools" / "helm")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


HELM = _find_helm()
pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm binary not found: set KVBUS_HELM, put helm on PATH, or run "
                         "`scripts/install-helm.sh` (installs ./.tools/helm)")


# -- rendering ---------------------------------------------------------------------------------


class HelmError(Exception):
    def __init__(self, args: list[str], stderr: str) -> None:
        super().__init__(f"helm {' '.join(args)} failed:\n{stderr}")
        self.stderr = stderr


def helm(*args: str) -> str:
    assert HELM is not None
    # No cluster is used: an empty kubeconfig keeps a developer's real one out of the way.
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KUBECONFIG": os.devnull})
    if proc.returncode != 0:
        raise HelmError(list(args), proc.stderr)
    return proc.stdout


def _value_args(sets: tuple[str, ...], files: tuple[str, ...]) -> list[str]:
    args: list[str] = []
    for f in files:
        args += ["-f", f]
    for s in sets:
        args += ["--set-json" if s.startswith("json:") else "--set", s.removeprefix("json:")]
    return args


@functools.lru_cache(maxsize=None)
def render_text(sets: tuple[str, ...] = (), files: tuple[str, ...] = ()) -> str:
    """`helm template` output (cached: the chart does not change during the run)."""
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *_value_args(sets, files))


def render(*sets: str, files: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_text(tuple(sets), files)) if d]


def render_error(*sets: str) -> str:
    with pytest.raises(HelmError) as info:
        helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *_value_args(tuple(sets), ()))
    return info.value.stderr


def raw_documents(text: str) -> list[str]:
    """The rendered documents as text, exactly as helm wrote them (without the Source comment)."""
    docs = []
    for chunk in re.split(r"^---\s*$", text, flags=re.M):
        body = "\n".join(line for line in chunk.strip("\n").split("\n") if not line.startswith("# Source:"))
        if body.strip():
            docs.append(body)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
    return found[0]


def component(docs: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    return [d for d in by_kind(docs, kind)
            if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == name]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def kvbus_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every container that runs the kvbus image (coordinator, schedulers, test)."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Pod"):
            for c in pod_spec(d)["containers"]:
                if c.get("command") == ["kvbus"]:
                    yield f"{d['kind']}/{d['metadata']['name']}", c


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def nats_conf(docs: list[dict[str, Any]]) -> str:
    return one(docs, "ConfigMap", f"{RELEASE}-nats-config")["data"]["nats.conf"]


VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "groups-1": (("groups.count=1",), ()),
    "groups-2": (("groups.count=2",), ()),
    "groups-3": (("groups.count=3",), ()),
    "no-auth-no-metrics": (("nats.auth.enabled=false", "metrics.enabled=false", "redis.auth.enabled=false"), ()),
    "jaeger-off-otel-off": (("jaeger.enabled=false", "otel.enabled=false"), ()),
    "jaeger-on": (("jaeger.enabled=true",), ()),
    **{f.name.removesuffix("-values.yaml"): ((), (str(f),)) for f in CI_VALUES},
}


# -- lint and Kubernetes validity --------------------------------------------------------------


def test_ci_value_files_exist() -> None:
    names = {f.name for f in CI_VALUES}
    assert {"external-values.yaml", "secure-values.yaml", "jaeger-values.yaml", "groups-5-values.yaml"} <= names


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "default")
def test_helm_lint(values: Path | None) -> None:
    out = helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))
    assert "0 chart(s) failed" in out


@pytest.fixture(scope="module")
def kubernetes_validate() -> Iterator[Any]:
    """kubernetes-validate, with its schema files parsed once instead of once per manifest."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    original = kv.utils.schema_contents
    kv.utils.schema_contents = functools.lru_cache(maxsize=None)(original)
    try:
        yield kv
    finally:
        kv.utils.schema_contents = original


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_is_valid_kubernetes(variant: str, kubernetes_validate: Any) -> None:
    sets, files = VARIANTS[variant]
    docs = render(*sets, files=files)
    assert docs
    seen = set()
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in seen, f"{key} rendered twice"
        seen.add(key)
        assert len(doc["metadata"]["name"]) <= 63
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            # A CRD: no schema in kubernetes-validate; check the fields Prometheus reads.
            assert doc["kind"] == "ServiceMonitor"
            assert doc["spec"]["endpoints"][0]["port"] == "metrics"
            assert doc["spec"]["selector"]["matchLabels"]["kvbus.io/metrics"] == "true"
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at "
                        f"{'/'.join(map(str, exc.path))}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pods_are_locked_down(variant: str) -> None:
    """Non-root, read-only root filesystem, no privilege escalation, resources, no API token."""
    sets, files = VARIANTS[variant]
    for doc in render(*sets, files=files):
        if doc["kind"] not in ("Deployment", "StatefulSet", "Pod"):
            continue
        what = f"{variant}: {doc['kind']}/{doc['metadata']['name']}"
        spec = pod_spec(doc)
        assert spec["securityContext"]["runAsNonRoot"] is True, what
        assert spec["securityContext"]["runAsUser"] > 0, what
        assert spec["automountServiceAccountToken"] is False, what
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, what
            assert sc["allowPrivilegeEscalation"] is False, what
            assert sc["capabilities"]["drop"] == ["ALL"], what
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], what


def test_long_names_stay_within_kubernetes_limits(kubernetes_validate: Any) -> None:
    release = "r" * 53  # the longest release name Helm accepts
    text = helm("template", release, str(CHART), "--set-json", 'groups.list=[{"name":"%s"}]' % ("g" * 24),
                "--set", "jaeger.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
    docs = [d for d in yaml.safe_load_all(text) if d]
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= (52 if doc["kind"] == "StatefulSet" else 63), name
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    names = [d["metadata"]["name"] for d in by_kind(docs, "StatefulSet")]
    assert len(set(names)) == len(names) == 3 and any(n.endswith("-" + "g" * 24) for n in names)


def test_kvbus_writes_only_to_mounted_volumes() -> None:
    for what, c in kvbus_containers(render()):
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/home/kvbus/.cache"} <= mounts, what


# -- groups and scaling ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_one_scheduler_statefulset_per_group(count: int) -> None:
    docs = render(f"groups.count={count}")
    stses = component(docs, "StatefulSet", "scheduler")
    groups = [f"g{i}" for i in range(count)]
    assert sorted(s["metadata"]["name"] for s in stses) == sorted(f"{RELEASE}-sched-{g}" for g in groups)
    for sts in stses:
        group = sts["metadata"]["labels"]["kvbus.io/group"]
        assert sts["spec"]["replicas"] == 2  # a standby per group
        assert sts["spec"]["selector"]["matchLabels"]["kvbus.io/group"] == group
        c = pod_spec(sts)["containers"][0]
        assert c["args"][-1] == f"--group={group}" and "group-scheduler" in c["args"]
        assert env_of(c)["KVBUS_GROUP"] == group
        assert sts["spec"]["serviceName"] == sts["metadata"]["name"]
    assert len(component(docs, "PodDisruptionBudget", "scheduler")) == count
    assert len(component(docs, "Service", "scheduler")) == count


def test_group_list_overrides() -> None:
    docs = render(files=(str(CHART / "ci" / "groups-list-values.yaml"),))
    stses = {s["metadata"]["labels"]["kvbus.io/group"]: s for s in component(docs, "StatefulSet", "scheduler")}
    assert sorted(stses) == ["coders", "planners", "reviewers"]
    assert stses["coders"]["spec"]["replicas"] == 3
    planner = pod_spec(stses["planners"])["containers"][0]
    assert "--bandwidth=1.25e+09" in planner["args"]
    coder_env = env_of(pod_spec(stses["coders"])["containers"][0])
    assert coder_env["KVBUS_SCHEDULER_MAX_ACTIVE"] == "8"
    assert coder_env["KVBUS_SCHEDULER_HYSTERESIS"] == "0.2"  # scheduler.config applies to every group
    assert pod_spec(stses["reviewers"])["containers"][0]["resources"]["limits"]["memory"] == "1Gi"
    coord = component(docs, "Deployment", "coordinator")[0]
    assert env_of(pod_spec(coord)["containers"][0])["KVBUS_COORDINATOR_CAPACITY_BPS"] == "2.5e+09"
    test_pod = by_kind(docs, "Pod")[0]
    assert "--group=coders" in test_pod["spec"]["containers"][0]["args"]


def _group_of(raw: str) -> str | None:
    m = re.search(r"^    kvbus\.io/group: (\S+)$", raw, flags=re.M)
    return m.group(1) if m else None


@pytest.mark.parametrize("before, after, new", [
    (("groups.count=2",), ("groups.count=3",), {"g2"}),
    (("groups.count=1",), ("groups.count=5",), {"g1", "g2", "g3", "g4"}),
    # a named group inserted in the middle of the list
    (("json:groups.list=[{\"name\":\"a\"},{\"name\":\"c\",\"replicas\":3}]",),
     ("json:groups.list=[{\"name\":\"a\"},{\"name\":\"b\"},{\"name\":\"c\",\"replicas\":3}]",), {"b"}),
])
def test_adding_a_group_changes_no_other_resource(before: tuple[str, ...], after: tuple[str, ...],
                                                  new: set[str]) -> None:
    """`helm upgrade` with one more group: every other resource is byte-identical, so nothing
    else is touched (Secrets aside: `helm template` cannot look up the installed passwords)."""
    old = [d for d in raw_documents(render_text(before)) if "\nkind: Secret\n" not in f"\n{d}\n"]
    new_docs = raw_documents(render_text(after))
    missing = [d[:300] for d in old if d not in new_docs]
    assert not missing, "changed by adding a group:\n" + "\n---\n".join(missing)
    added = [d for d in new_docs if d not in old and "\nkind: Secret\n" not in f"\n{d}\n"]
    assert {_group_of(d) for d in added} == new, [d[:200] for d in added]
    assert sorted(yaml.safe_load(d)["kind"] for d in added) == sorted(
        ["PodDisruptionBudget", "Service", "StatefulSet"] * len(new))


def test_existing_groups_statefulsets_identical_when_adding() -> None:
    two = {(_group_of(d), yaml.safe_load(d)["kind"]): d for d in raw_documents(render_text(("groups.count=2",)))
           if _group_of(d)}
    three = {(_group_of(d), yaml.safe_load(d)["kind"]): d for d in raw_documents(render_text(("groups.count=3",)))
             if _group_of(d)}
    for key in (("g0", "StatefulSet"), ("g1", "StatefulSet"), ("g0", "Service"), ("g1", "PodDisruptionBudget")):
        assert two[key] == three[key], key
    assert ("g2", "StatefulSet") in three and ("g2", "StatefulSet") not in two


# -- the values schema rejects bad values ------------------------------------------------------


@pytest.mark.parametrize("args, expected", [
    (("groups.count=-1",), ["/groups/count", "minimum"]),
    (("groups.count=0",), ["/groups/count", "minimum"]),
    (("groups.count=two",), ["/groups/count", "want integer"]),
    (("json:groups.count=1.5",), ["/groups/count"]),
    (("group.count=3",), ["additional properties 'group'"]),
    (("groups.list[0].name=Bad_Name",), ["/groups/list/0/name", "pattern"]),
    (("json:groups.list=[{\"replicas\":2}]",), ["/groups/list/0", "name"]),
    (("scheduler.replicas=0",), ["/scheduler/replicas", "minimum"]),
    (("coordinator.replicas=yes",), ["/coordinator/replicas"]),
    (("nats.maxPayload=huge",), ["/nats/maxPayload"]),
    (("otel.protocol=udp",), ["/otel/protocol"]),
    (("metrics.port=80",), ["/metrics/port", "minimum"]),
    (("image.pullPolicy=Sometimes",), ["/image/pullPolicy"]),
    (("json:scheduler.config={\"Max-Active\":3}",), ["/scheduler/config"]),
    (("json:nats.statefulSet.patch=[{\"op\":\"frobnicate\",\"path\":\"/spec\"}]",), ["/nats/statefulSet/patch/0/op"]),
    (("nats.enabled=false",), ["nats.external.url must name the NATS to use"]),
    (("nats.enabled=false", "nats.external.url=nats://u:pw@nats:4222"), ["must not carry credentials"]),
    (("nats.replicas=2",), ["JetStream quorum"]),
    (("nats.tls.enabled=true",), ["nats.tls.secretName is empty"]),
    (("test.group=nope",), ['test.group "nope" is not one of the groups (g0)']),
    (("json:groups.list=[{\"name\":\"a\"},{\"name\":\"a\"}]",), ['the group name "a" appears twice']),
    (("jaeger.enabled=true", "otel.endpoint=http://collector:4318"), ["jaeger.enabled and otel.endpoint"]),
    (("json:scheduler.statefulSet.patch=[{\"op\":\"replace\",\"path\":\"/spec/nothere\",\"value\":1}]",),
     ['key "nothere" does not exist']),
])
def test_bad_values_are_rejected_with_a_clear_message(args: tuple[str, ...], expected: list[str]) -> None:
    err = render_error(*args)
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in:\n{err}"


# -- helm test, tracing, metrics ---------------------------------------------------------------


@pytest.mark.parametrize("variant", ["default", "groups-3", "external", "secure"])
def test_helm_test_pod_runs_selftest_as_an_agent(variant: str) -> None:
    sets, files = VARIANTS[variant]
    docs = render(*sets, files=files)
    pods = by_kind(docs, "Pod")
    assert len(pods) == 1
    pod = pods[0]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["kvbus"] and c["args"][0] == "selftest"
    assert "--group=g0" in c["args"]  # the first group
    env = env_of(c)
    assert env["KVBUS_NATS_URL"].startswith(("nats://", "tls://"))
    assert "--nats-url" not in " ".join(c["args"])  # credentials stay out of argv
    password_ref = env["KVBUS_NATS_PASSWORD"]["secretKeyRef"]
    assert password_ref["key"] == "agent-password"
    assert env["KVBUS_NATS_URL"].endswith(":4222") and "$(KVBUS_NATS_PASSWORD)" in env["KVBUS_NATS_URL"]


def test_kvbus_services_log_in_as_the_service_user() -> None:
    docs = render()
    secret = one(docs, "Secret", f"{RELEASE}-nats-auth")
    for what, c in kvbus_containers(docs):
        env = env_of(c)
        ref = env["KVBUS_NATS_PASSWORD"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] == ("agent-password" if what.startswith("Pod/") else "service-password"), what
        assert env["KVBUS_NATS_URL"] == (f"nats://$(KVBUS_NATS_USER):$(KVBUS_NATS_PASSWORD)@"
                                         f"{RELEASE}-nats.{NAMESPACE}.svc.cluster.local:4222")
    for key in ("service-password", "agent-password"):
        assert len(base64.b64decode(secret["data"][key])) == 32


@pytest.mark.parametrize("variant, endpoint, protocol", [
    ("jaeger-on", f"http://{RELEASE}-jaeger.{NAMESPACE}.svc.cluster.local:4318", "http/protobuf"),
    ("jaeger", f"http://{RELEASE}-jaeger.{NAMESPACE}.svc.cluster.local:4317", "grpc"),
    ("external", "http://otel-collector.observability.svc.cluster.local:4318", "http/protobuf"),
])
def test_otlp_endpoint_in_every_kvbus_pod(variant: str, endpoint: str, protocol: str) -> None:
    sets, files = VARIANTS[variant]
    docs = render(*sets, files=files)
    containers = list(kvbus_containers(docs))
    assert len(containers) >= 3  # coordinator, a scheduler, the test pod
    for what, c in containers:
        env = env_of(c)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint, what
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == protocol, what
        assert env["OTEL_SERVICE_NAME"].startswith("kvbus-"), what
        assert "k8s.pod.name=$(KVBUS_POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"], what
    if variant.startswith("jaeger"):
        jaeger = one(docs, "Service", f"{RELEASE}-jaeger")
        assert {p["port"] for p in jaeger["spec"]["ports"]} == {4317, 4318, 16686}


def test_no_tracing_without_an_endpoint() -> None:
    for what, c in kvbus_containers(render()):
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env_of(c), what


def test_metrics_ports_annotations_and_service_monitor() -> None:
    docs = render()
    for what, c in kvbus_containers(docs):
        if what.startswith("Pod/"):
            continue
        assert env_of(c)["KVBUS_METRICS_PORT"] == "9464", what
        assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in c["ports"], what
    metric_services = [s for s in by_kind(docs, "Service") if s["metadata"]["labels"].get("kvbus.io/metrics") == "true"]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in metric_services} == {"coordinator", "scheduler"}
    for s in metric_services:
        assert s["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert s["metadata"]["annotations"]["prometheus.io/port"] == "9464"
    assert not by_kind(docs, "ServiceMonitor")
    monitors = by_kind(render(files=(str(CHART / "ci" / "secure-values.yaml"),)), "ServiceMonitor")
    assert len(monitors) == 1 and monitors[0]["metadata"]["labels"]["release"] == "prometheus"


# -- NATS, Redis, external services, TLS -------------------------------------------------------


def test_nats_config() -> None:
    docs = render()
    conf = nats_conf(docs)
    assert "max_payload: 8MB" in conf and "jetstream {" in conf
    assert "password: $KVBUS_AGENT_PASSWORD" in conf  # from the Secret, via the environment
    agent = re.search(r"user: \$KVBUS_AGENT_USER.*?permissions: (.*?)\n", conf, flags=re.S)
    assert agent and 'deny: [ "kvbus.agent.*.ctl" ]' in agent.group(1)  # only schedulers grant
    assert '"$KV.kvbus_coord' not in agent.group(1)
    secret = one(docs, "Secret", f"{RELEASE}-nats-auth")
    for value in secret["data"].values():  # neither passwords nor user names are in the ConfigMap
        assert base64.b64decode(value).decode() not in conf
    sts = one(docs, "StatefulSet", f"{RELEASE}-nats")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert pod_spec(sts)["containers"][0]["image"].startswith("nats:")
    # The config checksum restarts the servers when nats.conf changes.
    assert sts["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def test_nats_cluster_and_tls() -> None:
    docs = render(files=(str(CHART / "ci" / "secure-values.yaml"),))
    conf = nats_conf(docs)
    assert conf.count(f"{RELEASE}-nats-headless.{NAMESPACE}.svc.cluster.local:6222") == 3
    assert 'cert_file: "/etc/nats/tls/tls.crt"' in conf
    sts = one(docs, "StatefulSet", f"{RELEASE}-nats")
    assert sts["spec"]["replicas"] == 3
    assert one(docs, "PodDisruptionBudget", f"{RELEASE}-nats")["spec"]["maxUnavailable"] == 1
    assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == f"{RELEASE}-nats-auth"]
    for what, c in kvbus_containers(docs):
        env = env_of(c)
        assert env["KVBUS_NATS_URL"].startswith("tls://"), what
        assert env["KVBUS_NATS_PASSWORD"]["secretKeyRef"]["name"] == "kvbus-nats-users", what
        assert env["SSL_CERT_FILE"] == "/etc/kvbus/nats-ca/ca.crt", what
        assert c["image"] == "registry.example.com/ml/kvbus:0.1.0"


def test_external_nats_and_redis() -> None:
    docs = render(files=(str(CHART / "ci" / "external-values.yaml"),))
    assert not [d for d in docs if d["metadata"]["labels"]["app.kubernetes.io/component"] in ("nats", "redis")]
    for what, c in kvbus_containers(docs):
        env = env_of(c)
        assert env["KVBUS_NATS_URL"] == ("tls://$(KVBUS_NATS_USER):$(KVBUS_NATS_PASSWORD)@"
                                         "nats.messaging.svc.cluster.local:4222"), what
        assert env["KVBUS_NATS_USER"]["secretKeyRef"]["name"] == "kvbus-nats-credentials"
    test_env = env_of(by_kind(docs, "Pod")[0]["spec"]["containers"][0])
    assert test_env["KVBUS_REDIS_URL"] == "rediss://:$(KVBUS_REDIS_PASSWORD)@redis.cache.svc.cluster.local:6380/2"
    client = one(docs, "ConfigMap", f"{RELEASE}-client")["data"]
    assert client["KVBUS_NATS_URL"] == "tls://nats.messaging.svc.cluster.local:4222"


def test_redis_password_stays_out_of_argv_and_config() -> None:
    docs = render()
    redis = one(docs, "StatefulSet", f"{RELEASE}-redis")
    c = pod_spec(redis)["containers"][0]
    assert "REDIS_PASSWORD" in env_of(c) and "$REDIS_PASSWORD" in c["command"][-1]
    assert "include /run/redis/auth.conf" in one(docs, "ConfigMap", f"{RELEASE}-redis-config")["data"]["redis.conf"]


def test_escape_hatches() -> None:
    docs = render(files=(str(CHART / "ci" / "escape-hatches-values.yaml"),))
    nats_sts = one(docs, "StatefulSet", "bus")
    assert {"name": "EXTRA", "value": "1"} in pod_spec(nats_sts)["containers"][0]["env"]
    svc = one(docs, "Service", "bus")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"
    coord = one(docs, "Deployment", "brain")
    assert coord["spec"]["template"]["metadata"]["annotations"]["release"] == RELEASE  # tpl in merge
    assert all(s["spec"]["updateStrategy"]["type"] == "OnDelete" for s in component(docs, "StatefulSet", "scheduler"))
    assert not component(docs, "PodDisruptionBudget", "scheduler")
    assert not by_kind(docs, "Pod")


@pytest.mark.parametrize("variant", ["default", "jaeger", "external", "groups-list", "no-auth-no-metrics"])
def test_notes_tell_how_to_connect_an_agent_and_open_jaeger(variant: str) -> None:
    sets, files = VARIANTS[variant]
    out = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
               *_value_args(sets, files))
    notes = out[out.index("NOTES:"):]
    assert "Bus.connect(url)" in notes and f"helm test {RELEASE}" in notes
    if variant == "jaeger":
        assert f"port-forward svc/{RELEASE}-jaeger 16686:16686" in notes
    elif variant == "default":
        assert "Tracing is off" in notes and "NATS_PASSWORD=$(kubectl" in notes
        assert "--set groups.count=2" in notes
    elif variant == "no-auth-no-metrics":
        assert "WARNING: nats.auth.enabled is false" in notes
    elif variant == "groups-list":
        assert "append an item to groups.list" in notes


# -- values.yaml documents every key -----------------------------------------------------------

#: Keys whose default value is a block documented as a whole by the comment on the key.
VALUE_BLOCKS = {"resources", "podSecurityContext", "containerSecurityContext", "servicePermissions",
                "agentPermissions"}


def test_every_values_key_is_commented() -> None:
    lines = (CHART / "values.yaml").read_text().split("\n")
    stack: list[tuple[int, str]] = []
    undocumented = []
    for n, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [key]
        stack.append((indent, key))
        prev = next((lines[j].strip() for j in range(n - 1, -1, -1) if lines[j].strip()), "")
        if prev.startswith("# ") or any(p in VALUE_BLOCKS for p in path[:-1]):
            continue
        undocumented.append(".".join(path))
    assert not undocumented


def test_schema_knows_every_default_key() -> None:
    """additionalProperties: false everywhere means a key missing from the schema breaks installs."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: Any, sch: dict[str, Any], path: str) -> None:
        while "$ref" in sch:
            sch = schema["definitions"][sch["$ref"].rsplit("/", 1)[1]]
        if not isinstance(node, dict) or "properties" not in sch:
            return
        for k, v in node.items():
            assert k in sch["properties"] or sch.get("additionalProperties") is not False, f"{path}.{k}"
            if k in sch["properties"]:
                walk(v, sch["properties"][k], f"{path}.{k}")

    walk(values, schema, "")


# -- the rendered NATS config on a real server ------------------------------------------------


def _chart_nats(tmp_path: Path, port: int, monitor: int) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    from kvbus.local import find_nats_server

    conf = nats_conf(render())
    conf = re.sub(r"^port: \d+$", f"port: {port}", conf, flags=re.M)
    conf = re.sub(r"^http_port: \d+$", f"http_port: {monitor}", conf, flags=re.M)
    conf = conf.replace('"/var/run/nats/nats.pid"', f'"{tmp_path}/nats.pid"').replace('"/data"', f'"{tmp_path}/js"')
    (tmp_path / "nats.conf").write_text(conf + "\nhost: 127.0.0.1\n")
    creds = {"KVBUS_SERVICE_USER": "kvbus-service", "KVBUS_SERVICE_PASSWORD": "s3rvice",
             "KVBUS_AGENT_USER": "kvbus-agent", "KVBUS_AGENT_PASSWORD": "ag3nt", "SERVER_NAME": "kvbus-nats-0"}
    binary = find_nats_server()
    check = subprocess.run([binary, "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True,
                           env={**os.environ, **creds})
    assert check.returncode == 0, check.stdout + check.stderr
    with open(tmp_path / "nats.log", "wb") as log:
        proc = subprocess.Popen([binary, "-c", str(tmp_path / "nats.conf")], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **creds}, start_new_session=True)
    deadline = time.monotonic() + 15
    while "Server is ready" not in (tmp_path / "nats.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "nats.log").read_text()
        time.sleep(0.05)
    return proc, creds


def _wait_for_subscriptions(monitor: int, subjects: set[str], logs: Path, timeout: float = 90.0) -> None:
    """Until the server's monitoring endpoint lists a subscription on each subject."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/subsz?subs=1&limit=100000", timeout=5) as r:
            seen = {s["subject"] for s in json.load(r).get("subscriptions_list", [])}
        if subjects <= seen:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"no subscription on {subjects - seen} after {timeout}s; logs:\n"
                        + "".join(p.read_text() for p in logs.glob("*.log")))
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_chart_nats_config_on_a_real_server(tmp_path: Path) -> None:
    """The chart's nats.conf on a real nats-server: the coordinator and a group scheduler log in
    as the service user, `kvbus selftest` (what `helm test` runs) as the agent user and gets its
    4 MB context through bit-exact; the agent user may not publish grants; a wrong password fails."""
    import nats
    from kvbus.local import free_port

    port, monitor = free_port(), free_port()
    server, creds = _chart_nats(tmp_path, port, monitor)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        service_url = f"nats://{creds['KVBUS_SERVICE_USER']}:{creds['KVBUS_SERVICE_PASSWORD']}@127.0.0.1:{port}"
        agent_url = f"nats://{creds['KVBUS_AGENT_USER']}:{creds['KVBUS_AGENT_PASSWORD']}@127.0.0.1:{port}"
        env = {**os.environ, "KVBUS_NATS_URL": service_url, "HF_HUB_OFFLINE": "1"}
        for args in (["coordinator"], ["group-scheduler", "--group", "g0"]):
            with open(tmp_path / f"{args[0]}.log", "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "kvbus.cli", "-v", *args], env=env,
                                              stdout=log, stderr=subprocess.STDOUT))
        _wait_for_subscriptions(monitor, {"kvbus.sched.g0.request", "kvbus.coord.register"}, tmp_path)
        selftest = subprocess.run([sys.executable, "-m", "kvbus.cli", "selftest", "--group", "g0"],
                                  env={**os.environ, "KVBUS_NATS_URL": agent_url}, capture_output=True,
                                  text=True, timeout=120)
        logs = "".join((tmp_path / f).read_text() for f in ("coordinator.log", "group-scheduler.log", "nats.log"))
        assert selftest.returncode == 0, selftest.stdout + selftest.stderr + logs
        assert "selftest OK" in selftest.stdout
        assert "Violation" not in (tmp_path / "nats.log").read_text()  # nothing kvbus does was refused
        assert all(p.poll() is None for p in procs), logs

        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        nc = await nats.connect(agent_url, error_cb=on_error, allow_reconnect=False)
        try:
            await nc.publish("kvbus.agent.someone.ctl", b"forged grant")
            await nc.flush()
            await nc.subscribe("kvbus.sched.g0.request")  # other agents' requests
            await nc.flush()
            await nc.publish("kvbus.sched.g0.probe", b"")  # allowed
            await nc.flush()
            for _ in range(100):
                if len(errors) >= 2:
                    break
                await asyncio.sleep(0.02)
        finally:
            await nc.close()
        refused = [str(e) for e in errors]
        assert any("permissions violation for publish" in e and "kvbus.agent.someone.ctl" in e for e in refused), refused
        assert any("permissions violation for subscription" in e and "kvbus.sched.g0.request" in e
                   for e in refused), refused
        assert not any("kvbus.sched.g0.probe" in e for e in refused), refused

        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(f"nats://kvbus-agent:wrong@127.0.0.1:{port}", allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=2)
    finally:
        for p in procs:
            _stop(p)
        _stop(server)


# -- Dockerfile and install script -------------------------------------------------------------


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, flags=re.M | re.I)
    assert len(stages) >= 2, "multi-stage"
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url', text)
    assert "ARG TORCH_VERSION=2.13.0" in text and "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] == "10001"  # numeric, matches podSecurityContext.runAsUser
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001
    assert "COPY --from=build" in text
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignore and "tests" in ignore
    hadolint = shutil.which("hadolint")
    if hadolint:
        proc = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_install_script_is_valid_bash() -> None:
    script = ROOT / "scripts" / "install-helm.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
