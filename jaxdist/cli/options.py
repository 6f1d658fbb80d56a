"""What every step-building command shares: the model, the mesh, the devices, the step's own
settings; and `setup`, which turns them into a mesh, a rule table and a model config, all
checked before anything compiles. The commands that use a trained model (eval, generate,
export-hf) build no model of their own: `devices_and_mesh` gives them the mesh alone. Preset
lists in the help come from the registries."""

import dataclasses
import os
import pathlib
import sys
from typing import Annotated, Literal

import tyro

from jaxdist import hardware
from jaxdist.errors import ConfigError
from jaxdist.hf.source import hf_dir
from jaxdist.layout import MESH_AXES, StepConfig, SyncConfig
from meshes.presets import PRESETS as MESH_PRESETS
from models.presets import PRESETS as MODEL_PRESETS
from models.transformer_config import RematPolicy

# The user's own cache, unless told otherwise (tests point it at a temporary directory).
DEFAULT_CACHE = os.environ.get(
    "JAXDIST_COMPILE_CACHE", str(pathlib.Path.home() / ".cache" / "jaxdist" / "xla")
)
MODEL_HELP = (
    f"model preset ({', '.join(MODEL_PRESETS)}), or custom (then give --style, --layers, "
    "--d-model, --heads, --d-mlp, --seq-len, --vocab; --kv-heads defaults to --heads), or "
    "hf:PATH (a local Hugging Face model directory's architecture, randomly initialized)"
)
# What each mesh axis splits (jaxdist.layout.MESH_AXES, outermost first).
_AXES = {
    "replica": "DiLoCo groups that meet every --sync-every steps",
    "pipeline": "layer stages",
    "data": "the batch",
    "fsdp": "the batch, with weights and optimizer state sharded",
    "context": "the sequence",
    "expert": "MoE experts",
    "tensor": "heads and MLP width",
}
assert tuple(_AXES) == MESH_AXES, "a mesh axis without its words in --mesh's help"
MESH_HELP = (
    f"mesh preset ({', '.join(MESH_PRESETS)}) or inline axis=size list (data=2,fsdp=4; -1: the "
    "devices left) over the axes "
    + ", ".join(f"{a} ({what})" for a, what in _AXES.items())
    + "; auto: cpu8 on 8 CPU devices, else fsdp over all devices"
)
HARDWARE_HELP = f"hardware preset: {', '.join(hardware.PRESETS)}; a TPU slice size may follow"


