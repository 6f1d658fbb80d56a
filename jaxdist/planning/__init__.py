"""Before anything compiles: the collectives and memory a layout implies, the alpha-beta cost
model, the planner and the rule that says whether a step fits."""
