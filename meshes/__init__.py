"""Mesh and rule presets: with jaxdist.mesh, the only place that names mesh axes."""
