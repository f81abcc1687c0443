"""What is stored of a secret Gantry issues (a personal token, a gateway key, a
host's join token): its SHA-256 digest. The secret is shown once, when it is
made, and a leaked database holds nothing that authenticates."""

from __future__ import annotations

import hashlib


def secret_digest(secret: str) -> str:
    """The digest kept of ``secret``. Secrets are 256 random bits, so a fast hash is enough."""
    return hashlib.sha256(secret.encode()).hexdigest()
