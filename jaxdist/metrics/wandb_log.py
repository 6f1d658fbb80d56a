"""Weights & Biases: the scalars TensorBoard gets, from a thread of its own so the loop never waits.

The scalars are jaxdist.metrics.tensorboard.scalars(record), the same function TensorBoard's
writer uses, so the two can never differ; a record's step is the W&B step. wandb is an optional
extra (pip install 'jaxdist[wandb]'): `require` checks that it is there without importing it,
and only the thread here imports it, so the loop neither waits for its import and start (a few
seconds) nor for its network.

Where it goes: online when wandb finds an API key (WANDB_API_KEY, `wandb login`), else offline,
into RUN_DIR/wandb, for `wandb sync RUN_DIR/wandb` to upload later; WANDB_MODE, when set,
decides instead. A resumed jaxdist run resumes its W&B run: the run id is kept in
RUN_DIR/wandb/jaxdist-run-id and every attempt logs to it. W&B keeps a run's steps increasing,
so the steps a resume recomputes, which the W&B run already holds (online; their losses are
bitwise the same), are not sent again; offline, each attempt writes a fragment of its own,
which `wandb sync` joins in order.
"""

import importlib.util
import logging
import os
import pathlib
import secrets

from jaxdist.errors import ConfigError
from jaxdist.metrics.sink import BackgroundSink
from jaxdist.metrics.tensorboard import scalars

log = logging.getLogger("jaxdist.wandb")

INSTALL = "pip install 'jaxdist[wandb]'"
ID_FILE = "jaxdist-run-id"


def require() -> None:
    """Stops a run asked to log to W&B where wandb is not installed, before anything runs."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb needs the wandb package, which is not installed: {INSTALL}")


def run_id(directory: pathlib.Path) -> str:
    """The W&B run id of the jaxdist run whose W&B directory this is: the one kept there, or a
    new one, kept for the attempts to come."""
    path = directory / ID_FILE
    if path.is_file():
        return path.read_text().strip()
    new = secrets.token_hex(4)  # W&B ids: lower-case letters and digits
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(new + "\n")
    return new


class WandbLog(BackgroundSink):
    """The W&B run, started and fed from a thread of its own. A run that W&B cannot start or
    take (no network, a bad key) loses only W&B: a one-line warning, and the records are
    dropped; metrics.jsonl and TensorBoard hold them all."""

    def __init__(
        self,
        run_dir: pathlib.Path,
        project: str,
        entity: str | None = None,
        config: dict | None = None,
        console=None,
    ):
        self.directory = run_dir / "wandb"
        self.id = run_id(self.directory)
        self.console = console
        self.options = {
            "project": project,
            "entity": entity,
            "name": run_dir.name,
            "id": self.id,
            "resume": "allow",
            "dir": str(run_dir),
            "config": config,
        }
        self._floor = 0  # W&B's next step (a resumed run's): steps below it are not sent
        super().__init__("wandb")

    def _open(self):
        try:
            import wandb

            wandb.setup(wandb.Settings(silent=True))  # its banners would interleave the loop's
            mode = None  # WANDB_MODE decides, when set
            if not os.environ.get("WANDB_MODE"):
                mode = "online" if wandb.login(prompt=False, verify=False) else "offline"
            settings = wandb.Settings(silent=True, console="off")
            run = wandb.init(**self.options, mode=mode, settings=settings)
        except Exception as e:  # noqa: BLE001 - W&B is a side channel: the run goes on
            log.warning("no W&B logging: %s", str(e).partition("\n")[0])
            return None
        if self.console is not None:
            if run.offline:
                where = f"offline in {self.directory} (no API key); upload it with `wandb sync "
                where += f"{self.directory}`"
            else:
                where = run.url
            self.console.print(
                f"W&B run {self.id}: {where}", markup=False, highlight=False, soft_wrap=True
            )
        self._floor = run.step
        return run

    def _emit(self, run, records: list[dict]):
        try:
            for r in records:
                values = scalars(r)
                if values and r.get("step", -1) >= self._floor:
                    run.log(values, step=r["step"])
                    self._floor = r["step"]
            return run
        except Exception as e:  # noqa: BLE001
            log.warning("W&B logging stopped: %s", str(e).partition("\n")[0])
            return None

    def _finish(self, run) -> None:
        run.finish()
