"""Test harness only: ``torchrun --standalone --nproc_per_node N`` for one machine, with the imports
paid once. ``harness.run_pretrain`` uses it by default (``processes="fork"``).

    python -u tests/real_megatron/forkrun.py N [-m MODULE] SCRIPT.py [flags...]   # one launch
    python -u tests/real_megatron/forkrun.py --serve TAG_DIR                    # a launch server

Every rank of a torchrun launch starts an interpreter that imports torch, megatron-core and
Megatron-LM's ``megatron.training`` (with the CPU shim, about 7 s of CPU on the 2-core CI machine,
most of a tiny 3-iteration run), and the torchrun agent imports torch again. Here a process imports
them once, as a rank's own interpreter would (the same ``sys.path``, the harness's
``sitecustomize``), then forks the ranks. Each rank then runs exactly what torchrun's worker would:
``python -m MODULE SCRIPT.py flags`` (``runpy.run_module``) or ``python SCRIPT.py flags``
(``runpy.run_path``) as ``__main__``, with torchrun's environment variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a store the launching process
holds, as torchrun's agent does). Megatron-LM's code and megatron-slim's launcher run unmodified;
nothing here patches them. Preloaded modules are imported before the launcher's hooks run in the
rank; the launcher patches modules already imported either way (it imports them itself before
``pretrain_gpt.py`` runs), so the order of patches is the one torchrun gives.

``--serve`` keeps one such process for a whole test session (``harness``): it imports once, then
reads one launch per line on stdin (JSON: ``nproc``, ``module``, ``script``, ``args``, ``env``,
``cwd``, ``log``) and forks a leader per launch, which takes the launch's environment and working
folder, installs the shim parts that environment asks for (``sitecustomize.install``), writes
ranks' output to ``log`` and forks the ranks. The server answers ``started PID`` and, when the
leader is done, ``exit CODE``. Each launch is a fresh fork of the server, which never runs a torch
operation itself, so no state passes from one launch to the next.

Like torchrun: when a rank fails, the others are stopped and the launch exits with the failed
rank's code; ranks die with their leader and a leader with the server (``PR_SET_PDEATHSIG``), and
the server with its caller (it exits at the end of its stdin). Ranks are forked before the store's
thread starts and learn its port through a pipe, so no rank inherits a half-copied thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback
from datetime import timedelta

PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.training",
    "megatron.training.arguments",
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron_slim.megatron.hooks",  # the launcher's (importing it installs nothing)
)
HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _preload(tag_dir: str) -> None:
    sys.path.insert(0, tag_dir)  # where megatron.training lives (the launcher adds it too)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # a release without it: the rank imports it if it must
            importlib.import_module(name)
    sys.path.remove(tag_dir)


def _rank_path(module: str | None, script: str, base: list[str]) -> list[str]:
    """``sys.path`` as a rank's interpreter starts with it: ``python -m MODULE`` looks in the working
    folder first, ``python SCRIPT.py`` in the script's folder; then ``PYTHONPATH`` and the rest."""
    return [os.getcwd() if module else os.path.dirname(script), *base]


def _rank(rank: int, nproc: int, port_reader: int, parent: int, module: str | None, script: str, args: list) -> None:
    _die_with_parent(parent)
    with os.fdopen(port_reader) as pipe:
        port = pipe.read().strip()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        ROLE_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR=HOST,
        MASTER_PORT=port,
        TORCHELASTIC_RUN_ID="forkrun",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="True",  # env:// joins the launching process's store as a client
    )
    code = 0
    try:
        if module:
            sys.argv = [module, script, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # SystemExit("message"): Python prints it and exits 1
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - a rank's failure is its traceback and a non-zero exit
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def launch(nproc: int, module: str | None, script: str, args: list[str]) -> int:
    """Fork ``nproc`` ranks of ``[python -m module] script args`` from this process; their exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent, ranks, writers = os.getpid(), {}, []
    for rank in range(nproc):
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(writer)
            for w in writers:
                os.close(w)
            _rank(rank, nproc, reader, parent, module, script, args)
        os.close(reader)
        ranks[pid], writers = rank, writers + [writer]
    import torch.distributed as dist

    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    for writer in writers:
        os.write(writer, f"{store.port}\n".encode())
        os.close(writer)
    return _wait(ranks)


def _wait(ranks: dict[int, int]) -> int:
    failed = 0
    while ranks:
        pid, status = os.wait()
        if pid not in ranks:
            continue
        del ranks[pid]
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            _stop(list(ranks))
    return failed


def _stop(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _lead(request: dict, server: int, base_path: list[str]) -> None:
    """In a fresh fork of the server: become the launch ``request`` describes, run it, exit with its code."""
    code = 1
    try:
        _die_with_parent(server)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import sitecustomize  # the harness's shim: the parts this launch's environment asks for

        sitecustomize.install()
        module, script = request["module"], os.path.abspath(request["script"])
        sys.path[:] = _rank_path(module, script, base_path)
        code = launch(int(request["nproc"]), module, script, list(request["args"]))
    except BaseException:  # noqa: BLE001 - the launch's failure goes to its log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(tag_dir: str) -> None:
    base_path = sys.path[1:]  # without this file's folder, which a rank's interpreter would not have
    _preload(tag_dir)
    reply = sys.stdout
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            _lead(request, os.getppid(), base_path)
        reply.write(f"started {pid}\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(f"exit {os.waitstatus_to_exitcode(status)}\n")
        reply.flush()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"] and len(argv) == 2:
        serve(argv[1])
        return 0
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit(__doc__.split("\n\n")[1])
    nproc, rest = int(argv[0]), argv[1:]
    module = None
    if rest[0] == "-m":
        module, rest = rest[1], rest[2:]
    script = os.path.abspath(rest[0])
    base_path = sys.path[1:]
    _preload(os.path.dirname(script))
    sys.path[:] = _rank_path(module, script, base_path)
    return launch(nproc, module, script, rest[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
