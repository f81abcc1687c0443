"""Gantry's settings plus the floor views (bench/floor/urls.py), for bench/api.py's servers only."""

from controlplane.settings import *  # noqa: F403

ROOT_URLCONF = "bench.floor.urls"
