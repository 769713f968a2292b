"""DynMo in ``megatron-slim train``: the dynamic models and per-layer profiling (the recipe's
``dynmo:`` section, ``run``), and live migration of layers between pipeline ranks (``migrate``)."""

from megatron_slim.train.dynmo.migration import MigrationError, MigrationReport, migrate

__all__ = ["MigrationError", "MigrationReport", "migrate"]
