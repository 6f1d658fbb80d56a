"""The quality price of replica groups (DiLoCo): the tokens M groups need to reach data
parallelism's loss.

At equal tokens, M groups that train alone and meet every H steps end at a different loss than
data parallelism, so a layout of groups that steps faster is not thereby sooner done. The
planner ranks layouts by the time to data parallelism's loss, a product of two prices paid in
different places:

    to_loss_s = step_s (planning.planner, planning.sync: compute, communication, the
                        straggler's wait, the outer exchange: seconds a step)
              x tokens_factor (here: loss per token, paid in steps; 1 without groups)

`loss_gap` is Charles et al.'s measured gap (arXiv:2503.09799v1, "Scaling Laws for DiLoCo"):
the best-tuned evaluation loss of DiLoCo with M groups over data parallelism's at the same
model size N and tokens D = 20 N (Chinchilla-optimal, their Section 3.1), from Table 4 (N = 35M
to 2.4B, M = 1, 2, 4, 8, hyperparameters swept) and Table 5 (4B and 10B, M = 1, 2, 4,
hyperparameters from their scaling laws). Between measured sizes the gap is interpolated
linearly in log N; outside them it is held at the nearest measured size (below 35M: the 35M
gap; above 10B, or 2.4B for M = 8: the last one): the paper's own power laws in N (Table 7,
L = A N^alpha per M) and a straight line in log N fitted on Table 4 both predict M = 4 at 10B
at -0.35% and -0.37%, where Table 5 measured +0.29%, so the price does not extrapolate in N.
Between M = 1, 2, 4, 8 it is interpolated linearly in log2 M; above 8 it grows by the 4-to-8
increase for every further doubling (an extrapolation of ours: the paper trains no M > 8).

Not modelled: H. The paper fixes H = 30 for these tables (its Section 5.1 and Figure 9 show
the loss rising with H beyond H = 5, less for larger models, as curves without a table), so
the gap is H = 30's at every --sync-every. Nor the sync type, fragments or delay, nor the outer
step: the paper sweeps the outer learning rate per M (Nesterov momentum 0.9), so the gap is that
of a tuned outer step, whatever --outer-lr gives or auto resolves to (experiments/README.md
measured tiny models far from it at the paper's 0.7/0.9, near it with plain averaging).
Every model counts its weights as N, a mixture of experts all of them.

`tokens_factor` turns a gap into tokens by Chinchilla's fit (Hoffmann et al. 2022, Approach 3:
L(N, D) = E + A / N^alpha + B / D^beta): M groups after D tokens are taken to be data
parallelism after D / k, so they need k D tokens for its loss, where
B / (D / k)^beta - B / D^beta = gap x L(N, D), at D = 20 N. The paper fits no law in D (its
tokens are tied to N), so the gap, a share of its C4 losses, is applied to Chinchilla's loss.
"""

import bisect
import math

from jaxdist.layout import Layout
from jaxdist.model import param_count
from jaxdist.rules import variables

# The paper's synchronization cadence for Tables 4 and 5.
PAPER_H = 30
# Its token budget: D = 20 N (Section 3.1).
TOKENS_PER_PARAM = 20
# Charles et al. (arXiv:2503.09799v1) evaluation losses on C4's validation split, as printed:
# (N, data parallelism's loss, {M: DiLoCo's loss}). Table 4 (swept hyperparameters, H = 30):
TABLE_4 = (
    (35e6, 3.485, {1: 3.482, 2: 3.508, 4: 3.554, 8: 3.621}),
    (90e6, 3.167, {1: 3.162, 2: 3.182, 4: 3.213, 8: 3.265}),
    (180e6, 2.950, {1: 2.943, 2: 2.957, 4: 2.981, 8: 3.019}),
    (335e6, 2.784, {1: 2.777, 2: 2.788, 4: 2.808, 8: 2.841}),
    (550e6, 2.653, {1: 2.645, 2: 2.657, 4: 2.673, 8: 2.698}),
    (1.3e9, 2.460, {1: 2.451, 2: 2.464, 4: 2.472, 8: 2.493}),
    (2.4e9, 2.326, {1: 2.317, 2: 2.323, 4: 2.332, 8: 2.351}),
)
# Table 5 (hyperparameters from the scaling laws' joint fit; no M = 8):
TABLE_5 = (
    (4e9, 2.224, {1: 2.219, 2: 2.220, 4: 2.230}),
    (10e9, 2.090, {1: 2.086, 2: 2.086, 4: 2.096}),
)
PAPER_ROWS = TABLE_4 + TABLE_5
COLUMNS = (1, 2, 4, 8)
# Hoffmann et al. 2022 (Chinchilla), Approach 3's fit.
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def _column(M: int, rows) -> tuple[list[float], list[float]]:
    """(log N, gap) of one measured M, by size."""
    points = sorted((math.log(n), by_m[M] / dp - 1) for n, dp, by_m in rows if M in by_m)
    return [x for x, _ in points], [g for _, g in points]


