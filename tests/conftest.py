"""Tests run on 8 fake CPU devices; this must happen before any JAX backend starts.

The run is hermetic: caches the code under test (and its libraries) would keep in the user's
home directory go to one temporary directory per session instead, set in the environment here,
before anything imports jaxdist.cli, so that every subprocess the tests start inherits it."""

import atexit
import os
import shutil
import tempfile

# One directory for the whole session: pytest-xdist's workers start after the controller has
# imported this file, so they inherit it and share its caches (a program one worker compiled,
# the other loads); the process that made it removes it.
_SCRATCH = os.environ.get("JAXDIST_TEST_SCRATCH")
if _SCRATCH is None:
    _SCRATCH = os.environ["JAXDIST_TEST_SCRATCH"] = tempfile.mkdtemp(prefix="jaxdist-tests-")
    atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)
# The CLI's persistent XLA compile cache (jaxdist/cli/options.py DEFAULT_CACHE), shared by the
# session's subprocesses; matplotlib's font cache and config (breakdown.png); anything else
# that follows the XDG base directories.
os.environ["JAXDIST_COMPILE_CACHE"] = os.path.join(_SCRATCH, "xla")
os.environ["MPLCONFIGDIR"] = os.path.join(_SCRATCH, "matplotlib")
os.environ["XDG_CACHE_HOME"] = os.path.join(_SCRATCH, "cache")
os.environ["XDG_CONFIG_HOME"] = os.path.join(_SCRATCH, "config")

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The host's XLA_FLAGS, before the suite's own: the golden losses run under them alone.
_USER_XLA_FLAGS = os.environ.get("JAXDIST_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ["JAXDIST_TEST_USER_XLA_FLAGS"] = _USER_XLA_FLAGS
# Op-level events in CPU traces (for the profile tests); inert while no trace is running.
# LLVM at -O0 for XLA:CPU's kernels: the suite is compile-bound on tiny models, and -O0 takes
# about 40% off XLA:CPU's compiles (the whole suite on a 2-core host: 24.8-26.7 min before,
# 17.6-20.4 min after; experiments/README, "Times of the everyday commands"). It changes only
# how LLVM turns the optimized program into machine code (no HLO pass, fusion, sharding or
# buffer assignment), so every comparison holds; floating-point contraction differs, so the
# last bits of a loss can, and the golden losses (tests/test_golden.py) run in a process with
# the host's own flags, as a user's run does.
_SUITE_FLAGS = "--xla_cpu_enable_xprof_traceme=true --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{_USER_XLA_FLAGS} {_SUITE_FLAGS}".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# One persistent compilation cache for the session, in this process and (through
# JAXDIST_COMPILE_CACHE) in the CLI's subprocesses: many tests compile the same program (tiny on
# the same mesh, the single-device reference), and compiling is most of what the suite does.
jax.config.update("jax_compilation_cache_dir", os.environ["JAXDIST_COMPILE_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_report_header(config):
    # Which optional extras this run has, so a log says why tests skipped (or did not).
    from tests.extras import summary

    return summary()
