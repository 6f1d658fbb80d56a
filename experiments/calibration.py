"""The planner's absolute step time beside published training runs.

    python experiments/calibration.py            # a table; about 15 s on 2 cores
    python experiments/calibration.py --json     # the rows as JSON, with each row's terms

Each row is a run someone published with its settings: model sizes, devices, layout, batch,
remat; the rows, with their sources, are data in experiments/published_runs.py (the fit rows
and the first checks) and published_runs_at_scale.py (the 13B-405B checks). The planner prices
that one layout (planning.planner.price, what `jaxdist plan --mesh` runs) with the hardware
preset's calibrated figures (jaxdist/hardware.toml, jaxdist.planning.compute), its
tensor-parallel exchanges overlappable where the run's published configuration pipelines them
with its GEMMs (`Row.tensor_overlap`), and the row prints the published step time, the
predicted one and their ratio. `fit` rows set hardware.toml's figures (elementwise_passes: the
two H100 rows; v6e's matmul efficiency: its row); `check` rows were not used to set anything and
say how far the figures carry.

Published figures come in three units, all turned into seconds per step:
- MaxText's TFLOP/s per device: its own FLOP count per step (`maxtext_flops_per_token`, as
  MaxText's maxtext_utils.calculate_tflops_training_per_device counted them when those runs
  were published: 6 per weight per token, plus attention's 12 L T D without causal halving)
  divided by the figure;
- llm-foundry's tokens/s per GPU: one step's tokens per GPU divided by it;
- seconds per step, as logged.
"""

import argparse
import dataclasses
import json

import published_runs  # this folder's, beside this script
import published_runs_at_scale
from published_runs import Row

from jaxdist.hardware import get_hardware
from jaxdist.layout import StepConfig
from jaxdist.planning.inputs import PlanConfig
from jaxdist.planning.planner import price
from meshes.presets import STANDARD_RULES
from models.inventory import plan_model
from models.presets import get_model_config
from models.remat import RECOMPUTE

ROWS = published_runs.ROWS + published_runs_at_scale.ROWS


def model_config(sizes: tuple, remat: str | tuple[str, ...], moe: tuple = ()):
    """jaxdist's model of these sizes, with the run's remat policy or, for MaxText's custom
    one, the nearest (memory only: its time is priced by `recompute`); `moe`: (experts,
    top_k, capacity factor), every layer's MLP one of experts of width d_mlp."""
    style, layers, d, heads, kv, mlp, vocab, seq, tied = sizes
    experts = {}
    if moe:
        experts = dict(num_experts=moe[0], top_k=moe[1], capacity_factor=moe[2])
    return get_model_config(
        "custom",
        style=style,
        num_layers=layers,
        d_model=d,
        num_heads=heads,
        num_kv_heads=kv,
        d_mlp=mlp,
        vocab_size=vocab,
        seq_len=seq,
        tie_embeddings=tied,
        compute_dtype="bfloat16",
        remat=remat if isinstance(remat, str) else "dots_except_mlp",
        **experts,
    )


def recompute(row: Row, config) -> tuple[float, bool]:
    """(share of each layer's forward matmul FLOPs rerun, attention's forward rerun): from
    models/remat.py for jaxdist's policies, counted here for MaxText's custom tensors."""
    if isinstance(row.remat, str):
        return RECOMPUTE[row.remat](config), row.remat == "full"
    D, F, N, G = config.d_model, config.d_mlp, config.num_heads, config.num_kv_heads
    H = config.head_dim
    k = config.top_k if config.num_experts else 1  # a token's experts
    gated = 3 if config.style == "llama" else 2
    parts = {"mlp": gated * D * F * k, "qkv_proj": D * (N + 2 * G) * H, "out_proj": N * H * D}
    if row.remat == ("half",):  # torchtitan's selective op policy: every other matmul rerun
        return 0.5, False
    # mlp_in: the MLP's input projections alone (gate and up), its output one kept.
    rerun = dict(parts, mlp_in=(gated - 1) * D * F * k)
    share = sum(rerun.get(p, 0) for p in row.remat) / sum(parts.values())
    return share, "attention" in row.remat


def maxtext_flops_per_token(sizes: tuple) -> float:
    """MaxText's count (maxtext_utils.calculate_tflops_training_per_device, 2024-25): the
    MLP's three matmuls, QKV, the output projection and the head, 2 FLOPs per weight, times 3
    for forward and backward; attention 4 T H d_head per layer, times 3, not halved."""
    _, layers, d, heads, kv, mlp, vocab, seq, _ = sizes
    head_dim = d // heads
    ffn = 2 * mlp * d * 3
    qkv = 2 * d * (heads + 2 * kv) * head_dim
    projection = 2 * d * heads * head_dim
    learnable = ((ffn + qkv + projection) * layers + 2 * d * vocab) * 3
    attention = 4 * seq * heads * head_dim * layers * 3
    return learnable + attention


def published_step_s(row: Row, devices: int) -> float:
    tokens_per_device = row.batch_size * row.sizes[7] / devices
    if row.unit == "maxtext_tflops":
        return maxtext_flops_per_token(row.sizes) * tokens_per_device / (row.published * 1e12)
    if row.unit == "tokens_per_s":
        return tokens_per_device / row.published
    return row.published


# The planner's terms each row reports beside its step time (--json), and compute by kind.
TERMS = ("compute_s", "bubble_s", "comm_s", "comm_exposed_s", "overlap_s", "sync_s")


def predict(row: Row) -> dict:
    """The planner's row for the published layout."""
    layout = tuple((a, int(n)) for a, n in (p.split("=") for p in row.layout.split(",")))
    devices = 1
    for _, n in layout:
        devices *= n
    config = model_config(row.sizes, row.remat, row.moe)
    share, attention = recompute(row, config)
    model = dataclasses.replace(
        plan_model(config), recompute_matmul=share, recompute_attention=attention
    )
    hw = dataclasses.replace(get_hardware(row.hardware), tensor_overlap=row.tensor_overlap)
    cfg = PlanConfig(
        devices=devices,
        hardware=row.hardware,
        batch_size=row.batch_size,
        step=StepConfig(
            microbatches=row.microbatches,
            pipeline_schedule=row.schedule,
            virtual_stages=row.virtual_stages,
            # The published TPU runs compiled with XLA's own windowed einsums, two-way rings.
            collective_matmul=row.collective_matmul,
        ),
        mesh=layout,
    )
    priced = price(dict(layout), [model], STANDARD_RULES, cfg, hw)
    published = published_step_s(row, devices)
    return {
        "name": row.name,
        "role": row.role,
        "source": row.source,
        "published_step_s": published,
        "predicted_step_s": priced["step_s"],
        "ratio": priced["step_s"] / published,
        "predicted_mfu": priced["mfu"],
        "terms": {k: priced[k] for k in TERMS} | {"compute_by_kind": priced["compute_by_kind"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [predict(row) for row in ROWS]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{'role':5} {'published s':>11} {'predicted s':>11} {'ratio':>6}  run (source)")
    for r in results:
        print(
            f"{r['role']:5} {r['published_step_s']:11.3f} {r['predicted_step_s']:11.3f} "
            f"{r['ratio']:6.3f}  {r['name']} ({r['source']})"
        )


if __name__ == "__main__":
    main()
