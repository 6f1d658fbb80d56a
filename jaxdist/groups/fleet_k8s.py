"""A fleet of replica groups on Kubernetes (`jaxdist k8s --groups M`): what `jaxdist launch
--groups M` does on one host (jaxdist.groups.fleet), in Kubernetes' terms. The torchft lighthouse
runs as a Deployment behind a Service (Kubernetes restarts it); each group is a JobSet of its own
(jaxdist.cluster.manifests), its failurePolicy.maxRestarts the group's restarts. The checks are
the local launcher's (jaxdist.groups.fleet.plan).
"""

import dataclasses
import os
import posixpath

import yaml

from jaxdist.cluster import manifests
from jaxdist.errors import ConfigError
from jaxdist.groups.bridge import FT_PACKAGES, FT_PYTHON_VAR
from jaxdist.groups.fleet import FleetConfig, Plan, check_restarts, lighthouse_args, plan
from jaxdist.groups.member import ENV

# The lighthouse's port (torchft's usual one) and each group's store, on its pod 0.
LIGHTHOUSE_PORT = 29510
STORE_PORT = 29600
ATTEMPT = "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"

# A group's pod: the settings of a healing group after its JobSet's first restart (the group
# lost, its pods created again while the others run on).
_HEAL_SH = (
    f'if [ "${{JOBSET_RESTART_ATTEMPT:-0}}" != 0 ]; then export {ENV}="${ENV}_HEAL"; fi; exec "$@"'
)
# The lighthouse's pod: lighthouse.py from the image's jaxdist, run by the sidecar interpreter.
_LIGHTHOUSE_POD_SH = (
    'py=$1; shift; exec "$py" "$(python -c \'import importlib.util as u; '
    'print(u.find_spec("jaxdist").submodule_search_locations[0])\')/groups/lighthouse.py" "$@"'
)


def k8s_fleet(
    fc: FleetConfig, hosts: int, train_args: list[str], image: str, run_volume: str,
    gpus_per_host: int = 8, name: str = "jaxdist", run_mount: str = manifests.RUN_MOUNT,
    max_restarts: int = 3, port: int = 1234,
) -> str:  # fmt: skip
    """The lighthouse's Service and Deployment (Kubernetes restarts its pod on the Service's
    address), then a JobSet per group, NAME-gG, of `hosts` indexed pods: a jax.distributed
    job whose pod 0 coordinates and holds the group's torchft store. A lost pod fails its
    group's JobSet alone, restarted up to `max_restarts` times; its pods heal from a live
    peer. The run directory is on the claim, as the single JobSet's."""
    check_restarts(max_restarts)
    manifests.check_k8s(image, run_volume)
    p = plan(fc, train_args, lambda: _image_python(fc.ft_python))
    python = p.settings.ft_python
    manifests._on_volume(["--run-dir", p.run_dir], posixpath.normpath(run_mount), name)
    address = fc.lighthouse or f"http://{name}-lighthouse:{LIGHTHOUSE_PORT}"
    docs = [] if fc.lighthouse else _lighthouse_docs(fc, p, image, f"{name}-lighthouse")
    for g in range(fc.groups):
        job = f"{name}-g{g}"
        s = dataclasses.replace(
            p.settings, group=g, lighthouse=address, host=f"{job}-workers-0-0.{job}",
            store_port=STORE_PORT,
        )  # fmt: skip
        args = [
            *p.args, "--run-dir", f"{p.run_dir}/groups/{g}", "--coordinator", f"{s.host}:{port}",
            "--num-processes", str(hosts), "--process-id", "$(JOB_COMPLETION_INDEX)",
        ]  # fmt: skip
        pod = manifests._pod(image, args, port, gpus_per_host, run_volume, run_mount)
        (c,) = pod["containers"]
        c["command"], c["args"] = ["/bin/sh", "-c", _HEAL_SH, "jaxdist"], [*c["command"], *args]
        c["ports"].append({"containerPort": STORE_PORT})
        c["env"] += [
            {"name": "JOBSET_RESTART_ATTEMPT", "valueFrom": {"fieldRef": {"fieldPath": ATTEMPT}}},
            {"name": ENV, "value": s.to_env()},
            {"name": f"{ENV}_HEAL", "value": dataclasses.replace(s, heal=True).to_env()},
        ]  # fmt: skip
        docs.append(manifests.jobset_doc(job, hosts, pod, max_restarts))
    header = (
        f"# jaxdist: a lighthouse and {fc.groups} replica groups of {hosts} pod(s) each: "
        "kubectl apply -f THIS_FILE\n"
        f"# image: {manifests.BUILD_IMAGE.replace('IMAGE', image)}, with the torchft sidecar's "
        f"interpreter at {python} (a Python 3.11 with {FT_PACKAGES}; the Dockerfile has none)\n"
        f"# the claim {run_volume} (ReadWriteMany) must exist: the run directory is on it\n"
    )
    return header + yaml.safe_dump_all(docs, sort_keys=False)


def _image_python(given: str | None) -> str:
    """The sidecar interpreter's path in the image: not checked here, where the image is not."""
    python = given or os.environ.get(FT_PYTHON_VAR)
    if not python:
        raise ConfigError(
            "--groups runs torchft in a sidecar interpreter inside the image: name it with "
            f"--ft-python PATH (a Python 3.11 there with {FT_PACKAGES}) or {FT_PYTHON_VAR}"
        )
    return python


def _lighthouse_docs(fc: FleetConfig, p: Plan, image: str, name: str) -> list[dict]:
    """The lighthouse's Service (the address the groups are given) and its Deployment: one
    pod, never two at once (Recreate: two lighthouses would split the quorum)."""
    labels = {"app": name}  # copied where used: one dict twice would be a YAML alias
    container = {
        "name": "lighthouse",
        "image": image,
        "command": ["/bin/sh", "-c", _LIGHTHOUSE_POD_SH, "lighthouse"],
        "args": [
            p.settings.ft_python,
            "--bind",
            f"0.0.0.0:{LIGHTHOUSE_PORT}",
            *lighthouse_args(fc, p.settings.min_groups),
        ],
        "env": [{"name": "RUST_LOG", "value": "warn"}],
        "ports": [{"containerPort": LIGHTHOUSE_PORT}],
        "readinessProbe": {"tcpSocket": {"port": LIGHTHOUSE_PORT}, "periodSeconds": 2},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": dict(labels), "ports": [{"port": LIGHTHOUSE_PORT}]},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": {"labels": dict(labels)}, "spec": {"containers": [container]}},
        },
    }
    return [service, deployment]
