"""Compiles as JAX reports them: the seconds one thread has spent tracing, lowering and
compiling (XLA, or reading the persistent compile cache), and whether it is compiling now.

A compile can happen anywhere in a run: the first step, the first step of each new outer-step
program (replica groups), the first evaluation, a resume. Goodput charges its seconds to
"compile" wherever they fall, the step timer keeps them out of step times, and the watchdog
does not call a compile a slow step: all three read this one clock. JAX announces each phase
through jax.monitoring (a scalar when it starts, a duration when it ends); one listener pair is
registered per process, and each thread's phases are counted apart (a save's thread compiling
is not the loop's time).
"""

import threading
import time

from jax import monitoring

# jax._src.dispatch's events: tracing (top level only), lowering to MLIR, the backend compile
# (which also covers a persistent-cache hit). Nested phases count once (outermost only).
EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)


class _Thread:
    __slots__ = ("depth", "since", "seconds")

    def __init__(self) -> None:
        self.depth, self.since, self.seconds = 0, 0.0, 0.0


_threads: dict[int, _Thread] = {}
_lock = threading.Lock()
_registered = False


def _mine() -> _Thread:
    ident = threading.get_ident()
    t = _threads.get(ident)
    if t is None:
        with _lock:
            t = _threads.setdefault(ident, _Thread())
    return t


def _started(event: str, value, **_) -> None:
    if event in EVENTS:
        t = _mine()
        if t.depth == 0:
            t.since = time.perf_counter()
        t.depth += 1


def _ended(event: str, seconds: float, **_) -> None:
    if event in EVENTS:
        t = _mine()
        if t.depth == 0:  # its start came before the listener: JAX's own measure
            t.seconds += seconds
            return
        t.depth -= 1
        if t.depth == 0:
            t.seconds += time.perf_counter() - t.since


def _register() -> None:
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_scalar_listener(_started)
            monitoring.register_event_duration_secs_listener(_ended)
            _registered = True


class Clock:
    """One thread's compiles (the thread that makes it, by default): `seconds()` so far,
    finished phases only, and `running()`, how long the phase in progress has run (0.0: none).
    Either may be read from another thread (the watchdog's)."""

    def __init__(self, thread: int | None = None):
        _register()
        ident = thread if thread is not None else threading.get_ident()
        with _lock:
            self._t = _threads.setdefault(ident, _Thread())

    def seconds(self) -> float:
        return self._t.seconds

    def running(self) -> float:
        t = self._t
        since = t.since  # read once: the compiling thread may change it
        return max(0.0, time.perf_counter() - since) if t.depth > 0 else 0.0

    def total(self) -> float:
        """Every compile second so far, the one in progress included."""
        return self.seconds() + self.running()
