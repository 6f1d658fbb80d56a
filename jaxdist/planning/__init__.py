"""Before the fleet is rented: the collectives a layout implies and the ones XLA compiled, the
alpha-beta cost model, the memory model, the planner, and compiling for hardware not present."""
