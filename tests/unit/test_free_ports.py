"""The suite's own port picking (tests/integration/conftest.py): a port handed
to one test is never handed to another of the same run, bound or not."""

from __future__ import annotations

import subprocess
import sys

from tests.integration import conftest


def test_a_port_handed_out_is_never_handed_out_again_in_the_run(monkeypatch):
    """A stack's Triton range is picked long before its servers bind it, and a
    test's own Redis leaves its port free while it restarts: two picks that land
    on the same ports must not both get them."""
    picks = iter([21_111, 21_111, 21_120])
    monkeypatch.setattr(conftest.random, "randrange", lambda low, high: next(picks))
    assert conftest.free_ports(5) == 21_111
    assert conftest.free_port() == 21_120  # 21 111 is nobody's to listen on yet, but it is taken
    # Another process of the run (an xdist worker) is refused them too.
    other = (
        "import os, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'controlplane.settings'); django.setup(); "
        "from tests.integration import conftest; print(conftest._reserve([21_113]), conftest._reserve([21_130]))"
    )
    answer = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=60)
    assert answer.returncode == 0, answer.stderr[-2000:]
    assert answer.stdout.split() == ["False", "True"]
