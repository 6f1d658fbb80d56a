"""The experts' grouped GEMM: rows grouped by expert, each row times its own expert's matrix.

Legend: R rows (sorted by expert)  K contracted  N out  G groups (experts held here)

`jax.lax.ragged_dot` is the grouped GEMM everywhere XLA keeps it one: the TPU compiler lowers it
to a grouped-matmul kernel, and XLA:CPU computes it as the math needs. XLA's GPU compiler (jax
0.11.2) does not: its RaggedDotRewriter turns each ragged dot into a dense dot over every group,
each row times all G matrices (G x the FLOPs and a [G, R, K] operand; Qwen3-30B-A3B on 8 H100s
then needs 40-128x the routed FLOPs and does not fit). Its two ways out are closed on the pinned
stack: the cuBLASLt grouped GEMM is ROCm-only, and the cuDNN ragged-dot fusion
(`--xla_gpu_experimental_use_ragged_dot_fusion`, cuDNN >= 9.22) aborts the compile-only backend
("ComputeOutputToInputIndexing is not implemented for opcode ragged-dot").

So on Hopper GPUs (compute capability 9.x) the experts run JAX's own Pallas Mosaic GPU kernels
(`jax.experimental.pallas.ops.gpu`): `ragged_dot` for the forward and the input gradient (the
weights read transposed) and `transposed_ragged_dot` for the weight gradient, joined by a
custom VJP. What they cost: the forward kernel walks ceil(R / 128) + G - 1 row tiles (a group
boundary inside a tile costs that tile twice), so its FLOPs are within G x 128 rows of the
math's. The kernels leave rows past the groups' sum unwritten: those rows are zeroed here (the
receive buffer's unused tail must come out zero, as `ragged_dot`'s does).

`kernel_for` picks the kernel once per layer from the mesh's device; the FLOPs a compiled
program spends in either are counted by `jaxdist.compiled.gemms` (the `grouped_gemm` scopes).
"""

import functools
import types
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from jaxdist.errors import ConfigError

GroupedGemm = Literal["auto", "xla", "pallas"]
# Tiles of the Mosaic GPU kernels: 128 x 128 outputs over 64-wide slices of K (bf16 WGMMA
# shapes, and the sizes JAX's own tests and benchmark of these kernels use).
BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 128, 64, 4


def hopper(device) -> bool:
    """A GPU of compute capability 9.x (H100, H200, H800, GH200): the Mosaic GPU kernels' target
    (they use Hopper's WGMMA and TMA)."""
    if device.platform not in ("gpu", "cuda"):
        return False
    return str(getattr(device, "compute_capability", "")).split(".")[0] == "9"


def kernel_for(choice: GroupedGemm, device) -> Literal["xla", "pallas"]:
    """The grouped GEMM a layer runs: `auto` takes the Pallas kernels on Hopper and XLA's
    ragged dot elsewhere; `pallas` elsewhere than Hopper is refused in one line."""
    if choice == "auto":
        return "pallas" if hopper(device) else "xla"
    if choice == "pallas" and not hopper(device):
        raise ConfigError(
            f"--moe-gemm pallas runs JAX's Mosaic GPU kernels, which need a Hopper GPU "
            f"(compute capability 9.x), not {device.device_kind}; pass --moe-gemm auto or xla"
        )
    return choice


def fits_kernels(dtype, K: int, N: int) -> bool:
    """Whether the Mosaic GPU kernels take these shapes: 16-bit operands (WGMMA's), K a multiple
    of the K tile, and both widths multiples of the output tile (the weight gradient's)."""
    return (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and K % BLOCK_K == 0
        and K % BLOCK_M == 0
        and N % BLOCK_N == 0
    )


