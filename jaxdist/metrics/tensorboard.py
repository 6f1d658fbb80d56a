"""TensorBoard event files from the records metrics.jsonl gets, written off the loop's path.

One event file per attempt (process). Each opens with a SessionLog START at the attempt's first
step: TensorBoard's reader then drops what earlier attempts logged from that step on, and the
steps a resume recomputes show their new values, as metrics.jsonl's latest record per step.
TensorBoard keeps scalars as float32.
"""

import logging
import os
import pathlib
import queue
import threading
import time

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary

log = logging.getLogger("jaxdist.tensorboard")

# Record field -> scalar tag. Skipped steps: train/skipped, 1 where the record's finite is false.
TAGS = {
    "loss": "train/loss",
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
    return out


def _event(step: int, wall_time: float, values: dict[str, float]) -> Event:
    summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
    return Event(wall_time=wall_time, step=step, summary=summary)


class TensorBoardLog:
    """Queues records; a background thread writes and flushes them, so the loop never waits
    on the disk. tensorboardX's own SummaryWriter queues through a worker that flushes on a
    timer (flush() does not drain it): a kill -9 would lose up to that long. Here each batch
    taken from the queue is written and flushed at once."""

    def __init__(self, directory: pathlib.Path, first_step: int = 0):
        self.directory = directory
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon: a loop that dies of an exception (close never called) still exits.
        self._thread = threading.Thread(
            target=self._run, args=(first_step,), name="tensorboard", daemon=True
        )
        self._thread.start()

    def write(self, record: dict) -> None:
        self._queue.put(record)

    def close(self) -> None:
        """Writes what is queued, flushes, and joins the thread."""
        self._queue.put(None)
        self._thread.join()

    def _open(self, first_step: int) -> EventsWriter | None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # The writer names the file by the time in whole seconds and the host, and
            # truncates a file of that name: the nanoseconds keep two attempts started in one
            # second apart, and in order (TensorBoard reads the files sorted by name).
            suffix = f".{time.time_ns()}.{os.getpid()}"
            writer = EventsWriter(str(self.directory / "events"), suffix)
            start = SessionLog(status=SessionLog.START)
            writer.write_event(Event(wall_time=time.time(), step=first_step, session_log=start))
            writer.flush()
            return writer
        except OSError as e:
            log.warning("no TensorBoard events: cannot write %s (%s)", self.directory, e)
            return None

    def _run(self, first_step: int) -> None:
        writer = self._open(first_step)
        done = False
        while not done:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get())
            if None in batch:
                batch, done = batch[: batch.index(None)], True
            if writer is None:
                continue  # drained and dropped: the run goes on without events
            try:
                for r in batch:
                    values = scalars(r)
                    if values and "step" in r:
                        writer.write_event(_event(r["step"], r.get("time", time.time()), values))
                writer.flush()
            except OSError as e:
                log.warning("TensorBoard events stopped: %s", e)
                writer = None
        if writer is not None:
            writer.close()
