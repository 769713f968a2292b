"""The only package that knows Megatron-LM / megatron-core: flags, specs, install() hooks, version shims."""
