"""Torch runtime: schedule interpreter, attention kernels, CP engine, data path."""
