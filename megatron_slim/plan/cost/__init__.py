"""The cost model: time and memory of schedule actions on a hardware profile. Pure Python, no torch.

* ``layer``       -- per-GPU work and memory of one decoder layer and of the embedding/output layers
* ``activations`` -- a pipeline chunk's saved activations under recomputation and offloading
* ``model``       -- ``CostModel``: every schedule action of a recipe, priced
* ``slicing``     -- slice policies (``uniform``, ``balanced``): where SlimPipe cuts a microbatch
* ``calibration`` -- measured kernel rates that replace a profile's efficiency factors
"""
