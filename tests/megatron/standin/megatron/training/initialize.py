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
                                      cp=args.context_parallel_size,
                                      vpp=args.virtual_pipeline_model_parallel_size or 1, seed=args.seed or 1234)
    _cpu_token_counter()
    return get_args()


def _cpu_token_counter():
    """CPU only (not in the real package): megatron-core's schedules allocate their token counter with
    ``torch.zeros(..., device="cuda")``; give their module a torch whose ``zeros`` maps that to CPU."""
    import torch
    from megatron.core.pipeline_parallel import schedules

    class CpuTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, device=None, **kwargs):
            return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    if schedules.torch is torch:
        schedules.torch = CpuTorch()
