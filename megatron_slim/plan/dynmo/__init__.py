"""DynMo: rebalancing layers across pipeline stages while a dynamic model trains (pure planning)."""
