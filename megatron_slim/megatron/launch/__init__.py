"""Megatron-LM launch time: megatron-slim's flags, what a parsed namespace stands for, the start-up
checks on it, and the guard that refuses our flags where no parsed args reach the hooks.

``args`` sits below ``flags`` and ``cp_checks``: both read it and neither imports the other through
it. Imports no megatron and no torch.
"""
