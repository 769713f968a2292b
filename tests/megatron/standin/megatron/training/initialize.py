import torch.distributed as dist

from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import get_args, set_global_variables


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, allow_no_cuda=False):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)
    set_global_variables(args)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    from megatron_slim.megatron.parallel import init_model_parallel

    args.groups = init_model_parallel(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                                      vpp=args.virtual_pipeline_model_parallel_size or 1, seed=args.seed or 1234)
    return get_args()
