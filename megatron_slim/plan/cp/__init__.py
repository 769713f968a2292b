"""Context-parallel planning: sequence lengths, the CP topology, Zeppelin's placement, remapping and
routing plans, and the baseline engines' placements. Pure Python; imports no torch."""
