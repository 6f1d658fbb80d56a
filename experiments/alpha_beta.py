"""Collective time against message size: alpha-beta fits, the crossover, and bucketing.

    python experiments/alpha_beta.py                  # 8 fake CPU devices; on GPUs, all of them
    python experiments/alpha_beta.py --kinds all-reduce --max-mb 16 --reps 50

For all-reduce (psum), all-gather and collective-permute inside shard_map, over message sizes
from 1 KB to 64 MB (powers of 2; n is the full buffer, as in jaxdist.planning.traffic and
jaxdist.planning.costmodel: the all-reduced array, the gathered output, the array each device
sends), it times many calls and reports p50/p90/max per collective, then fits
T(n) = alpha + n/beta to the p50s by least squares on relative residuals (so 1 KB counts as much
as 64 MB), with non-negative coefficients. The plain fit is converted to the cost model's ring
convention (per-step alpha and per-device bandwidth B for p devices: all-reduce
2(p-1) alpha + 2(p-1)/p n/B, all-gather (p-1) alpha + (p-1)/p n/B, permute alpha + n/B) and
printed beside the "cpu" preset (or --preset). The crossover n* = alpha * beta splits the
latency-bound regime (below: bucket small tensors) from the bandwidth-bound one (above).
Bucketing: K tensors of S bytes all-reduced one after another (a data dependency through an
optimization barrier keeps XLA from combining them), the same K psums left independent (XLA's
all-reduce combiner may merge them: the compiled count is reported), and one bucket of K*S
bytes, measured, beside the fit's and the preset's predictions.

Timing: one jit and compile per size, warm-up calls, donated buffers fed back in (the output
takes the input's memory), block_until_ready per call. Each call runs the collective `inner` times
in a fori_loop (up to 100 for small messages, 1 from 16 MB) so that the ~0.4 ms dispatch of a
program over 8 fake devices is amortized: a sample is call time / inner, so p50/p90/max spread
over calls, not over single collectives. On fake CPU devices a collective is a rendezvous of
threads plus memory copies on however many cores there are: the numbers describe this host's
threads and memory, not a network, and they are noisy when other work shares the cores.
Minor page faults are counted per call: from 32 MB up, glibc hands XLA's per-call buffers out
as fresh mmaps (its mmap threshold stops growing at 32 MB), so every call faults its buffers
in and the time jumps several-fold; such points (fault bytes over a quarter of the p buffers)
measure the allocator, are drawn hollow and left out of the fit. --malloc-no-mmap (glibc
mallopt) keeps buffers on the heap (here: no faults at 32 MB, still some at 64 MB).
On CPU the achieved bandwidth n/T also peaks near 1 MB, while p buffers still fit the last-level
cache, and sags beyond it: a cache regime the two-parameter model has no term for.
Writes experiments/results/alpha_beta.json and .png (a few minutes on 2 cores).
"""

import argparse
import ctypes
import json
import math
import os
import pathlib
import resource
import sys
import time

KINDS = ("all-reduce", "all-gather", "collective-permute")


def ring_terms(kind: str, p: int) -> tuple[float, float]:
    """(steps, bytes factor): T = steps * alpha_step + factor * n / B in the cost model's ring,
    read off jaxdist.planning.costmodel.collective_time with unit links, so the conversion is
    the model's own."""
    from jaxdist.hardware import Link
    from jaxdist.planning.costmodel import collective_time

    steps = collective_time(kind, 1.0, p, Link(alpha_s=1.0, bandwidth=math.inf))
    factor = collective_time(kind, 1.0, p, Link(alpha_s=0.0, bandwidth=1.0))
    return steps, factor


