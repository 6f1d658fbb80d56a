"""FP8 matmuls (stage 2, compute forward/backward): which projections run on FP8 operands, and
the FP8 projection itself.

The rule `projection_recipe` is shared: the model applies it to each projection (`recipe`), and
the planner prices a projection's GEMMs in FP8 only where it says the model runs them so
(jaxdist.planning.fp8), as it refuses hardware without FP8 units in `no_fp8_units`' words.

Why a filter at all: quantizing costs a pass over each operand (amax, scale, cast) that a small
GEMM does not win back. torchao measured the crossover for tensorwise scaling on H100 and skips
a linear layer when its output width is at most 4096 and its input width at most 1024
(torchao.float8 `_auto_filter_for_tensorwise`, pytorch/ao PR #2410); cuBLAS's FP8 GEMMs also
need every dimension a multiple of 16.

`einsum` is a projection y = x @ w written as an einsum (no batch dims: "btd,df->btf"). Where
the active layout's `--fp8` runs it in FP8, the forward GEMM takes the activation and the
weight in e4m3, both backward GEMMs (dgrad, wgrad) the output gradient in e5m2, each tensor
with one scale, and every GEMM's result is dequantized to the compute dtype. The GEMMs are
`lax.dot_general` on f8 operands themselves, not quantize-dequantize around a 16-bit dot: XLA's
GPU compiler runs the former as FP8 GEMMs (for H100 and H200, XLA 0.11: Triton GEMM fusions
whose dot reads f8 operands; cuBLASLt's f8 matmul with Triton GEMMs off), while the latter
silently stays a bf16 GEMM (jax#22313). Flax's maintained pieces (flax.linen.fp8_ops:
update_fp8_meta, quantize, dequantize, the dot transposes) do the scaling; the two custom VJPs
are this module's, for the residuals' sake (`_bits`).

- current: each scale from the tensor's own amax in that step (x and w in the forward, the
  output gradient in the backward); no state.
- delayed: each scale from the tensor's amax history (Flax's `update_fp8_meta`: the max of the
  last `--fp8-history` steps' amaxes; 1 before any), kept in the train state as `Fp8Meta`
  variables, stacked over the layers. The step gets their new values as their "gradients"
  (Flax's overwrite-with-gradient: the custom VJP returns the new meta as the meta's
  cotangent) and writes them into the state (jaxdist.step), never through the optimizer.

On the CPU an f8 dot is an honest emulation: XLA's CPU backend converts the f8 operands to f32
and multiplies those, so the results carry FP8's rounding exactly, without its speed. TPUs (v4,
v5e, v5p, v6e) have no FP8 matrix units, XLA would emulate it there too, slower than bf16: every
TPU is refused, as are GPUs before compute capability 8.9 and a pipeline axis (`check`).
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops
from jax import lax

from jaxdist.errors import ConfigError
from jaxdist.rules import current_layout

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The delayed state of one projection, per layer: a scale [1] and an amax history [A] for each
# of its input (x), its weight (w) and its output gradient (g).
TENSORS = ("x", "w", "g")
PREFIX = "fp8_"
CPU_NOTE = (
    "--fp8 {recipe} on cpu: the projections in FP8 are emulated, XLA's CPU backend converting "
    "the f8 operands to f32 and multiplying those (FP8's rounding; not its speed)"
)


def worth_fp8(d_in: int, d_out: int) -> bool:
    """Whether a projection from d_in to d_out features gains from FP8 GEMMs (see above)."""
    if d_in % 16 or d_out % 16:
        return False
    return not (d_out <= 4096 and d_in <= 1024)


class Fp8Meta(nnx.Variable):
    """Delayed scaling's state (a scale or an amax history of one tensor, per layer): not a
    weight. The step keeps it apart from the parameters (jaxdist.step.TrainState.fp8), so the
    optimizer, weight decay, clipping and the replica groups' outer step never see it."""


# --- Which recipe a projection runs in ------------------------------------------------------


def _operands(spec: str) -> tuple[str, str, str, set[str]]:
    """lhs, rhs, out letters of a projection's einsum and its contracted letters."""
    inputs, out = spec.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    contracted = (set(lhs) & set(rhs)) - set(out)
    return lhs, rhs, out, contracted


