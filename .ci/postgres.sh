#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the hpo tests (tests/hpo/test_postgres.py) on 127.0.0.1:${LDS_PG_PORT}.
# Installs Debian's `postgresql` with apt-get if it is missing. Never fails the caller: if the server cannot be
# started, it says why and exits 0, and the PostgreSQL test skips printing the reason.
set -u
PORT="${LDS_PG_PORT:-55432}"
DATA="${LDS_PG_DIR:-/tmp/lds-postgres}"
say() { echo "postgres.sh: $*"; }

if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  say "installing Debian's postgresql (apt-get)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } \
      >/tmp/lds-postgres-apt.log 2>&1; then
    say "apt-get install postgresql failed (see /tmp/lds-postgres-apt.log); the PostgreSQL test will skip"
    exit 0
  fi
fi
BIN="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
# PostgreSQL refuses to run as root; the Debian package creates the `postgres` user.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

if "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT"; then
  say "already running on 127.0.0.1:$PORT"
else
  if [ ! -f "$DATA/PG_VERSION" ]; then
    mkdir -p "$DATA" && { [ "$(id -u)" != 0 ] || chown postgres: "$DATA"; }
    as_pg "$BIN/initdb" -D "$DATA" -U postgres --auth=trust >"$DATA.initdb.log" 2>&1 \
      || { say "initdb failed (see $DATA.initdb.log); the PostgreSQL test will skip"; exit 0; }
  fi
  as_pg "$BIN/pg_ctl" -D "$DATA" -l "$DATA/server.log" -w -t 30 \
      -o "-p $PORT -k /tmp -c listen_addresses=127.0.0.1" start >/dev/null \
    || { say "the server did not start (see $DATA/server.log); the PostgreSQL test will skip"; exit 0; }
  say "started on 127.0.0.1:$PORT (data in $DATA)"
fi
as_pg "$BIN/psql" -q -h 127.0.0.1 -p "$PORT" -U postgres -tc "SELECT 1 FROM pg_database WHERE datname='lds_hpo'" \
  | grep -q 1 || as_pg "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres lds_hpo \
  || say "could not create database lds_hpo"
exit 0
