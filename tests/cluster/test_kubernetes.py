"""deploy/kubernetes/: every manifest validates against the Kubernetes schemas, the pieces agree with each other
and with axond's own command line, and Indexed Job pods get their completion index as node rank."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from axond.cli.coordinator_cmd import coordinator as coordinator_cmd
from axond.cli.worker_cmd import worker as worker_cmd
from axond.control.client import CoordinatorClient
from axond.coordinator.state.rendezvous import natural_order

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
VERSIONS = ("1.30.0", "1.33.0")
"""Kubernetes versions the manifests are checked against: the oldest still common and a recent one."""


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


DOCS = _documents()


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} in {MANIFESTS}, found {len(found)}"
    return found[0]


def _schemas_available(version: str) -> bool:
    try:
        import kubernetes_validate
    except ImportError:
        return False
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    return (root / f"v{version}-local-strict").is_dir()


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    if not _schemas_available(version):
        pytest.skip(f"kubernetes-validate or its bundled v{version} schemas are not installed "
                    "(pip install -e '.[dev]')")
    import kubernetes_validate

    assert {d["kind"] for _, d in DOCS} >= {"Secret", "Service", "StatefulSet", "Job"}
    for name, doc in DOCS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            what = f"{doc['kind']} {doc['metadata']['name']}"
            pytest.fail(f"{name}: {what} is not valid Kubernetes {version}: {e.message}")


def test_a_misspelt_field_is_refused() -> None:
    """The validation above can fail: strict schemas reject fields Kubernetes does not know."""
    if not _schemas_available(VERSIONS[0]):
        pytest.skip("kubernetes-validate or its bundled schemas are not installed (pip install -e '.[dev]')")
    import kubernetes_validate

    job = yaml.safe_load(yaml.safe_dump(_one("Job", "axond-train")))
    job["spec"]["completionsMode"] = job["spec"].pop("completionMode")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, VERSIONS[0], strict=True)


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _secret_refs(container: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]


def test_the_coordinator_is_a_statefulset_with_its_state_on_a_claim_and_grpc_probes() -> None:
    sts = _one("StatefulSet", "axond-coordinator")
    governing = _one("Service", sts["spec"]["serviceName"])
    assert governing["spec"].get("clusterIP") == "None", "a StatefulSet's serviceName must be a headless Service"
    svc = _one("Service", "axond-coordinator")
    assert svc["spec"].get("clusterIP") != "None", "clients reach the coordinator through a Service with one address"
    assert governing["spec"]["selector"] == svc["spec"]["selector"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items(), "the Service must select the coordinator's pod"
    container = _container(sts)
    args = container["args"]
    assert args[0] == "coordinator"
    ctx = coordinator_cmd.make_context("coordinator", list(args[1:]))  # axond's own parser accepts the flags
    port = ctx.params["port"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == ctx.params["state_dir"], "the state dir must be on the claim"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (svc_port,) = svc["spec"]["ports"]
    assert ports[svc_port["targetPort"]] == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, f"{probe} must ask grpc.health.v1 on the serving port"
    secret = _one("Secret", "axond-token")
    assert _secret_refs(container) == [("axond-token", "token")] and "token" in secret["stringData"]
    assert {e["name"] for e in container["env"]} >= {"AXOND_TOKEN"}


def test_the_workers_are_an_indexed_job_with_a_headless_service() -> None:
    job = _one("Job", "axond-train")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    headless = _one("Service", pod["subdomain"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    container = _container(job)
    args = container["args"]
    assert args[0] == "worker"
    ctx = worker_cmd.make_context("worker", list(args[1:]))
    lo, _, hi = ctx.params["nnodes"].partition(":")
    assert spec["completions"] == spec["parallelism"] == int(lo) == int(hi or lo), \
        "one pod per node: completions, parallelism and --nnodes agree"
    assert ctx.params["cmd"], "the worker runs a training command"
    coordinator_svc = _one("Service", "axond-coordinator")
    host, port = ctx.params["address"].rsplit(":", 1)
    assert host == coordinator_svc["metadata"]["name"] and int(port) == coordinator_svc["spec"]["ports"][0]["port"]
    assert _secret_refs(container) == [("axond-token", "token")]
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] == 0, "axond restarts the job, not Kubernetes"
    shm = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in shm.values()


def test_the_workers_checkpoints_are_on_storage_every_pod_shares() -> None:
    """The training command's --checkpoint-dir lies on a ReadWriteMany claim, not on a pod's own volume: each pod
    writes its ranks' shards there and a restarted generation resumes from what every pod saved."""
    job = _one("Job", "axond-train")
    container = _container(job)
    cmd = list(worker_cmd.make_context("worker", list(container["args"][1:])).params["cmd"])
    ckpt_dir = cmd[cmd.index("--checkpoint-dir") + 1]
    mounts = sorted(container["volumeMounts"], key=lambda m: len(m["mountPath"]), reverse=True)
    mount = next(m for m in mounts if (ckpt_dir + "/").startswith(m["mountPath"].rstrip("/") + "/"))
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    volume = volumes[mount["name"]]
    assert "persistentVolumeClaim" in volume, f"{ckpt_dir} is on volume {mount['name']!r}: {volume}, not a claim"
    claim = _one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every pod mounts the checkpoints at once"


def test_every_pod_runs_as_a_non_root_user() -> None:
    for kind, name in (("StatefulSet", "axond-coordinator"), ("Job", "axond-train")):
        pod = _one(kind, name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert _container(_one(kind, name))["securityContext"]["allowPrivilegeEscalation"] is False


def test_hostnames_are_ordered_with_their_numbers_as_numbers() -> None:
    names = [f"axond-train-{i}" for i in range(12)]
    shuffled = sorted(names, key=lambda n: (hash(n) % 7, n))
    assert [n for n in sorted(shuffled, key=lambda n: natural_order((n, 0)))] == names
    assert natural_order(("node", 2)) < natural_order(("node", 3)) < natural_order(("node1", 0))


def test_indexed_job_pods_get_their_completion_index_as_node_rank(client: CoordinatorClient) -> None:
    """Pods `axond-train-10` and `axond-train-9` (an 11-pod job's last two) register in the wrong lexical order;
    the real coordinator gives each the node rank of its index's order."""
    hosts = ["axond-train-10", "axond-train-9", "axond-train-1"]
    nodes = {h: client.register_node(h).node_id for h in hosts}
    ranks: dict[str, int] = {}

    def join(host: str) -> None:
        ranks[host] = client.join("indexed", nodes[host], nproc=1, min_nodes=3, max_nodes=3, timeout=20).node_rank

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert ranks == {"axond-train-1": 0, "axond-train-9": 1, "axond-train-10": 2}
