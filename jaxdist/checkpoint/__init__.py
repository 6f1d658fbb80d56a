"""Stage 5, checkpoint and recover: the Orbax store and the node-local tier, the run's record
and the check a resume must pass, when each tier saves (tiers, Young-Daly interval), and the
loop's recovery policies (preemption signals, non-finite steps). Which state it restores is
its callers' (jaxdist.attempt for the loop, jaxdist.inference.runs for a run's weights)."""
