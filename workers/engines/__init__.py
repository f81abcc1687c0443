"""Engine builds on a GPU host: executors (docker or native), run (one build,
step by step), verify (GPUs in, engine out), reconcile (after a dead worker)."""
