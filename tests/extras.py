"""The optional extras some tests need, in one place, so that `pip install -e ".[dev]"` alone
collects the whole suite and every test that needs more skips in one line naming what to install.

The checks only look (jaxdist.planning's own `missing()`, an environment variable); nothing
optional is imported at collection. `cli_without` runs the command line as on a host where an
extra was never installed, so the message a user gets there is tested in every environment."""

import os
import pathlib
import subprocess
import sys

import pytest

from jaxdist.compiled import gpu, tpu

# The variable .ci/run sets to a Python with torch and transformers (a CPU build).
TORCH_REFERENCE_VAR = "JAXDIST_HF_REFERENCE_PYTHON"
TORCH_REFERENCE_MISSING = (
    f"needs a torch reference: set {TORCH_REFERENCE_VAR} to a Python with torch and "
    "transformers (pip install torch transformers safetensors; .ci/run makes one)"
)


def torch_reference() -> str | None:
    """The reference Python's path, or None. A path that is set but lacks torch is not
    probed here (a subprocess per collection): the test that runs it then fails, saying so."""
    found = os.environ.get(TORCH_REFERENCE_VAR)
    return found if found and pathlib.Path(found).is_file() else None


# The variable .ci/run sets to the [ft] extra's sidecar Python (3.11, torch and torchft, CPU).
FT_PYTHON_VAR = "JAXDIST_FT_PYTHON"
FT_MISSING = (
    f"needs the [ft] extra's sidecar: set {FT_PYTHON_VAR} to a Python 3.11 with torch and "
    "torchft (pip install torch==2.13.0 torchft==0.2.0 numpy; .ci/run makes one)"
)


def ft_python() -> str | None:
    found = os.environ.get(FT_PYTHON_VAR)
    return found if found and pathlib.Path(found).is_file() else None


# Each reason is one line naming the extra and its install command.
needs_gpu_aot = pytest.mark.skipif(gpu.missing() is not None, reason=gpu.MISSING)
needs_tpu = pytest.mark.skipif(tpu.missing() is not None, reason=tpu.MISSING)
needs_torch_reference = pytest.mark.skipif(
    torch_reference() is None, reason=TORCH_REFERENCE_MISSING
)
needs_ft = pytest.mark.skipif(ft_python() is None, reason=FT_MISSING)


def summary() -> str:
    """One line for the test report's header: which extras this run has."""
    have = {
        "gpu-aot": gpu.missing() is None,
        "tpu": tpu.missing() is None,
        "torch reference": torch_reference() is not None,
        "ft": ft_python() is not None,
    }
    return "extras: " + ", ".join(f"{k} {'present' if v else 'absent'}" for k, v in have.items())


# The top-level packages each extra installs: hidden, the host is as if it had never had it.
PACKAGES = {"gpu-aot": ("jax_plugins",), "tpu": ("libtpu",)}

# A fresh interpreter in which every import finder answers "not here" for the hidden packages
# (as on a host without them: `import` raises ModuleNotFoundError, importlib.util.find_spec
# returns None or, for a submodule, raises), then the command line with the remaining args.
_WITHOUT = """
import sys
hidden = set(sys.argv[1].split(","))


class Hidden:
    def __init__(self, finder):
        self.finder = finder

    def __getattr__(self, name):
        return getattr(self.finder, name)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in hidden:
            return None
        return self.finder.find_spec(name, path, target)


sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
for name in [m for m in sys.modules if m.partition(".")[0] in hidden]:
    del sys.modules[name]
from jaxdist.cli.main import main

sys.exit(main(sys.argv[2:]))
"""


def cli_without(extra: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`jaxdist *args` where the packages of `extra` cannot be imported."""
    from tests.helpers import CLI_ENV  # the session's environment, caches included

    hidden = ",".join(PACKAGES[extra])
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT, hidden, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=CLI_ENV,
    )
