"""`manage.py gantry_register_model`, as the dashboard suggests it."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from deployments.models import RegisteredModel


def test_registers_on_this_host_by_default(host, minilm_path, settings, capsys):
    settings.GANTRY_HOST_NAME = host.name
    call_command("gantry_register_model", "--name", "mini", "--kind", "embedding", "--path", str(minilm_path))
    model = RegisteredModel.objects.get(name="mini")
    assert (model.host.name, model.inspection) == (host.name, "pending")
    assert "the host is inspecting it" in capsys.readouterr().out


def test_an_unknown_host_is_named(db, minilm_path):
    with pytest.raises(CommandError, match="host: no GPU host named 'elsewhere'"):
        call_command(
            "gantry_register_model",
            "--name",
            "m",
            "--kind",
            "embedding",
            "--path",
            str(minilm_path),
            "--host",
            "elsewhere",
        )
