"""Activation recomputation and offloading, as Megatron-LM spells them, as one value.

A recipe's ``train.recompute`` is Megatron's ``--recompute-granularity`` (``none`` = no flag):

* ``selective``: ``--recompute-modules`` (``train.recompute_modules``, default ``core_attn``) are
  checkpointed inside every layer.
* ``full``: whole layers are checkpointed. ``--recompute-method uniform --recompute-num-layers N``
  checkpoints every group of ``N`` consecutive layers (only each group's input is kept; backward
  rebuilds the whole group); ``block`` checkpoints the first ``N`` layers of each pipeline chunk one
  by one and keeps every activation of the rest. ``recompute: full`` alone means uniform, 1 layer.

``train.offload_ratio`` is megatron-slim's own: the fraction of each slice's saved layer
activations copied to host memory after its forward and prefetched for its backward.

``RECOMPUTE_CHOICES`` is what a search iterates over; ``recompute_choices`` adds every block depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Granularity = Literal["none", "selective", "full"]
Method = Literal["uniform", "block"]

# Megatron-core's TransformerConfig.__post_init__ allowed set for recompute_modules, read at each tag:
# 0.16.1, 0.17.1 and 0.18.2 accept these seven; 0.19 (0.19.2 wheel) adds "gdn_norm_out" (Gated
# DeltaNet layers, which a Llama-style recipe has none of), so a recipe may name only these.
RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)
# Megatron-core raises at start-up for these on a dense, non-MLA model (moe_act needs
# --moe-grouped-gemm, mla_up_proj --multi-latent-attention): megatron-args refuses them.
MODULES_MEGATRON_REFUSES_ON_LLAMA: tuple[str, ...] = ("moe_act", "mla_up_proj")
DEFAULT_RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn",)


@dataclass(frozen=True)
class Recompute:
    """What is recomputed (normalised: ``modules`` only for selective, ``method``/``num_layers``
    only matter for full) and how much of each slice's activations is offloaded."""

    granularity: Granularity = "none"
    method: Method = "uniform"
    num_layers: int = 1
    modules: tuple[str, ...] = ()
    offload_ratio: float = 0.0

    def recomputed_layers(self, layers: int) -> int:
        """How many of a chunk's ``layers`` keep only their (group's) input."""
        if self.granularity != "full":
            return 0
        return layers if self.method == "uniform" else min(self.num_layers, layers)

    def kept_inputs(self, layers: int) -> int:
        """Checkpoint inputs a chunk of ``layers`` keeps: one per uniform group, one per block layer."""
        if self.granularity != "full":
            return 0
        if self.method == "uniform":
            return -(-layers // self.num_layers)
        return min(self.num_layers, layers)

    def rebuilt_layers(self, layers: int) -> int:
        """Layers whose full activations exist at once while backward recomputes a checkpoint."""
        if self.granularity != "full":
            return 0
        return min(self.num_layers, layers) if self.method == "uniform" else 1

    def train_fields(self) -> dict[str, object]:
        """The ``train.*`` recipe fields that spell this value."""
        fields: dict[str, object] = {"recompute": self.granularity, "offload_ratio": self.offload_ratio}
        if self.granularity == "full":
            fields.update(recompute_method=self.method, recompute_num_layers=self.num_layers)
        if self.granularity == "selective":
            fields["recompute_modules"] = list(self.modules)
        return fields

    def overrides(self) -> list[str]:
        """``--set`` strings for these fields (a search applies them to a recipe)."""
        return [f"train.{k}={','.join(v) if isinstance(v, list) else v}" for k, v in self.train_fields().items()]


# Offload ratios a search tries (any ratio in [0, 1] is valid in a recipe).
OFFLOAD_RATIOS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)

RECOMPUTE_CHOICES: tuple[Recompute, ...] = (
    Recompute(),
    Recompute("selective", modules=("core_attn",)),
    Recompute("selective", modules=("core_attn", "mlp")),
    Recompute("full", "uniform", 1),
)


def recompute_choices(layers_per_chunk: int) -> tuple[Recompute, ...]:
    """``RECOMPUTE_CHOICES`` plus ``full`` ``block`` with every depth short of the whole chunk
    (block with every layer recomputes what uniform 1 does)."""
    blocks = tuple(Recompute("full", "block", n) for n in range(1, layers_per_chunk))
    return RECOMPUTE_CHOICES + blocks
