from megatron.training.global_vars import get_args  # noqa: F401
from megatron.training.training import pretrain  # noqa: F401
