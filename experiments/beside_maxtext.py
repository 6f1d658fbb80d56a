"""jaxdist beside MaxText 0.2.5 on the same XLA TPU compiler: memory per chip, rows per chip that
fit, and the collectives each program compiles, for one model on one slice.

It installs nothing. Give it a Python with MaxText (its own venv; see experiments/README.md):

    python3.12 -m venv mt-venv
    mt-venv/bin/pip install "maxtext[tpu]==0.2.5" "jax==0.11.2" "jaxlib==0.11.2" \
        "libtpu==0.0.48.*"
    python experiments/beside_maxtext.py --maxtext-python mt-venv/bin/python

Both programs compile for the slice from this host (no TPU): MaxText's own `train_compile`
(Google names the slice `v5p-16`, 8 chips) and `jaxdist train --compile-only --target`. Memory
per chip is XLA's argument + output + temp - alias in both. Collectives are counted in each
compiled HLO by jaxdist.compiled.hlo (loop trips multiplied in); bytes each chip sends per step
are all-gather x (n-1)/n, all-reduce x 2(n-1)/n, reduce-scatter x (n-1)/n of the full buffer,
collective-permute x 1. jaxdist compiles each policy twice: with its one-way rings (the
default) and with XLA's two-way rings, as MaxText compiles them (`--collective-matmul two-way`).
About 32 minutes on 2 cores (each MaxText compile takes 2-3).

A GQA model with a 128K vocabulary, the policy table alone (`--model llama3-8b --seq 4096 --rows
2 --policies-only`, about 20 minutes; `llama2-7b` likewise).

Long context (`--context 4 --seq 32768 --fraction-rows 0.25`): the sequence split over 4
chips, fsdp over 2, both programs' all-gather strategy; one policy pair, about 5 minutes.
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from jaxdist.compiled import hlo

# MaxText's model and the same model as a Hugging Face config for jaxdist (models/configs).
MODELS = {"llama2-7b": "llama2-7b", "llama3-8b": "llama3-8b"}
# (MaxText remat_policy, jaxdist --remat) that keep the same things, row by row.
POLICIES = [
    ("full", "full"),
    ("minimal_with_context", "dots"),
    ("save_dot_except_mlp", "dots_except_mlp"),
]
TWO_WAY = ("--collective-matmul", "two-way")
MT_ENV = {"TPU_SKIP_MDS_QUERY": "1", "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def _sent(collectives: dict, n: int) -> float:
    share = (n - 1) / n
    weight = {"all-gather": share, "all-reduce": 2 * share, "reduce-scatter": share}
    return sum(v["bytes"] * weight.get(kind, 1.0) for (_, kind), v in collectives.items())


def _step_hlo(dump: pathlib.Path) -> str:
    """The compiled train step's HLO among XLA's dumps (the largest optimized module)."""
    files = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not files:
        raise SystemExit(f"no HLO dump under {dump}")
    return files[-1].read_text()


def maxtext(
    python: str, model: str, policy: str, rows: float, seq: int, work: pathlib.Path, cp: int = 1
):
    """MaxText's compile for v5p-16: (GB per chip or None where XLA refused, HLO summary).
    `cp` > 1: the sequence split over `context` (MaxText's all-gather strategy), fsdp the rest."""
    site = subprocess.run(
        [python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dump = work / f"mt-{policy}-{rows}"
    env = {**MT_ENV, "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}
    cmd = [python, "-m", "maxtext.trainers.pre_train.train_compile", f"{site}/configs/base.yml"]
    cmd += ["compile_topology=v5p-16", "compile_topology_num_slices=1", f"model_name={model}"]
    cmd += [f"per_device_batch_size={rows}", f"max_target_length={seq}", "jax_cache_dir="]
    cmd += [f"remat_policy={policy}"]
    if cp > 1:
        cmd += [f"ici_context_parallelism={cp}", f"ici_fsdp_parallelism={8 // cp}"]
        cmd += ["context_parallel_strategy=all_gather"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    text = r.stdout + r.stderr
    if r.returncode:
        if "RESOURCE_EXHAUSTED" in text or "exceeds" in text:
            return None, {}
        raise SystemExit(f"MaxText's compile failed:\n{text[-3000:]}")
    fields = {k: _field(text, k) for k in ("argument", "output", "temp", "alias")}
    peak = fields["argument"] + fields["output"] + fields["temp"] - fields["alias"]
    shape = {"fsdp": 8 // cp, "context": cp} if cp > 1 else {"fsdp": 8}
    return peak / 1e9, hlo.summarize(hlo.collectives(_step_hlo(dump), shape))


def _field(text: str, name: str) -> float:
    """One field of XLA's memory analysis as MaxText prints it (CompiledMemoryStats), bytes."""
    m = re.search(rf"\b{name}_size_in_bytes=(\d+)", text)
    if not m:
        raise SystemExit(f"MaxText printed no {name}_size_in_bytes; its output format changed")
    return float(m.group(1))


def jaxdist(
    model: str, remat: str, rows: float, seq: int, cp: int = 1, *extra: str
) -> tuple[float | None, dict, str]:
    """jaxdist's compile of the same step: (GB per chip or None where refused, collectives,
    the policy auto took). `extra`: more flags for `jaxdist train`."""
    mesh = f"context={cp},fsdp={8 // cp}" if cp > 1 else "fsdp=8"
    cmd = [sys.executable, "-m", "jaxdist.cli", "train", "--model", model, "--seq-len", str(seq)]
    cmd += ["--mesh", mesh, "--batch-size", str(round(8 * rows)), "--compile-only", "--json", "-"]
    cmd += ["--target", "v5p-16", "--remat", remat, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        if "refused the step for lack of memory" in r.stderr or "does not fit" in r.stderr:
            return None, {}, remat
        raise SystemExit(f"jaxdist's compile failed:\n{r.stderr[-3000:]}")
    report = json.loads(r.stdout.strip().splitlines()[-1])
    rows_ = {(c["axis"], c["kind"]): c for c in report["collectives"]}
    peak = report["per_device_bytes"]["peak_estimate"] / 1e9
    policy = report["remat"]["policy"] if isinstance(report["remat"], dict) else remat
    return (peak if report["fits"] else None), rows_, policy


def most_rows(fits, low: int, high: int) -> int:
    """The most rows per chip in [low, high] for which fits(rows) holds (fits(low) must)."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maxtext-python", required=True, help="a Python with maxtext 0.2.5")
    p.add_argument("--model", default="llama2-7b", choices=sorted(MODELS))
    p.add_argument("--rows", type=int, default=4, help="rows per chip")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--many-rows", type=int, default=47, help="rows per chip to check both at")
    p.add_argument("--search", action="store_true", help="search each program's most rows")
    p.add_argument(
        "--policies-only", action="store_true", help="the policy table alone (no auto, no rows)"
    )
    p.add_argument("--json", default="experiments/results/beside_maxtext.json")
    p.add_argument(
        "--context",
        type=int,
        default=1,
        help="split the sequence this many ways (both programs' all-gather strategy, fsdp the "
        "rest of the 8 chips); compares one policy pair: --rows may be a fraction",
    )
    p.add_argument("--fraction-rows", type=float, help="rows per chip below 1 (with --context)")
    a = p.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="beside-maxtext-"))
    if a.context > 1:
        return _context(a, work)
    out: dict = {"model": a.model, "rows_per_chip": a.rows, "seq": a.seq, "policies": []}
    for mt_policy, ours in POLICIES:
        mt_gb, mt_coll = maxtext(a.maxtext_python, MODELS[a.model], mt_policy, a.rows, a.seq, work)
        our_gb, our_coll, _ = jaxdist(a.model, ours, a.rows, a.seq)
        # XLA's own two-way rings, as MaxText compiles them (jaxdist.parallel.collective_matmul)
        two_gb, two_coll, _ = jaxdist(a.model, ours, a.rows, a.seq, 1, *TWO_WAY)
        out["policies"].append(
            dict(maxtext=mt_policy, jaxdist=ours, maxtext_gb=mt_gb, jaxdist_gb=our_gb)
            | dict(maxtext_sent_gb=_sent(mt_coll, 8) / 1e9 if mt_coll else None)
            | dict(jaxdist_sent_gb=_sent(our_coll, 8) / 1e9 if our_coll else None)
            | dict(
                two_way_gb=two_gb, two_way_sent_gb=_sent(two_coll, 8) / 1e9 if two_coll else None
            )
            | dict(maxtext_collectives=_kinds(mt_coll), jaxdist_collectives=_kinds(our_coll))
        )
        print(json.dumps(out["policies"][-1]), flush=True)
    if a.policies_only:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
        return 0
    auto_gb, _, auto_policy = jaxdist(a.model, "auto", a.rows, a.seq)
    out["auto"] = {"policy": auto_policy, "gb": auto_gb}
    # Rows per chip at each program's default (MaxText: full; jaxdist: auto), at --many-rows
    # (47: the most MaxText's default fits here) and one more; --search finds each maximum.
    many = {}
    for rows in (a.many_rows, a.many_rows + 1):
        mt_gb = maxtext(a.maxtext_python, MODELS[a.model], "full", rows, a.seq, work)[0]
        our_gb, _, policy = jaxdist(a.model, "auto", rows, a.seq)
        many[rows] = {"maxtext_full_gb": mt_gb, "jaxdist_auto_gb": our_gb, "jaxdist_auto": policy}
        print(json.dumps({rows: many[rows]}), flush=True)
    out["many_rows"] = many
    if a.search:
        out["most_rows"] = {
            "maxtext (full, its default)": most_rows(
                lambda r: (
                    maxtext(a.maxtext_python, MODELS[a.model], "full", r, a.seq, work)[0]
                    is not None
                ),
                a.rows,
                96,
            ),
            "jaxdist (auto, its default)": most_rows(
                lambda r: jaxdist(a.model, "auto", r, a.seq)[0] is not None, a.rows, 96
            ),
        }
    pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    _print(out)
    return 0


def _context(a, work: pathlib.Path) -> int:
    """Long context: one policy pair (MaxText `minimal_with_context`, jaxdist `dots`), the
    sequence split over `context`; memory and every (axis, kind) of collectives side by side."""
    rows = a.fraction_rows or a.rows
    mt_gb, mt = maxtext(
        a.maxtext_python, MODELS[a.model], "minimal_with_context", rows, a.seq, work, a.context
    )
    our_gb, ours, _ = jaxdist(a.model, "dots", rows, a.seq, a.context)
    print(f"{a.model}, context={a.context} on v5p-16, seq {a.seq}, {rows} rows per chip")
    print(f"peak GB per chip: MaxText {mt_gb}, jaxdist {our_gb}")
    ours = {key: {"count": r["count"], "bytes": r["bytes"]} for key, r in ours.items()}
    for key in sorted(set(mt) | set(ours)):
        m, o = mt.get(key, {"count": 0, "bytes": 0}), ours.get(key, {"count": 0, "bytes": 0})
        print(f"{'/'.join(key):36} MaxText {m['bytes'] / 1e9:8.2f} GB in {m['count']:5}", end="")
        print(f"   jaxdist {o['bytes'] / 1e9:8.2f} GB in {o['count']:5}")
    total = [sum(r["bytes"] for r in side.values()) / 1e9 for side in (mt, ours)]
    print(f"every collective: MaxText {total[0]:.2f} GB, jaxdist {total[1]:.2f} GB")
    out = {"context": a.context, "seq": a.seq, "rows_per_chip": rows, "maxtext_gb": mt_gb}
    out |= {"jaxdist_gb": our_gb, "maxtext_total_gb": total[0], "jaxdist_total_gb": total[1]}
    pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def _kinds(collectives: dict) -> dict[str, float]:
    kinds: dict[str, float] = {}
    for (_, kind), v in collectives.items():
        kinds[kind] = kinds.get(kind, 0.0) + v["bytes"] / 1e9
    return {k: round(v, 2) for k, v in sorted(kinds.items())}


def _print(out: dict) -> None:
    print(
        f"\n{out['model']}, fsdp=8 on v5p-16 (8 chips), seq {out['seq']}, "
        f"{out['rows_per_chip']} rows per chip: GB per chip (sent GB per chip per step)"
    )
    print(
        f"{'MaxText policy':24} {'MaxText':>18} {'jaxdist policy':16} {'jaxdist':>18} "
        f"{'jaxdist two-way':>18}"
    )
    for r in out["policies"]:
        mt = (
            "refused"
            if r["maxtext_gb"] is None
            else f"{r['maxtext_gb']:.2f} ({r['maxtext_sent_gb']:.1f})"
        )
        ours, two = (
            "refused" if r[f"{k}_gb"] is None else f"{r[f'{k}_gb']:.2f} ({r[f'{k}_sent_gb']:.1f})"
            for k in ("jaxdist", "two_way")
        )
        print(f"{r['maxtext']:24} {mt:>18} {r['jaxdist']:16} {ours:>18} {two:>18}")
    print(f"jaxdist --remat auto: {out['auto']['policy']}, {out['auto']['gb']} GB per chip")
    for rows, r in out["many_rows"].items():
        mt = "refused" if r["maxtext_full_gb"] is None else f"{r['maxtext_full_gb']:.2f} GB"
        ours = "refused" if r["jaxdist_auto_gb"] is None else f"{r['jaxdist_auto_gb']:.2f} GB"
        print(
            f"{rows} rows per chip: MaxText (full) {mt}; jaxdist (auto: {r['jaxdist_auto']}) {ours}"
        )
    for who, rows in out.get("most_rows", {}).items():
        print(f"most rows per chip that fit, {who}: {rows}")


if __name__ == "__main__":
    sys.exit(main())
