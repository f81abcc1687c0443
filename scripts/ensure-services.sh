#!/usr/bin/env bash
# The services `make test` needs: PostgreSQL on 127.0.0.1:5432 (user postgres,
# password postgres, or trust auth) and Redis on 127.0.0.1:6379. Installs and
# starts what is missing; leaves running services alone. Idempotent.
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

if ! (command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p 5432); then
  if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    echo "installing PostgreSQL"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
  fi
  version=$(ls /etc/postgresql | sort -V | tail -n1)
  if [ -z "$version" ]; then
    version=$(ls /usr/lib/postgresql | sort -V | tail -n1)
    $SUDO pg_createcluster "$version" main
  fi
  echo "starting PostgreSQL $version"
  $SUDO "$(dirname "$0")/detached.sh" pg_ctlcluster --skip-systemctl-redirect "$version" main start </dev/null || true
  for _ in $(seq 1 50); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.2; done
  pg_isready -q -h 127.0.0.1 -p 5432
  # A fresh cluster asks for passwords over TCP: give the test user one.
  if [ "$(id -u)" -eq 0 ]; then
    su postgres -c "psql -q -c \"ALTER USER postgres PASSWORD 'postgres'\"" >/dev/null
  else
    sudo -u postgres psql -q -c "ALTER USER postgres PASSWORD 'postgres'" >/dev/null
  fi
fi

# The chaos tests start (and stop) Redis servers of their own: the binary is needed
# even where a Redis already runs.
command -v redis-server >/dev/null || {
  echo "installing Redis"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
}
if ! (command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG); then
  echo "starting Redis"
  "$(dirname "$0")/detached.sh" redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" \
    --appendonly no --dir /tmp --logfile /tmp/gantry-test-redis.log </dev/null
  for _ in $(seq 1 50); do redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
fi
