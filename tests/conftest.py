"""Tests run on 8 fake CPU devices; this must happen before any JAX backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Op-level events in CPU traces (for the profile tests); inert while no trace is running.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
