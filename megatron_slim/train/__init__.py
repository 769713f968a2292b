"""``megatron-slim train``: a real training loop on megatron-core model chunks, on local ranks.

``commands/train.py`` prepares the data and spawns the ranks; ``loop.py`` is one rank's life:
parallel groups, model chunks, optimizer, data, the schedule interpreter, checkpoints.
"""
