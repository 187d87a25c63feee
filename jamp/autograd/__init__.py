"""A namespace shaped like torch.autograd. Not built yet: the package is reserved for it."""
