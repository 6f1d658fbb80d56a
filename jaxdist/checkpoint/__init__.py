"""Stage 5, checkpoint and recover: the Orbax store and the node-local tier, the run's record
and resuming from it, when each tier saves (tiers, Young-Daly interval), and the loop's
recovery policies (preemption signals, non-finite steps)."""
