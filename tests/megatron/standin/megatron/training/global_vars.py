_GLOBAL_ARGS = None


def get_args():
    assert _GLOBAL_ARGS is not None, "args is not initialized."
    return _GLOBAL_ARGS


def set_global_variables(args):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args
