# shellcheck shell=bash disable=SC2034
# lib.sh: paths and pid bookkeeping shared by slurm/up.sh and slurm/down.sh (sourced, not run;
# SC2034 is off because the variables set here are used by those scripts).
#
# Invariant: every daemon that up.sh starts runs in the foreground of its own session (setsid, no
# self-daemonising), so `$!` is the daemon's own pid. up.sh records it as "<pid> <comm>" in
# $PID_DIR/<name>; down.sh signals exactly that pid, and only while /proc/<pid>/comm still equals the
# recorded command name, so a recycled pid is never signalled. Daemons found running without a
# record (started by something else) are used as they are and never stopped.

SLURM_TEMPLATE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE_DIR=${ROLLART_SLURM_STATE:-/var/lib/rollart-slurm}
PID_DIR=$STATE_DIR/pids
SPOOL_DIR=$STATE_DIR/spool
LOG_DIR=$STATE_DIR/log
RUN_DIR=/run/slurm
CONF_DIR=/etc/slurm
CLUSTER=rollart
ACCT_DB=slurm_acct_db
SLURM_NODES=(rollout1 train1)
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH

log() { echo "[slurm $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# waitfor SECONDS CMD...: poll CMD every 0.1 s until it succeeds; 1 (and a message) on timeout.
waitfor() {
  local secs=$1 i
  shift
  for ((i = 0; i < secs * 10; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  log "timed out after ${secs}s waiting for: $*"
  return 1
}

# pid_runs PID COMM: PID is a live (not zombie) process whose command name is COMM.
pid_runs() {
  local stat
  [ -n "$1" ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 1
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

# recorded_pid NAME: print the recorded pid of NAME if that process still runs the recorded command.
recorded_pid() {
  local rec=$PID_DIR/$1 pid comm
  [ -f "$rec" ] || return 1
  read -r pid comm <"$rec" || return 1
  pid_runs "$pid" "$comm" || return 1
  echo "$pid"
}

# start_daemon NAME COMM CMD...: run CMD (which must stay in the foreground) in a new session,
# record its pid, and wait until the pid runs COMM (proof that `$!` is the daemon itself).
start_daemon() {
  local name=$1 comm=$2 pid
  shift 2
  setsid "$@" >>"$LOG_DIR/$name.out" 2>&1 </dev/null &
  pid=$!
  echo "$pid $comm" >"$PID_DIR/$name"
  if ! waitfor 10 pid_runs "$pid" "$comm"; then
    tail -n 20 "$LOG_DIR/$name.out" >&2
    die "$name (pid $pid) did not start as $comm; see $LOG_DIR/$name.out"
  fi
  log "started $name (pid $pid)"
}

# stop_daemons SECONDS NAME...: SIGTERM each recorded daemon, wait up to SECONDS for all of them,
# then SIGKILL what is left. Records of daemons that are gone are removed.
stop_daemons() {
  local secs=$1 name pid i alive
  shift
  for name in "$@"; do
    if pid=$(recorded_pid "$name"); then
      kill -TERM "$pid" 2>/dev/null && log "stopping $name (pid $pid)"
    fi
  done
  for ((i = 0; i < secs * 10; i++)); do
    alive=0
    for name in "$@"; do recorded_pid "$name" >/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for name in "$@"; do
    if pid=$(recorded_pid "$name"); then
      log "$name (pid $pid) ignored SIGTERM for ${secs}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$PID_DIR/$name"
  done
}
