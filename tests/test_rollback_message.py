"""The NaN rollback's message, worked by hand for where the restored checkpoint lies.

Every run here: the tiny model, 8 steps, a checkpoint every N steps (the first at step N-1),
NaN injected at one step's loss (--fault-nan-steps), --nonfinite rollback. A step's NaN is seen
when the next step is already dispatched, before that next step's save: so the newest
checkpoint at that moment is the last one at or before the bad step. A NaN step skips its own
update but still moves the data position (state.step) past its batch.
"""

import pytest

from jaxdist.cli.main import main
from jaxdist.metrics.records import latest_per_step, read_metrics

TRAIN = ["train", "--model", "tiny", "--steps", "8", "--batch-size", "16", "--log-every", "1"]
TRAIN += ["--nonfinite", "rollback", "--devices", "cpu:8"]


# Both cases inject the NaN at step 5 and differ only in the checkpoint interval, which the
# host alone reads: the step (the injected step is part of it) is the same compiled program,
# compiled once for both.
@pytest.mark.slow
@pytest.mark.parametrize(
    "bad, every, message",
    [
        # Checkpoints at 1, 3, 5: the one of step 5 itself holds step 5 without its update
        # (at data position 6); only batch 5 is passed over. It once read "batches 6..5".
        (
            5,
            2,
            "step 5: NaN/Inf; rolled back to checkpoint step 5 (saved with step 5's update "
            "skipped), skipping batch 5",
        ),
        # Checkpoints at 3 (and 7, the last step): the one of step 3 is at data position 4;
        # batch 4 (whose update the rollback undoes) and the bad batch 5 are passed over.
        (5, 4, "step 5: NaN/Inf; rolled back to checkpoint step 3, skipping batches 4..5"),
    ],
)
def test_rollback_names_the_batches_it_skips(tmp_path, capsys, bad, every, message):
    run = [*TRAIN, "--fault-nan-steps", str(bad), "--checkpoint-every", str(every)]
    assert main([*run, "--run-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert message in err.splitlines()
    # And the run did what the message says: every step logged, the last one finite.
    recs = latest_per_step(read_metrics(tmp_path / "metrics.jsonl"))
    assert sorted(recs) == list(range(8)) and not recs[bad]["finite"] and recs[7]["finite"]