def fans(spec: str, w_shape: tuple[int, ...]) -> tuple[int, int]:
    """(d_in, d_out) of a projection: the weight's contracted and kept sizes."""
    _, rhs, _, contracted = _operands(spec)
    d_in = math.prod(n for a, n in zip(rhs, w_shape, strict=True) if a in contracted)
    return d_in, math.prod(w_shape) // d_in


def projection_recipe(step, d_in: int, d_out: int) -> str:
    """The recipe a projection from d_in to d_out features runs in under `step` (a
    jaxdist.layout.StepConfig): its --fp8, or off where --fp8-filter auto finds it too small
    to gain (worth_fp8)."""
    if step.fp8 == "off" or (step.fp8_filter == "auto" and not worth_fp8(d_in, d_out)):
        return "off"
    return step.fp8


def recipe(spec: str, w_shape: tuple[int, ...]) -> str:
    """The recipe the active layout runs this projection in (w_shape: one layer's weight).
    Outside a layout (a model built or called on its own): off."""
    step = getattr(current_layout(), "step", None)
    return "off" if step is None else projection_recipe(step, *fans(spec, w_shape))


def in_fp8(step, model: str, fans: list[tuple[int, int]]) -> str | None:
    """What --fp8 does to a model whose layers' projections go from d_in to d_out features
    (`fans`, each stack's; the experts' and the head's stay in the compute dtype): how many run
    in FP8 and, where some or all do not, why; None with --fp8 off."""
    if step.fp8 == "off":
        return None
    kept = [f for f in fans if projection_recipe(step, *f) == "off"]
    said = f"fp8: --fp8 {step.fp8} runs {len(fans) - len(kept)} of the {len(fans)} projections "
    said += f"of each of {model}'s layers in FP8"
    if not kept:
        return said
    shapes = ", ".join(f"{i}->{o}" for i, o in dict.fromkeys(kept))
    unaligned = any(i % 16 or o % 16 for i, o in kept)
    why = (
        "not multiples of 16, as FP8 GEMMs need, or " if unaligned else ""
    ) + "too small to gain (at most 1024 features in and 4096 out: the casts cost more)"
    said += f"; {len(kept)} stay in the compute dtype, {why}: {shapes}"
    if len(kept) == len(fans):
        said += "; the step is the compute dtype's, unchanged (--fp8-filter none: FP8 anyway)"
    return said


# --- The delayed state ----------------------------------------------------------------------


def meta_name(weight: str, tensor: str, kind: str) -> str:
    """The state's name for one tensor of the projection by `weight` (wqkv_LDGQH ->
    fp8_wqkv_x_scale_L1, fp8_wqkv_x_amax_LA; A: the amax history)."""
    proj = weight.rsplit("_", 1)[0]
    return f"{PREFIX}{proj}_{tensor}_{kind}_{'L1' if kind == 'scale' else 'LA'}"


def delayed_state(projections: dict, layers: int) -> dict[str, Fp8Meta]:
    """The Fp8Meta variables a model holds for its projections ({weight: (einsum, one layer's
    weight shape)}) that the active layout runs with --fp8 delayed: scales 1 and histories of
    zeros (Flax's start), stacked over the layers; {} for every other recipe."""
    out = {}
    for weight, (spec, shape) in projections.items():
        if recipe(spec, shape) != "delayed":
            continue
        history = current_layout().step.fp8_history
        for t in TENSORS:
            scale_L1, amax_LA = jnp.ones((layers, 1)), jnp.zeros((layers, history))
            out[meta_name(weight, t, "scale")] = Fp8Meta(scale_L1, logical_axes=("layers", None))
            out[meta_name(weight, t, "amax")] = Fp8Meta(amax_LA, logical_axes=("layers", None))
    return out


def layer_meta(w: dict, weight: str) -> dict | None:
    """One layer's delayed state for the projection by `weight`, picked from the layer's
    inputs `w` by name ({"x_scale": [1], "x_amax": [A], ...}); None where it has none."""
    if meta_name(weight, "x", "scale") not in w:
        return None
    return {f"{t}_{k}": w[meta_name(weight, t, k)] for t in TENSORS for k in ("scale", "amax")}