def grouped_matmul(x_RK, w_GKN, sizes_G, kernel: Literal["xla", "pallas"] = "xla"):
    """[R, K] rows grouped by sizes_G (rows past their sum come out zero) times their group's
    [K, N] matrix: [R, N]. `pallas` where `fits_kernels` holds, else XLA's ragged dot."""
    if kernel == "pallas" and fits_kernels(x_RK.dtype, x_RK.shape[1], w_GKN.shape[2]):
        return _pallas_grouped_matmul(x_RK, w_GKN.astype(x_RK.dtype), sizes_G)
    return jax.lax.ragged_dot(x_RK, w_GKN, sizes_G)


def _mosaic_kernels() -> tuple[Callable, Callable]:
    """JAX's Mosaic GPU kernels, imported where used: (ragged_dot, transposed_ragged_dot)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    tiles = dict(
        block_m=BLOCK_M,
        block_n=BLOCK_N,
        block_k=BLOCK_K,
        max_concurrent_steps=STAGES,
        grid_block_n=1,
    )
    forward = functools.partial(ragged_dot_mgpu.ragged_dot, **tiles)
    weights = transposed_ragged_dot_mgpu.transposed_ragged_dot
    if not hasattr(jax.devices()[0], "core_count"):
        weights = _on_target_sms(weights)
    return forward, functools.partial(weights, **tiles)


# The SMs of the H100 and H200 SXM targets (jaxdist/compiled/gpu_targets: core_count).
TARGET_SMS = 132


def _on_target_sms(kernel: Callable) -> Callable:
    """The weight-gradient kernel sizes its grid by `jax.devices()[0].core_count`, the SMs of
    the GPU it runs on. Compiling for a GPU from a CPU host (jaxdist.compiled.gpu), the devices
    JAX lists are the host's CPUs, which have none: there it sees the target's SMs instead (a
    copy of the function whose `jax` answers `devices()` so; nothing global changes)."""

    class _Target:
        core_count = TARGET_SMS

    class _Jax:
        def __getattr__(self, name):
            return getattr(jax, name)

        @staticmethod
        def devices(*_):
            return [_Target()]

    code = kernel.__code__
    globals_ = {**kernel.__globals__, "jax": _Jax()}
    return types.FunctionType(code, globals_, kernel.__name__, kernel.__defaults__, None)


# Tests replace this with stand-ins of the same contracts (the kernels run only on Hopper).
KERNELS: Callable[[], tuple[Callable, Callable]] = _mosaic_kernels


def _in_groups(y_RN, sizes_G):
    """Rows past the groups' sum set to zero (the kernels leave them unwritten)."""
    rows_R = jnp.arange(y_RN.shape[0])
    return jnp.where((rows_R < sizes_G.sum())[:, None], y_RN, jnp.zeros((), y_RN.dtype))


@jax.custom_vjp
def _pallas_grouped_matmul(x_RK, w_GKN, sizes_G):
    forward, _ = KERNELS()
    with jax.named_scope("grouped_gemm"):
        return _in_groups(forward(x_RK, w_GKN, group_sizes=sizes_G), sizes_G)


def _forward(x_RK, w_GKN, sizes_G):
    return _pallas_grouped_matmul(x_RK, w_GKN, sizes_G), (x_RK, w_GKN, sizes_G)


def _backward(saved, dy_RN):
    x_RK, w_GKN, sizes_G = saved
    forward, weights = KERNELS()
    dy_RN = _in_groups(dy_RN, sizes_G)
    with jax.named_scope("grouped_gemm"):
        # dx = dy w^T: the forward kernel reading each [K, N] matrix as its transpose.
        dx_RK = _in_groups(forward(dy_RN, w_GKN, group_sizes=sizes_G, transpose_rhs=True), sizes_G)
    with jax.named_scope("grouped_gemm_wgrad"):
        # dw_g = x_g^T dy_g over each group's rows: the rows are the contracted (ragged) axis.
        dw_GKN = weights(x_RK, dy_RN, group_sizes=sizes_G)
    return dx_RK, dw_GKN.astype(w_GKN.dtype), None


_pallas_grouped_matmul.defvjp(_forward, _backward)
