"""The test process's side of ``forkrun.py --serve``: one launch server per test process (each
pytest-xdist worker has its own), started at the first launch and reused by the later ones.

A launch is one JSON line to the server and two lines back (``started PID``, ``exit CODE``); the
ranks' output goes to a log file the caller names. A launch that outlives its timeout has its
leader killed (its ranks die with it) and raises :class:`LaunchTimeout`. A server that died is
started again at the next launch.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

FORKRUN = Path(__file__).with_name("forkrun.py")
START_TIMEOUT_S = 300.0


class LaunchTimeout(RuntimeError):
    pass


class _Server:
    def __init__(self, tag: Path, env: dict):
        self.key = (str(tag), env.get("PYTHONPATH", ""))
        self.errors = tempfile.NamedTemporaryFile(prefix="forkrun-server-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(FORKRUN), "--serve", str(tag)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            env=env,
        )
        self._pending = b""  # read from the server, not yet split into lines
        self._expect("ready", START_TIMEOUT_S)

    def _line(self, deadline: float) -> Optional[str]:
        """The server's next line, or None at ``deadline`` (the pipe is read unbuffered, so a line
        already received is never left waiting in a buffer that ``select`` cannot see)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"the launch server exited ({self.proc.wait()}):\n{self._errors()}")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode().strip()

    def _expect(self, word: str, timeout_s: float) -> str:
        line = self._line(time.monotonic() + timeout_s)
        if line is None or not line.startswith(word):
            raise RuntimeError(f"the launch server said {line!r}, not {word!r}:\n{self._errors()}")
        return line[len(word) :].strip()

    def _errors(self) -> str:
        return Path(self.errors.name).read_text(errors="replace")[-4000:]

    def launch(self, request: dict, timeout_s: float) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        leader = int(self._expect("started", 60))
        line = self._line(time.monotonic() + timeout_s)
        if line is None:
            os.kill(leader, signal.SIGKILL)  # its ranks die with it
            self._expect("exit", 60)
            raise LaunchTimeout(f"no result within {timeout_s:.0f}s")
        if not line.startswith("exit"):
            raise RuntimeError(f"the launch server said {line!r}, not 'exit'")
        return int(line.split()[1])

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.errors.name)


_lock = threading.Lock()
_server: Optional[_Server] = None


def launch(tag: Path, request: dict, server_env: dict, timeout_s: float) -> int:
    """Run ``request`` (``forkrun.py``'s launch fields) on this process's server; its exit code."""
    global _server
    with _lock:
        key = (str(tag), server_env.get("PYTHONPATH", ""))
        if _server is not None and (_server.proc.poll() is not None or _server.key != key):
            _server.close()
            _server = None
        if _server is None:
            _server = _Server(tag, server_env)
        return _server.launch(request, timeout_s)


@atexit.register
def _close() -> None:
    if _server is not None:
        _server.close()
