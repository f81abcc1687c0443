"""WSGI entry point of the pages server: pages, the REST API and the admin on
gunicorn's sync workers (controlplane.serving.pages_argv). Each process keeps
one PostgreSQL connection between requests (DATABASE_CONN_MAX_AGE, 60 s unless
set), as a plain Django deployment does.

No pool here, whatever DATABASE_POOL_SIZE says (it is the web and live
servers' setting, and an environment shared with them carries it): a sync
process serves one request at a time, so a pool only opened connections that
waited."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ["DATABASE_POOL_SIZE"] = "0"
os.environ.setdefault("DATABASE_CONN_MAX_AGE", "60")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
