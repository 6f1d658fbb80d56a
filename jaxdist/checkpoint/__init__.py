"""Stage 5, checkpoint and recover: the Orbax store, the run's record and resuming from it,
when to save (Young-Daly), and the loop's recovery policies (preemption signals, non-finite
steps)."""
