#!/usr/bin/env bash
# down.sh: stop the daemons that slurm/up.sh started, by their recorded pids (never by name).
# Jobs still queued on a controller that up.sh started are cancelled first. Every wait is bounded;
# exit status 0 when nothing (more) runs. PURGE=1 also drops the controller state, the node spools,
# the logs and the accounting database, so job ids start again at 1.
set -uo pipefail
T0=$(date +%s%N)
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PURGE=${PURGE:-0}

cancel_jobs() {
  recorded_pid slurmctld >/dev/null || return 0
  scontrol ping 2>/dev/null | grep -q 'is UP' || return 0
  squeue -h -o %A 2>/dev/null | xargs -r scancel 2>/dev/null
  waitfor 15 test -z "$(squeue -h -o %A 2>/dev/null)" || log "jobs still queued; stopping anyway"
}

drop_accounting_db() {
  if ! recorded_pid mariadbd >/dev/null && ! mariadb-admin ping >/dev/null 2>&1; then
    [ -d "/var/lib/mysql/$ACCT_DB" ] || return 0
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    start_daemon mariadbd mariadbd /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 \
      --pid-file=/run/mysqld/mysqld.pid
    waitfor 30 mariadb-admin ping || return 1
  fi
  mariadb -e "DROP DATABASE IF EXISTS $ACCT_DB" && log "dropped database $ACCT_DB"
}

[ "$(id -u)" = 0 ] || die "down.sh must run as root"
[ -d "$PID_DIR" ] || { log "no state in $STATE_DIR: nothing to stop"; exit 0; }
cancel_jobs
stop_daemons 15 slurmd-rollout1 slurmd-train1
stop_daemons 15 slurmctld
stop_daemons 15 slurmdbd
[ "$PURGE" = 1 ] && drop_accounting_db
stop_daemons 30 mariadbd
stop_daemons 10 munged
if [ "$PURGE" = 1 ]; then
  rm -rf "$SPOOL_DIR" "$LOG_DIR" "$PID_DIR"
  rm -f "$RUN_DIR"/slurmctld.pid "$RUN_DIR"/slurmd-*.pid "$RUN_DIR"/slurmdbd.pid
  log "purged $STATE_DIR"
fi
log "SLURM cluster stopped in $((($(date +%s%N) - T0) / 1000000)) ms"
