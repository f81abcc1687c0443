"""The suite's own port picking (tests/integration/conftest.py): a port handed
to one test is never handed to another of the same run, bound or not."""

from __future__ import annotations

import fcntl
import subprocess
import sys

from tests.integration import conftest
from workers.runtimes.base import busy_ports


def _unclaimed(ports: list[int]) -> bool:
    """Nothing listens on ``ports`` and no process of the run holds them (probed, not taken)."""
    if busy_ports("127.0.0.1", ports):
        return False
    conftest.PORT_LOCKS.mkdir(exist_ok=True)
    for port in ports:
        with open(conftest.PORT_LOCKS / str(port), "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(handle, fcntl.LOCK_UN)
    return True


def _ports_nobody_holds() -> tuple[int, int, int]:
    """Five consecutive ports, and two more apart, that no test of this run has
    been handed (the run's other tests hold theirs until their process ends)."""
    base = next(p for p in range(31_000, 20_000, -40) if _unclaimed([*range(p, p + 5), p + 9, p + 19]))
    return base, base + 9, base + 19


def test_a_port_handed_out_is_never_handed_out_again_in_the_run(monkeypatch):
    """A stack's Triton range is picked long before its servers bind it, and a
    test's own Redis leaves its port free while it restarts: two picks that land
    on the same ports must not both get them."""
    base, single, spare = _ports_nobody_holds()
    picks = iter([base, base, single])
    monkeypatch.setattr(conftest.random, "randrange", lambda low, high: next(picks))
    assert conftest.free_ports(5) == base
    assert conftest.free_port() == single  # base is nobody's to listen on yet, but it is taken
    # Another process of the run (an xdist worker) is refused them too.
    other = (
        "import os, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'controlplane.settings'); django.setup(); "
        f"from tests.integration import conftest; print(conftest._reserve([{base + 2}]), conftest._reserve([{spare}]))"
    )
    answer = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=60)
    assert answer.returncode == 0, answer.stderr[-2000:]
    assert answer.stdout.split() == ["False", "True"]
