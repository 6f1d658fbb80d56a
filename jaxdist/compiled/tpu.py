"""Compile for hardware this host does not have: TPU slices described by their topology.

With the optional libtpu package, JAX builds a TPU topology's devices on a CPU-only host; a
step lowered for a mesh over them compiles with the TPU compiler, so XLA's TPU memory analysis,
collectives and cost analysis are read before a slice is rented. Nothing runs on them.
"""

import importlib.util
import math
import os

from jaxdist.errors import ConfigError
from jaxdist.hardware import cloud_slice

# Chips of a v5p slice form a 3D torus, v5e a 2D one; topology names give the extents.
_DIMS = {"v5p": 3, "v5e": 2, "v4": 3, "v6e": 2}


def topology_name(generation: str, chips: int) -> str:
    """The most cubic topology of `chips` chips: 64 v5p chips are v5p:4x4x4."""
    dims = _DIMS.get(generation)
    if dims is None:
        raise ConfigError(f"unknown TPU generation {generation!r}; known: {', '.join(_DIMS)}")
    if chips < 1 or chips & (chips - 1):
        raise ConfigError(f"{chips} TPU chips: slices come in powers of two; pick one")
    extents = [1] * dims
    for i in range(int(math.log2(chips))):
        extents[(dims - 1 - i) % dims] *= 2
    # A 3D slice's unit extents go last: 4 v5p chips are one host's 2x2x1 (libtpu refuses
    # 1x2x2, which its host bounds do not divide).
    order = sorted(extents, key=lambda e: (dims == 3 and e == 1, e))
    return f"{generation}:{'x'.join(map(str, order))}"


def parse_target(text: str) -> str:
    """`tpu-v5p:4x4x4` -> `v5p:4x4x4`; Google Cloud's `v5p-128` (64 chips) -> `v5p:4x4x4`."""
    found = cloud_slice(text)
    if found:
        return topology_name(*found)
    body = text.removeprefix("tpu-")
    if body == text:
        raise ConfigError(
            f"--target {text!r}: write a Google Cloud slice (v5p-16, v6e-8) or "
            "tpu-GENERATION:TOPOLOGY (tpu-v5p:2x2x2) for a TPU slice, or h100:N, h200:N, "
            "h100:HxN for GPUs"
        )
    if ":" in body:
        generation, topology = body.split(":", 1)
        if generation not in _DIMS or not all(p.isdigit() for p in topology.split("x")):
            raise ConfigError(f"--target {text!r}: write e.g. tpu-v5p:4x4x4 or tpu-v5e:4x4")
        return body
    raise ConfigError(f"--target {text!r}: write e.g. tpu-v5p:4x4x4 or v5p-128")


MISSING = "compiling for a TPU target needs the libtpu package: pip install 'jaxdist[tpu]'"


def missing() -> str | None:
    """Why TPU targets cannot be compiled here, or None when they can. Looks without importing
    libtpu (JAX loads it when it builds the topology), and never raises."""
    try:
        found = importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):  # ValueError: a half-imported libtpu without a spec
        found = False
    return None if found else MISSING


def tpu_devices(topology: str) -> list:
    """The devices of a TPU topology, for compiling only."""
    why = missing()
    if why:
        raise ConfigError(why)
    # libtpu looks for a TPU VM's metadata server unless told it is not on one.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # The lockfile guards a real chip; compiling only, several processes may share libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.split(":")[0] + "-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    import jax
    from jax.experimental import topologies

    # A topology's compile runs on no local device but the CPU's: not started, the other
    # plugins (CUDA's, with jaxdist[gpu-aot] beside [tpu]) print no traceback on a host they
    # cannot use ("Unable to load cuFFT"). A JAX_PLATFORMS of the user's own stands.
    started = jax._src.xla_bridge.backends_are_initialized()  # noqa: SLF001 - no public query
    if not os.environ.get("JAX_PLATFORMS") and not started:
        jax.config.update("jax_platforms", "cpu")

    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu's errors are plain RuntimeErrors with its own text
        raise ConfigError(f"TPU topology {topology!r} was refused by libtpu: {e}") from None
    return list(desc.devices)