def fit_alpha_beta(n, t) -> tuple[float, float]:
    """T = alpha + n / beta, least squares on relative residuals, alpha and 1/beta >= 0."""
    import numpy as np
    from scipy.optimize import nnls

    n, t = np.asarray(n, float), np.asarray(t, float)
    A = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (alpha, inv_beta), _ = nnls(A, np.ones_like(t))
    return float(alpha), float(1 / inv_beta) if inv_beta > 0 else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-devices", type=int, default=8, help="fake CPU devices when no GPU")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--min-kb", type=float, default=1)
    ap.add_argument("--max-mb", type=float, default=64)
    ap.add_argument("--reps", type=int, default=30, help="timed calls per size")
    ap.add_argument("--bucket-count", type=int, default=256)
    ap.add_argument("--bucket-kb", type=float, default=4)
    ap.add_argument(
        "--preset", default=None, help="jaxdist.hardware preset (default: cpu, or h100)"
    )
    ap.add_argument("--malloc-no-mmap", action="store_true", help="glibc: reuse large buffers")
    ap.add_argument("--out", default=None, help="results directory (default: experiments/results)")
    args = ap.parse_args()
    if args.malloc_no_mmap:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)):
            sys.exit("mallopt refused: --malloc-no-mmap needs glibc")
    kinds = [k.strip() for k in args.kinds.split(",")]
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")

    import jax

    # Read only by the CPU backend, so where GPUs exist they are the devices measured.
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist.hardware import get_hardware
    from jaxdist.planning.costmodel import collective_time

    devices = jax.devices()
    p = len(devices)
    if p < 2:
        sys.exit(f"only {p} {devices[0].platform} device: no collective to time")
    platform = devices[0].platform
    hw = get_hardware(args.preset or ("cpu" if platform == "cpu" else "h100"))
    link = hw.inner
    mesh = jax.make_mesh((p,), ("x",), devices=devices)
    sharding = NamedSharding(mesh, P("x"))
    f32 = 4

    def compiled(local_fn, local_elems: int, hlo_op: str):
        """jit(shard_map(local_fn)) compiled for a [p * local_elems] f32 array, donated."""
        fn = jax.jit(
            jax.shard_map(local_fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False),
            donate_argnums=0,
        )
        x = jax.device_put(jnp.zeros((p * local_elems,), jnp.float32), sharding)
        exe = fn.lower(x).compile()
        count = exe.as_text().count(f" {hlo_op}(") + exe.as_text().count(f" {hlo_op}-start(")
        if not count:  # XLA simplified the collective away: the timing would be meaningless
            raise RuntimeError(f"compiled program holds no {hlo_op}")
        return exe, x, count

    def time_calls(exe, x, inner: int) -> tuple[list[float], float]:
        """Per-collective samples, and page-faulted bytes per collective."""
        for _ in range(3):  # warm-up: first-touch of buffers, thread pools
            x = exe(x)
        x.block_until_ready()
        samples = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(args.reps):
            t0 = time.perf_counter()
            x = exe(x)
            x.block_until_ready()
            samples.append((time.perf_counter() - t0) / inner)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return samples, faults * resource.getpagesize() / args.reps / inner

    def stats(timed) -> dict:
        samples, fault_bytes = timed
        q = np.percentile(samples, [50, 90, 100])
        return {"p50_s": q[0], "p90_s": q[1], "max_s": q[2], "fault_bytes": fault_bytes}

    def local_program(kind: str, n: int, inner: int):
        """The per-device body and its local element count for a message of n bytes."""
        if kind == "all-reduce":
            return lambda x: jax.lax.fori_loop(
                0, inner, lambda i, x: jax.lax.psum(x, "x"), x
            ), n // f32
        if kind == "all-gather":
            m = n // f32 // p

            # Keep shard 0 of the gathered buffer as the next input: a static slice XLA cannot
            # fold into the gather (the gather's own shard would be).
            def gather(i, x):
                return jax.lax.all_gather(x, "x", tiled=True)[:m]

            return lambda x: jax.lax.fori_loop(0, inner, gather, x), m
        perm = [(i, (i + 1) % p) for i in range(p)]
        return lambda x: jax.lax.fori_loop(
            0, inner, lambda i, x: jax.lax.ppermute(x, "x", perm), x
        ), n // f32

    sizes = []
    n = int(2 ** np.ceil(np.log2(args.min_kb * 1024)))
    while n <= args.max_mb * 2**20:
        sizes.append(n)
        n *= 2
    rows = []
    t_start = time.perf_counter()
    print(f"{p} {platform} devices ({devices[0].device_kind}), load {os.getloadavg()[0]:.1f}")
    for kind in kinds:
        for n in sizes:
            if n % (f32 * p):
                continue
            inner = int(np.clip(2**24 // n, 1, 100))
            body, local = local_program(kind, n, inner)
            exe, x, _ = compiled(body, local, kind)
            st = stats(time_calls(exe, x, inner))
            fitted = st["fault_bytes"] < 0.25 * p * n
            rows.append({"kind": kind, "bytes": n, "inner": inner, **st, "fitted": fitted})
            note = "" if fitted else f"  faults {st['fault_bytes'] / 2**20:.0f} MB: not fitted"
            print(
                f"{kind:19s} {n / 1024:9.0f} KB  p50 {st['p50_s'] * 1e6:10.1f} us  "
                f"p90 {st['p90_s'] * 1e6:10.1f}  max {st['max_s'] * 1e6:10.1f}  "
                f"{n / st['p50_s'] / 1e9:6.2f} GB/s{note}",
                flush=True,
            )
            del exe, x

    fits = {}
    for kind in kinds:
        rs = [r for r in rows if r["kind"] == kind and r["fitted"]]
        alpha, beta = fit_alpha_beta([r["bytes"] for r in rs], [r["p50_s"] for r in rs])
        steps, factor = ring_terms(kind, p)
        pred = np.array([alpha + r["bytes"] / beta for r in rs])
        meas = np.array([r["p50_s"] for r in rs])
        fits[kind] = {
            "alpha_s": alpha,
            "beta_Bps": beta,
            "crossover_bytes": alpha * beta,
            "alpha_step_s": alpha / steps,
            "bandwidth_Bps": beta * factor,
            "preset_alpha_step_s": link.alpha_s,
            "preset_bandwidth_Bps": link.bandwidth,
            "rms_rel_error": float(np.sqrt(np.mean((pred / meas - 1) ** 2))),
            "fitted_sizes": len(rs),
        }

    # Bucketing: K tensors of S bytes, stacked [K, S/4] per device so every variant moves the
    # same bytes in and out of one program; only the collectives differ.
    K, S = args.bucket_count, int(args.bucket_kb * 1024)
    e = S // f32
    bucket_inner = 10

    def one_by_one(xs):
        outs, prev = [], None
        for i in range(K):
            xi = xs[i] if prev is None else jax.lax.optimization_barrier((prev, xs[i]))[1]
            prev = jax.lax.psum(xi, "x")
            outs.append(prev)
        return jnp.stack(outs)

    def independent(xs):
        return jnp.stack([jax.lax.psum(xs[i], "x") for i in range(K)])

    def bucketed(xs):
        return jax.lax.psum(xs.reshape(-1), "x").reshape(K, e)

    bucket = {"count": K, "tensor_bytes": S, "variants": {}}
    for name, fn in (
        ("one_by_one", one_by_one),
        ("independent", independent),
        ("one_bucket", bucketed),
    ):

        def body(x, fn=fn):
            return jax.lax.fori_loop(
                0, bucket_inner, lambda i, x: fn(x.reshape(K, e)).reshape(-1), x
            )

        exe, x, count = compiled(body, K * e, "all-reduce")
        st = stats(time_calls(exe, x, bucket_inner))
        bucket["variants"][name] = {**st, "compiled_all_reduces": count}
        print(f"bucketing {name:12s} p50 {st['p50_s'] * 1e3:8.2f} ms  ({count} all-reduce ops)")
        del exe, x
    v = bucket["variants"]
    if "all-reduce" in fits:
        f = fits["all-reduce"]
        t = lambda nbytes: f["alpha_s"] + nbytes / f["beta_Bps"]  # noqa: E731
        bucket["fit_one_by_one_s"], bucket["fit_one_bucket_s"] = K * t(S), t(K * S)
    bucket["preset_one_by_one_s"] = K * collective_time("all-reduce", S, p, link)
    bucket["preset_one_bucket_s"] = collective_time("all-reduce", K * S, p, link)
    bucket["measured_speedup"] = v["one_by_one"]["p50_s"] / v["one_bucket"]["p50_s"]
    if "fit_one_bucket_s" in bucket:
        bucket["fit_speedup"] = bucket["fit_one_by_one_s"] / bucket["fit_one_bucket_s"]
    bucket["preset_speedup"] = bucket["preset_one_by_one_s"] / bucket["preset_one_bucket_s"]

    print(f"\nfitted on {p} {platform} devices vs preset {hw.name!r} (ring convention):")
    print(
        f"{'kind':19s} {'alpha':>9s} {'beta':>10s} {'n*':>9s} | {'alpha/step':>10s} "
        f"{'B':>10s} | {'preset a':>9s} {'preset B':>10s} | rms err"
    )
    for kind, f in fits.items():
        print(
            f"{kind:19s} {f['alpha_s'] * 1e6:7.1f}us {f['beta_Bps'] / 1e9:6.2f}GB/s "
            f"{f['crossover_bytes'] / 1024:7.0f}KB | {f['alpha_step_s'] * 1e6:8.1f}us "
            f"{f['bandwidth_Bps'] / 1e9:6.2f}GB/s | {link.alpha_s * 1e6:7.1f}us "
            f"{link.bandwidth / 1e9:6.2f}GB/s | {f['rms_rel_error']:.0%}"
        )
    print(
        f"bucketing {K} x {S // 1024} KB: one by one {v['one_by_one']['p50_s'] * 1e3:.2f} ms, "
        f"one bucket {v['one_bucket']['p50_s'] * 1e3:.2f} ms: {bucket['measured_speedup']:.1f}x "
        f"measured, {bucket.get('fit_speedup', float('nan')):.1f}x from the fit, "
        f"{bucket['preset_speedup']:.1f}x from the preset"
    )

    out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "devices": {"count": p, "platform": platform, "kind": devices[0].device_kind},
        "host_cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        "jax": jax.__version__,
        "preset": hw.name,
        "args": vars(args),
        "rows": rows,
        "fits": fits,
        "bucketing": bucket,
        "wall_s": time.perf_counter() - t_start,
    }
    (out / "alpha_beta.json").write_text(json.dumps(record, indent=1))
    plot(rows, fits, bucket, p, platform, hw.name, link, out / "alpha_beta.png")


def plot(rows, fits, bucket, p, platform, preset, link, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from jaxdist.planning.costmodel import collective_time

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.6))
    for (kind, f), color in zip(fits.items(), ("C0", "C1", "C2"), strict=False):
        rs = [r for r in rows if r["kind"] == kind]
        n = np.array([r["bytes"] for r in rs], float)
        p50, p90, mx = (np.array([r[k] for r in rs]) for k in ("p50_s", "p90_s", "max_s"))
        a.fill_between(n, p50, p90, color=color, alpha=0.2)
        fitted = np.array([r["fitted"] for r in rs])
        a.plot(n[fitted], p50[fitted], "o", color=color, ms=4, label=f"{kind} p50 (band: p90)")
        a.plot(n[~fitted], p50[~fitted], "o", color=color, ms=5, mfc="none")
        a.plot(n, mx, "x", color=color, ms=3, alpha=0.5)
        a.plot(n, f["alpha_s"] + n / f["beta_Bps"], "-", color=color, lw=1)
        a.plot(
            n,
            [collective_time(kind, x, p, link) for x in n],
            "--",
            color=color,
            lw=1,
            alpha=0.7,
        )
        a.axvline(f["crossover_bytes"], color=color, ls=":", lw=1)
        b.plot(n, n / p50, "o-", color=color, ms=3, label=kind)
        b.axhline(f["beta_Bps"], color=color, ls="-", lw=0.8, alpha=0.6)
        b.axvline(f["crossover_bytes"], color=color, ls=":", lw=1)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("message bytes n (full buffer)")
    a.set_ylabel("time per collective, s")
    a.set_title(
        f"{p} {platform} devices: solid fit, dashed preset {preset!r}, x max, : n*,\n"
        "hollow: page-fault bound, not fitted",
        fontsize=9,
    )
    a.legend(fontsize=7)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("message bytes n")
    b.set_ylabel("n / T(n), bytes/s")
    b.set_title("algorithm bandwidth: rises while latency-bound, flat at beta")
    b.legend(fontsize=7)

    v = bucket["variants"]
    labels = ["one by one", "independent\n(XLA may combine)", "one bucket"]
    keys = ["one_by_one", "independent", "one_bucket"]
    meas = np.array([v[k]["p50_s"] for k in keys]) * 1e3
    err = np.array([v[k]["p90_s"] for k in keys]) * 1e3 - meas
    x = np.arange(3)
    c.bar(x - 0.27, meas, 0.27, yerr=[np.zeros(3), err], label="measured p50 (to p90)")
    if "fit_one_by_one_s" in bucket:
        fit = [bucket["fit_one_by_one_s"], np.nan, bucket["fit_one_bucket_s"]]
        c.bar(x, np.array(fit) * 1e3, 0.27, label="fitted alpha-beta")
    pre = [bucket["preset_one_by_one_s"], np.nan, bucket["preset_one_bucket_s"]]
    c.bar(x + 0.27, np.array(pre) * 1e3, 0.27, label=f"preset {preset!r}")
    for i, k in enumerate(keys):
        top = v[k]["p90_s"] * 1e3 * 1.1
        c.text(i - 0.27, top, f"{v[k]['compiled_all_reduces']} op", ha="center", fontsize=7)
    c.set_xticks(x, labels, fontsize=8)
    c.set_yscale("log")
    c.set_ylabel("ms")
    c.set_title(
        f"all-reduce of {bucket['count']} x {bucket['tensor_bytes'] // 1024} KB: "
        f"{bucket['measured_speedup']:.1f}x from bucketing"
    )
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
