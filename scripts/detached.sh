#!/usr/bin/env bash
# Run COMMAND with none of the caller's descriptors but 0-2, in a session of its
# own: every daemon Gantry's scripts start goes through this, so a daemon never
# keeps a lock or a pipe of whoever ran `make test` (a CI pipe stays open as long
# as any process holds it). Usage: detached.sh COMMAND [ARG...]
set -euo pipefail
for fd in /proc/$$/fd/*; do
  fd=${fd##*/}
  if [ "$fd" -gt 2 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
done
exec setsid "$@"
