"""Data mixtures: `--data web=DIR_A:0.7,code=DIR_B:0.3`.

Each row of a batch is drawn from one source with the given weights, by a generator keyed on
(seed, step): no iterator state, so any step's batch is known at once, on any process count,
and a resume continues the same draw. The realised proportions are exact to count (the loop
logs them), and binomial around the weights.
"""

import pathlib
from typing import NamedTuple

import numpy as np

from jaxdist.errors import ConfigError

_STREAM = 0x6D6978  # keys the source draw apart from any other use of the seed


class Component(NamedTuple):
    name: str
    path: str
    weight: float


def is_mixture(spec: str) -> bool:
    """`name=PATH:WEIGHT,...`; a path that exists as given is a path, whatever it holds."""
    return "=" in spec and not pathlib.Path(spec).exists()


def parse(spec: str) -> list[Component]:
    out: list[Component] = []
    for part in spec.split(","):
        name, eq, rest = part.partition("=")
        path, colon, weight = rest.rpartition(":")
        if not (eq and colon and name.strip() and path.strip()):
            raise ConfigError(
                f"mixture part {part!r} is not NAME=DATA_DIR:WEIGHT; write e.g. "
                "--data web=data/web:0.7,code=data/code:0.3"
            )
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"mixture weight {weight!r} of {name!r} is not a number") from None
        if not w > 0:
            raise ConfigError(
                f"mixture weight of {name!r} is {w}; weights must be > 0 (leave a source out "
                "to drop it)"
            )
        out.append(Component(name.strip(), path.strip(), w))
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"mixture names {names} repeat; give each source its own name")
    return out


class Draw:
    """Which source each row of a step's global batch comes from."""

    def __init__(self, weights: list[float], seed: int, batch_size: int):
        p = np.asarray(weights, np.float64)
        self.weights = p / p.sum()
        self.cumulative = np.cumsum(self.weights)
        self.cumulative[-1] = 1.0
        self.seed, self.batch_size = seed, batch_size

    def sources(self, step: int) -> np.ndarray:
        """[batch_size] source index per global row of `step`."""
        if len(self.weights) == 1:
            return np.zeros(self.batch_size, np.int64)
        u = np.random.default_rng([self.seed, step, _STREAM]).random(self.batch_size)
        return np.searchsorted(self.cumulative, u, side="right")


class Tally:
    """Rows drawn per source from step 0 (a resumed attempt counts the steps before its start
    again): the realised proportions the loop logs with each step's record."""

    def __init__(self, draw: Draw, names: list[str], start: int):
        self.draw, self.names = draw, names
        self.rows = np.zeros(len(names), np.int64)
        for s in range(start) if len(names) > 1 else ():
            self.rows += np.bincount(draw.sources(s), minlength=len(names))

    def count(self, step: int) -> dict:
        """Counts step's rows; the fields its record carries: the shares so far, under
        "mixture" (none for a single source)."""
        if len(self.names) < 2:
            return {}
        self.rows += np.bincount(self.draw.sources(step), minlength=len(self.rows))
        shares = (self.rows / self.rows.sum()).tolist()
        return {"mixture": dict(zip(self.names, shares, strict=True))}
