"""A sink for the records metrics.jsonl gets, written from a thread of its own so the loop
never waits on a disk or a network: TensorBoard's event files and Weights & Biases."""

import queue
import threading


class BackgroundSink:
    """Queues records; a daemon thread opens the destination, then takes each batch from the
    queue and emits it at once (a kill -9 loses at most what was still queued). A destination
    that cannot be opened or written to loses only itself: the batches are drained and
    dropped, and the run goes on. Subclasses give `_open() -> handle | None`,
    `_emit(handle, records) -> handle | None` (None: stop emitting) and `_finish(handle)`."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon: a loop that dies of an exception (close never called) still exits.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def write(self, record: dict) -> None:
        self._queue.put(record)

    def close(self) -> None:
        """Emits what is queued, finishes, and joins the thread."""
        self._queue.put(None)
        self._thread.join()

    def _open(self):
        raise NotImplementedError

    def _emit(self, handle, records: list[dict]):
        raise NotImplementedError

    def _finish(self, handle) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        handle = self._open()
        done = False
        while not done:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get())
            if None in batch:
                batch, done = batch[: batch.index(None)], True
            if handle is not None:
                handle = self._emit(handle, batch)
        if handle is not None:
            self._finish(handle)
