from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from deployments.errors import ValidationFailed
from deployments.models import ModelKind, RegisteredModel
from deployments.services import registered_models


class Command(BaseCommand):
    help = "Register a HuggingFace-format checkpoint folder as a model."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True)
        parser.add_argument("--kind", required=True, choices=ModelKind.values)
        parser.add_argument("--path", required=True, help="absolute path of the checkpoint folder")
        parser.add_argument("--hub-id", default="")
        parser.add_argument("--revision", default="")
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
                hub_id=options["hub_id"],
                revision=options["revision"],
            )
        except ValidationFailed as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"registered {model.name} ({model.architecture}, fingerprint {model.fingerprint[:12]})")
