"""The sync floor of bench/api.py: plain Django (Gantry's settings plus the floor
views) on gunicorn's sync workers, as the plainest fast Django deployment runs."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.floor.settings")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
