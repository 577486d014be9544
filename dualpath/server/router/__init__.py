"""The router: its callers' side (``client``), its thread (``loop``), what it is built from
(``setup``) and its socket-free state (``state`` and its parts, records in ``types``)."""
