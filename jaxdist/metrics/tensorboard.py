"""TensorBoard event files from the records metrics.jsonl gets, written off the loop's path.

One event file per attempt (process). Each opens with a SessionLog START at the attempt's first
step: TensorBoard's reader then drops what earlier attempts logged from that step on, and the
steps a resume recomputes show their new values, as metrics.jsonl's latest record per step.
TensorBoard keeps scalars as float32.
"""

import logging
import os
import pathlib
import time

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary

from jaxdist.metrics.sink import BackgroundSink

log = logging.getLogger("jaxdist.tensorboard")

# Record field -> scalar tag, for TensorBoard and W&B alike (jaxdist.metrics.wandb_log logs
# `scalars` too). Skipped steps: train/skipped, 1 where the record's finite is false; saves and
# the replica groups' outer rounds, scalars of their own (checkpoint/..., outer/...).
TAGS = {
    "loss": "train/loss",
    "mtp_loss": "train/mtp_loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "step_time_s": "train/step_time_s",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "eval_loss": "eval/loss",
}


def scalars(record: dict) -> dict[str, float]:
    """The scalar tags a record gives (none, for most events)."""
    out = {tag: float(record[k]) for k, tag in TAGS.items() if record.get(k) is not None}
    if "finite" in record:
        out["train/skipped"] = 0.0 if record["finite"] else 1.0
    if record.get("event") == "save":
        out["checkpoint/blocked_s"] = float(record["blocked_s"])
    if record.get("event") == "round":  # replica groups' outer round (jaxdist.metrics.outer)
        out["outer/round"] = float(record["round"])
        out["outer/bytes"] = float(record["bytes"])
        out["outer/step_time_s"] = float(record["step_time_s"])
        if record["seconds"] is not None:
            out["outer/seconds"] = float(record["seconds"])
    return out


def _event(step: int, wall_time: float, values: dict[str, float]) -> Event:
    summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
    return Event(wall_time=wall_time, step=step, summary=summary)


class TensorBoardLog(BackgroundSink):
    """TensorBoard event files, written and flushed batch by batch from a thread of its own.
    tensorboardX's own SummaryWriter queues through a worker that flushes on a timer (flush()
    does not drain it): a kill -9 would lose up to that long."""

    def __init__(self, directory: pathlib.Path, first_step: int = 0):
        self.directory, self.first_step = directory, first_step
        super().__init__("tensorboard")

    def _open(self) -> EventsWriter | None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # The writer names the file by the time in whole seconds and the host, and
            # truncates a file of that name: the nanoseconds keep two attempts started in one
            # second apart, and in order (TensorBoard reads the files sorted by name).
            suffix = f".{time.time_ns()}.{os.getpid()}"
            writer = EventsWriter(str(self.directory / "events"), suffix)
            start = SessionLog(status=SessionLog.START)
            writer.write_event(
                Event(wall_time=time.time(), step=self.first_step, session_log=start)
            )
            writer.flush()
            return writer
        except OSError as e:
            log.warning("no TensorBoard events: cannot write %s (%s)", self.directory, e)
            return None

    def _emit(self, writer: EventsWriter, records: list[dict]) -> EventsWriter | None:
        try:
            for r in records:
                values = scalars(r)
                if values and "step" in r:
                    writer.write_event(_event(r["step"], r.get("time", time.time()), values))
            writer.flush()
            return writer
        except OSError as e:
            log.warning("TensorBoard events stopped: %s", e)
            return None

    def _finish(self, writer: EventsWriter) -> None:
        writer.close()
