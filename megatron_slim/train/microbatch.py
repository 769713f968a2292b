"""What one microbatch of ``megatron-slim train`` is: which samples it holds, its forward step and
loss (Megatron's ``pretrain_gpt``), and an iteration's loss reduced over ranks.

Global batch ``G`` samples per iteration; data-parallel rank ``d`` takes samples
``it*G + d*m*b .. + m*b`` as ``m`` microbatches of ``b``, so the data order depends only on the
iteration: a resumed run reads exactly what the uninterrupted run would have read.
"""

from __future__ import annotations

import functools

import torch

from megatron_slim.plan.recipe import Recipe


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's pretrain_gpt loss: (sum of masked token losses, token count, report)."""
    losses = output_tensor.float()
    loss = torch.sum(losses.reshape(-1) * loss_mask.reshape(-1))
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def vocab_targets(labels: torch.Tensor, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Under ``schedule.vocab_parallel`` the loss is computed by every pipeline rank
    (``runtime/pipeline/vocab.py``): the last stage hands on the slice's labels and loss mask."""
    return labels, loss_mask


def vocab_forward_step(data_iterator, model):
    """``forward_step`` with the output layer left to the pipeline's vocabulary exchange."""
    from megatron_slim.megatron.model.vocab_head import final_hidden_states

    batch = next(data_iterator)
    with final_hidden_states(model):
        output = model(batch["tokens"], batch["position_ids"], None)
    return output, functools.partial(vocab_targets, batch["labels"], batch["loss_mask"])


def microbatches(dataset, recipe: Recipe, iteration: int, dp_rank: int):
    """Data-parallel rank ``dp_rank``'s microbatches of (0-based) ``iteration``."""
    t, m = recipe.train, recipe.num_microbatches
    base = iteration * t.global_batch_size + dp_rank * m * t.micro_batch_size
    for k in range(m):
        samples = [dataset[base + k * t.micro_batch_size + i] for i in range(t.micro_batch_size)]
        yield {
            name: torch.stack([torch.as_tensor(s[name]) for s in samples])
            for name in ("tokens", "labels", "loss_mask", "position_ids")
        }


def summed_loss(reports: list) -> torch.Tensor:
    """The microbatches' ``lm loss`` reports summed: (sum of token losses, token count)."""
    return torch.stack([r["lm loss"] for r in reports]).sum(0)


def dp_mean(total: torch.Tensor, group, size: int) -> float:
    """Token-weighted loss over the data (x context) parallel ranks (Megatron's ``lm loss`` reduction)."""
    import torch.distributed as dist

    if size > 1:
        dist.all_reduce(total, group=group)
    return (total[0] / total[1].clamp(min=1)).item()
