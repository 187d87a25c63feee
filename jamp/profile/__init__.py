"""The profiler and the AMP report. Not built yet: the package is reserved for it."""
