"""jaxpr-level transforms: autocast, custom_fwd/custom_bwd and the autograd tools."""
