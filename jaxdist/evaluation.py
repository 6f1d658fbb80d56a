"""Held-out loss: the mean next-token loss of the parameters over fixed batches of data the run
never trains on (the eval split of a tokenized directory, or `--eval-data`).

The eval batches are batches 0..n-1 of their own stream (its own shuffle, its own seed), the
same every time, and run through the step's own `eval_fn` on the training mesh: evaluating
never touches the training stream, the state, or what a resume restores. It pays in wall-clock
(the loop waits for it, reported apart from step time), not in step time.

Held-out data smaller than what one evaluation reads is read again, reshuffled: the loss is
then over fewer distinct tokens than it averages, which `coverage` counts and
`small_data_warning` says once.
"""

import math
from collections.abc import Callable
from typing import Protocol

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxdist.cluster.join import local_value, process_rows
from jaxdist.config import DataConfig, EvalConfig
from jaxdist.data import TokenBatches
from jaxdist.errors import ConfigError


class Evaluates(Protocol):
    """What `evaluate` runs: a train step's jitted functions (jaxdist.step.JittedStep), or an
    opened run's forward alone (jaxdist.inference.runs.Forward)."""

    @property
    def eval_fn(self) -> Callable: ...

    @property
    def batch_sharding(self) -> NamedSharding: ...


def eval_batches(
    config: EvalConfig,
    data: DataConfig,
    seq_len: int,
    vocab_size: int,
    batch_sharding,
    explicit: bool,
) -> TokenBatches | None:
    """This process's rows of the eval stream, or None when there is nothing to evaluate on
    and evaluation was not asked for (`explicit`: --eval-every N > 0 or --eval-data given)."""
    if config.eval_every == 0:
        return None
    path = config.eval_data or data.path
    rows = process_rows(batch_sharding, (data.batch_size, seq_len + 1))
    held = DataConfig(path=path, batch_size=data.batch_size, seed=data.seed)
    try:
        return TokenBatches(held, seq_len, vocab_size, rows, split="eval")
    except ConfigError:
        if config.eval_data is not None:
            # --eval-data names held-out data: without an eval split, all of it is held out.
            return TokenBatches(held, seq_len, vocab_size, rows, split="train")
        if explicit:
            raise
        return None


def evaluate(jitted: Evaluates, params, batches: TokenBatches, steps) -> float:
    """Mean loss of `params` over the batches of these steps, no update: a held-out loss when
    the batches come from data (or positions of the stream) the run never trains on."""
    losses = []
    for s in steps:
        batch = jax.make_array_from_process_local_data(
            jitted.batch_sharding, batches.batch(s), batches.global_shape
        )
        losses.append(jitted.eval_fn(params, batch))
    # Every batch has the same number of target tokens: the mean of means is the token mean.
    return float(np.mean([local_value(x) for x in losses]))


def distinct_windows(batches: TokenBatches, num_batches: int) -> int:
    """Sequences (windows) that batches 0..num_batches-1 read, each counted once.

    Row g of the stream reads window g of its source's windows shuffled afresh each pass
    (jaxdist.data.batches): rows within the first pass read different windows; past it the
    same windows come again, in grain's order, a function of the seed and the count alone."""
    B = batches.global_shape[0]
    rows = np.arange(num_batches * B)
    which = np.concatenate([batches.draw.sources(s) for s in range(num_batches)])
    seen = 0
    for k, source in enumerate(batches.sources):
        g = rows[which == k]
        if len(g) and g[-1] >= source.num_windows:
            order = grain.MapDataset.range(source.num_windows)
            order = order.shuffle(seed=batches.config.seed).repeat()
            seen += len({order[int(i)] for i in g})
        else:
            seen += len(g)
    return seen


def coverage(batches: TokenBatches, num_batches: int) -> dict[str, int]:
    """Target tokens one evaluation averages over, and how many of them are distinct."""
    B, T1 = batches.global_shape
    distinct = distinct_windows(batches, num_batches)
    return {
        "tokens": num_batches * B * (T1 - 1),
        "distinct_tokens": distinct * (T1 - 1),
        "distinct_windows": distinct,
    }


def small_data_warning(batches: TokenBatches, num_batches: int, flag: str) -> str | None:
    """One line when one evaluation reads more sequences than the held-out data holds (they
    repeat), naming the ways out; None when every sequence read is a different one. `flag`:
    the option that sets the number of batches."""
    c = coverage(batches, num_batches)
    B, T1 = batches.global_shape
    if c["distinct_windows"] == num_batches * B:
        return None
    where = batches.config.path or "the embedded corpus"
    where = f"the eval split of {where}" if batches.split == "eval" else where
    return (
        f"held-out data too small: {where} holds {batches.num_windows:,} sequences of "
        f"{T1 - 1} tokens, one evaluation reads {num_batches * B:,} ({num_batches} batches of "
        f"{B}), so batches repeat and the loss is over {c['distinct_tokens']:,} distinct tokens, "
        f"not {c['tokens']:,}; tokenize with a larger --eval-fraction, pass more held-out data, "
        f"or lower {flag}"
    )


def report(loss: float, batches: TokenBatches, num_batches: int) -> dict:
    """What `jaxdist eval` prints: loss, perplexity, tokens (and how many distinct), bits
    per byte."""
    # Bits per byte: nats per token x tokens per byte of text (the split's own ratio) / ln 2;
    # comparable across tokenizers, unlike the loss itself.
    tpb = batches.tokens_per_byte
    c = coverage(batches, num_batches)
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "tokens": c["tokens"],
        "distinct_tokens": c["distinct_tokens"],
        "bits_per_byte": loss * tpb / math.log(2) if tpb else None,
        "batches": num_batches,
        "distinct_windows": c["distinct_windows"],
    }
