#!/usr/bin/env bash
# A real single-node Slurm on this machine, for tests/slurm (root, no systemd needed).
#
#   bash scripts/slurm-local.sh start    # install if missing, configure, start; waits for idle
#   bash scripts/slurm-local.sh status   # one line; exit 0 when the node is up
#   bash scripts/slurm-local.sh stop     # cancel every job, stop the daemons by their pid files
#
# Debian's Slurm 22.05 packages, configured after ../shared/notes/slurm-local.md: one node sized
# from this machine, partitions `low` (default) and `high`; a job in `high` preempts (requeues) a
# job in `low`. No accounting daemon: use squeue / scontrol show job, not sacct. Job state is
# wiped at every start (slurmctld -c): this is a test cluster.
set -euo pipefail

STATE=${SLURM_LOCAL_STATE:-/var/lib/slurm-local}  # state, spool, logs
RUN=/run/slurm-local                              # pid files
CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)

say() { echo "slurm-local: $*" >&2; }
die() { say "$*"; exit 1; }

alive() {  # alive PIDFILE: the process named in PIDFILE runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  local missing=()
  for p in slurmctld slurmd slurm-client munge; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # a clean machine may have no package lists yet: update only when the install needs it
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && \
         apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } \
    || die "apt-get install ${missing[*]} failed"
}

write_config() {
  local cpus mem_mb gres_types="" gres_line="" gpus
  cpus=$(nproc)
  # NOTE: MemTotal, not MemAvailable: the file must not change from one start to the next
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
  gpus=$(find /dev -maxdepth 1 -name 'nvidia[0-9]*' 2>/dev/null | wc -l)
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$RUN"
  if [ "$gpus" -gt 0 ]; then
    gres_types="GresTypes=gpu"$'\n'
    gres_line=" Gres=gpu:$gpus"
    printf 'AutoDetect=off\nName=gpu File=/dev/nvidia[0-%d]\n' $((gpus - 1)) > /etc/slurm/gres.conf
  fi
  local new
  new=$(cat <<EOF
# written by batchrun scripts/slurm-local.sh; rewritten at every start
ClusterName=local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# the default (120 s) makes a requeued job wait that long before it runs again
AuthInfo=cred_expire=5
MpiDefault=none
SwitchType=switch/none
# linuxproc leaves orphans; no cgroups here
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# cores and memory are consumable: without DefMemPerCPU a job claims all memory and array
# tasks run one at a time
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
${gres_types}ReturnToService=2
JobRequeue=1
KillWait=5
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb$gres_line State=UNKNOWN
# GraceTime=0: a preempted job's batch shell gets SIGTERM at once
PartitionName=low Nodes=$HOST Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=0 MaxTime=INFINITE State=UP
PartitionName=high Nodes=$HOST PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
EOF
)
  if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$new" ]; then
    printf '%s\n' "$new" > "$CONF"
    return 0  # changed
  fi
  return 1
}

start_munge() {
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
  if ! alive /run/munge/munged.pid; then
    runuser -u munge -- /usr/sbin/munged || die "munged did not start"
  fi
  munge -n | unmunge >/dev/null 2>&1 || die "munge does not work (munge -n | unmunge)"
}

node_state() { sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -1; }

wait_idle() {
  local state="" i
  for i in $(seq 1 60); do
    state=$(node_state)
    case "$state" in
      idle|mixed|allocated) return 0 ;;
      down*|drain*) scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  die "node $HOST not idle after 30 s (state '${state:-none}'); see $STATE/slurmctld.log"
}

start() {
  install_packages
  local changed=0
  write_config && changed=1
  if [ $changed = 1 ] && { alive "$RUN/slurmctld.pid" || alive "$RUN/slurmd.pid"; }; then
    stop_daemons  # the config changed under running daemons
  fi
  start_munge
  if ! alive "$RUN/slurmctld.pid"; then
    slurmctld -c || die "slurmctld did not start; see $STATE/slurmctld.log"
  fi
  if ! alive "$RUN/slurmd.pid"; then
    slurmd || die "slurmd did not start; see $STATE/slurmd.log"
  fi
  wait_idle
  status
}

stop_pids() {  # stop_pids PIDFILE...: TERM to all at once, wait up to 10 s, then KILL
  local f pids=() pid running
  for f in "$@"; do
    alive "$f" && pids+=("$(cat "$f")")
    rm -f "$f"
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 1 100); do
    running=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
    [ $running = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null; done
  return 0
}

stop_daemons() {
  stop_pids "$RUN/slurmd.pid" "$RUN/slurmctld.pid"
}

stop() {
  if alive "$RUN/slurmctld.pid"; then
    # a test cluster: cancel what is left so no job step outlives the daemons
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 50); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  stop_pids "$RUN/slurmd.pid" "$RUN/slurmctld.pid" /run/munge/munged.pid
}

status() {
  local state
  if ! command -v sinfo >/dev/null; then say "not installed"; return 3; fi
  if ! alive "$RUN/slurmctld.pid"; then say "not running"; return 3; fi
  state=$(node_state)
  say "node $HOST ${state:-unknown}; partitions $(sinfo -h -o %P | tr '\n' ' ')"
  case "$state" in idle|mixed|allocated) return 0 ;; *) return 3 ;; esac
}

[ "$(id -u)" = 0 ] || die "run as root (installs packages, runs the daemons)"
case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
