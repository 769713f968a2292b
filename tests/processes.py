"""Whether a process the test started still runs, read from /proc (Linux, as the suite needs)."""


def running(pid: int) -> bool:
    """True while ``pid`` runs; False once it exited, including an unreaped zombie (stopped running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
