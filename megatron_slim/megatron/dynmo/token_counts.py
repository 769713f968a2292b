"""How many tokens each decoder layer computed, through the launcher (``--dynmo-exit-threshold``,
``--dynmo-mod-capacity``): the measure of what early exit and mixture of depths save.

Two forward pre-hooks per layer count tokens (every row of a ``[..., hidden]`` input): those
entering the layer and those entering its MLP. A stock layer's MLP sees every token, an early-exit
layer's only the tokens that have not exited, a routing layer's only its routed tokens (its
attention too). Counts cover one iteration, every microbatch (a recomputed forward counts again).
Logged every ``--log-interval`` by the first data-, tensor- and context-parallel rank of each
pipeline stage, one line per layer of that stage:
``dynmo tokens at iteration N (rank R): layer L ran its MLP on A of T tokens (S)``.
"""

from __future__ import annotations

from collections import defaultdict

from megatron_slim.megatron.dynmo.freeze import decoder_layers_of


def _rows(args: tuple, kwargs: dict) -> int:
    hidden = args[0] if args else kwargs["hidden_states"]
    return hidden.numel() // hidden.shape[-1]


class TokenCounts:
    def __init__(self, model) -> None:
        self.entered: dict[int, int] = defaultdict(int)
        self.computed: dict[int, int] = defaultdict(int)
        for layer in decoder_layers_of(model):
            index = layer.layer_number - 1
            layer.register_forward_pre_hook(self._counter(self.entered, index), with_kwargs=True)
            layer.mlp.register_forward_pre_hook(self._counter(self.computed, index), with_kwargs=True)

    @staticmethod
    def _counter(counts: dict[int, int], index: int):
        def count(module, args, kwargs):
            counts[index] += _rows(args, kwargs)

        return count

    def clear(self) -> None:
        self.entered.clear()
        self.computed.clear()

    def lines(self, iteration: int, rank: int) -> list[str]:
        return [
            f"dynmo tokens at iteration {iteration} (rank {rank}): layer {index} ran its MLP on "
            f"{self.computed[index]} of {self.entered[index]} tokens ({self.computed[index] / self.entered[index]:.3f})"
            for index in sorted(self.entered)
        ]


def logs_tokens(parallel_state) -> bool:
    """Whether this rank speaks for its pipeline stage (the first data-, tensor- and
    context-parallel rank)."""
    firsts = (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_context_parallel_rank(),
    )
    return not any(firsts)
