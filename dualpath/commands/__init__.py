"""The ``dualpath`` commands that have no room of their own (``generate``, ``keys``, ...); each
module is a command: ``add_arguments(parser)``, an options dataclass and ``run(options)``."""
