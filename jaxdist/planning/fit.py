"""Fit by default (`--remat auto`): the fastest rematerialization policy whose step fits, and the
one rule that says whether a step fits a device.

Policies trade memory for recompute: keeping every activation is fastest and largest, full
remat recomputes a whole forward and keeps only each layer's input. Which one a step needs
depends on the model, the batch, the layout and the device, so no fixed default serves: a
preset's `dots` left a Llama-2-7B at 4 rows per v5p chip where full remat fits 47 (compiled for
v5p-16 by jax 0.11.2 with libtpu 0.0.48 at 750f0cc, 2026-12-02; experiments/README.md, "Beside
MaxText on the same compiler"), while a small model would pay full remat's extra forward for
nothing.

`choose` walks the policies from fastest to leanest (the model family's order) and takes the
first whose predicted peak (jaxdist.planning.memory.device_peak) `fits`: the device's budget
for one program, less the memory model's margin of error. `plan`, `train
--remat auto` and `train --compile-only` all choose here (`resolve` for one layout). Where the
step is compiled for a target, jaxdist.compiled.aot confirms the choice with the compiler and
moves on to the next policy when XLA refuses it or its peak does not fit (`next_policy`).
"""

import dataclasses
from collections.abc import Callable, Sequence

from jaxdist.errors import ConfigError
from jaxdist.hardware import budget
from jaxdist.layout import Layout
from jaxdist.planning.inputs import PlanModel
from jaxdist.planning.memory import device_peak

# The memory model is held within 10% of the compilers (tests/test_plan_compiled.py): a predicted
# peak leaves that room, a compiled one (XLA's own figure) needs none.
PREDICTION_MARGIN = 0.9
# Device memory is shown in GiB everywhere (plan, --compile-only, --verify, remat auto): the
# unit the compilers' own messages use ("exceeds available HBM", "only reduced to 70.21GiB").
GIB = 2**30


def gib(nbytes: float, digits: int = 2) -> str:
    """Bytes of device memory as every printed line shows them."""
    return f"{nbytes / GIB:.{digits}f} GiB"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a per-device peak fits, by the one rule: what one program may hold on the
    device (jaxdist.hardware.budget), less the margin of error of the figure (a prediction's
    10%; a compiled peak, XLA's own, none). "Fits" means the same before and after compiling:
    the compiled step fits what a program may hold; a prediction says so only with room for
    its error."""

    peak: float
    budget: float  # bytes one program may hold on the device
    predicted: bool

    @property
    def margin(self) -> float:
        """The share of the budget kept back for the figure's error."""
        return 1.0 - PREDICTION_MARGIN if self.predicted else 0.0

    @property
    def usable(self) -> float:
        return self.budget * (1.0 - self.margin)

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    def rule(self) -> str:
        """The threshold and its margin, in words."""
        if self.predicted:
            return (
                f"{gib(self.usable)} usable ({gib(self.budget)} less {self.margin:.0%} for the "
                "prediction's error)"
            )
        return f"{gib(self.usable)} usable (no margin: XLA's own peak)"

    def line(self) -> str:
        """The verdict with its figures and margin: one line, the same wherever it is shown."""
        said = "fits" if self.fits else "does not fit"
        what = "predicted" if self.predicted else "compiled"
        return f"{said}: {what} peak {gib(self.peak)} of {self.rule()}"


def verdict(peak_bytes: float, memory_bytes: float, platform: str, predicted: bool = True):
    """The one rule (`Verdict`) for a step of this per-device peak on a device of
    `memory_bytes` on `platform`; `predicted`: the peak is the memory model's, not XLA's."""
    return Verdict(peak_bytes, budget(memory_bytes, platform), predicted)


def usable(memory_bytes: float, platform: str, predicted: bool = True) -> float:
    """The most a step's peak may be to fit: the device's budget, less the prediction's margin
    where the peak is predicted rather than compiled."""
    return verdict(0.0, memory_bytes, platform, predicted).usable


def fits(peak_bytes: float, memory_bytes: float, platform: str, predicted: bool = True) -> bool:
    """The one rule: whether a step of this per-device peak fits the device (`Verdict`)."""
    return verdict(peak_bytes, memory_bytes, platform, predicted).fits


@dataclasses.dataclass(frozen=True)
class RematChoice:
    policy: str
    memory_bytes: float  # the device's
    platform: str
    predicted: dict[str, float]  # policy -> predicted peak per device, for each one tried

    @property
    def fits(self) -> bool:
        return fits(self.predicted[self.policy], self.memory_bytes, self.platform)

    @property
    def said(self) -> bool:
        """Whether a run says which policy it took: on an accelerator always; on fake CPU
        devices where a policy leaner than the fastest fits (where none fits, the host-memory
        check, jaxdist.planning.hostfit, says it better; past the usable share but within the
        device, the compiler decides)."""
        fastest = next(iter(self.predicted))
        return self.platform != "cpu" or (self.fits and self.policy != fastest)

    def line(self) -> str:
        """One line for the run's output: what was chosen and why."""
        tried = ", ".join(f"{p} {gib(b, 1)}" for p, b in self.predicted.items())
        return (
            f"remat auto: {self.policy} (predicted per device: "
            f"{tried}; fits in {verdict(0.0, self.memory_bytes, self.platform).rule()})"
        )


def choose(
    order: Sequence[str], peak_of: Callable[[str], float], memory_bytes: float, platform: str
) -> RematChoice:
    """The first policy of `order` (fastest first) whose predicted peak fits a device of
    `memory_bytes` on `platform`; the leanest, not fitting (`.fits` False), where none does."""
    predicted: dict[str, float] = {}
    for policy in order:
        predicted[policy] = peak_of(policy)
        if fits(predicted[policy], memory_bytes, platform):
            break
    return RematChoice(policy, memory_bytes, platform, predicted)


def resolve(
    order: Sequence[str],
    plan_at: Callable[[str], PlanModel],
    layout: Layout,
    memory_bytes: float,
    platform: str,
) -> RematChoice:
    """The fastest policy of `order` whose step on `layout` is predicted to fit, the model at
    each policy being `plan_at(policy)`; a ConfigError where on an accelerator even the
    leanest needs more than the whole device."""

    def peak_of(policy: str) -> float:
        at = dataclasses.replace(layout, remat=policy)
        return device_peak(plan_at(policy), at, platform)["peak"]

    choice = choose(order, peak_of, memory_bytes, platform)
    leanest = choice.predicted[choice.policy]
    if not choice.fits and platform != "cpu" and leanest > memory_bytes:
        raise ConfigError(
            f"{plan_at(choice.policy).name} at batch {layout.batch_size} on "
            f"{layout.describe()} does not fit at any rematerialization policy: the leanest "
            f"({choice.policy}) needs about {gib(leanest, 1)} per device, the device has "
            f"{gib(memory_bytes, 1)}; use a smaller --batch-size, more devices, or a mesh "
            "that shards more of the model (fsdp, tensor, pipeline)"
        )
    return choice


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
