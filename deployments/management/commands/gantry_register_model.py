"""`manage.py gantry_register_model`: register a checkpoint folder on a GPU host
from the command line (the same service as POST /api/models/)."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from common.errors import ValidationFailed
from deployments.models import ModelKind, RegisteredModel
from deployments.services import registered_models


class Command(BaseCommand):
    help = "Register a HuggingFace-format checkpoint folder on a GPU host; that host's worker inspects it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True)
        parser.add_argument("--kind", required=True, choices=ModelKind.values)
        parser.add_argument("--path", required=True, help="absolute path of the checkpoint folder on the host")
        parser.add_argument(
            "--host", default=settings.GANTRY_HOST_NAME, help="the GPU host that holds it (default: GANTRY_HOST_NAME)"
        )
        parser.add_argument("--hub-id", default="")
        parser.add_argument("--revision", default="")
        parser.add_argument("--trust-remote-code", action="store_true", help="let the checkpoint's own code run")
        parser.add_argument("--if-missing", action="store_true", help="do nothing if the name is registered")

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        if options["if_missing"] and RegisteredModel.objects.filter(name=options["name"]).exists():
            self.stdout.write(f"model {options['name']} is already registered")
            return
        try:
            model = registered_models.model_register(
                name=options["name"],
                kind=options["kind"],
                path=options["path"],
                host=options["host"],
                hub_id=options["hub_id"],
                revision=options["revision"],
                trust_remote_code=options["trust_remote_code"],
            )
        except ValidationFailed as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"registered {model.name} on {options['host']}; the host is inspecting it")
