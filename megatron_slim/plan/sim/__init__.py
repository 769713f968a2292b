"""Simulators of the plans, on the cost model. Pure Python, no torch.

* ``engine``, ``costs``         -- discrete-event simulation of a pipeline schedule
* ``cp/`` (``sim``; ``events``, ``layer``, ``attention``, ``ring``, ``network``; ``trace``, ``plot``)
  -- context-parallel attention over variable-length packs on the network model
* ``trace``                     -- Chrome trace (Perfetto) export; ``plot`` -- PNG (matplotlib)
"""
