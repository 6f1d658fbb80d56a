"""Model definitions. They speak logical axes only (jaxdist.axes) and know no mesh."""
