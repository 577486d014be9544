"""``dualpath bench layerwise``: the paper's mechanisms measured on a real local cluster."""
