"""The tests' oracle: tiny model shapes (``models``) and the reference implementations every
exactness test compares against -- the unsliced, unsharded, single-process model's loss and
per-parameter gradients, both through megatron-core (``reference``) and as an independent pure-torch
Llama (``llama``)."""
