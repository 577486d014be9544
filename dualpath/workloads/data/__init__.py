"""Data shipped with the package: the demo workload (weka_demo.json) and its license."""
