#!/usr/bin/env bash
# Start a throwaway SLURM cluster on this machine for the SLURM backend tests (tests/elastic/controller/test_slurm.py):
# munged, one slurmctld and one slurmd per node name (lds-n1..lds-n${LDS_SLURM_NODES}, all on 127.0.0.1, each on
# its own port), in partition `lds`, configured in ${LDS_SLURM_DIR}/slurm.conf (point SLURM_CONF there to use it).
# Installs Debian's slurmctld, slurmd, slurm-client and munge with apt-get if they are missing (not with
# LDS_SLURM_INSTALL=0, as the tests' fixture runs it). Never fails the caller: if the cluster cannot be started, it
# says why and exits 0, and the SLURM tests skip printing the reason. `bash .ci/slurm.sh stop` stops the daemons.
set -u
DIR="${LDS_SLURM_DIR:-/tmp/lds-slurm}"
NODES="${LDS_SLURM_NODES:-3}"
PORT="${LDS_SLURM_PORT:-46817}"  # slurmctld; the slurmds take the next NODES ports
say() { echo "slurm.sh: $*"; }
export SLURM_CONF="$DIR/slurm.conf"

if [ "${1:-}" = stop ]; then
  for pid_file in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
    [ -f "$pid_file" ] && kill "$(cat "$pid_file")" 2>/dev/null
  done
  say "stopped"
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
  if [ "${LDS_SLURM_INSTALL:-1}" = 0 ]; then
    say "SLURM or munge is not installed (run .ci/slurm.sh to install them); the SLURM tests will skip"
    exit 0
  fi
  say "installing Debian's slurmctld, slurmd, slurm-client and munge (apt-get)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge; } >/tmp/lds-slurm-apt.log 2>&1; then
    say "apt-get install failed (see /tmp/lds-slurm-apt.log); the SLURM tests will skip"
    exit 0
  fi
fi
if [ "$(id -u)" != 0 ]; then
  say "not root: slurmd must run as root to start jobs; the SLURM tests will skip"
  exit 0
fi

if SLURM_CONF="$SLURM_CONF" timeout 10 sinfo -h -p lds -o '%D %t' 2>/dev/null | grep -q idle; then
  say "already running ($SLURM_CONF)"
  exit 0
fi

mkdir -p "$DIR/state" "$DIR/log" "/run/munge"
if [ ! -S /run/munge/munge.socket.2 ] || ! munge -n </dev/null >/dev/null 2>&1; then
  [ -s /etc/munge/munge.key ] || mungekey --create >/dev/null 2>&1 || create-munge-key >/dev/null 2>&1
  chown -R munge: /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null
  runuser -u munge -- munged >"$DIR/log/munged.out" 2>&1 \
    || { say "munged did not start (see $DIR/log/munged.out); the SLURM tests will skip"; exit 0; }
fi

LAST=$((PORT + NODES))
cat >"$SLURM_CONF" <<EOF
ClusterName=lds
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again after cred_expire seconds (default 120; 5 is the least SLURM accepts).
AuthInfo=cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/linear
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=300
SchedulerParameters=sched_interval=2
MessageTimeout=20
NodeName=lds-n[1-$NODES] NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$((PORT + 1))-$LAST CPUs=2 State=UNKNOWN
PartitionName=lds Nodes=lds-n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
EOF

slurmctld -f "$SLURM_CONF" -c >"$DIR/log/slurmctld.out" 2>&1 \
  || { say "slurmctld did not start (see $DIR/log/slurmctld.out, $DIR/log/slurmctld.log); the SLURM tests will skip"; exit 0; }
for i in $(seq 1 "$NODES"); do
  mkdir -p "$DIR/spool-lds-n$i"
  slurmd -f "$SLURM_CONF" -N "lds-n$i" >"$DIR/log/slurmd-lds-n$i.out" 2>&1 \
    || { say "slurmd lds-n$i did not start (see $DIR/log/slurmd-lds-n$i.out); the SLURM tests will skip"; exit 0; }
done
for _ in $(seq 1 30); do
  if [ "$(sinfo -h -p lds -t idle -o '%D' 2>/dev/null)" = "$NODES" ]; then
    say "started: $NODES nodes idle in partition lds (SLURM_CONF=$SLURM_CONF)"
    exit 0
  fi
  sleep 1
done
say "the nodes did not become idle (sinfo: $(sinfo -h -N -o '%N %t' 2>&1 | tr '\n' ' ')); see $DIR/log; the SLURM tests will skip"
exit 0
