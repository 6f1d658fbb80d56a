"""Step metrics: throughput and MFU from a FLOPs model, distributions, and metrics.jsonl."""

import json
import pathlib

import numpy as np


def throughput(
    step_time_s: float,
    tokens_per_step: int,
    flops_per_token: float,
    num_devices: int,
    peak_flops_per_device: float | None,
) -> dict[str, float | None]:
    tokens_per_s = tokens_per_step / step_time_s
    model_flops = tokens_per_s * flops_per_token
    mfu = None
    if peak_flops_per_device:
        mfu = model_flops / (num_devices * peak_flops_per_device)
    return {"tokens_per_s": tokens_per_s, "model_tflops": model_flops / 1e12, "mfu": mfu}


def distribution(values: list[float]) -> dict[str, float]:
    """p50/p90/max: one average hides the stragglers that fleet-scale training dies of."""
    if not values:
        return {}
    a = np.asarray(values)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "max": float(a.max()),
        "mean": float(a.mean()),
        "n": len(values),
    }


class MetricsLog:
    """Appends one JSON object per logged step; opened by the process that writes logs."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
