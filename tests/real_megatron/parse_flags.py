"""Parse and validate flag sets with one Megatron-LM tag's real ``arguments.py`` (run as a script).

    python parse_flags.py FLAGSETS.json  ->  prints one JSON line per set:
        {"name": ..., "ok": true, "values": {...}} | {"name": ..., "error": "<type>: <message>"}

Each set is ``{"name", "world_size", "argv"}``, optionally ``"report"``: parsed argument names
whose values ``values`` returns. The launcher's hooks are installed first (as
``python -m megatron_slim.launch`` does), so megatron-slim's flags are registered and its start-up
checks run inside ``validate_args``; ``WORLD_SIZE`` is faked per set. The tag's folder and the
harness shim (Megatron's CUDA queries answered on the CPU) must be on ``PYTHONPATH``.
"""

import json
import os
import sys


def main(path: str) -> None:
    from megatron_slim.megatron.hooks import prepare_launch

    prepare_launch()
    from megatron.training import arguments

    with open(path) as f:
        flag_sets = json.load(f)
    for flag_set in flag_sets:
        os.environ.update(WORLD_SIZE=str(flag_set["world_size"]), RANK="0", LOCAL_RANK="0")
        sys.argv = ["pretrain_gpt.py", *flag_set["argv"]]
        try:
            args = arguments.parse_args()
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            values = {key: getattr(args, key) for key in flag_set.get("report", [])}
            result = {"name": flag_set["name"], "ok": True, "values": values}
        except (Exception, SystemExit) as exc:  # report every failure, including argparse's exit
            result = {"name": flag_set["name"], "error": f"{type(exc).__name__}: {exc}"}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
