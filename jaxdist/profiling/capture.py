"""Profiling during training: trace chosen steps, attribute them, warn early.

`--profile A:B` traces steps A..B-1 once; `--watch-comm F` traces a few steps every
`--watch-every` steps and warns when exposed communication or sync passes F of the step, or the
step time p90 drifts above p50. Traced steps run synchronously (each waits for its result), so
the trace's step windows hold exactly their own device work.
"""

import contextlib
import pathlib

import jax
from rich.console import Console

from jaxdist.metrics.records import MetricsLog
from jaxdist.profiling import report as profile_report

WATCH_STEPS = 3


class Capture:
    """Decides which steps are traced (`loop.profile`, `loop.watch_comm`), wraps them in a
    trace, and attributes each finished window."""

    def __init__(
        self,
        run_dir: pathlib.Path,
        loop,
        jitted,
        global_shape,
        mesh,
        hardware: str,
        console: Console,
        log: MetricsLog | None,
    ):
        self.windows: list[tuple[int, int, str]] = []
        if loop.profile:
            self.windows.append((*loop.profile_steps(), "profile"))
        self.watch = loop.watch_comm
        self.watch_every = loop.watch_every
        self.jitted, self.global_shape, self.mesh = jitted, global_shape, mesh
        self.hardware, self.console, self.log = hardware, console, log
        self.run_dir = run_dir
        self._active: tuple[int, int, str] | None = None
        self._hlo: str | None = None
        self._outer: dict = {}  # replica groups: outer-step part -> its program's HLO

    def _window(self, s: int) -> tuple[int, int, str] | None:
        for w in self.windows:
            if w[0] <= s < w[1]:
                return w
        if self.watch and s > 0 and s % self.watch_every == 0:
            w = (s, s + WATCH_STEPS, "watch")
            self.windows.append(w)
            return w
        return None

    def traced(self, s: int) -> bool:
        return any(w[0] <= s < w[1] for w in self.windows)

    @contextlib.contextmanager
    def step(self, s: int, state):
        window = self._active or self._window(s)
        if window is None or s >= window[1]:
            yield
            return
        if self._active is None:
            self._active = window
            jax.block_until_ready(state)  # the previous step must not spill into the trace
            jax.profiler.start_trace(str(self._dir(window)))
        with jax.profiler.StepTraceAnnotation("train", step_num=s):
            yield

    def after(self, s: int, outputs) -> None:
        if self._active is None:
            return
        jax.block_until_ready(outputs)  # the step's device work stays inside its window
        if s == self._active[1] - 1:
            window, self._active = self._active, None
            jax.profiler.stop_trace()
            self._analyze(window)

    def close(self) -> None:
        """Ends a trace cut short by the end of the run (or a preemption) and reports it."""
        if self._active is not None:
            window, self._active = self._active, None
            jax.profiler.stop_trace()
            self._analyze(window)

    def _outer_programs(self, window) -> dict[int, str]:
        """Replica groups: the program of each traced step that ran part of the outer step
        (compiled again, abstractly; cached by part), for its collectives' axes and bytes."""
        programs = {}
        for s in range(window[0], window[1]):
            act = self.jitted.outer_part(s)
            if act is not None:
                if act not in self._outer:
                    self._outer[act] = self.jitted.compile_abstract(
                        self.global_shape, act
                    ).as_text()
                programs[s] = self._outer[act]
        return programs

    def _dir(self, window) -> pathlib.Path:
        name = "profile" if window[2] == "profile" else f"watch/step_{window[0]}"
        return self.run_dir / name

    def _analyze(self, window) -> None:
        out = self._dir(window)
        if self._hlo is None:
            self._hlo = self.jitted.compile_abstract(self.global_shape).as_text()
        mesh_shape = dict(self.mesh.shape)
        step_hlo = self._outer_programs(window)
        profile_report.save(out, self._hlo, mesh_shape, self.hardware, step_hlo)
        # Read back as `jaxdist profile RUN` reads it: one path, one report.
        report = profile_report.profile_saved(out)
        profile_report.write(
            report,
            out / "breakdown.json",
            out / "breakdown.png" if window[2] == "profile" else None,
        )
        f = report["summary"]["fraction_of_step"]
        if window[2] == "profile":
            profile_report.print_report(report, self.console, self.console)
            self.console.print(f"profile: {out}/breakdown.json, breakdown.png")
        warnings = profile_report.warnings(report, self.watch or 0.25)
        if self.log:
            self.log.write(
                {
                    "event": window[2],
                    "step": window[0],
                    "comm_exposed": f["comm_exposed_s"],
                    "sync": f["sync_s"],
                    "idle": f["idle_s"],
                    "warnings": warnings,
                }
            )
        if window[2] == "watch":
            for w in warnings:
                self.console.print(f"[yellow]watch (steps {window[0]}..{window[1] - 1}):[/] {w}")
