"""Gantry's one home for tritonclient: model configs, the repository layout,
and talking to a running server."""
