"""SlimPipe under Megatron-Bridge's own training loop: ``bridge.install(config, num_slices=...)``.

``installer`` patches the config's layer spec and the schedule getter; ``config`` checks the
Bridge ``ConfigContainer`` first. See docs/megatron-bridge.md.
"""

from megatron_slim.megatron.bridge.installer import BridgeInstall, install

__all__ = ["BridgeInstall", "install"]
