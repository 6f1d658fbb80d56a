"""Where a fleet's work went (`jaxdist goodput RUN` on a run of `launch --groups`): the rounds
committed and lost, the groups' rounds missed and the tokens they would have trained, and each
fault's cost (a group's time away until it healed, a lighthouse's restart), from the records
alone: launch.jsonl, restarts.jsonl, rounds.jsonl, heals.jsonl and each group's config.json.
"""

import json
import pathlib
import statistics

from rich.console import Console
from rich.table import Table


def _lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def is_fleet(run_dir) -> bool:
    return (pathlib.Path(run_dir) / "rounds.jsonl").exists()


def fleet_report(run_dir) -> dict:
    run = pathlib.Path(run_dir)
    launches = _lines(run / "launch.jsonl")
    rounds, heals = _lines(run / "rounds.jsonl"), _lines(run / "heals.jsonl")
    groups = sorted({x["group"] for x in launches if isinstance(x["group"], int)})
    config = json.loads((run / "groups" / str(groups[0]) / "config.json").read_text())
    H = config["sync"]["sync_every"] if config.get("sync") else None
    H = H or (rounds[1]["step"] - rounds[0]["step"] if len(rounds) > 1 else rounds[0]["step"] + 1)
    tokens_per_group_step = config["data"]["batch_size"] * config["model"]["seq_len"]
    M, last = len(groups), rounds[-1]["step"] if rounds else -1
    due = (last + 1) // H
    taken = sum(len(r["groups"]) for r in rounds)
    gaps = [b["time"] - a["time"] for a, b in zip(rounds, rounds[1:], strict=False)]
    typical = statistics.median(gaps) if gaps else 0.0
    start = min(x["start"] for x in launches) if launches else 0.0
    faults = []
    for r in _lines(run / "restarts.jsonl"):
        fault = {"cause": r["cause"], "time_s": round(r["time"] - start, 1)}
        if r["by"].startswith("group"):
            g = int(r["by"].split()[1])
            back = [h for h in heals if h["group"] == g and h["time"] > r["time"]]
            before = [x for x in rounds if x["time"] < r["time"]]
            since = before[-1]["round"] if before else 0
            until = back[0]["round"] if back else (rounds[-1]["round"] if rounds else 0)
            missed = sum(1 for x in rounds if since < x["round"] <= until and g not in x["groups"])
            fault.update(
                away_s=round((back[0]["time"] if back else rounds[-1]["time"]) - r["time"], 1),
                rounds_missed=missed,
                tokens_lost=missed * H * tokens_per_group_step,
                healed_from=back[0]["from"] if back else None,
            )
        else:  # the lighthouse: the longest wait between two rounds in the next 30 s
            near = [
                b["time"] - a["time"]
                for a, b in zip(rounds, rounds[1:], strict=False)
                if r["time"] - typical <= b["time"] <= r["time"] + 30
            ]
            fault["stall_s"] = round(max(0.0, max(near, default=0.0) - typical), 1)
        faults.append(fault)
    faults += _absences(rounds, groups, faults, start, H * tokens_per_group_step)
    faults.sort(key=lambda f: f["time_s"])
    return {
        "groups": M,
        "sync_every": H,
        "rounds_committed": len(rounds),
        "rounds_lost": due - len(rounds),
        "group_rounds": taken,
        "group_rounds_due": M * due,
        "tokens_lost": (M * due - taken) * H * tokens_per_group_step,
        "work_share": taken / (M * due) if due else 0.0,
        "wall_s": round(rounds[-1]["time"] - start, 1) if rounds else 0.0,
        "round_s_p50": round(typical, 3),
        "faults": faults,
    }


def _absences(rounds, groups, faults, start: float, tokens_per_round: int) -> list[dict]:
    """Spans of rounds a live group missed with no restart behind them (stopped, stalled, or
    late to its first quorum): the rounds and tokens no restart accounts for."""
    out = []
    for g in groups:
        owed = sum(
            f.get("rounds_missed", 0) for f in faults if f["cause"].startswith(f"group {g}:")
        )
        span: list[dict] = []
        spans = []
        for r in rounds:
            if g in r["groups"]:
                if span:
                    spans.append(span)
                span = []
            else:
                span.append(r)
        spans += [span] if span else []
        spans.sort(key=len)
        while spans and owed >= len(spans[-1]):  # the longest: the restarts' (counted above)
            owed -= len(spans.pop())
        for s in sorted(spans, key=lambda s: s[0]["round"]):
            out.append(
                {
                    "cause": f"group {g} absent, not restarted (stopped, stalled or late)",
                    "time_s": round(s[0]["time"] - start, 1),
                    "away_s": round(s[-1]["time"] - s[0]["time"], 1),
                    "rounds_missed": len(s),
                    "tokens_lost": len(s) * tokens_per_round,
                }
            )
    return out


def print_fleet(rep: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(
        f"{rep['groups']} groups, H = {rep['sync_every']}: {rep['rounds_committed']} rounds "
        f"committed, {rep['rounds_lost']} lost; {rep['group_rounds']} of "
        f"{rep['group_rounds_due']} group-rounds trained ({rep['work_share']:.1%}), "
        f"{rep['tokens_lost']:,} tokens lost; {rep['wall_s']} s from the first start to the "
        f"last round",
        highlight=False,
    )
    table = Table("at (s)", "fault", "away / stall (s)", "rounds missed", "tokens lost")
    for f in rep["faults"]:
        away = f.get("away_s", f.get("stall_s", ""))
        table.add_row(
            str(f["time_s"]), f["cause"], str(away), str(f.get("rounds_missed", 0)),
            f"{f.get('tokens_lost', 0):,}",
        )  # fmt: skip
    console.print(table)
