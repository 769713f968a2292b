"""SlimPack: slice-level packing of variable-length samples into MicroPacks over DP ranks.

``costs`` prices a slice, ``plan`` is the packing plan value, ``assemble`` builds and prices a
plan from pieces per rank, ``heuristic`` and ``milp`` are the two solver phases, ``slimpack``
drives them, ``baselines`` holds the packers SlimPack is compared with, ``evaluate`` scores a plan.
"""
