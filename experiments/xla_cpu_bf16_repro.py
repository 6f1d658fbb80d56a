"""XLA:CPU aborts compiling a bfloat16 psum in a shard_map that is manual over only some axes.

    python experiments/xla_cpu_bf16_repro.py            # bf16: aborts, exit 134
    python experiments/xla_cpu_bf16_repro.py float32    # runs, prints ok
    python experiments/xla_cpu_bf16_repro.py bfloat16 all   # manual over every axis: ok

Pure JAX, two fake CPU devices. jaxdist met it in the embedding table's gradient
(jaxdist/kernels/lookup.py), whose shard_map is manual over the token axes only, and avoids it
by summing bf16 in float32 on CPU itself (`summed_on`), which is what the failing pass does.

Not filed: this machine cannot post to GitHub, and a search of public issues found none that
matches (searched for the message, the pass and the function). To be filed at
https://github.com/openxla/xla/issues (component XLA:CPU; jax 0.11.2 / jaxlib 0.11.2):

Title: XLA:CPU: AllReducePromotion aborts ("Invalid binary instruction opcode copy") on a bf16
all-reduce whose reducer root is a copy (JAX shard_map with partial axis_names)

Text:
    On CPU, a bf16 `jax.lax.psum` (also `psum_scatter`, `pmax`) inside `jax.shard_map` with
    `axis_names` a strict subset of the mesh axes aborts the process at compile time:

        F hlo_instruction.cc:1661] Invalid binary instruction opcode copy
        @ xla::HloInstruction::CreateBinary()
        @ xla::(anonymous namespace)::CloneAllReduce()
        @ xla::ChangeOpDataType::RunImpl()
        @ xla::AllReducePromotion::RunImpl()
        @ xla::cpu::CpuCompiler::RunHloPassesThroughLayoutAssn()

    JAX lowers the reducer's add under the partly manual mesh with a `Sharding` custom call on
    its result; Shardy turns that into a `copy`, so the all-reduce's to_apply is
    `add = bf16[] add(p0, p1); ROOT copy = bf16[] copy(add)`. The CPU pipeline's
    AllReducePromotion({BF16, F32}) rebuilds the reducer as
    `CreateBinary(to_apply->root_instruction()->opcode(), x, y)`, i.e. a binary `copy`, and the
    CHECK fires. float32 (not promoted), float16 and a fully manual shard_map compile and run;
    `--xla_disable_hlo_passes=all-reduce-promotion` also avoids it. Expected: the promoted
    reducer is cloned from the original computation (or looks through a root copy), or a
    Status error rather than a process abort. Reproducer: this file (prints the versions,
    then aborts with exit code 134 or prints ok).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

dtype = jnp.dtype(sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
manual = {"data", "other"} if sys.argv[2:] == ["all"] else {"data"}
print(
    f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, {dtype}, manual over {sorted(manual)}",
    flush=True,
)
mesh = jax.make_mesh((2, 1), ("data", "other"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
summed = jax.shard_map(
    lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P(),
    axis_names=manual,
)  # fmt: skip
out = jax.jit(summed)(jnp.ones((2, 4), dtype))
assert out.tolist() == [[2.0] * 4], out
print("ok")
