"""Stage 5, checkpoint and recover: the Orbax store, when to save (Young-Daly), and the loop's
recovery policies (preemption signals, non-finite steps)."""