# --- The FP8 projection ---------------------------------------------------------------------


def einsum(spec: str, x: jax.Array, w: jax.Array, meta: dict | None = None) -> jax.Array:
    """x @ w as the einsum `spec` says, in FP8 where the active layout runs this projection so
    (`recipe`), else as jnp.einsum. `meta`: the layer's delayed state (`layer_meta`)."""
    which = recipe(spec, w.shape)
    if which == "off":
        return jnp.einsum(spec, x, w)
    dims = dimension_numbers(spec, x.ndim)
    x = x.astype(w.dtype)  # the compute dtype, as the weight is given
    if which == "current":
        return current_dot(x, w, dims)
    if meta is None:
        raise RuntimeError(
            f"--fp8 delayed: the projection {spec} has no FP8 state; the model was built "
            "outside the step's layout (jaxdist.step.build builds it inside)"
        )
    return delayed_dot(x, w, meta, dims)


def dimension_numbers(spec: str, x_ndim: int):
    """lax.dot_general's dimension numbers of a projection einsum: contracted letters only,
    the output x's kept dims then w's, in order (what dot_general gives without a transpose)."""
    lhs, rhs, out, contracted = _operands(spec)
    kept = [a for a in lhs if a not in contracted] + [a for a in rhs if a not in contracted]
    if len(lhs) != x_ndim or "".join(kept) != out:
        raise ValueError(f"{spec!r} is not a projection x @ w (no batch dims, output in order)")
    order = sorted(contracted, key=lhs.index)
    return (tuple(lhs.index(a) for a in order), tuple(rhs.index(a) for a in order)), ((), ())


def own_scale(x: jax.Array, dtype) -> jax.Array:
    """Current scaling: x's scale from its own amax (amax / the format's max; 1 where the
    amax is 0 or not finite, as Flax's compute_scale keeps the previous scale)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    fp8_max = fp8_ops.get_fp8_max(dtype, jnp.float32)
    return fp8_ops.compute_scale(amax, jnp.ones((), jnp.float32), fp8_max)


# The f8 operands are kept for the backward GEMMs as their bits. jax.checkpoint (every remat
# policy but full) passes a saved f8 value through reduce_precision(exponent 4, mantissa 3)
# (jax PR #22244), which follows IEEE rules and so turns e4m3fn's values above 240 (its largest
# IEEE-finite one; e4m3fn reaches 448) into NaN: every scaled tensor's amax lands there. Flax's
# own quantized_dot keeps f8 residuals, so it is not used whole here, only its pieces.
def _bits(q: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(q, jnp.uint8)


def _f8(bits: jax.Array, dtype) -> jax.Array:
    return lax.bitcast_convert_type(bits, dtype)


def _backward(dims, g, g_scale, q_x, x_scale, q_w, w_scale):
    """dgrad and wgrad on f8 operands: the output gradient in e5m2, dequantized."""
    q_g = fp8_ops.quantize(g, E5M2, g_scale, g.dtype)
    transpose = dict(dimension_numbers=dims, precision=None, preferred_element_type=g.dtype)
    dx = fp8_ops.dot_general_transpose_lhs(q_g, q_x, q_w, **transpose)
    dw = fp8_ops.dot_general_transpose_rhs(q_g, q_x, q_w, **transpose)
    return (
        fp8_ops.dequantize(dx, g.dtype, w_scale * g_scale),
        fp8_ops.dequantize(dw, g.dtype, x_scale * g_scale),
    )


def _forward(x, w, dims, x_scale, w_scale):
    """The forward GEMM on e4m3 operands, dequantized; and the operands."""
    q_x = fp8_ops.quantize(x, E4M3, x_scale, x.dtype)
    q_w = fp8_ops.quantize(w, E4M3, w_scale, x.dtype)
    y = lax.dot_general(q_x, q_w, dims, preferred_element_type=x.dtype)
    return fp8_ops.dequantize(y, x.dtype, x_scale * w_scale), q_x, q_w


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def current_dot(x: jax.Array, w: jax.Array, dims) -> jax.Array:
    """The FP8 dot with current scaling (own_scale for x, w and the output gradient)."""
    return _current_fwd(x, w, dims)[0]


def _current_fwd(x, w, dims):
    x_scale, w_scale = own_scale(x, E4M3), own_scale(w, E4M3)
    y, q_x, q_w = _forward(x, w, dims, x_scale, w_scale)
    # The f8 operands are the residuals: half the bytes of 16-bit ones.
    return y, (_bits(q_x), x_scale, _bits(q_w), w_scale)


def _current_bwd(dims, res, g):
    q_x, x_scale, q_w, w_scale = res
    q_x, q_w = _f8(q_x, E4M3), _f8(q_w, E4M3)
    return _backward(dims, g, own_scale(g, E5M2), q_x, x_scale, q_w, w_scale)


current_dot.defvjp(_current_fwd, _current_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def delayed_dot(x: jax.Array, w: jax.Array, meta: dict, dims) -> jax.Array:
    """The FP8 dot with delayed scaling, as Flax's fp8_scaled_dot_general: each scale from
    its history before this step (update_fp8_meta), this step's amax pushed into it; the new
    meta comes back as the meta's cotangent (overwrite-with-gradient)."""
    return _delayed_fwd(x, w, meta, dims)[0]


