"""Compile for NVIDIA GPUs this host does not have: H100 and H200 hosts, described by target
configs.

XLA's GPU compiler runs on a CPU host. With the optional CUDA plugin (`jaxdist[gpu-aot]`),
JAX builds abstract GPU devices from a GpuTargetConfigProto (the device's compute capability,
cores, caches, memory; gpu_targets/ holds H100 SXM, transcribed from XLA's own published
spec, and H200, as an H200 reported it to XLA) and a topology `slices x hosts x GPUs per
host`; a step lowered for a mesh over them compiles to the real optimized GPU program with
XLA's per-GPU memory analysis.
Nothing runs on them.

Known limits of compiling without the device: cuDNN's own graph is not built (its workspace is
missing from the temporaries, and whether cuDNN accepts a shape is only checked on a GPU);
there is no autotuning, so kernel counts are approximate (the GEMM tiling cost model stands in
for it); `cost_analysis()` returns None; JAX's attention checks consult the CPU backend.
"""

import dataclasses
import importlib.util
import os
import pathlib
import re

from jaxdist.errors import ConfigError

_TARGETS = pathlib.Path(__file__).with_name("gpu_targets")
# The hardware preset (jaxdist/hardware.toml) of each target config.
KINDS = ("h100", "h200")
# Without autotuning XLA would pick fallback GEMM tiles; its cost model picks realistic ones.
# Triton GEMMs stay on (XLA's default, as on a GPU): jaxdist.compiled.gemms reads them.
# CUB's radix sort off: XLA sizes its scratch through the CUDA runtime, which fails without a
# GPU ("cudaErrorInvalidDevice: invalid device ordinal", jax 0.11.2) for a sort long enough to
# take it, as a dropless MoE's sort of its token x top-k assignments is (65,536 for
# Qwen3-30B-A3B at 8,192 tokens a device); XLA's own sort stands in.
COMPILER_OPTIONS = {
    "xla_gpu_experimental_cost_model_gemm_tiling_default": True,
    "xla_gpu_enable_cub_radix_sort": False,
}
AOT_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in COMPILER_OPTIONS.items())


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    kind: str  # h100 or h200: a hardware preset and a target config
    hosts: int
    per_host: int

    @property
    def devices(self) -> int:
        return self.hosts * self.per_host

    @property
    def topology(self) -> str:
        return f"1x{self.hosts}x{self.per_host}"


def is_gpu_target(text: str) -> bool:
    return text.split(":", 1)[0] in KINDS


def parse_target(text: str) -> GpuTarget:
    """`h100:8` -> 8 H100s on one host; `h100:2x8` -> 2 hosts of 8; `h200:1` -> one H200."""
    kind, sep, count = text.partition(":")
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)", count)
    if kind not in KINDS or not sep or not m:
        raise ConfigError(
            f"--target {text!r}: write h100:N or h200:N (N GPUs on one host), or h100:HxN "
            f"(H hosts of N GPUs); known GPUs: {', '.join(KINDS)}"
        )
    hosts, per_host = int(m.group(1) or 1), int(m.group(2))
    if hosts < 1 or not 1 <= per_host <= 8:
        raise ConfigError(
            f"--target {text!r}: a host holds 1 to 8 GPUs (h100:N, N <= 8), and there is at "
            "least one host (h100:HxN)"
        )
    return GpuTarget(kind, hosts, per_host)


MISSING = "compiling for a GPU target needs the CUDA plugin: pip install 'jaxdist[gpu-aot]'"


def missing() -> str | None:
    """Why GPU targets cannot be compiled here, or None when they can. Never raises: the
    answer decides between a one-line message and the work."""
    try:
        # Finding a submodule imports its parent: without any plugin, `jax_plugins` itself is
        # absent and find_spec raises instead of returning None.
        found = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else MISSING


def prepare() -> None:
    """Sets the compiler flags for a compile-only GPU target; before JAX starts a backend.
    Without the CUDA plugin, a ConfigError saying what to install, before any work."""
    why = missing()
    if why:
        raise ConfigError(why)
    flags = os.environ.get("XLA_FLAGS", "")
    if AOT_FLAGS not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {AOT_FLAGS}".strip()
    # Only the CUDA plugin's compiler is used: started as a backend, it would look for a GPU
    # (and its CUDA libraries) and fail. The compiling process runs on the CPU backend.
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_platforms", "cpu")


def gpu_devices(target: GpuTarget) -> list:
    """The devices of a GPU topology, for compiling only, host by host."""
    why = missing()
    if why:
        raise ConfigError(why)
    from jax.experimental import topologies

    config = (_TARGETS / f"{target.kind}.txtpb").read_text()
    try:
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=target.topology
        )
    except Exception as e:  # the plugin's errors are plain RuntimeErrors with its own text
        raise ConfigError(f"GPU topology {target.topology} was refused: {e}") from None
    # Host-major order: a mesh's outer axes (pipeline, data) then span hosts, inner ones the
    # NVLink domain, as on a real cluster (jaxdist.layout.MESH_AXES is outermost first).
    return sorted(desc.devices, key=lambda d: (d.process_index, d.id))
