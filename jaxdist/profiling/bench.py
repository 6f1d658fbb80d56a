"""`jaxdist bench`: the real training step of a preset, timed, as one JSON line.

The same code path as `jaxdist train` (data, optimizer, metrics fetched one step late), after
warm-up, beside the bare compiled step run back to back, so the loop's own cost is visible.
"""

import time

import jax

from jaxdist import hardware
from jaxdist.cluster.join import metric_value
from jaxdist.compiled.memory import xla_peak
from jaxdist.metrics.records import distribution, throughput

_NO_PEAK = "no peak FLOP/s known for {} devices; pass --peak-tflops to get an MFU"


def bench(
    jitted,
    batches,
    model,
    batch_size: int,
    steps: int,
    warmup: int = 3,
    peak_tflops: float | None = None,
) -> dict:
    """The step's figures; MFU against `peak_tflops` per device, else the hardware table's
    peak for the devices present, else (CPUs) null with a note saying why."""
    global_shape = (batch_size, model.seq_len + 1)

    def place(s):
        return jax.make_array_from_process_local_data(
            jitted.batch_sharding, batches.batch(s), global_shape
        )

    t0 = time.perf_counter()
    exe = jitted.compile_abstract(global_shape)
    compile_s = time.perf_counter() - t0
    state = jitted.init_fn()
    for s in range(warmup):
        state, m = exe(state, place(s))
    jax.block_until_ready(m)

    # The loop as `train` runs it: dispatch step s, then read step s-1's metrics.
    times, pending = [], None
    t_prev = time.perf_counter()
    for s in range(warmup, warmup + steps):
        state, m = exe(state, place(s))
        if pending is not None:
            metric_value("loss", pending["loss"])
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
        pending = m
    metric_value("loss", pending["loss"])
    times.append(time.perf_counter() - t_prev)

    bare, synced_p50 = _bare_and_synced(exe, state, place(0), steps)
    stats = distribution(times)
    peak = hardware.peak_flops(jax.devices()[0], peak_tflops)
    tp = throughput(
        stats["p50"], batch_size * model.seq_len, model.flops_per_token, jax.device_count(), peak
    )
    mem = jax.devices()[0].memory_stats() or {}
    estimate = xla_peak(exe.memory_analysis())
    peak_bytes = mem.get("peak_bytes_in_use", estimate)
    return {
        "model": model.name,
        "remat": getattr(model.config, "remat", None),  # the policy --remat auto chose
        "batch_size": batch_size,
        "seq_len": model.seq_len,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "tokens_per_s": tp["tokens_per_s"],
        "model_tflops": tp["model_tflops"],
        "mfu": tp["mfu"],
        "peak_tflops_per_device": None if peak is None else peak / 1e12,
        "step_ms_p50": stats["p50"] * 1e3,
        "step_ms_p90": stats["p90"] * 1e3,
        "step_ms_bare": bare * 1e3,
        "step_ms_synced_p50": synced_p50 * 1e3,
        "tokens_per_s_synced": batch_size * model.seq_len / synced_p50,
        "loop_overhead": stats["p50"] / bare - 1,
        "peak_mem_gb": peak_bytes / 1e9,
        "peak_mem_gib": peak_bytes / 2**30,  # the peers' unit
        "xla_estimate_gib": estimate / 2**30,
        "peak_mem_source": "allocator" if "peak_bytes_in_use" in mem else "xla_estimate",
        "compile_s": compile_s,
        "steps": steps,
        "final_loss": metric_value("loss", m["loss"]),
    } | ({} if peak else {"mfu_note": _NO_PEAK.format(jax.devices()[0].device_kind)})


def _bare_and_synced(exe, state, batch, steps: int) -> tuple[float, float]:
    """Seconds per step two more ways: the bare step (same executable and batch, nothing
    else, one wait at the end), and the p50 of steps each waited for, as a benchmark that
    synchronizes after every step times it (the torch peers do): the host's launch gap
    between steps is then in the figure."""
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, _m = exe(state, batch)
    jax.block_until_ready(state)
    bare = (time.perf_counter() - t0) / steps
    synced = []
    for _ in range(min(steps, 10)):
        t0 = time.perf_counter()
        state, _m = exe(state, batch)
        jax.block_until_ready(state)
        synced.append(time.perf_counter() - t0)
    return bare, distribution(synced)["p50"]
