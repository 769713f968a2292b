"""One plan-agreement helper (``runtime.agreement``) for pipeline schedules and CP plans: an int64
all-gather of the digest that passes when every rank holds it and raises on every rank otherwise."""

import torch.distributed as dist

from megatron_slim.runtime.spawn import run_ranks


def _agree(rank, world_size):
    from megatron_slim.runtime.agreement import check_agreement

    schedule = "0123456789abcdef"  # a Schedule.digest(): 16 hex characters, more than one int64 word
    check_agreement(schedule, dist.group.WORLD, ranks="pipeline ranks", what="SlimPipe schedule")
    out = {}
    for name, digest in (
        ("schedule", "fedcba987654321" + "0" if rank else schedule),
        ("sha256", ("ab" if rank == 1 else "cd") * 32),
    ):
        try:
            check_agreement(digest, dist.group.WORLD, ranks="pipeline ranks", what="SlimPipe schedule")
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


def test_ranks_agree_or_all_fail_naming_each_ranks_digest():
    results = run_ranks(_agree, 2, timeout_s=120)
    for r in results:
        assert r["schedule"].startswith(
            "pipeline ranks disagree on the SlimPipe schedule (pipeline rank 0: "
            "0123456789abcdef, pipeline rank 1: fedcba9876543210)"
        )
        assert "pipeline rank 1: abababababababab" in r["sha256"]
