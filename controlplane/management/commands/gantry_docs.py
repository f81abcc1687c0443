"""`manage.py gantry_docs [--check]`: write the manual's generated parts (the
configuration table, the API reference); with --check, only say which differ."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.docs import generated


class Command(BaseCommand):
    help = "Write docs/configuration.md's table and docs/api-reference.md from the settings and the schema."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--check", action="store_true", help="change nothing; fail if a page is out of date")

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        from django.db import connection

        if connection.vendor != "postgresql":
            # Integer bounds in the schema are the database's: document PostgreSQL's (no connection is made).
            raise CommandError("run it with DATABASE_URL=postgres://... (the bounds documented are PostgreSQL's)")
        stale = [path for path, text in generated().items() if not path.exists() or path.read_text() != text]
        if options["check"]:
            if stale:
                names = ", ".join(p.name for p in stale)
                raise CommandError(f"out of date: {names} (python manage.py gantry_docs writes them)")
            return
        for path, text in generated().items():
            path.write_text(text)
        self.stdout.write(f"wrote {', '.join(p.name for p in stale) or 'nothing (all up to date)'}")
