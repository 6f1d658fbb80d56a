"""Fit by default (`--remat auto`): the fastest rematerialization policy whose step fits.

Policies trade memory for recompute: keeping every activation is fastest and largest, full
remat recomputes a whole forward and keeps only each layer's input. Which one a step needs
depends on the model, the batch, the layout and the device, so no fixed default serves: a
preset's `dots` left a Llama-2-7B at 4 rows per v5p chip where full remat fits 47, while a
small model would pay full remat's extra forward for nothing.

`choose` walks the policies from fastest to leanest (the model family's order) and takes the
first whose predicted peak (the planner's memory model, jaxdist.planning.memory) fits the
usable share of the device's memory. Where the step is compiled for a target, the caller
confirms the choice with the compiler and moves on to the next policy when XLA refuses it or
its peak does not fit (`next_policy`): the prediction is within 15% of XLA's, not exact.
"""

import dataclasses
from collections.abc import Callable, Sequence

from jaxdist.errors import ConfigError

# The share of the device's memory a step may plan for: XLA's allocator, the runtime and the
# collectives' buffers need the rest (jaxdist.planning.planner's MEMORY_HEADROOM).
USABLE = 0.9


@dataclasses.dataclass(frozen=True)
class RematChoice:
    policy: str
    budget_bytes: float  # usable per device
    predicted: dict[str, float]  # policy -> predicted peak per device, for each one tried
    by: str = "planner"  # or "compiler", when XLA refused the planner's choice

    def line(self) -> str:
        """One line for the run's output: what was chosen and why."""
        gb = 1e9
        tried = ", ".join(f"{p} {b / gb:.1f} GB" for p, b in self.predicted.items())
        return (
            f"remat auto: {self.policy} (chosen by the {self.by}; predicted per device: "
            f"{tried}; {self.budget_bytes / gb:.1f} GB usable)"
        )


def choose(
    order: Sequence[str], peak_of: Callable[[str], float], budget_bytes: float, what: str
) -> RematChoice:
    """The first policy of `order` (fastest first) whose predicted peak fits `budget_bytes`;
    a ConfigError naming the need and the fixes when even the leanest is predicted not to fit
    the whole device (`budget_bytes / USABLE`). `what`: the step, for that message."""
    predicted: dict[str, float] = {}
    for policy in order:
        predicted[policy] = peak_of(policy)
        if predicted[policy] <= budget_bytes:
            return RematChoice(policy, budget_bytes, predicted)
    leanest = order[-1]
    if predicted[leanest] > budget_bytes / USABLE:
        raise ConfigError(
            f"{what} does not fit at any rematerialization policy: the leanest ({leanest}) "
            f"needs about {predicted[leanest] / 1e9:.1f} GB per device, the device has "
            f"{budget_bytes / USABLE / 1e9:.1f} GB; use a smaller --batch-size, more devices, "
            "or a mesh that shards more of the model (fsdp, tensor, pipeline)"
        )
    # Within the headroom: the compiler may still accept it.
    return RematChoice(leanest, budget_bytes, predicted)


def next_policy(order: Sequence[str], policy: str) -> str | None:
    """The policy after `policy` in `order` (leaner, slower); None after the leanest, or for
    a policy outside the order (one asked for by name)."""
    if policy not in order:
        return None
    i = list(order).index(policy)
    return order[i + 1] if i + 1 < len(order) else None


def refused_for_memory(error: BaseException) -> bool:
    """Whether a compile failed because the step does not fit the device (XLA's TPU compiler
    refuses such a step outright)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "exceeds" in text and "memory" in text.lower()
