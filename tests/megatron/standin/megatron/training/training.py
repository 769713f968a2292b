import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.training.global_vars import get_args
from megatron.training.initialize import initialize_megatron

LAST_RUN = {}


def finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """Stand-in for DDP + ``megatron.core.distributed.finalize_model_grads``: gradients summed over
    data x context parallel ranks and scaled by ``1 / (dp * cp)`` (DDP's gradient_scaling_factor), or,
    under --calculate-per-token-loss, by the inverse of ``num_tokens`` summed over those ranks."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if num_tokens is not None:
        dist.all_reduce(num_tokens, group=group)
        scale = 1.0 / max(int(num_tokens.item()), 1)
    else:
        scale = 1.0 / dist.get_world_size(group)
    for chunk in model:
        for param in chunk.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
                param.grad.mul_(scale)


def train_step(forward_step_func, data_iterator, model, optimizer):
    args = get_args()
    for chunk in model:
        chunk.zero_grad()
    forward_backward_func = get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=args.global_batch_size // args.micro_batch_size // args.data_parallel_size,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.decoder_seq_length, forward_only=False, adjust_tensor_shapes_fn=None,
        force_all_reduce=False)
    if "first_grads" not in LAST_RUN:  # test instrumentation (not in the real script)
        LAST_RUN["first_grads"] = {n: p.grad.clone() for n, p in model[0].named_parameters() if p.grad is not None}
    optimizer.step()
    LAST_RUN.setdefault("functions", []).append(getattr(forward_backward_func, "__name__", ""))
    return losses_reduced


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}):
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    args = get_args()
    groups = args.groups
    vpp = args.virtual_pipeline_model_parallel_size or 1
    model = []
    for chunk in range(vpp):
        pre = groups.pp_rank == 0 and chunk == 0
        post = groups.pp_rank == groups.pp_size - 1 and chunk == vpp - 1
        model.append(model_provider(pre_process=pre, post_process=post, vp_stage=chunk))
    for chunk in model:  # as train() does in the real package
        chunk.config.finalize_model_grads_func = finalize_model_grads
    LAST_RUN["initial_state"] = {k: v.clone() for k, v in model[0].state_dict().items() if torch.is_tensor(v)}
    optimizer = torch.optim.SGD([p for m in model for p in m.parameters()], lr=args.lr or 0.05)
    train_ds = train_valid_test_dataset_provider()
    losses = []
    for it in range(args.train_iters):
        iterators = [iter(train_ds(it)) for _ in model]
        reduced = train_step(forward_step_func, iterators, model, optimizer)
        if reduced:
            total = torch.stack([r["lm loss"] for r in reduced]).sum(0)
            if groups.cp_size * groups.dp_size > 1:  # train_step's reduction over data x context parallel ranks
                from megatron.core import parallel_state

                dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            losses.append((total[0] / total[1]).item())
    LAST_RUN.update(losses=losses, model=model)
