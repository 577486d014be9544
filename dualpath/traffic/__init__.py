"""Traffic between engines and stores.

The per-NIC manager (:mod:`.manager`) and its chunks, copies, work items, queues and in-flight
windows; bandwidth grants shared by the engines of a node; the EP traffic generator; the QoS
lanes and the token bucket that emulates a NIC's bandwidth.
"""
