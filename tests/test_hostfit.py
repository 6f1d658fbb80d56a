"""A step too big for the host's memory (fake CPU devices share it) is refused before it
compiles, from the planner's memory model; one that fits passes."""

import os

import pytest

from jaxdist.errors import ConfigError
from jaxdist.layout import MESH_AXES, Layout
from jaxdist.planning import hostfit
from meshes.presets import STANDARD_RULES
from models.inventory import plan_model
from models.presets import get_model_config

GB = 1e9
CPU8 = {"pipeline": 1, "data": 2, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}


def model(name: str, **overrides):
    return plan_model(get_model_config(name, compute_dtype="float32", **overrides))


def layout(sizes: dict, batch: int, m) -> Layout:
    return Layout(tuple(sizes.items()), STANDARD_RULES, batch_size=batch, seq_len=m.seq_len)


def test_the_readme_bench_on_a_small_host_is_refused_naming_a_batch_that_fits():
    gpt2 = model("gpt2-124m")
    with pytest.raises(ConfigError) as e:
        hostfit.check(gpt2, layout(CPU8, 32, gpt2), 8, available=20 * GB)
    message = str(e.value)
    assert "8 devices x" in message and "20.0 GB is available" in message
    assert "--remat full" in message and "a smaller --model" in message
    # The batch it names does fit, at the same memory; the one it was given does not.
    suggested = int(message.split("a smaller --batch-size (")[1].split()[0])
    assert suggested < 32 and 32 % suggested == 0
    hostfit.check(gpt2, layout(CPU8, suggested, gpt2), 8, 20 * GB)
    if 2 * suggested < 32:  # and it is the largest halving that does
        with pytest.raises(ConfigError):
            hostfit.check(gpt2, layout(CPU8, 2 * suggested, gpt2), 8, 20 * GB)


def test_a_fitting_step_passes_and_needs_at_least_its_adam_state():
    tiny = model("tiny")
    single = dict.fromkeys(MESH_AXES, 1)
    need = hostfit.check(tiny, layout(single, 16, tiny), 1, available=1 * GB)
    # fp32 weights, gradients and AdamW's two moments: 16 bytes per parameter (tiny has
    # 476,416), plus the activations of 16 rows.
    assert 16 * 476_416 < need < 1 * GB


def test_the_remat_fix_is_not_offered_where_remat_is_already_full():
    gpt2 = model("gpt2-124m", remat="full")
    with pytest.raises(ConfigError) as e:
        hostfit.check(gpt2, layout(CPU8, 32, gpt2), 8, 1 * GB)
    assert "--remat full" not in str(e.value)
    assert "(even 4 needs" in str(e.value)  # 4 rows: one per device of data x fsdp


def test_available_memory_is_read_in_bytes():
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # MemAvailable is in kB: read as bytes it lies between a thousandth of the memory and all.
    assert total / 1000 < hostfit.available_bytes() <= total
