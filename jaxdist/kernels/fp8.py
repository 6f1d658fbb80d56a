"""FP8 matmuls (stage 2, compute forward/backward): which projections run on FP8 operands.

The rule below is shared: the model applies it to each projection, and the planner prices a
projection's GEMMs in FP8 only where the model would run them so (one rule, not two copies).

Why a filter at all: quantizing costs a pass over each operand (amax, scale, cast) that a small
GEMM does not win back. torchao measured the crossover for tensorwise scaling on H100 and skips
a linear layer when its output width is at most 4096 and its input width at most 1024
(torchao.float8 `_auto_filter_for_tensorwise`, pytorch/ao PR #2410); cuBLAS's FP8 GEMMs also
need every dimension a multiple of 16.
"""

RECIPES = ("off", "current", "delayed")


def worth_fp8(d_in: int, d_out: int) -> bool:
    """Whether a projection from d_in to d_out features gains from FP8 GEMMs (see above)."""
    if d_in % 16 or d_out % 16:
        return False
    return not (d_out <= 4096 and d_in <= 1024)
