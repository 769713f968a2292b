"""``python -m megatron_slim ...`` is ``megatron-slim ...``; torchrun runs it as
``torchrun --nproc_per_node N -m megatron_slim train ...``."""

import sys

from megatron_slim.cli import main

if __name__ == "__main__":
    sys.exit(main())
