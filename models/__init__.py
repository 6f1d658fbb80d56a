"""Model definitions. They speak logical axes only (jaxdist.model.LOGICAL_AXES) and know no mesh."""
