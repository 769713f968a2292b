"""The only package that knows Megatron-LM / megatron-core: flags, specs, install() hooks, version shims.

``add_arguments(parser)`` registers megatron-slim's flags (an ``extra_args_provider``);
``install(args)`` hooks the schedule and layer specs into ``megatron.training``. Importing this
package imports neither megatron nor torch; the submodules that need them import them.
"""

from megatron_slim.megatron.launch.flags import add_arguments


def install(args=None) -> None:
    from megatron_slim.megatron.hooks import install as _install

    _install(args)


__all__ = ["add_arguments", "install"]