def _delayed_fwd(x, w, meta, dims):
    x_scale, x_amax = fp8_ops.update_fp8_meta(x, E4M3, meta["x_scale"], meta["x_amax"])
    w_scale, w_amax = fp8_ops.update_fp8_meta(w, E4M3, meta["w_scale"], meta["w_amax"])
    y, q_x, q_w = _forward(x, w, dims, x_scale, w_scale)
    new = {"x_scale": x_scale, "x_amax": x_amax, "w_scale": w_scale, "w_amax": w_amax}
    return y, (_bits(q_x), _bits(q_w), new, meta["g_scale"], meta["g_amax"])


def _delayed_bwd(dims, res, g):
    q_x, q_w, new, g_scale, g_amax = res
    g_scale, g_amax = fp8_ops.update_fp8_meta(g, E5M2, g_scale, g_amax)
    dx, dw = _backward(
        dims, g, g_scale, _f8(q_x, E4M3), new["x_scale"], _f8(q_w, E4M3), new["w_scale"]
    )
    return dx, dw, {**new, "g_scale": g_scale, "g_amax": g_amax}


delayed_dot.defvjp(_delayed_fwd, _delayed_bwd)


# --- Where FP8 runs -------------------------------------------------------------------------


def no_fp8_units(recipe_: str, kind: str, why: str, fix: str) -> ConfigError:
    """The refusal of --fp8 on hardware without FP8 matrix units, a run's (`check`) or a plan's
    (jaxdist.planning.fp8): one line, the hardware, why it has none, the fix."""
    return ConfigError(f"--fp8 {recipe_} on {kind}: no FP8 matrix units ({why}); {fix}")


def check(layout, mesh) -> None:
    """Refuses --fp8 where the devices cannot run it, before anything is traced: a TPU (no FP8
    matrix units before v7), a GPU before compute capability 8.9. A pipeline axis is the
    layout's own problem (jaxdist.layout.Layout.problems)."""
    recipe_ = layout.step.fp8
    if recipe_ == "off":
        return
    device = mesh.devices.flat[0]
    kind = getattr(device, "device_kind", device.platform)
    if device.platform == "tpu":
        why = "TPU v4, v5e, v5p and v6e: XLA would emulate the GEMMs, slower than bfloat16"
        raise no_fp8_units(recipe_, kind, why, "use --fp8 off on TPUs")
    capability = getattr(device, "compute_capability", None)
    if capability and tuple(int(p) for p in str(capability).split(".")[:2]) < (8, 9):
        why = f"compute capability {capability}: FP8 tensor cores start at 8.9, Ada and Hopper"
        raise no_fp8_units(recipe_, kind, why, "use --fp8 off on this GPU")


def platform_note(layout, mesh) -> str | None:
    """The one line a run on the CPU prints about FP8 there (an emulation), or None."""
    if layout.step.fp8 == "off" or mesh.devices.flat[0].platform != "cpu":
        return None
    return CPU_NOTE.format(recipe=layout.step.fp8)
