"""DynMo in the training loop: live migration of layers between pipeline ranks (``migrate``)."""

from megatron_slim.train.dynmo.migration import MigrationError, MigrationReport, migrate

__all__ = ["MigrationError", "MigrationReport", "migrate"]
