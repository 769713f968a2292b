"""Simulators of the plans, on the cost model. Pure Python, no torch.

* ``engine``, ``costs``         -- discrete-event simulation of a pipeline schedule
* ``cp_sim`` (``cp_events``, ``cp_layer``, ``cp_attention``, ``cp_ring``, ``cp_network``) -- context-parallel
  attention over variable-length packs on the network model
* ``trace``                     -- Chrome trace (Perfetto) export; ``plot`` -- PNG (matplotlib)
"""
