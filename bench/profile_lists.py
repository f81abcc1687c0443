"""In-process cost of the API's list pages, for profiling (not part of make bench).

Seeds the bench database as bench/api.py does, then times each path given
(default: the five-column builds floor, the builds and events pages) through
Django's test client, 300 requests each, and with ``--profile PATH`` prints
cProfile's heaviest calls for that one.

    .venv/bin/python bench/profile_lists.py "/api/events/?limit=50" --profile "/api/events/?limit=50"
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import add_database_argument, setup_postgres  # noqa: E402

REQUESTS = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_database_argument(parser)
    default = ["/floor/builds/", "/api/builds/?limit=50", "/api/events/?limit=50"]
    parser.add_argument("paths", nargs="*", default=default)
    parser.add_argument("--profile", help="a path to run under cProfile after the timings")
    parser.add_argument("--sort", default="cumulative", help="cProfile's sort key")
    args = parser.parse_args()
    setup_postgres(args.database_url)
    from django.test import Client

    from bench.api import _seed

    token, _ = _seed()
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_HOST="127.0.0.1")
    for path in args.paths:
        answer = client.get(path)
        if answer.status_code != 200:
            raise SystemExit(f"{path}: {answer.status_code} {answer.content[:200]!r}")
        for _ in range(30):
            client.get(path)
        began = time.perf_counter()
        for _ in range(REQUESTS):
            client.get(path)
        print(f"{path:<48} {(time.perf_counter() - began) / REQUESTS * 1000:6.2f} ms per request")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(REQUESTS):
            client.get(args.profile)
        profile.disable()
        pstats.Stats(profile).sort_stats(args.sort).print_stats(45)


if __name__ == "__main__":
    main()
