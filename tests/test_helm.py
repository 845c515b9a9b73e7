"""The Helm chart (helm/kvbus): lint, render, Kubernetes schemas, values schema, scaling, NATS config.

Everything here runs `helm template` (no cluster). The users of the rendered nats.conf are
compared with kvbus.security's per-agent scheme, and the file is run on a real nats-server with
a real coordinator, group scheduler, agents and `kvbus selftest` logging in as the chart's
users, so the permissions it writes are the ones kvbus needs and keep agents apart.

Needs the `helm` binary: env KVBUS_HELM, else `helm` on PATH, else ./.tools/helm (what
`scripts/install-helm.sh` installs); the module is skipped without it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
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
#: The development switch: one NATS server (the real-server tests below run one nats-server on loopback).
SINGLE = "nats.replicas=1"


def _find_helm() -> str | None:
    for candidate in (os.environ.get("KVBUS_HELM"), shutil.which("helm"), str(ROOT / ".tools" / "helm")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


HELM = _find_helm()
pytestmark = pytest.mark.skipif(
    HELM is None,
    reason="helm binary not found: set KVBUS_HELM, put helm on PATH, or run "
    "`scripts/install-helm.sh` (installs ./.tools/helm)",
)


# -- rendering ---------------------------------------------------------------------------------


class HelmError(Exception):
    def __init__(self, args: list[str], stderr: str) -> None:
        super().__init__(f"helm {' '.join(args)} failed:\n{stderr}")
        self.stderr = stderr


def helm(*args: str) -> str:
    assert HELM is not None
    # No cluster is used: an empty kubeconfig keeps a developer's real one out of the way.
    proc = subprocess.run(
        [HELM, *args], capture_output=True, text=True, timeout=60, env={**os.environ, "KUBECONFIG": os.devnull}
    )
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


@functools.cache
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
    return [
        d for d in by_kind(docs, kind) if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == name
    ]


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


_NATS_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|[{}\[\],:=]|[^\s{}\[\],:="#]+')


def parse_nats_conf(text: str) -> dict[str, Any]:
    """A nats.conf as a dict: maps ({ k: v } or k { }), lists, quoted strings, bare words
    (true/false become booleans, anything else, e.g. 8MB or $VARIABLE, stays a string)."""
    tokens: list[str] = []
    at = 0
    for m in _NATS_TOKEN.finditer(text):
        assert m.start() == at, f"nats.conf does not parse at {text[at : at + 60]!r}"
        at = m.end()
        if m.group().strip() and not m.group().startswith("#"):
            tokens.append(m.group())
    assert at == len(text), f"nats.conf does not parse at {text[at : at + 60]!r}"
    pos = 0

    def value() -> Any:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "{":
            return body("}")
        if tok == "[":
            items = []
            while tokens[pos] != "]":
                if tokens[pos] == ",":
                    pos += 1
                    continue
                items.append(value())
            pos += 1
            return items
        if tok.startswith('"'):
            return json.loads(tok)
        return {"true": True, "false": False}.get(tok, tok)

    def body(end: str | None) -> dict[str, Any]:
        nonlocal pos
        out: dict[str, Any] = {}
        while pos < len(tokens) and tokens[pos] != end:
            if tokens[pos] == ",":
                pos += 1
                continue
            key = tokens[pos].strip('"')
            pos += 1
            if tokens[pos] in (":", "="):
                pos += 1
            assert key not in out, f"{key} twice"
            out[key] = value()
        pos += 1
        return out

    return body(None)


def auth_secret(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The generated auth Secret's keys, decoded: a password per user, and auth.conf."""
    return {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", f"{RELEASE}-nats-auth")["data"].items()}


def auth_conf(docs: list[dict[str, Any]]) -> str:
    """auth.conf, the users with their passwords, from the generated auth Secret."""
    return auth_secret(docs)["auth.conf"]


def nats_users(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The users of the rendered authorization block, in order: auth.conf in the generated
    Secret when nats.conf includes it, else nats.conf's own (nats.auth.existingSecret)."""
    conf = parse_nats_conf(nats_conf(docs))
    if conf.get("include") == "auth.conf":
        assert "authorization" not in conf
        conf = parse_nats_conf(auth_conf(docs))
    return conf["authorization"]["users"]


def security_users(agents: list[tuple[str, str, tuple[str, ...]]], groups: list[str]) -> list[tuple[str, Any]]:
    """(user, permissions) of every user kvbus.security.permissions_config writes, in order."""
    from kvbus.security import AgentGrant, permissions_config

    block, _ = permissions_config([AgentGrant(n, g, bcast) for n, g, bcast in agents], groups)
    users = json.loads(block[block.index("users:") + len("users:") : block.rindex("}")])
    return [(u["user"], u["permissions"]) for u in users]


VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "groups-1": (("groups.count=1",), ()),
    "groups-2": (("groups.count=2",), ()),
    "groups-3": (("groups.count=3",), ()),
    "no-auth-no-metrics": (("nats.auth.enabled=false", "metrics.enabled=false", "redis.auth.enabled=false"), ()),
    "jaeger-off-otel-off": (("jaeger.enabled=false", "otel.enabled=false"), ()),
    "jaeger-on": (("jaeger.enabled=true",), ()),
    "reloader-off": (("nats.reloader.enabled=false",), ()),
    "existing-secret": (("nats.auth.existingSecret=kvbus-nats-users",), ()),
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
            pytest.fail(
                f"{variant}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {'/'.join(map(str, exc.path))}"
            )


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
    text = helm(
        "template",
        release,
        str(CHART),
        "--set-json",
        'groups.list=[{"name":"%s"}]' % ("g" * 24),
        "--set",
        "jaeger.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true",
    )
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


def _is_auth_secret(raw: str) -> bool:
    """The one document that lists the NATS users: the generated auth Secret (a key per user and
    auth.conf). A new group or agent adds its user there, so it changes (and `helm template`
    cannot look up the installed passwords, so they differ between two renders)."""
    doc = yaml.safe_load(raw)
    return (doc["kind"], doc["metadata"]["name"]) == ("Secret", f"{RELEASE}-nats-auth")


def _without_random_passwords(raw: str) -> str:
    """A rendered document, the values of any other Secret (the Redis password: random in
    `helm template`, kept by `lookup` on a real upgrade) masked."""
    doc = yaml.safe_load(raw)
    if doc["kind"] != "Secret":
        return raw
    return yaml.safe_dump({**doc, "data": dict.fromkeys(doc.get("data", {}), "<random>")})


#: The NATS server's own resources: they must not change when a user is added.
NATS_SERVER_DOCS = {("StatefulSet", f"{RELEASE}-nats"), ("ConfigMap", f"{RELEASE}-nats-config")}


@pytest.mark.parametrize(
    "before, after, new",
    [
        (("groups.count=2",), ("groups.count=3",), {"g2"}),
        (("groups.count=1",), ("groups.count=5",), {"g1", "g2", "g3", "g4"}),
        # a named group inserted in the middle of the list
        (
            ('json:groups.list=[{"name":"a"},{"name":"c","replicas":3}]',),
            ('json:groups.list=[{"name":"a"},{"name":"b"},{"name":"c","replicas":3}]',),
            {"b"},
        ),
        # one more agent: no new resource at all
        (
            ('json:nats.auth.agents=[{"name":"alice","group":"g0"}]',),
            ('json:nats.auth.agents=[{"name":"alice","group":"g0"},{"name":"bob","group":"g0"}]',),
            set(),
        ),
    ],
    ids=["2-to-3", "1-to-5", "named-in-the-middle", "one-more-agent"],
)
def test_adding_a_group_or_agent_changes_only_the_auth_secret(
    before: tuple[str, ...], after: tuple[str, ...], new: set[str]
) -> None:
    """`helm upgrade` with one more group or agent: every resource but the auth Secret is
    byte-identical (the NATS StatefulSet and its ConfigMap too, so no NATS server restarts: the
    reloader hot-reloads the Secret's auth.conf), and the only new resources are the new group's
    scheduler StatefulSet, Service and PodDisruptionBudget."""
    old_all, new_all = raw_documents(render_text(before)), raw_documents(render_text(after))
    assert sum(map(_is_auth_secret, old_all)) == sum(map(_is_auth_secret, new_all)) == 1
    old = [_without_random_passwords(d) for d in old_all if not _is_auth_secret(d)]
    new_docs = [_without_random_passwords(d) for d in new_all if not _is_auth_secret(d)]
    missing = [d[:300] for d in old if d not in new_docs]
    assert not missing, "changed by adding a group or agent:\n" + "\n---\n".join(missing)
    server_docs = [
        d for d in old if (yaml.safe_load(d)["kind"], yaml.safe_load(d)["metadata"]["name"]) in NATS_SERVER_DOCS
    ]
    assert len(server_docs) == 2 and all(d in new_docs for d in server_docs)
    added = [d for d in new_docs if d not in old]
    assert {_group_of(d) for d in added} == new, [d[:200] for d in added]
    assert sorted(yaml.safe_load(d)["kind"] for d in added) == sorted(
        ["PodDisruptionBudget", "Service", "StatefulSet"] * len(new)
    )


def test_existing_groups_statefulsets_identical_when_adding() -> None:
    two = {
        (_group_of(d), yaml.safe_load(d)["kind"]): d
        for d in raw_documents(render_text(("groups.count=2",)))
        if _group_of(d)
    }
    three = {
        (_group_of(d), yaml.safe_load(d)["kind"]): d
        for d in raw_documents(render_text(("groups.count=3",)))
        if _group_of(d)
    }
    for key in (("g0", "StatefulSet"), ("g1", "StatefulSet"), ("g0", "Service"), ("g1", "PodDisruptionBudget")):
        assert two[key] == three[key], key
    assert ("g2", "StatefulSet") in three and ("g2", "StatefulSet") not in two


# -- the values schema rejects bad values ------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (("groups.count=-1",), ["/groups/count", "minimum"]),
        (("groups.count=0",), ["/groups/count", "minimum"]),
        (("groups.count=two",), ["/groups/count", "want integer"]),
        (("json:groups.count=1.5",), ["/groups/count"]),
        (("group.count=3",), ["additional properties 'group'"]),
        (("groups.list[0].name=Bad_Name",), ["/groups/list/0/name", "pattern"]),
        (('json:groups.list=[{"replicas":2}]',), ["/groups/list/0", "name"]),
        (("scheduler.replicas=0",), ["/scheduler/replicas", "minimum"]),
        (("coordinator.replicas=yes",), ["/coordinator/replicas"]),
        (("nats.maxPayload=huge",), ["/nats/maxPayload"]),
        (("otel.protocol=udp",), ["/otel/protocol"]),
        (("metrics.port=80",), ["/metrics/port", "minimum"]),
        (("image.pullPolicy=Sometimes",), ["/image/pullPolicy"]),
        (('json:scheduler.config={"Max-Active":3}',), ["/scheduler/config"]),
        (('json:nats.statefulSet.patch=[{"op":"frobnicate","path":"/spec"}]',), ["/nats/statefulSet/patch/0/op"]),
        (("nats.enabled=false",), ["nats.external.url must name the NATS to use"]),
        (("nats.enabled=false", "nats.external.url=nats://u:pw@nats:4222"), ["must not carry credentials"]),
        (("nats.replicas=2",), ["JetStream quorum"]),
        (("nats.tls.enabled=true",), ["nats.tls.secretName is empty"]),
        (("test.group=nope",), ['test.group "nope" is not one of the groups (g0)']),
        (('json:groups.list=[{"name":"a"},{"name":"a"}]',), ['the group name "a" appears twice']),
        (("jaeger.enabled=true", "otel.endpoint=http://collector:4318"), ["jaeger.enabled and otel.endpoint"]),
        (
            ('json:scheduler.statefulSet.patch=[{"op":"replace","path":"/spec/nothere","value":1}]',),
            ['key "nothere" does not exist'],
        ),
        (
            ('json:nats.auth.agents=[{"name":"bad.name","group":"g0"}]',),
            ["at '/nats/auth/agents/0/name': 'bad.name' does not match pattern"],
        ),
        (('json:nats.auth.agents=[{"name":"a"}]',), ["at '/nats/auth/agents/0': missing property 'group'"]),
        (('json:nats.auth.agents=[{"name":"a","group":"g0","groups":["g1"]}]',), ["additional properties 'groups'"]),
        (
            ('json:nats.auth.agents=[{"name":"a","group":"g0","broadcastsFrom":["b c"]}]',),
            ["/nats/auth/agents/0/broadcastsFrom/0", "pattern"],
        ),
        (
            ('json:nats.auth.agents=[{"name":"a","group":"g9"}]',),
            ['nats.auth.agents[0] (a): group "g9" is not one of the groups (g0)'],
        ),
        (
            ('json:nats.auth.agents=[{"name":"a","group":"g0"},{"name":"a","group":"g0"}]',),
            ['the agent name "a" appears twice'],
        ),
        (
            ('json:nats.auth.agents=[{"name":"selftest-tx","group":"g0"}]',),
            ['the name "selftest-tx" is used by `helm test`'],
        ),
        (("nats.auth.agentPermissions.publish=x",), ["additional properties 'agentPermissions'"]),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(args: tuple[str, ...], expected: list[str]) -> None:
    err = render_error(*args)
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in:\n{err}"


@pytest.mark.parametrize(
    "name", ["a", "Planner-2_b", "x" * 64, "", "x" * 65, "bad.name", "sp ace", "wild*", "gt>", "ünï"]
)
def test_agent_names_follow_check_name(name: str) -> None:
    """The schema accepts exactly the agent names kvbus.protocol.check_name accepts."""
    from kvbus.protocol import check_name

    try:
        check_name("agent", name)
        valid = True
    except ValueError:
        valid = False
    agents = json.dumps([{"name": "ok", "group": "g0", "broadcastsFrom": [name]}, {"name": name, "group": "g0"}])
    if valid:
        assert render(f"json:nats.auth.agents={agents}")
    else:
        err = render_error(f"json:nats.auth.agents={agents}")
        assert "/nats/auth/agents/0/broadcastsFrom/0" in err and "/nats/auth/agents/1/name" in err, err


# -- helm test, tracing, metrics ---------------------------------------------------------------


@pytest.mark.parametrize("variant", ["default", "groups-3", "external", "secure"])
def test_helm_test_pod_runs_selftest_as_two_agents(variant: str) -> None:
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
    assert env["KVBUS_NATS_URL"].startswith(("nats://", "tls://")) and "@" not in env["KVBUS_NATS_URL"]
    assert "--nats-url" not in " ".join(c["args"])  # credentials stay out of argv
    secret = {"external": "kvbus-nats-credentials", "secure": "kvbus-nats-users"}.get(variant, f"{RELEASE}-nats-auth")
    for var, agent in (("KVBUS_SELFTEST_SENDER", "selftest-tx"), ("KVBUS_SELFTEST_RECEIVER", "selftest-rx")):
        # Each test agent logs in as its own user, like any agent of the per-agent scheme.
        assert env[var] == agent
        assert env[f"{var}_PASSWORD"]["secretKeyRef"] == {"name": secret, "key": f"agent-{agent}"}
        assert env[f"{var}_URL"].endswith(":4222") and f"://agent-{agent}:$({var}_PASSWORD)@" in env[f"{var}_URL"]
        assert env[f"{var}_INBOX_PREFIX"] == f"_INBOX.{agent}"


def test_kvbus_pods_log_in_as_their_own_user() -> None:
    """The coordinator as user coordinator, each group's scheduler as sched-<group>, each with
    its reply inbox; the Secret holds one 32-character password per user."""
    docs = render("groups.count=2")
    secret = one(docs, "Secret", f"{RELEASE}-nats-auth")
    expected = {
        f"Deployment/{RELEASE}-coordinator": ("coordinator", "_INBOX.coord"),
        f"StatefulSet/{RELEASE}-sched-g0": ("sched-g0", "_INBOX.sched-g0"),
        f"StatefulSet/{RELEASE}-sched-g1": ("sched-g1", "_INBOX.sched-g1"),
    }
    seen = {}
    for what, c in kvbus_containers(docs):
        if what.startswith("Pod/"):
            continue
        env = env_of(c)
        seen[what] = (env["KVBUS_NATS_USER"], env["KVBUS_NATS_INBOX_PREFIX"])
        assert env["KVBUS_NATS_PASSWORD"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"],
            "key": env["KVBUS_NATS_USER"],
        }, what
        assert env["KVBUS_NATS_URL"] == (
            f"nats://$(KVBUS_NATS_USER):$(KVBUS_NATS_PASSWORD)@{RELEASE}-nats.{NAMESPACE}.svc.cluster.local:4222"
        )
    assert seen == expected
    assert sorted(secret["data"]) == sorted(
        ["agent-selftest-tx", "agent-selftest-rx", "sched-g0", "sched-g1", "coordinator", "auth.conf"]
    )
    passwords = [base64.b64decode(v) for k, v in secret["data"].items() if k != "auth.conf"]
    assert all(len(p) == 32 for p in passwords) and len(set(passwords)) == len(passwords)


@pytest.mark.parametrize(
    "variant, endpoint, protocol",
    [
        ("jaeger-on", f"http://{RELEASE}-jaeger.{NAMESPACE}.svc.cluster.local:4318", "http/protobuf"),
        ("jaeger", f"http://{RELEASE}-jaeger.{NAMESPACE}.svc.cluster.local:4317", "grpc"),
        ("external", "http://otel-collector.observability.svc.cluster.local:4318", "http/protobuf"),
    ],
)
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
    # Agent pods (envFrom the client ConfigMap, as NOTES says) export where the kvbus pods do.
    client = one(docs, "ConfigMap", f"{RELEASE}-client")["data"]
    assert client["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint and client["OTEL_EXPORTER_OTLP_PROTOCOL"] == protocol
    if variant.startswith("jaeger"):
        jaeger = one(docs, "Service", f"{RELEASE}-jaeger")
        assert {p["port"] for p in jaeger["spec"]["ports"]} == {4317, 4318, 16686}
        # That endpoint is a Jaeger port that speaks the protocol, and the container listens on it.
        port = next(p for p in jaeger["spec"]["ports"] if p["port"] == int(endpoint.rsplit(":", 1)[1]))
        assert port["targetPort"] == ("otlp-grpc" if protocol == "grpc" else "otlp-http")
        (container,) = one(docs, "Deployment", f"{RELEASE}-jaeger")["spec"]["template"]["spec"]["containers"]
        assert port["targetPort"] in {p["name"] for p in container["ports"]}
        assert {"name": "COLLECTOR_OTLP_ENABLED", "value": "true"} in container["env"]


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
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in metric_services} == {
        "coordinator",
        "scheduler",
    }
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
    parsed = parse_nats_conf(conf)
    assert parsed["jetstream"]["store_dir"] == "/data" and parsed["max_payload"] == "8MB"
    # The users are not in nats.conf: it includes auth.conf, a key of the generated Secret.
    assert parsed["include"] == "auth.conf" and "authorization" not in parsed and "KVBUS_PW_" not in conf
    secret = auth_secret(docs)
    for user, password in secret.items():  # no password is in the ConfigMap
        if user != "auth.conf":
            assert password not in conf and f'password: "{password}"' in secret["auth.conf"]
    sts = one(docs, "StatefulSet", f"{RELEASE}-nats")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    spec = pod_spec(sts)
    nats, reloader = spec["containers"]
    assert nats["image"].startswith("nats:") and reloader["image"] == nats["image"]  # no other image
    assert not [e for e in nats["env"] if e["name"].startswith("KVBUS_PW_")]
    # nats.conf and auth.conf in one directory, as nats.conf's include expects.
    config = next(v for v in spec["volumes"] if v["name"] == "config")
    assert config["projected"]["sources"] == [
        {"configMap": {"name": f"{RELEASE}-nats-config"}},
        {"secret": {"name": f"{RELEASE}-nats-auth", "items": [{"key": "auth.conf", "path": "auth.conf"}]}},
    ]
    assert {"name": "config", "mountPath": "/etc/nats-config", "readOnly": True} in nats["volumeMounts"]
    assert nats["args"] == ["--config", "/etc/nats-config/nats.conf"]
    # The reloader sidecar sees the same files and signals the server through the pid file.
    assert spec["shareProcessNamespace"] is True
    assert reloader["name"] == "reloader" and reloader["command"][:2] == ["sh", "-c"]
    assert {(m["name"], m["mountPath"]) for m in reloader["volumeMounts"]} == {
        ("config", "/etc/nats-config"),
        ("pid", "/var/run/nats"),
    }
    script = reloader["command"][2]
    assert 'files="/etc/nats-config/*.conf"' in script and "pid_file=/var/run/nats/nats.pid" in script
    assert 'nats-server --signal "reload=$pid_file"' in script and "while sleep 5; do" in script
    assert reloader["securityContext"] == nats["securityContext"]
    assert reloader["resources"]["limits"]["memory"] == "64Mi"
    subprocess.run(["sh", "-n", "-c", script], check=True)
    # The config checksum restarts the servers when nats.conf changes; a new user does not.
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/config"] and "checksum/users" not in annotations


#: Agents (name, group, broadcastsFrom) and groups of the permission renders below.
AGENTS = [
    ("planner", "g0", ("coder", "Reviewer_2")),
    ("coder", "g1", ()),
    ("Reviewer_2", "g2", ("coder",)),
    ("x" * 64, "g0", ()),
]
GROUPS = ["g0", "g1", "g2"]
TEST_AGENTS = [("selftest-tx", "g0", ()), ("selftest-rx", "g0", ())]


def _agents_value(agents: list[tuple[str, str, tuple[str, ...]]]) -> str:
    return "json:nats.auth.agents=" + json.dumps(
        [{"name": n, "group": g, **({"broadcastsFrom": list(b)} if b else {})} for n, g, b in agents]
    )


@pytest.mark.parametrize(
    "sets, files, agents, groups",
    [
        ((_agents_value(AGENTS), "groups.count=3"), (), AGENTS + TEST_AGENTS, GROUPS),
        ((_agents_value(AGENTS), "groups.count=3", "test.enabled=false"), (), AGENTS, GROUPS),
        (
            (_agents_value(AGENTS[:1]), "groups.count=3", "test.group=g2"),
            (),
            AGENTS[:1] + [(n, "g2", b) for n, _, b in TEST_AGENTS],
            GROUPS,
        ),
        (("groups.count=1",), (), TEST_AGENTS, ["g0"]),
        (
            (),
            (str(CHART / "ci" / "groups-list-values.yaml"),),
            [
                ("planner", "planners", ()),
                ("coder_1", "coders", ()),
                ("Reviewer-A", "reviewers", ("coder_1",)),
                ("reviewer-b", "reviewers", ("coder_1", "planner")),
                ("selftest-tx", "coders", ()),
                ("selftest-rx", "coders", ()),
            ],
            ["planners", "coders", "reviewers"],
        ),
    ],
    ids=["3-groups", "no-test-pod", "test-in-g2", "defaults", "ci-groups-list"],
)
def test_nats_permissions_are_kvbus_security_ones(
    sets: tuple[str, ...], files: tuple[str, ...], agents: list[tuple[str, str, tuple[str, ...]]], groups: list[str]
) -> None:
    """Every user of the rendered nats.conf, in order, has exactly the permissions
    kvbus.security gives it (agent_permissions, scheduler_permissions, coordinator_permissions)."""
    docs = render(*sets, files=files)
    users = nats_users(docs)
    assert [(u["user"], u["permissions"]) for u in users] == security_users(agents, groups)
    # auth.conf holds each user's password, the one of the Secret key named as the user (what
    # the kvbus pods and agents log in with).
    secret = auth_secret(docs)
    assert sorted(secret) == sorted([u["user"] for u in users] + ["auth.conf"])
    assert {u["user"]: u["password"] for u in users} == {k: v for k, v in secret.items() if k != "auth.conf"}
    assert not [e for e in _nats_env(docs) if e["name"].startswith("KVBUS_PW_")]


def test_nats_users_from_an_existing_secret() -> None:
    """With nats.auth.existingSecret the chart cannot write the passwords: nats.conf lists the
    users, each password a $KVBUS_PW_<user> variable the NATS container gets from that Secret
    (so a new user rolls the servers; `test_users_roll_the_servers_without_hot_reload`)."""
    docs = render(files=(str(CHART / "ci" / "secure-values.yaml"),))
    assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].startswith(f"{RELEASE}-nats")]
    sts = one(docs, "StatefulSet", f"{RELEASE}-nats")
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in pod_spec(sts)["containers"][0]["env"]
        if e["name"].startswith("KVBUS_PW_")
    }
    refs = list(env.values())
    assert sorted(r["key"] for r in refs) == sorted(
        ["agent-planner", "agent-writer", "agent-selftest-tx", "agent-selftest-rx", "sched-g0", "coordinator"]
    )
    assert {r["name"] for r in refs} == {"kvbus-nats-users"}
    users = parse_nats_conf(nats_conf(docs))["authorization"]["users"]
    assert {u["password"][1:]: {"name": "kvbus-nats-users", "key": u["user"]} for u in users} == env
    assert "include" not in parse_nats_conf(nats_conf(docs))
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    assert volumes["config"] == {"name": "config", "configMap": {"name": f"{RELEASE}-nats-config"}}
    # The reloader still runs: it hot-reloads a renewed TLS certificate.
    reloader = pod_spec(sts)["containers"][1]
    assert 'files="/etc/nats-config/*.conf /etc/nats/tls/*"' in reloader["command"][2]
    assert {"name": "tls", "mountPath": "/etc/nats/tls", "readOnly": True} in reloader["volumeMounts"]
    client = one(docs, "ConfigMap", f"{RELEASE}-client")
    assert client["data"]["KVBUS_NATS_SECRET"] == "kvbus-nats-users"
    how = client["metadata"]["annotations"]["kvbus.io/nats-credentials"]
    assert "jsonpath='{.data.agent-NAME}'" in how and "inbox_prefix='_INBOX.NAME'" in how


