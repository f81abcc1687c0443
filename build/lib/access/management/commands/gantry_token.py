"""manage.py gantry_token <username> [--name N] [--days D]: a personal API
token for automation, its secret printed once (stdout, nothing else)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from access.services import token_create


class Command(BaseCommand):
    help = "Make a personal API token for a user and print its secret (shown this once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="command line", help="what the token is for")
        parser.add_argument("--days", type=int, default=90, help="days until it expires; 0: never")

    def handle(self, *args: Any, username: str, name: str, days: int, **options: Any) -> None:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}")
        if days < 0:
            raise CommandError("--days must be 0 (never expires) or more")
        expires_at = timezone.now() + dt.timedelta(days=days) if days else None
        self.stdout.write(token_create(user=user, name=name, expires_at=expires_at).secret)
