#!/usr/bin/env bash
# up.sh: install (if missing) and start a single-host SLURM test cluster. Root, Debian 12, no systemd.
#
# Daemons, in start order: munged; mariadbd + slurmdbd (cluster registered before slurmctld starts);
# slurmctld; two slurmd "nodes", rollout1 and train1 (2 fake GPUs). Partitions: rollout, train,
# all (both nodes) and the preemptible scavenger. Idempotent: what already runs is left alone.
# Pids of the daemons started here are recorded under $ROLLART_SLURM_STATE (default
# /var/lib/rollart-slurm); slurm/down.sh stops exactly those.
# Env: ROLLART_SLURM_STATE (state dir), UP_TIMEOUT (seconds to wait for idle nodes, default 60).
set -euo pipefail
T0=$(date +%s%N)
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server openmpi-bin libopenmpi-dev)
UP_TIMEOUT=${UP_TIMEOUT:-60}
CONF_CHANGED=0

install_packages() {
  local status
  status=$(dpkg-query -W -f='${db:Status-Abbrev}\n' "${PKGS[@]}" 2>&1 || true)
  grep -qv '^ii ' <<<"$status" || return 0
  log "installing ${PKGS[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null
}

prepare_host() {
  install -d -m 0755 "$CONF_DIR" "$PID_DIR" "$LOG_DIR" "$RUN_DIR" "$SPOOL_DIR/slurmctld"
  local n
  for n in "${SLURM_NODES[@]}"; do install -d "$SPOOL_DIR/slurmd/$n"; done
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o mysql -g mysql -m 0755 /run/mysqld
  ln -sfn /dev/null "$RUN_DIR/fakegpu0" # gres/gpu files must be char devices
  ln -sfn /dev/null "$RUN_DIR/fakegpu1"
  if ! grep -qE "^127\.0\.0\.1([[:space:]].*)?[[:space:]]${SLURM_NODES[0]}([[:space:]]|$)" /etc/hosts; then
    echo "127.0.0.1 ${SLURM_NODES[*]}" >>/etc/hosts # node names must resolve (MASTER_ADDR from nodelists)
  fi
}

cgroup_plugin() {
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then echo cgroup/v2; else echo cgroup/v1; fi
}

# render NAME MODE: fill slurm/NAME.in's @PLACEHOLDERS@ into $CONF_DIR/NAME; note whether it changed.
render() {
  local name=$1 mode=$2 tmp
  tmp=$(mktemp "$CONF_DIR/.$name.XXXXXX")
  sed -e "s#@CLUSTER@#$CLUSTER#g" -e "s#@SPOOL_DIR@#$SPOOL_DIR#g" -e "s#@RUN_DIR@#$RUN_DIR#g" \
    -e "s#@LOG_DIR@#$LOG_DIR#g" -e "s#@ACCT_DB@#$ACCT_DB#g" -e "s#@CGROUP_PLUGIN@#$(cgroup_plugin)#g" \
    "$SLURM_TEMPLATE_DIR/$name.in" >"$tmp"
  grep -q '@[A-Z_]*@' "$tmp" && die "unfilled placeholder in $name: $(grep -o '@[A-Z_]*@' "$tmp" | head -1)"
  chmod "$mode" "$tmp"
  if cmp -s "$tmp" "$CONF_DIR/$name"; then rm -f "$tmp"; return 0; fi
  mv -f "$tmp" "$CONF_DIR/$name"
  CONF_CHANGED=1
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --force
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  recorded_pid munged >/dev/null || munge -n >/dev/null 2>&1 ||
    start_daemon munged munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F
  waitfor 10 munge -n || die "munged does not answer; see $LOG_DIR/munged.out"
}

start_accounting() {
  recorded_pid mariadbd >/dev/null || mariadb-admin ping >/dev/null 2>&1 ||
    start_daemon mariadbd mariadbd /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 \
      --pid-file=/run/mysqld/mysqld.pid
  waitfor 30 mariadb-admin ping || die "MariaDB does not answer; see $LOG_DIR/mariadbd.out"
  recorded_pid slurmdbd >/dev/null || sacctmgr -n list cluster >/dev/null 2>&1 ||
    start_daemon slurmdbd slurmdbd slurmdbd -D
  waitfor 60 sacctmgr -n list cluster || die "slurmdbd does not answer; see $LOG_DIR/slurmdbd.log"
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
}

ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurm() {
  local n pid
  if recorded_pid slurmctld >/dev/null || ctld_up; then
    [ "$CONF_CHANGED" = 0 ] || { log "configuration changed: scontrol reconfigure"; scontrol reconfigure; }
  else
    start_daemon slurmctld slurmctld slurmctld -D
  fi
  waitfor 30 ctld_up || die "slurmctld is not UP; see $LOG_DIR/slurmctld.log"
  for n in "${SLURM_NODES[@]}"; do
    recorded_pid "slurmd-$n" >/dev/null && continue
    pid=$(cat "$RUN_DIR/slurmd-$n.pid" 2>/dev/null || true)
    pid_runs "$pid" slurmd && continue
    start_daemon "slurmd-$n" slurmd slurmd -D -N "$n"
  done
}

# Node states that are not usable yet, one "name state" per line (empty when all nodes are idle).
nodes_not_idle() { sinfo -h -N -o '%N %T' | sort -u | grep -vE ' (idle|mixed|allocated)$' || true; }

wait_idle() {
  local i n bad=
  for ((i = 0; i < UP_TIMEOUT * 10; i++)); do
    bad=$(nodes_not_idle)
    [ -z "$bad" ] && [ "$(sinfo -h -N -o '%N' | sort -u | wc -l)" -ge "${#SLURM_NODES[@]}" ] && return 0
    # A node left drained by an earlier run (e.g. config change) is resumed once it has registered.
    if grep -qE ' (drained|draining)$' <<<"$bad" && ((i % 20 == 10)); then
      while read -r n _; do
        scontrol update nodename="$n" state=resume 2>/dev/null || true
      done < <(grep -E ' (drained|draining)$' <<<"$bad")
    fi
    sleep 0.1
  done
  sinfo -N -l >&2 || true
  die "nodes not idle after ${UP_TIMEOUT}s: $(tr '\n' ' ' <<<"$bad"); see $LOG_DIR/slurmd-*.log"
}

[ "$(id -u)" = 0 ] || die "up.sh must run as root"
install_packages
prepare_host
render slurm.conf 0644
render gres.conf 0644
render cgroup.conf 0644
render slurmdbd.conf 0600
start_munge
start_accounting
start_slurm
wait_idle
log "SLURM cluster up in $((($(date +%s%N) - T0) / 1000000)) ms"
sinfo