def _in_n(params: float, M: int, rows) -> float:
    """One measured M's gap at `params`: linear in log N between measured sizes, held at the
    nearest one outside them."""
    xs, gs = _column(M, rows)
    x = math.log(params)
    if x <= xs[0]:
        return gs[0]
    if x >= xs[-1]:
        return gs[-1]
    i = bisect.bisect_right(xs, x)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return gs[i - 1] + t * (gs[i] - gs[i - 1])


def loss_gap(params: float, replicas: int, rows=PAPER_ROWS) -> float:
    """DiLoCo's loss over data parallelism's, less 1 (+0.0066: 0.66% higher), for a model of
    `params` weights in `replicas` groups, at the paper's H = 30 and D = 20 N, from `rows`
    (the paper's tables; a subset to check the rest against)."""
    if params <= 0 or replicas < 1:
        raise ValueError(f"loss_gap({params}, {replicas}): parameters and groups must be > 0")
    m = math.log2(replicas)
    if replicas >= COLUMNS[-1]:  # the last doubling's increase, for every further one
        hi, lo = _in_n(params, COLUMNS[-1], rows), _in_n(params, COLUMNS[-2], rows)
        return hi + (m - math.log2(COLUMNS[-1])) * (hi - lo)
    k = bisect.bisect_right(COLUMNS, replicas)
    lo_m, hi_m = COLUMNS[k - 1], COLUMNS[k]
    t = (m - math.log2(lo_m)) / (math.log2(hi_m) - math.log2(lo_m))
    lo, hi = _in_n(params, lo_m, rows), _in_n(params, hi_m, rows)
    return lo + t * (hi - lo)


def chinchilla_loss(params: float, tokens: float) -> float:
    c = CHINCHILLA
    return c["E"] + c["A"] / params ** c["alpha"] + c["B"] / tokens ** c["beta"]


def tokens_factor(gap: float, params: float) -> float:
    """The tokens a run whose loss is (1 + gap) times data parallelism's at equal tokens needs
    for data parallelism's loss, per token of data parallelism's (above 1: more), by
    Chinchilla's fit at D = 20 N (the module's docstring)."""
    c = CHINCHILLA
    tokens = TOKENS_PER_PARAM * params
    data_term = c["B"] / tokens ** c["beta"]
    base = 1 + gap * chinchilla_loss(params, tokens) / data_term
    if base <= 0:  # no finite data gets there; the tables' gaps stay far from it
        raise ValueError(f"a loss gap of {gap:+.2%} at {params:.3g} parameters: no data for it")
    return base ** (1 / c["beta"])


def quality_terms(abstract_params, layout: Layout) -> dict[str, float]:
    """A row's price in loss per token: the loss gap, the tokens factor (1 without replica
    groups: every other layout computes data parallelism's step; the parameters are counted
    only for layouts with groups, the few among the many the planner prices)."""
    if not layout.grouped:
        return {"loss_gap": 0.0, "tokens_factor": 1.0}
    params = param_count(v.shape for v in variables(abstract_params))
    gap = loss_gap(params, layout.replicas)
    return {"loss_gap": gap, "tokens_factor": tokens_factor(gap, params)}


def with_quality(row: dict, abstract_params, layout: Layout) -> dict:
    """The row with its loss gap, tokens factor and time to data parallelism's loss
    (`to_loss_s`: seconds per step of data parallelism's run, the plan's ranking)."""
    terms = quality_terms(abstract_params, layout)
    return {**row, **terms, "to_loss_s": row["step_s"] * terms["tokens_factor"]}
