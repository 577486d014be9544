"""Agent workloads: the turn schema, the paper's presets, the trace readers (Weka, Mooncake)
and the samples shipped with the package (``data/``)."""
