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
# Op-level events in CPU traces (for the profile tests); inert while no trace is running.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
).strip()

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