@dataclasses.dataclass(frozen=True)
class Common:
    model: Annotated[str, tyro.conf.arg(help=MODEL_HELP)] = "tiny"
    style: Literal["gpt2", "llama"] | None = None
    """model family: gpt2 (LayerNorm, GELU, learned positions) or llama (RMSNorm, SwiGLU,
    RoPE); these size flags override a preset's, and define --model custom (default: the
    preset's)"""
    layers: int | None = None
    """transformer layers (default: the preset's)"""
    d_model: int | None = None
    """model width (default: the preset's)"""
    heads: int | None = None
    """attention heads (default: the preset's)"""
    kv_heads: int | None = None
    """key and value heads (grouped-query attention; default: --heads)"""
    d_mlp: int | None = None
    """the MLP's hidden width (default: the preset's)"""
    seq_len: int | None = None
    """tokens per row (the model's context; a Hugging Face model's may be shortened) (default:
    the preset's)"""
    vocab: int | None = None
    """vocabulary (tokenized data replaces it with its own, padded to a multiple of 128)
    (default: the preset's)"""
    mesh: Annotated[str, tyro.conf.arg(help=MESH_HELP)] = "auto"
    devices: str = "auto"
    """cpu:N for N fake CPU devices; auto uses the accelerators present, else cpu:8"""
    batch_size: int | None = None
    """global batch in rows; default 16, or one row per device of the batch axes if more"""
    step: tyro.conf.OmitArgPrefixes[StepConfig] = StepConfig()
    sync: tyro.conf.OmitArgPrefixes[SyncConfig] = SyncConfig()
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bfloat16 on GPU/TPU, float32 on CPU; parameters stay float32"""
    remat: Literal["auto", "preset"] | RematPolicy = "auto"
    """rematerialization: auto (the fastest policy whose step fits the device's memory, by
    the planner's memory model, confirmed by the compiler for a --target), preset (the model
    preset's own), none, full (recompute each layer), dots (save matmul and attention
    outputs, recompute element-wise work), or another policy of models/remat.py"""
    attention: Literal["auto", "xla", "splash", "cudnn"] = "auto"
    """attention kernel: auto (the platform's fused one: splash on TPU, cuDNN on GPU at 16
    bits, else XLA's), or xla (plain einsums, runs everywhere), splash, cudnn"""
    capacity_factor: float | None = None
    """MoE: capacity mode, each expert takes factor x tokens x top-k / experts per device (tokens
    past it are dropped); default dropless (every routed token runs)"""
    moe_buffer_factor: float | None = None
    """MoE, dropless with experts split over devices: each device's receive buffer as a
    multiple of its balanced share (default 1.25); rows past it are dropped and counted in
    moe_dropped"""
    moe_gemm: Literal["auto", "xla", "pallas"] | None = None
    """MoE, dropless: the experts' grouped GEMM: auto (default: JAX's Pallas kernels on Hopper
    GPUs, where XLA's ragged dot multiplies every row by every expert; XLA's ragged dot
    elsewhere), xla, or pallas (Hopper only)"""
    mtp_depth: int | None = None
    """multi-token prediction (DeepSeek-V3's): modules that each predict one token further
    ahead, their loss added in training, never run in evaluation or generation (default: the
    model's; a Hugging Face DeepSeek-V3 directory's num_nextn_predict_layers where it holds
    their weights, else 0)"""
    mtp_loss_weight: float | None = None
    """multi-token prediction: the weight of the modules' mean loss in the objective
    (DeepSeek-V3: 0.3, then 0.1; default 0.3)"""
    compile_cache: str = DEFAULT_CACHE
    """persistent XLA compilation cache directory, or off"""

    def validate(self) -> None:
        """Every field that can be wrong, before any device or compile: one message each."""
        for attr, _ in (*_SIZES, ("batch_size", None)):
            value = getattr(self, attr)
            if value is not None and value < 1:
                raise ConfigError(f"{_flag(attr)} {value} must be at least 1")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(
                f"--capacity-factor: capacity factor {self.capacity_factor} must be > 0"
            )
        if self.moe_buffer_factor is not None and not self.moe_buffer_factor >= 1:
            raise ConfigError(
                f"--moe-buffer-factor: {self.moe_buffer_factor} must be at least 1 (the "
                "balanced share)"
            )
        self.step.validate()
        if self.model == "custom":
            needed = ["style", *(a for a, _ in _SIZES if a != "kv_heads")]
            missing = [_flag(a) for a in needed if getattr(self, a) is None]
            if missing:
                raise ConfigError(
                    f"--model custom needs {', '.join(missing)}; e.g. --model custom --style "
                    "llama --layers 24 --d-model 1024 --heads 16 --kv-heads 8 --d-mlp 4096 "
                    "--seq-len 2048 --vocab 32000"
                )
        elif self.model not in MODEL_PRESETS and hf_dir(self.model) is None:
            raise ConfigError(
                f"unknown model {self.model!r}; choose one of: {', '.join(MODEL_PRESETS)}, "
                "custom, or hf:PATH"
            )

    def sync_config(self) -> SyncConfig | None:
        """The replica groups' sync settings where --mesh names a `replica` axis; None
        without one (and then no sync flag may be given)."""
        named = any(p.strip().startswith("replica=") for p in self.mesh.split(","))
        if named:
            return self.sync
        changed = self.sync.changed_flags()
        if changed:
            raise ConfigError(
                f"{', '.join(changed)} set(s) how replica groups meet, and --mesh {self.mesh} "
                "has none: add replica=M to --mesh (e.g. --mesh replica=2,fsdp=4), or drop "
                "the flag"
            )
        return None

    def model_overrides(self) -> dict:
        """The style and size flags given, as TransformerConfig fields (a custom model's
        kv heads default to its heads)."""
        fields = {field: getattr(self, attr) for attr, field in (("style", "style"), *_SIZES)}
        if self.model == "custom" and self.kv_heads is None:
            fields["num_kv_heads"] = self.heads
        return {k: v for k, v in fields.items() if v is not None}


# The model-size flags: Common's field, and the TransformerConfig field it sets.
_SIZES = (
    ("layers", "num_layers"),
    ("d_model", "d_model"),
    ("heads", "num_heads"),
    ("kv_heads", "num_kv_heads"),
    ("d_mlp", "d_mlp"),
    ("seq_len", "seq_len"),
    ("vocab", "vocab_size"),
)


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def _attention(platform: str, dtype: str, asked: str = "auto") -> str:
    """The fused kernel of the platform (jaxdist.kernels.attention); cuDNN's takes 16-bit
    inputs only."""
    if asked == "cudnn" and (platform != "gpu" or dtype != "bfloat16"):
        raise ConfigError(
            f"--attention cudnn runs on GPUs at bfloat16; this step is {platform} at {dtype}: "
            "use --attention xla or auto"
        )
    if asked == "splash" and platform == "gpu":
        raise ConfigError(
            "--attention splash is TPU's kernel (interpreted on CPU): on GPU use cudnn or xla"
        )
    if asked != "auto":
        return asked
    if platform == "tpu":
        return "splash"
    return "cudnn" if platform == "gpu" and dtype == "bfloat16" else "xla"


def setup(
    args: Common,
    *,
    profiling: bool = False,
    cluster=None,
    target: str | None = None,
    data: str | None = None,
):
    """Devices, mesh, layout and model config, all checked before anything compiles.

    `profiling`: op-level trace events; `cluster`: a DistributedConfig to join (multi-process);
    `target`: compile for a TPU slice or GPUs this host does not have; `data`: the --data whose
    vocabulary the model takes (a Hugging Face architecture keeps its own). With --remat auto
    the model takes the fastest policy that fits (jaxdist.planning.fit, by the one price of
    the step's memory). Returns (mesh, layout, model config, args with the batch size
    resolved)."""
    from jaxdist.layout import Layout
    from jaxdist.mesh import setup_devices

    args.validate()
    if profiling:
        # Op-level events in traces: XLA:CPU emits them only with this flag; on GPU, command
        # buffers (CUDA graphs) would hide the ops behind one launch.
        flags = "--xla_cpu_enable_xprof_traceme=true --xla_gpu_enable_command_buffer="
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    gpu_target = _gpu_target(target)
    setup_devices(args.devices)
    if cluster is not None:
        from jaxdist.cluster.join import initialize

        initialize(cluster, cpu=True)
    # A target's compile runs nothing, and the deviceless compiler that makes it cannot load
    # an executable back (XLA: "PjRtCompiler must be constructed with a Client"): no cache.
    if args.compile_cache != "off" and not target:
        _persistent_cache(args.compile_cache)
    platform, target_devices = _target_devices(target, gpu_target)
    model_cfg = _with_data(args, model_config(args, platform), data)
    mesh, rules = _mesh(args.mesh, platform, gpu_target, target_devices)
    layout = Layout.on(mesh, rules, args.step, seq_len=model_cfg.seq_len, sync=args.sync_config())
    if args.batch_size is None:
        args = dataclasses.replace(args, batch_size=max(16, layout.batch_unit))
    layout = dataclasses.replace(layout, batch_size=args.batch_size)
    if args.remat == "auto":
        model_cfg = _remat_auto(model_cfg, layout, mesh, target, platform)
    _say_fp8(layout, mesh, model_cfg)
    return mesh, dataclasses.replace(layout, remat=model_cfg.remat), model_cfg, args


def devices_and_mesh(args: Common):
    """The devices, the compile cache, and the mesh of --mesh over the devices with its rule
    table, for a command that uses a trained model (its record says what the model is: no
    preset is built, no remat chosen). Returns (mesh, rules, platform)."""
    import jax

    from jaxdist.mesh import setup_devices

    setup_devices(args.devices)
    if args.compile_cache != "off":
        _persistent_cache(args.compile_cache)
    platform = jax.default_backend()
    mesh, rules = _mesh(args.mesh, platform, None, None)
    return mesh, rules, platform


def computes(platform: str, dtype: str = "auto", attention: str = "auto") -> tuple[str, str]:
    """The compute dtype and attention kernel of a model on `platform`: auto is bfloat16 on
    GPU/TPU, float32 on CPU, and the platform's fused kernel."""
    if dtype == "auto":
        dtype = "float32" if platform == "cpu" else "bfloat16"
    return dtype, _attention(platform, dtype, attention)


def _remat_auto(model_cfg, layout, mesh, target: str | None, platform: str):
    """`--remat auto`: the model family's fastest policy (models/remat.py) predicted to fit the
    device (jaxdist.planning.fit.resolve); one line on stderr says which."""
    from jaxdist.compiled.memory import device_memory
    from jaxdist.planning import fit
    from models.inventory import plan_model
    from models.remat import ORDER as REMAT_ORDER

    memory = device_memory(mesh, target)
    if memory is None:
        return dataclasses.replace(model_cfg, remat=REMAT_ORDER[0])

    def plan_at(policy: str):
        return plan_model(dataclasses.replace(model_cfg, remat=policy))

    choice = fit.resolve(REMAT_ORDER, plan_at, layout, memory, platform)
    if choice.said:
        print(choice.line(), file=sys.stderr)
    return dataclasses.replace(model_cfg, remat=choice.policy)


def _say_fp8(layout, mesh, model_cfg) -> None:
    """With --fp8: one line on stderr, how many of the model's layer projections run in FP8,
    and why the others do not (jaxdist.kernels.fp8.in_fp8), by the rule the model applies;
    then, where some do on the CPU, that they are emulated there (fp8.platform_note)."""
    step = layout.step
    if step.fp8 == "off":
        return
    from jaxdist.kernels import fp8
    from models.layer import PROJECTIONS
    from models.transformer_config import _param_shapes, stacks

    shapes = _param_shapes(model_cfg)
    fans = [
        fp8.fans(spec, shapes[prefix + name][1:])  # one layer's weight
        for prefix, _ in stacks(model_cfg)
        for name, spec in PROJECTIONS.items()
        if prefix + name in shapes
    ]
    print(fp8.in_fp8(step, model_cfg.name, fans), file=sys.stderr)
    note = fp8.platform_note(layout, mesh)
    if note and any(fp8.projection_recipe(step, *f) != "off" for f in fans):
        print(f"note: {note}", file=sys.stderr)


def _with_data(args: Common, model_cfg, data: str | None):
    """The model with the data's vocabulary (jaxdist.data.batches.data_vocab), but for a
    pretrained architecture (`hf:`), which keeps its own."""
    if data is None or hf_dir(args.model) is not None:
        return model_cfg
    from jaxdist.data.batches import data_vocab
    from models.presets import with_data_vocab

    return with_data_vocab(model_cfg, data_vocab(data)[0])


def _gpu_target(target: str | None):
    """The GPU target to compile for, its compiler's flags set (read when JAX starts)."""
    if not target:
        return None
    from jaxdist.compiled import gpu

    if not gpu.is_gpu_target(target):
        return None
    parsed = gpu.parse_target(target)
    gpu.prepare()
    return parsed


def _persistent_cache(directory: str) -> None:
    """A restarted run (preemption, crash) then skips recompiling: restart time is part of
    what every failure costs. Small programs too: Orbax compiles dozens on a first save."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(directory)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _target_devices(target: str | None, gpu_target) -> tuple[str, list | None]:
    """The platform compiled for, and the target's abstract devices (None: this host's)."""
    import jax

    if gpu_target:
        from jaxdist.compiled import gpu

        return "gpu", gpu.gpu_devices(gpu_target)
    if target:
        from jaxdist.compiled.tpu import parse_target, tpu_devices

        return "tpu", tpu_devices(parse_target(target))
    return jax.default_backend(), None


def model_config(args: Common, platform: str):
    """The model preset with the flags' overrides, for the platform's dtype and attention."""
    from models.presets import get_model_config

    dtype, attention = computes(platform, args.compute_dtype, args.attention)
    given = {
        "capacity_factor": args.capacity_factor,
        "moe_buffer_factor": args.moe_buffer_factor,
        "moe_gemm": args.moe_gemm,
    }
    moe = {k: v for k, v in given.items() if v is not None}
    # The transformer config's own checks refuse bad values and unsupported styles in one line.
    mtp = {"mtp_depth": args.mtp_depth, "mtp_loss_weight": args.mtp_loss_weight}
    mtp = {k: v for k, v in mtp.items() if v is not None}
    if moe and (args.model == "custom" or not get_model_config(args.model).num_experts):
        raise ConfigError(
            f"--capacity-factor/--moe-buffer-factor/--moe-gemm apply to MoE models; {args.model} "
            "has no experts (try --model tiny-moe)"
        )
    return get_model_config(
        args.model,
        **moe,
        **mtp,
        **args.model_overrides(),
        compute_dtype=dtype,
        **({} if args.remat in ("preset", "auto") else {"remat": args.remat}),
        attention=attention,
    )


def _mesh(name: str, platform: str, gpu_target, target_devices):
    """The mesh of --mesh over the devices (a target's, or this host's), and its rules."""
    from jaxdist.mesh import build_mesh, parse_mesh
    from meshes.presets import STANDARD_RULES, get_mesh_preset

    if name == "auto":
        # Eight fake CPU devices (the default) take the cpu8 preset; any other count, as an
        # accelerator host's devices, FSDP over all of them.
        import jax

        count = len(target_devices) if target_devices is not None else jax.device_count()
        rules = STANDARD_RULES
        cpu8 = platform == "cpu" and count == 8
        mesh_cfg = get_mesh_preset("cpu8").mesh if cpu8 else parse_mesh("fsdp=-1")
    else:
        preset = get_mesh_preset(name)
        mesh_cfg, rules = preset.mesh, preset.rules
    if gpu_target and mesh_cfg.dcn:
        # The target's devices come host-major, so the outer axes (the preset's across-host
        # part) land across hosts without a hybrid mesh, which needs real slice indices.
        mesh_cfg = dataclasses.replace(mesh_cfg, ici=tuple(mesh_cfg.sizes().items()), dcn=())
    return build_mesh(mesh_cfg, target_devices), rules


def check_host_memory(mesh, layout, model_cfg, runs: bool = True) -> None:
    """Fake CPU devices all share this host's memory: a step that cannot fit in it is refused
    here, before it compiles (jaxdist.planning.hostfit). `runs`: False for a compile alone,
    which holds none of the step's buffers."""
    if not runs or mesh.devices.flat[0].platform != "cpu":
        return
    from jaxdist.planning.hostfit import check
    from models.inventory import plan_model

    check(plan_model(model_cfg), layout, len(mesh.local_devices))
