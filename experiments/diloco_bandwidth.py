"""The slow link DiLoCo needs, beside Charles et al.'s Table 6 (arXiv:2503.09799).

    python experiments/diloco_bandwidth.py    # under a second, no devices

"Scaling Laws for DiLoCo" gives, for three models and their step times, the bandwidth between
the groups at which compute fills 80% of the wall clock, for data parallelism (a sync every
step) and for DiLoCo syncing every H = 100 steps. jaxdist.planning.sync.paper_bandwidth
computes it from the model's size, its step time and H alone, by the planner's alpha-beta
pricing (planning.costmodel) and its bisection (sync.solve_gbps), under the assumptions
written beside it (bf16 weights, M = 4 groups, one pass of (M-1)/M of them over the link per
sync, each sync hidden behind 0.52 of a step's compute: that last figure fitted on the
paper's three data-parallel rows). Prints ours beside the paper's, row by row, and the ratio;
tests/test_plan_replica.py holds each within 15%.
"""

from jaxdist.planning.sync import PAPER_GROUPS, PAPER_HIDDEN_SHARE, paper_bandwidth

# Charles et al. (arXiv:2503.09799), Table 6: (model, parameters, seconds per step, H, Gbit/s
# for 80% compute utilization); H = 1 is data parallelism.
TABLE_6 = (
    ("10B", 10e9, 0.8, 1, 184.2),
    ("10B", 10e9, 0.8, 100, 6.2),
    ("Llama-3-405B", 405e9, 26.0, 1, 222.3),
    ("Llama-3-405B", 405e9, 26.0, 100, 7.5),
    ("DeepSeek-V3", 671e9, 20.0, 1, 569.0),
    ("DeepSeek-V3", 671e9, 20.0, 100, 16.0),
)


def rows() -> list[dict]:
    """Each row of Table 6 with ours beside it."""
    out = []
    for model, params, step_s, H, paper in TABLE_6:
        ours = paper_bandwidth(params, step_s, H)
        method = "data parallel" if H == 1 else f"DiLoCo H={H}"
        out.append(dict(model=model, step_s=step_s, method=method, paper=paper, ours=ours))
    return out


def main() -> None:
    print(
        f"Gbit/s between {PAPER_GROUPS} groups for 80% compute utilization "
        f"(sync hidden behind {PAPER_HIDDEN_SHARE} of a step)"
    )
    print(f"{'model':<14}{'s/step':>7}  {'method':<15}{'paper':>8}{'ours':>8}{'ratio':>7}")
    for r in rows():
        print(
            f"{r['model']:<14}{r['step_s']:>7g}  {r['method']:<15}{r['paper']:>8.1f}"
            f"{r['ours']:>8.1f}{r['ours'] / r['paper']:>7.3f}"
        )


if __name__ == "__main__":
    main()
