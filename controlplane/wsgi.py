"""WSGI entry point of the pages server: pages, the REST API and the admin on
gunicorn's sync workers (controlplane.serving.pages_argv). Each process keeps
its PostgreSQL connection between requests (DATABASE_CONN_MAX_AGE, 60 s unless
a pool is asked for), as a plain Django deployment does."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
if not os.environ.get("DATABASE_POOL_SIZE", "").strip("0"):
    os.environ.setdefault("DATABASE_CONN_MAX_AGE", "60")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