def _users_by_name(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {u["user"]: u for u in nats_users(docs)}


def _nats_env(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return pod_spec(one(docs, "StatefulSet", f"{RELEASE}-nats"))["containers"][0]["env"]


@pytest.mark.parametrize(
    "before, after, added",
    [
        (("groups.count=2",), ("groups.count=3",), {"sched-g2"}),
        (
            ('json:groups.list=[{"name":"a"},{"name":"c"}]',),
            ('json:groups.list=[{"name":"a"},{"name":"b"},{"name":"c"}]',),
            {"sched-b"},
        ),
        ((_agents_value(AGENTS), "groups.count=3"), (_agents_value(AGENTS), "groups.count=4"), {"sched-g3"}),
        (
            (_agents_value(AGENTS[:2]), "groups.count=3"),
            (_agents_value(AGENTS[:3]), "groups.count=3"),
            {"agent-Reviewer_2"},
        ),
    ],
)
def test_adding_a_group_or_agent_adds_its_user_only(
    before: tuple[str, ...], after: tuple[str, ...], added: set[str]
) -> None:
    """`helm upgrade` with one more group (or agent): one more user in auth.conf and one more
    Secret key, every other user's permissions unchanged (their passwords too on a real upgrade:
    the Secret keeps the installed ones by `lookup`, which `helm template` cannot run), and no
    pod changes but the new group's: not the NATS servers (nats.conf and their environment are
    the same), not the other kvbus pods."""
    old_docs, new_docs = render(*before), render(*after)
    old_users, new_users = _users_by_name(old_docs), _users_by_name(new_docs)
    assert set(new_users) - set(old_users) == added and set(old_users) <= set(new_users)
    assert all(new_users[u]["permissions"] == old_users[u]["permissions"] for u in old_users)
    assert [u for u in new_users if u not in old_users] == [u for u in new_users if u in added]
    assert nats_conf(old_docs) == nats_conf(new_docs)
    assert _nats_env(old_docs) == _nats_env(new_docs)
    old_keys = set(auth_secret(old_docs))
    assert set(auth_secret(new_docs)) - old_keys == added
    old_raw, new_raw = (
        [_without_random_passwords(d) for d in raw_documents(render_text(tuple(sets))) if not _is_auth_secret(d)]
        for sets in (before, after)
    )
    assert all(d in new_raw for d in old_raw)  # NATS, the coordinator, the other groups, the client ConfigMap
    if any(u.startswith("agent-") for u in added):
        assert new_raw == old_raw  # a new agent restarts no pod at all


@pytest.mark.parametrize("mode", ["reloader-off", "existing-secret"])
def test_users_roll_the_servers_without_hot_reload(mode: str) -> None:
    """Where nothing hot-reloads the users, a new user changes the NATS pod template, so
    `helm upgrade` rolls the servers instead of leaving the new user locked out: without the
    reloader through the checksum/users annotation (nats.conf stays the same), with
    nats.auth.existingSecret through nats.conf (its users) and the password variables."""
    sets = VARIANTS[mode][0]
    before, after = (*sets, _agents_value(AGENTS[:1])), (*sets, _agents_value(AGENTS[:1]), "groups.count=2")
    old_docs, new_docs = render(*before), render(*after)
    old_sts, new_sts = one(old_docs, "StatefulSet", f"{RELEASE}-nats"), one(new_docs, "StatefulSet", f"{RELEASE}-nats")
    old_ann, new_ann = (s["spec"]["template"]["metadata"]["annotations"] for s in (old_sts, new_sts))
    if mode == "reloader-off":
        assert "reloader" not in [c["name"] for c in pod_spec(old_sts)["containers"]]
        assert "shareProcessNamespace" not in pod_spec(old_sts)
        assert nats_conf(old_docs) == nats_conf(new_docs) and old_ann["checksum/config"] == new_ann["checksum/config"]
        assert old_ann["checksum/users"] != new_ann["checksum/users"]
        old_sts["spec"]["template"]["metadata"]["annotations"].pop("checksum/users")
        new_sts["spec"]["template"]["metadata"]["annotations"].pop("checksum/users")
        assert old_sts == new_sts  # nothing else changes
    else:
        assert not [d for d in by_kind(new_docs, "Secret") if d["metadata"]["name"].startswith(f"{RELEASE}-nats")]
        assert old_ann["checksum/config"] != new_ann["checksum/config"]
        added = [e for e in _nats_env(new_docs) if e not in _nats_env(old_docs)]
        assert [e["valueFrom"]["secretKeyRef"] for e in added] == [{"name": "kvbus-nats-users", "key": "sched-g1"}]
        assert [u["user"] for u in nats_users(new_docs) if u not in nats_users(old_docs)] == ["sched-g1"]


def test_nats_cluster_and_tls() -> None:
    docs = render(files=(str(CHART / "ci" / "secure-values.yaml"),))
    conf = nats_conf(docs)
    assert conf.count(f"{RELEASE}-nats-headless.{NAMESPACE}.svc.cluster.local:6222") == 3
    parsed = parse_nats_conf(conf)
    assert len(parsed["cluster"]["routes"]) == 3 and parsed["tls"]["cert_file"] == "/etc/nats/tls/tls.crt"
    assert [u["user"] for u in parsed["authorization"]["users"]] == [
        "agent-planner",
        "agent-writer",
        "agent-selftest-tx",
        "agent-selftest-rx",
        "sched-g0",
        "coordinator",
    ]
    assert 'cert_file: "/etc/nats/tls/tls.crt"' in conf
    sts = one(docs, "StatefulSet", f"{RELEASE}-nats")
    assert sts["spec"]["replicas"] == 3
    assert one(docs, "PodDisruptionBudget", f"{RELEASE}-nats")["spec"]["maxUnavailable"] == 1
    assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == f"{RELEASE}-nats-auth"]
    for what, c in kvbus_containers(docs):
        env = env_of(c)
        assert env["KVBUS_NATS_URL"].startswith("tls://"), what
        password = env["KVBUS_SELFTEST_SENDER_PASSWORD" if what.startswith("Pod/") else "KVBUS_NATS_PASSWORD"]
        assert password["secretKeyRef"]["name"] == "kvbus-nats-users", what
        assert env["SSL_CERT_FILE"] == "/etc/kvbus/nats-ca/ca.crt", what
        assert c["image"] == "registry.example.com/ml/kvbus:0.2.0"  # the pinned tag of ci/secure-values.yaml


def _selftest_args(docs: list[dict[str, Any]]) -> list[str]:
    return list(_container(docs, "Pod", f"{RELEASE}-selftest")["args"])


def test_nats_defaults_to_a_3_server_cluster_with_buckets_at_r3() -> None:
    docs = render()
    sts = one(docs, "StatefulSet", f"{RELEASE}-nats")
    assert sts["spec"]["replicas"] == 3
    parsed = parse_nats_conf(nats_conf(docs))
    assert len(parsed["cluster"]["routes"]) == 3
    assert one(docs, "PodDisruptionBudget", f"{RELEASE}-nats")["spec"]["maxUnavailable"] == 1
    # Schedulers and the coordinator have budgets too: a drain never takes every replica at once.
    pdbs = {d["metadata"]["name"] for d in by_kind(docs, "PodDisruptionBudget")}
    assert {f"{RELEASE}-nats", f"{RELEASE}-coordinator", f"{RELEASE}-sched-g0"} <= pdbs, pdbs
    for what, c in kvbus_containers(docs):
        assert env_of(c)["KVBUS_BUCKET_REPLICAS"] == "3", what
    args = _selftest_args(docs)
    assert "--expect-replicas=3" in args
    assert f"--nats-monitor-url=http://{RELEASE}-nats-headless.{NAMESPACE}.svc.cluster.local:8222" in args


@pytest.mark.parametrize(
    ("sets", "replicas"),
    [((SINGLE,), "1"), (("nats.replicas=5",), "3"), (("nats.replicas=5", "nats.jetstream.bucketReplicas=5"), "5")],
    ids=["single-server-development", "five-servers", "five-servers-r5"],
)
def test_bucket_replicas_follow_the_nats_servers(sets: tuple[str, ...], replicas: str) -> None:
    docs = render(*sets)
    for what, c in kvbus_containers(docs):
        assert env_of(c)["KVBUS_BUCKET_REPLICAS"] == replicas, what
    assert f"--expect-replicas={replicas}" in _selftest_args(docs)
    if sets == (SINGLE,):
        assert "cluster" not in parse_nats_conf(nats_conf(docs))
        assert not [d for d in by_kind(docs, "PodDisruptionBudget") if d["metadata"]["name"] == f"{RELEASE}-nats"]


def test_bucket_check_is_off_for_an_external_nats_or_when_disabled() -> None:
    docs = render("nats.enabled=false", "nats.external.url=nats://nats.example:4222")
    assert not any(a.startswith("--expect-replicas") for a in _selftest_args(docs))
    for what, c in kvbus_containers(docs):
        assert "KVBUS_BUCKET_REPLICAS" not in env_of(c), what  # kvbus follows the cluster it finds
    docs = render("test.checkBucketReplicas=false")
    assert not any(a.startswith("--expect-replicas") for a in _selftest_args(docs))
    assert "/nats/jetstream/bucketReplicas" in render_error("nats.jetstream.bucketReplicas=7")


def test_selftest_checks_bucket_replicas_on_a_real_cluster() -> None:
    """`kvbus selftest --expect-replicas` (what `helm test` runs) against a real 3-server cluster:
    passes at 3, fails at 1 (the buckets must have exactly what the chart asks)."""
    from kvbus.app.cluster import NatsCluster

    with NatsCluster(3) as c:
        env = {**os.environ, "KVBUS_NATS_URL": c.url}
        sched = subprocess.Popen(
            [sys.executable, "-m", "kvbus.app.cli", "group-scheduler", "--group", "default"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            assert sched.stdout is not None
            line = sched.stdout.readline().decode()  # it prints one line once it serves
            assert line.startswith("group scheduler"), line
            monitor = f"http://127.0.0.1:{c.servers[2].http_port}"
            base = [
                sys.executable,
                "-m",
                "kvbus.app.cli",
                "selftest",
                "--bytes",
                "65536",
                "--nats-monitor-url",
                monitor,
            ]
            ok = subprocess.run([*base, "--expect-replicas", "3"], env=env, capture_output=True, text=True, timeout=120)
            assert ok.returncode == 0, ok.stdout + ok.stderr
            assert "bucket kvbus_agents: 3 replica(s)" in ok.stdout
            bad = subprocess.run(
                [*base, "--expect-replicas", "1"],
                env={**env, "KVBUS_SELFTEST_REPLICAS_WAIT": "1"},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert bad.returncode == 1 and "should have 1 replica(s)" in bad.stderr, bad.stdout + bad.stderr
        finally:
            _stop(sched)


def test_redis_cluster_mode() -> None:
    docs = render(files=(str(CHART / "ci" / "redis-cluster-values.yaml"),))
    sts = one(docs, "StatefulSet", f"{RELEASE}-redis")
    assert sts["spec"]["replicas"] == 6 and sts["spec"]["serviceName"] == f"{RELEASE}-redis-headless"
    conf = one(docs, "ConfigMap", f"{RELEASE}-redis-config")["data"]["redis.conf"]
    for line in ("cluster-enabled yes", "cluster-config-file /data/nodes.conf", "include /run/redis/announce.conf"):
        assert line in conf
    headless = one(docs, "Service", f"{RELEASE}-redis-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in headless["spec"]["ports"]} == {6379, 16379}
    job = one(docs, "Job", f"{RELEASE}-redis-cluster-create")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    script = pod_spec(job)["containers"][0]["command"][-1]
    assert "--cluster-replicas 1" in script and script.count(f"-headless.{NAMESPACE}.svc.cluster.local") == 6
    # The password never is on a command line, and kvbus pods reach the cluster with the cluster client.
    assert "REDIS_PASSWORD" not in script
    for what, c in kvbus_containers(docs):
        env = env_of(c)
        if "KVBUS_REDIS_URL" in env:
            assert env["KVBUS_REDIS_URL"].startswith("redis+cluster://:$(KVBUS_REDIS_PASSWORD)@"), what
    standalone = render()
    assert one(standalone, "StatefulSet", f"{RELEASE}-redis")["spec"]["replicas"] == 1
    assert not [d for d in by_kind(standalone, "Job")]
    assert "/redis/cluster/shards" in render_error("redis.mode=cluster", "redis.cluster.shards=2")


def test_external_nats_and_redis() -> None:
    docs = render(files=(str(CHART / "ci" / "external-values.yaml"),))
    assert not [d for d in docs if d["metadata"]["labels"]["app.kubernetes.io/component"] in ("nats", "redis")]
    for what, c in kvbus_containers(docs):
        env = env_of(c)
        if what.startswith("Pod/"):
            assert env["KVBUS_SELFTEST_SENDER_URL"] == (
                "tls://agent-selftest-tx:$(KVBUS_SELFTEST_SENDER_PASSWORD)@nats.messaging.svc.cluster.local:4222"
            )
            continue
        assert env["KVBUS_NATS_URL"] == (
            "tls://$(KVBUS_NATS_USER):$(KVBUS_NATS_PASSWORD)@nats.messaging.svc.cluster.local:4222"
        ), what
        # The same per-user scheme: the external Secret holds a key per user (sched-g0, coordinator).
        assert env["KVBUS_NATS_PASSWORD"]["secretKeyRef"] == {
            "name": "kvbus-nats-credentials",
            "key": env["KVBUS_NATS_USER"],
        }, what
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
    out = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, *_value_args(sets, files))
    notes = out[out.index("NOTES:") :]
    assert f"helm test {RELEASE}" in notes
    if variant == "no-auth-no-metrics":
        assert "Bus.connect(url)" in notes
    else:  # each agent logs in as its own user, with its own reply inbox
        assert (
            'Bus.connect(url, secure=True, user=f"agent-{agent}", password=os.environ["NATS_PASSWORD"],' in notes
            and 'inbox_prefix=f"_INBOX.{agent}"' in notes
        )
    if variant == "jaeger":
        assert f"port-forward svc/{RELEASE}-jaeger 16686:16686" in notes
        # How an agent pod exports to it: the client ConfigMap's variables and a service name.
        assert f"configMapRef:\n           name: {RELEASE}-client" in notes and "OTEL_SERVICE_NAME" in notes
        assert f"port-forward svc/{RELEASE}-jaeger 4318:4318" in notes
        assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf" in notes
    elif variant == "external":
        assert f"name: {RELEASE}-client" in notes and "4318:4318" not in notes
    elif variant == "default":
        assert "Tracing is off" in notes and "--set groups.count=2" in notes
        assert (
            f"NATS_PASSWORD=$(kubectl -n {NAMESPACE} get secret {RELEASE}-nats-auth "
            '-o jsonpath="{.data.agent-$AGENT}" | base64 -d)'
        ) in notes
        assert "No agent has a user yet: list them in nats.auth.agents" in notes
    elif variant == "no-auth-no-metrics":
        assert "WARNING: nats.auth.enabled is false" in notes
    elif variant == "groups-list":
        assert "append an item to groups.list" in notes
        assert "Agents with a user (nats.auth.agents): planner (planners), coder_1 (coders)," in notes
        assert "export AGENT=planner" in notes and 'group="planners"' in notes


# -- values.yaml documents every key -----------------------------------------------------------

#: Keys whose default value is a block documented as a whole by the comment on the key.
VALUE_BLOCKS = {"resources", "podSecurityContext", "containerSecurityContext"}


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


def _chart_nats(
    docs: list[dict[str, Any]], tmp_path: Path, port: int, monitor: int, existing_secret: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """A real nats-server running the rendered nats.conf as the NATS pod does: in one directory
    (``tmp_path``, the pod's /etc/nats-config) with the auth Secret's auth.conf, which it
    includes; or, with nats.auth.existingSecret, its environment set as the StatefulSet sets it
    (each user's password variable from ``existing_secret``, that Secret's keys). Its pid file
    is tmp_path/nats.pid. Returns the server and each user's password."""
    from kvbus.app.processes import find_nats_server

    conf = nats_conf(docs)
    conf = re.sub(r"^port: \d+$", f"port: {port}", conf, flags=re.M)
    conf = re.sub(r"^http_port: \d+$", f"http_port: {monitor}", conf, flags=re.M)
    conf = conf.replace('"/var/run/nats/nats.pid"', f'"{tmp_path}/nats.pid"').replace('"/data"', f'"{tmp_path}/js"')
    (tmp_path / "nats.conf").write_text(conf + "\nhost: 127.0.0.1\n")
    if existing_secret is None:
        assert 'include "auth.conf"' in conf
        secret = auth_secret(docs)
        (tmp_path / "auth.conf").write_text(secret.pop("auth.conf"))
    else:
        assert "include" not in conf
        secret = dict(existing_secret)
    env = {"SERVER_NAME": "kvbus-nats-0"}
    for e in _nats_env(docs):
        if "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = secret[e["valueFrom"]["secretKeyRef"]["key"]]
    binary = find_nats_server()
    check = subprocess.run(
        [binary, "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert check.returncode == 0, check.stdout + check.stderr
    with open(tmp_path / "nats.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, "-c", str(tmp_path / "nats.conf")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    deadline = time.monotonic() + 15
    while "Server is ready" not in (tmp_path / "nats.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "nats.log").read_text()
        time.sleep(0.05)
    return proc, secret


def _pod_env(container: dict[str, Any], secret: dict[str, str], port: int) -> dict[str, str]:
    """A container's environment as Kubernetes builds it (secretKeyRef read from ``secret``,
    $(VAR) expanded), with the NATS service address replaced by the local server's."""
    env: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
            env[e["name"]] = value.replace(f"{RELEASE}-nats.{NAMESPACE}.svc.cluster.local:4222", f"127.0.0.1:{port}")
        elif "secretKeyRef" in e["valueFrom"] and e["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-nats-auth":
            env[e["name"]] = secret[e["valueFrom"]["secretKeyRef"]["key"]]
    return env


def _container(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return pod_spec(one(docs, kind, name))["containers"][0]


def _wait_for_subscriptions(
    monitor: int, subjects: set[str], logs: Path, timeout: float = 90.0, procs: tuple[subprocess.Popen[bytes], ...] = ()
) -> None:
    """Until the server's monitoring endpoint lists a subscription on each subject (fails at
    once when one of ``procs`` exits or the server refuses something)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/subsz?subs=1&limit=100000", timeout=5) as r:
            seen = {s["subject"] for s in json.load(r).get("subscriptions_list", [])}
        if subjects <= seen:
            return
        refused = "Violation" in (logs / "nats.log").read_text()
        if time.monotonic() > deadline or refused or any(p.poll() is not None for p in procs):
            pytest.fail(
                f"no subscription on {subjects - seen} ({'refused' if refused else 'timeout or exit'}); "
                "logs:\n" + "".join(p.read_text() for p in logs.glob("*.log"))
            )
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _wait_for_errors(errors: list[str], needles: list[str], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(any(n in e for e in errors) for n in needles):
        assert time.monotonic() < deadline, f"expected errors with {needles}, got {errors}"
        await asyncio.sleep(0.02)


async def test_chart_users_on_a_real_server(tmp_path: Path) -> None:
    """The chart's nats.conf on a real nats-server, everyone logging in as the chart says: the
    coordinator and the group scheduler with their pods' user and reply inbox, agents alice and
    bob as NOTES.txt shows, the `helm test` agents with their pod's environment. Transfers and a
    broadcast go through; alice may not read bob's inbox or data, nor publish a grant; a wrong
    password is refused."""
    import nats

    from kvbus.app.processes import free_port
    from kvbus.bus import Bus
    from kvbus.coordinator import Coordinator
    from kvbus.group_scheduler import GroupScheduler, SchedulerConfig
    from kvbus.protocol import Grant, agent_subject
    from tests.conftest import FAST
    from tests.kvutil import kv_of_bytes, random_kv
    from tests.peer import SIG

    docs = render(_agents_value([("alice", "g0", ()), ("bob", "g0", ("alice",)), ("carol", "g0", ())]), SINGLE)
    port, monitor = free_port(), free_port()
    server, secret = _chart_nats(docs, tmp_path, port, monitor)
    url = f"nats://127.0.0.1:{port}"
    closers: list[Any] = []
    try:

        def pod_options(kind: str, name: str) -> dict[str, Any]:
            env = _pod_env(_container(docs, kind, name), secret, port)
            return {
                "user": env["KVBUS_NATS_USER"],
                "password": env["KVBUS_NATS_PASSWORD"],
                "inbox_prefix": env["KVBUS_NATS_INBOX_PREFIX"],
            }

        coord = await Coordinator.connect(url, nats_options=pod_options("Deployment", f"{RELEASE}-coordinator"))
        closers.append(coord)
        sched = await GroupScheduler.connect(
            url,
            "g0",
            config=SchedulerConfig(max_active=8),
            nats_options=pod_options("StatefulSet", f"{RELEASE}-sched-g0"),
        )
        closers.append(sched)
        errors: dict[str, list[str]] = {}
        buses: dict[str, Bus] = {}
        agents = {}
        for name in ("alice", "bob", "carol"):
            errors[name] = []

            async def on_error(exc: Exception, name: str = name) -> None:
                errors[name].append(str(exc))

            bus = await Bus.connect(
                url,
                config=FAST,
                secure=True,
                user=f"agent-{name}",
                password=secret[f"agent-{name}"],
                inbox_prefix=f"_INBOX.{name}",
                error_cb=on_error,
            )
            closers.append(bus)
            buses[name] = bus
            agents[name] = await bus.agent(name, group="g0", signature=SIG)

        stolen: list[bytes] = []

        async def steal(msg: Any) -> None:
            stolen.append(msg.data)

        alice = buses["alice"].transport
        await alice.subscribe(agent_subject("bob", "inbox"), steal)
        await alice.subscribe("kvbus.agent.bob.data.>", steal)
        await alice.publish(
            agent_subject("bob", "ctl"),
            Grant(transfer_id="x" * 32, medium="full", chunk_size=1 << 20, window=16, rate_bps=0.0).encode(),
        )
        await _wait_for_errors(
            errors["alice"],
            [
                'subscription to "kvbus.agent.bob.inbox"',
                'subscription to "kvbus.agent.bob.data.>"',
                'publish to "kvbus.agent.bob.ctl"',
            ],
        )

        big = kv_of_bytes(SIG, 4 << 20, seed=3)
        report = await agents["alice"].send("bob", big, medium="full")
        got = await agents["bob"].receive(timeout=20)
        assert got.transfer_id == report.transfer_id and got.kv.equal(big)
        shared = random_kv(SIG, 8)
        await agents["alice"].broadcast(["bob"], shared, medium="full")
        assert (await agents["bob"].receive(timeout=20)).kv.equal(shared)
        assert stolen == []
        assert not errors["bob"] and not errors["carol"]
        assert len(errors["alice"]) == 3, errors["alice"]

        # The `helm test` agents, from their pod's environment.
        env = _pod_env(_container(docs, "Pod", f"{RELEASE}-selftest"), secret, port)
        test_agents = {}
        for var in ("KVBUS_SELFTEST_SENDER", "KVBUS_SELFTEST_RECEIVER"):
            bus = await Bus.connect(
                env[f"{var}_URL"], config=FAST, secure=True, inbox_prefix=env[f"{var}_INBOX_PREFIX"]
            )
            closers.append(bus)
            test_agents[var] = await bus.agent(env[var], group="g0", signature=SIG)
        small = random_kv(SIG, 4)
        await test_agents["KVBUS_SELFTEST_SENDER"].send(env["KVBUS_SELFTEST_RECEIVER"], small, medium="full")
        assert (await test_agents["KVBUS_SELFTEST_RECEIVER"].receive(timeout=20)).kv.equal(small)

        assert "Violation" not in "".join(
            line for line in (tmp_path / "nats.log").read_text().splitlines() if "agent-alice" not in line
        )
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(
                f"nats://agent-alice:wrong@127.0.0.1:{port}",
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
            )
    finally:
        for c in reversed(closers):
            await c.close()
        _stop(server)


@contextlib.contextmanager
def _chart_services(docs: list[dict[str, Any]], tmp_path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """The chart's nats.conf on a real nats-server, with `kvbus coordinator` and `kvbus
    group-scheduler --group g0` running with their pods' environment; yields the port and the
    users' passwords once both serve."""
    from kvbus.app.processes import free_port

    port, monitor = free_port(), free_port()
    server, secret = _chart_nats(docs, tmp_path, port, monitor)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for kind, name, args in (
            ("Deployment", f"{RELEASE}-coordinator", ["coordinator"]),
            ("StatefulSet", f"{RELEASE}-sched-g0", ["group-scheduler", "--group", "g0"]),
        ):
            env = {**os.environ, **_pod_env(_container(docs, kind, name), secret, port), "HF_HUB_OFFLINE": "1"}
            env.pop("KVBUS_METRICS_PORT", None)  # both would serve the same port here
            with open(tmp_path / f"{args[0]}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "kvbus.app.cli", "-v", *args],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        _wait_for_subscriptions(
            monitor, {"kvbus.sched.g0.request.*", "kvbus.coord.register.*"}, tmp_path, procs=tuple(procs)
        )
        yield port, secret
        logs = "".join((tmp_path / f).read_text() for f in ("coordinator.log", "group-scheduler.log", "nats.log"))
        assert "Violation" not in (tmp_path / "nats.log").read_text(), logs  # nothing kvbus does was refused
        assert all(p.poll() is None for p in procs), logs
    finally:
        for p in procs:
            _stop(p)
        _stop(server)


async def test_chart_service_pods_on_a_real_server(tmp_path: Path) -> None:
    """`kvbus coordinator` and `kvbus group-scheduler` with the environment the chart gives their
    pods (their own user and reply inbox), on the chart's nats.conf: they serve, and two agents
    logging in as NOTES.txt shows get a context through the scheduler."""
    from kvbus.bus import Bus
    from tests.conftest import FAST
    from tests.kvutil import kv_of_bytes
    from tests.peer import SIG

    docs = render(_agents_value([("alice", "g0", ()), ("bob", "g0", ())]), SINGLE)
    with _chart_services(docs, tmp_path) as (port, secret):
        buses = [
            await Bus.connect(
                f"nats://127.0.0.1:{port}",
                config=FAST,
                secure=True,
                user=f"agent-{n}",
                password=secret[f"agent-{n}"],
                inbox_prefix=f"_INBOX.{n}",
            )
            for n in ("alice", "bob")
        ]
        try:
            alice, bob = [await b.agent(n, group="g0", signature=SIG) for b, n in zip(buses, ("alice", "bob"))]
            kv = kv_of_bytes(SIG, 2 << 20, seed=7)
            report = await alice.send("bob", kv, medium="full")
            got = await bob.receive(timeout=30)
            assert got.transfer_id == report.transfer_id and got.kv.equal(kv)
        finally:
            for b in buses:
                await b.close()


def test_helm_test_pod_on_a_real_server(tmp_path: Path) -> None:
    """`kvbus selftest` (what `helm test` runs) with its pod's environment, against the chart's
    nats.conf, coordinator and scheduler: its 4 MB context arrives bit-exact."""
    docs = render(SINGLE)
    with _chart_services(docs, tmp_path) as (port, secret):
        env = _pod_env(_container(docs, "Pod", f"{RELEASE}-selftest"), secret, port)
        env.pop("KVBUS_REDIS_URL", None)
        selftest = subprocess.run(
            [sys.executable, "-m", "kvbus.app.cli", "selftest", "--group", "g0"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert selftest.returncode == 0, selftest.stdout + selftest.stderr
        assert "selftest OK" in selftest.stdout


def _start_reloader(docs: list[dict[str, Any]], tmp_path: Path) -> subprocess.Popen[bytes]:
    """The NATS pod's reloader sidecar: its very shell loop (from the rendered StatefulSet),
    watching tmp_path (the server's /etc/nats-config) and signalling through tmp_path/nats.pid."""
    from kvbus.app.processes import find_nats_server

    reloader = next(
        c for c in pod_spec(one(docs, "StatefulSet", f"{RELEASE}-nats"))["containers"] if c["name"] == "reloader"
    )
    script = reloader["command"][2]
    assert reloader["command"][:2] == ["sh", "-c"] and script.count("/etc/nats-config/") == 1
    script = script.replace("/etc/nats-config/", f"{tmp_path}/")
    script = script.replace("/var/run/nats/nats.pid", f"{tmp_path}/nats.pid")
    path = f"{os.path.dirname(find_nats_server())}{os.pathsep}{os.environ.get('PATH', '')}"
    with open(tmp_path / "reloader.log", "wb") as log:
        proc = subprocess.Popen(
            ["sh", "-c", script],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PATH": path},
            start_new_session=True,
        )
    deadline = time.monotonic() + 10
    while "reloader: watching" not in (tmp_path / "reloader.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "reloader.log").read_text()
        time.sleep(0.05)
    return proc


def _upgraded_auth_conf(old_docs: list[dict[str, Any]], new_docs: list[dict[str, Any]]) -> str:
    """The auth.conf of ``new_docs`` as `helm upgrade` writes it over ``old_docs``: the Secret
    keeps the installed users' passwords (`lookup`, which `helm template` cannot run)."""
    old, new = auth_secret(old_docs), auth_secret(new_docs)
    conf = new.pop("auth.conf")
    for user, password in new.items():
        if user in old:
            assert conf.count(f'password: "{password}"') == 1
            conf = conf.replace(f'password: "{password}"', f'password: "{old[user]}"')
    return conf


async def test_adding_an_agent_is_a_hot_reload_on_a_real_server(tmp_path: Path) -> None:
    """Adding an agent on a running system, on a real nats-server with the pod's layout (nats.conf
    including the Secret's auth.conf) and the pod's reloader loop: the NATS StatefulSet and
    ConfigMap render the same, so nothing restarts; the kubelet swaps in the new auth.conf, the
    reloader signals the server, the new agent logs in, and the agent already connected stays
    connected (no disconnect, no reconnect, its subscription still delivers)."""
    import nats

    from kvbus.app.processes import free_port

    interval = "nats.reloader.intervalSeconds=1"
    old_docs = render(_agents_value([("alice", "g0", ())]), interval, SINGLE)
    new_docs = render(_agents_value([("alice", "g0", ()), ("bob", "g0", ())]), interval, SINGLE)
    for kind, name in NATS_SERVER_DOCS:
        assert one(old_docs, kind, name) == one(new_docs, kind, name), f"{kind}/{name} changed"
    port, monitor = free_port(), free_port()
    url = f"nats://127.0.0.1:{port}"
    server, secret = _chart_nats(old_docs, tmp_path, port, monitor)
    reloader = _start_reloader(old_docs, tmp_path)
    connections: list[Any] = []
    try:
        events: list[str] = []

        async def on_disconnect() -> None:
            events.append("disconnected")

        async def on_reconnect() -> None:
            events.append("reconnected")

        alice = await nats.connect(
            url,
            user="agent-alice",
            password=secret["agent-alice"],
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        connections.append(alice)
        inbox = await alice.subscribe("kvbus.agent.alice.inbox.*")
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(
                url, user="agent-bob", password="x", allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2
            )

        await asyncio.sleep(2.5)  # a few rounds of the loop: unchanged files, no reload
        assert "Reloaded server configuration" not in (tmp_path / "nats.log").read_text()

        # The kubelet's update of the projected volume: the new file replaces the old one atomically.
        (tmp_path / ".auth.conf.new").write_text(_upgraded_auth_conf(old_docs, new_docs))
        os.replace(tmp_path / ".auth.conf.new", tmp_path / "auth.conf")
        bob_password = auth_secret(new_docs)["agent-bob"]
        deadline = time.monotonic() + 20
        while True:
            try:
                bob = await nats.connect(
                    url,
                    user="agent-bob",
                    password=bob_password,
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    connect_timeout=2,
                )
                break
            except nats.errors.Error:
                assert time.monotonic() < deadline, (tmp_path / "reloader.log").read_text()
                await asyncio.sleep(0.2)
        connections.append(bob)

        assert server.poll() is None and (tmp_path / "nats.pid").read_text().strip() == str(server.pid)
        assert "Reloaded server configuration" in (tmp_path / "nats.log").read_text()
        assert "nats-server reloaded" in (tmp_path / "reloader.log").read_text()
        await bob.publish("kvbus.agent.alice.inbox.bob", b"hello")  # bob's permissions allow this
        assert (await inbox.next_msg(timeout=5)).data == b"hello"
        assert alice.is_connected and events == [] and alice.stats["reconnects"] == 0
        assert reloader.poll() is None
    finally:
        for nc in connections:
            await nc.close()
        _stop(reloader)
        _stop(server)


async def test_existing_secret_users_on_a_real_server(tmp_path: Path) -> None:
    """With nats.auth.existingSecret, the rendered nats.conf reads each password from the
    variable the StatefulSet sets from that Secret: the users log in, a wrong password does not."""
    import secrets

    import nats

    from kvbus.app.processes import free_port

    docs = render(_agents_value([("alice", "g0", ())]), "nats.auth.existingSecret=kvbus-nats-users", SINGLE)
    # A letter first: nats-server parses a variable's value as a config value, and one that
    # starts with a digit is read as a number and refused (the chart README says so).
    existing = {u["user"]: "p" + secrets.token_urlsafe(24) for u in nats_users(docs)}
    port, monitor = free_port(), free_port()
    server, secret = _chart_nats(docs, tmp_path, port, monitor, existing_secret=existing)
    try:
        for user in ("agent-alice", "sched-g0", "coordinator"):
            nc = await nats.connect(f"nats://127.0.0.1:{port}", user=user, password=secret[user])
            await nc.close()
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(
                f"nats://127.0.0.1:{port}",
                user="agent-alice",
                password=existing["coordinator"],
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
            )
    finally:
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


def test_dockerfile_copies_every_package_folder() -> None:
    """`pip install .` in the image needs every folder pyproject.toml maps to a kvbus package."""
    import tomllib

    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY\s+(\S+?)/\s", (ROOT / "Dockerfile").read_text(), flags=re.M))
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"


def test_install_script_is_valid_bash() -> None:
    script = ROOT / "scripts" / "install-helm.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)


# -- vLLM engines' connector config ---------------------------------------------------------------


def test_vllm_connector_config_for_each_engine() -> None:
    """Each engine's --kv-transfer-config names the kvbus connector and parses as its config."""
    from kvbus.integrations.vllm.config import ConnectorConfig

    docs = render(files=(str(CHART / "ci" / "vllm-values.yaml"),))
    data = one(docs, "ConfigMap", f"{RELEASE}-vllm")["data"]
    assert sorted(data) == ["executor.json", "planner.json"]
    for agent, raw in data.items():
        config = json.loads(raw)
        assert config["kv_connector"] == "KVBusConnector"
        assert config["kv_connector_module_path"] == "kvbus.integrations.vllm"
        assert config["kv_load_failure_policy"] == "recompute" and config["kv_role"] == "kv_both"
        parsed = ConnectorConfig.from_extra(config["kv_connector_extra_config"], environ={})
        assert parsed.agent == agent.removesuffix(".json") and parsed.group == "g0"
        assert parsed.nats_url == f"nats://{RELEASE}-nats.{NAMESPACE}.svc.cluster.local:4222"
        assert parsed.store_bytes == 2147483648
    assert ConnectorConfig.from_extra(json.loads(data["executor.json"])["kv_connector_extra_config"]).medium == "int8"
    assert json.loads(data["planner.json"])["kv_connector_extra_config"]["push_to"] == ["executor"]
    assert not component(render(), "ConfigMap", "vllm")  # off by default


@pytest.mark.parametrize(
    "args, expected",
    [
        (("vllmConnector.enabled=true",), "set nats.auth.enabled=false"),
        (
            (
                "vllmConnector.enabled=true",
                "nats.auth.enabled=false",
                'json:vllmConnector.engines=[{"agent":"a"},{"agent":"a"}]',
            ),
            "appears twice",
        ),
        (
            ("vllmConnector.enabled=true", "nats.auth.enabled=false", 'json:vllmConnector.engines=[{"agent":"a b"}]'),
            "pattern",
        ),
    ],
)
def test_vllm_connector_bad_values(args: tuple[str, ...], expected: str) -> None:
    assert expected in render_error(*args)


# -- the data plane ------------------------------------------------------------------------------------


def test_data_plane_port_network_policy_and_shared_memory() -> None:
    docs = render()
    (policy,) = by_kind(docs, "NetworkPolicy")
    selector = {"matchLabels": {"kvbus.io/data-plane": "true"}}
    assert policy["spec"]["podSelector"] == selector
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": selector}], "ports": [{"protocol": "TCP", "port": 7450}]}
    ]
    (pod,) = by_kind(docs, "Pod")
    assert pod["metadata"]["labels"]["kvbus.io/data-plane"] == "true"  # the policy selects agent pods
    c = pod["spec"]["containers"][0]
    assert {"name": "data", "containerPort": 7450, "protocol": "TCP"} in c["ports"]
    env = env_of(c)
    assert env["KVBUS_PATHS_ALLOWED"] == "shm,tcp,nats" and env["KVBUS_PATHS_TCP_PORT"] == "7450"
    assert env["KVBUS_HOST_ID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}  # shm within the pod only
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    (client,) = [cm for cm in by_kind(docs, "ConfigMap") if cm["metadata"]["name"].endswith("-client")]
    assert client["data"]["KVBUS_PATHS_ALLOWED"] == "shm,tcp,nats" and client["data"]["KVBUS_PATHS_TCP_PORT"] == "7450"
    # Restricted to NATS, on another port, without the policy or the memory volume.
    docs = render(
        "dataPlane.allowed=nats",
        "dataPlane.port=7460",
        "dataPlane.networkPolicy.enabled=false",
        "dataPlane.shm.enabled=false",
    )
    assert not by_kind(docs, "NetworkPolicy")
    (pod,) = by_kind(docs, "Pod")
    env = env_of(pod["spec"]["containers"][0])
    assert env["KVBUS_PATHS_ALLOWED"] == "nats" and env["KVBUS_PATHS_TCP_PORT"] == "7460"
    assert not [v for v in pod["spec"]["volumes"] if v["name"] == "shm"]
    assert "allowed" in render_error("dataPlane.allowed=udp")  # the schema names the bad value
