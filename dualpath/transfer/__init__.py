"""Data plane: transfer backends that move KV bytes between engines, and the QoS lanes.

``base`` defines the backend interface, ``lanes`` the pure weighted-round-robin arbiter,
``mooncake`` the Mooncake Transfer Engine backend and ``local`` an in-process backend for
tests. Import the submodule you need; importing this package loads neither mooncake nor torch.
"""
