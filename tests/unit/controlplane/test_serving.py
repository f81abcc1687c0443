"""The web server's process settings (controlplane.serving)."""

from __future__ import annotations

import gc

from controlplane import serving


def test_a_web_process_keeps_the_collector_off_what_it_loaded():
    thresholds = gc.get_threshold()
    try:
        serving.settle_heap()
        assert gc.get_freeze_count() > 10_000  # Django and Gantry, as imported by this test run
        assert gc.get_threshold() == serving.GC_THRESHOLDS
        assert gc.isenabled()  # cycles made by requests are still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_two_web_processes_per_core_unless_told(monkeypatch):
    monkeypatch.delenv("GANTRY_WEB_WORKERS", raising=False)
    monkeypatch.setattr(serving.os, "cpu_count", lambda: 2)
    assert serving.web_workers() == 4
    monkeypatch.setattr(serving.os, "cpu_count", lambda: 64)
    assert serving.web_workers() == 8
    monkeypatch.setenv("GANTRY_WEB_WORKERS", "3")
    assert serving.web_workers() == 3
    argv = serving.web_argv("python", bind="127.0.0.1", port=8000)
    assert argv[argv.index("--workers") + 1] == "3"
    assert "controlplane.serving.HttpWorker" in argv
