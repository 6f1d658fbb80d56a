"""Held-out loss: the mean next-token loss of the parameters over fixed batches of data the run
never trains on (the eval split of a tokenized directory, or `--eval-data`).

The eval batches are batches 0..n-1 of their own stream (its own shuffle, its own seed), the
same every time, and run through the step's own `eval_fn` on the training mesh: evaluating
never touches the training stream, the state, or what a resume restores. It pays in wall-clock
(the loop waits for it, reported apart from step time), not in step time.
"""

import dataclasses
import math

import jax
import numpy as np

from jaxdist.cluster.join import local_value, process_rows
from jaxdist.data import DataConfig, TokenBatches
from jaxdist.errors import ConfigError
from jaxdist.step import JittedStep


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    eval_every: int | None = None
    """evaluate every N steps and at the end; default: at the end when the data has an eval
    split; 0: never"""
    eval_batches: int = 20
    """fixed batches per evaluation (the same ones each time)"""
    eval_data: str | None = None
    """held-out data (a tokenized directory: its eval split, else all of it); default: the
    training data's eval split"""

    def validate(self) -> None:
        if self.eval_every is not None and self.eval_every < 0:
            raise ConfigError(f"--eval-every {self.eval_every} must be >= 0 (0: never)")
        if self.eval_batches < 1:
            raise ConfigError(f"--eval-batches {self.eval_batches} must be at least 1")


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


def evaluate(jitted: JittedStep, params, batches: TokenBatches, steps) -> float:
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


def report(loss: float, batches: TokenBatches, num_batches: int) -> dict:
    """What `jaxdist eval` prints: loss, perplexity, tokens, bits per byte."""
    B, T1 = batches.global_shape
    tokens = num_batches * B * (T1 - 1)
    # Bits per byte: nats per token x tokens per byte of text (the split's own ratio) / ln 2;
    # comparable across tokenizers, unlike the loss itself.
    tpb = batches.tokens_per_byte
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "tokens": tokens,
        "bits_per_byte": loss * tpb / math.log(2) if tpb else None,
        "batches": num_batches,
        # More rows than the held-out data has windows: some are read twice (reshuffled).
        "distinct_windows": min(batches.num_windows, num_batches * B),
    }
