"""Stand-ins for the parts of Megatron-Bridge that ``megatron_slim.megatron.bridge`` relies on
(Bridge itself needs transformer-engine to import, which does not install here; the real package
is checked by ``tests/real_bridge``). Each mirrors Bridge 0.6.2 / 0.3.1 as cited:

* ``GPTModelProvider``: a megatron-core ``TransformerConfig`` with Bridge's extra fields;
  ``layer_spec`` resolves ``transformer_layer_spec`` as ``GPTModelProvider.provide`` does
  (gpt_provider.py:256-262 in 0.6.2: a ``ModuleSpec`` as is, else call it with the provider, adding
  ``vp_stage=`` when its signature has one);
* ``forward_step``: gpt_step.py's shape: ``(state, data_iterator, model, return_schedule_plan)``,
  one ``next()`` per call, megatron-core's ``get_batch_on_this_cp_rank`` on the dict, the model
  called with keywords, ``masked_next_token_loss``'s 3-tuple (losses.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from types import SimpleNamespace
from typing import Any, Callable, Optional, Union

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_batch_on_this_cp_rank

from tests.oracle.models import NARROW_GQA_2L


def local_layer_spec(config: "GPTModelProvider") -> ModuleSpec:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization=config.normalization)


@dataclasses.dataclass
class GPTModelProvider(TransformerConfig):
    seq_length: int = 32
    vocab_size: int = 64
    rotary_base: float = 10000.0
    position_embedding_type: str = "rope"
    transformer_layer_spec: Union[ModuleSpec, Callable] = local_layer_spec

    def layer_spec(self, vp_stage: Optional[int] = None) -> ModuleSpec:
        spec = self.transformer_layer_spec
        if isinstance(spec, ModuleSpec):
            return spec
        if "vp_stage" in inspect.signature(spec).parameters:
            return spec(self, vp_stage=vp_stage)
        return spec(self)


def tiny_provider(**overrides: Any) -> GPTModelProvider:
    from megatron_slim.megatron.model.gpt import transformer_config
    from megatron_slim.plan.recipe import ModelConfig

    model = ModelConfig(**NARROW_GQA_2L)
    base = transformer_config(model)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return GPTModelProvider(**fields, seq_length=model.seq_length, vocab_size=model.vocab_size, **overrides)


def config_container(model: Any = None, **dataset: Any) -> SimpleNamespace:
    """The parts of a ``ConfigContainer`` install() reads (training.config.ConfigContainer)."""
    data = dict(dataloader_type="single", reset_attention_mask=False)
    data.update(dataset)
    return SimpleNamespace(
        model=model if model is not None else tiny_provider(),
        train=SimpleNamespace(micro_batch_size=2, global_batch_size=4),
        dataset=SimpleNamespace(**data),
    )


def masked_next_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(state: Any, data_iterator, model, return_schedule_plan: bool = False):
    batch = get_batch_on_this_cp_rank(next(data_iterator), cp_group=state.cp_group)
    output = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"],
    )
    return output, functools.partial(masked_next_token_loss, batch["loss_mask"])
