#!/usr/bin/env bash
# local_cluster.sh - a real two-node SLURM cluster (nodes n1 and n2, partition "debug") on this one
# machine, so syncrl's SLURM job scripts and the `slurm` tests run against genuine slurmctld/slurmd
# daemons instead of mocks. Debian 12 (slurm-wlm 22.05), run as root, no systemd needed.
#
# Usage:
#   bash slurm/local_cluster.sh start    # install slurm+munge if missing, start everything, wait for idle nodes
#   bash slurm/local_cluster.sh status   # daemons + sinfo; exit 0 when the cluster is usable, 1 when not
#   bash slurm/local_cluster.sh stop     # cancel all jobs, stop what `start` started, restore /etc/slurm
#   bash slurm/local_cluster.sh fail-node n2     # fault injection: n2's slurmd and all its processes die
#   bash slurm/local_cluster.sh revive-node n2   # start n2's slurmd again; it rejoins the cluster
# then use the ordinary client commands (sinfo, srun, sbatch, scancel, scontrol): /etc/slurm/slurm.conf
# is a symlink to the generated config while the cluster is up, so no extra environment is needed.
#
# Environment:
#   SYNCRL_SLURM_DIR            state directory (default /var/tmp/syncrl-slurm): slurm.conf, log/,
#                               pids/ (what this script started), spool/, ctld-state/
#   SYNCRL_SLURM_START_TIMEOUT  seconds `start` waits for both nodes to be idle (default 30)
#
# Exit codes: 0 ok; 1 failure (see the message and the logs in $SYNCRL_SLURM_DIR/log);
#   2 usage; 3 this machine cannot host the cluster (not root, no apt-get/util-linux, or the packages
#   could not be installed) - tests treat 3 as "skip", anything else as a bug.
#
# How it works: both slurmd run on this host with `slurmd -N nX`, each in its own UTS namespace
# (`unshare --uts`) whose hostname is nX, listening on its own port and address (127.0.10.1/.2 via
# /etc/hosts). Every node advertises all CPUs and memory of the machine, so the host is
# oversubscribed 2x when both nodes are busy.
set -euo pipefail

STATE=${SYNCRL_SLURM_DIR:-/var/tmp/syncrl-slurm}
START_TIMEOUT=${SYNCRL_SLURM_START_TIMEOUT:-30}
CONF=$STATE/slurm.conf
PIDS=$STATE/pids
LOGS=$STATE/log
ETC_CONF=/etc/slurm/slurm.conf
ETC_BACKUP=/etc/slurm/slurm.conf.syncrl-backup
NODES=(n1 n2)
declare -A NODE_ADDR=([n1]=127.0.10.1 [n2]=127.0.10.2)
# 6819 is slurmdbd's default port: keep clear of it in case accounting is added later.
declare -A NODE_PORT=([n1]=6821 [n2]=6822)
PARTITION=debug
PACKAGES=(slurmctld slurmd slurm-client munge)
EXIT_UNAVAILABLE=3

# The script's own client calls must reach this cluster even if the caller's SLURM_CONF points elsewhere.
export SLURM_CONF=$CONF

log() { printf '[local_cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
unavailable() { log "UNAVAILABLE: $*"; exit "$EXIT_UNAVAILABLE"; }

# ---------------------------------------------------------------- process helpers

# PID 1 here reaps orphans slowly, so a zombie counts as gone.
pid_live() {
    local st
    st=$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

# Start time in clock ticks: together with the PID it identifies a process, so a recycled PID
# is never mistaken for a daemon we started.
pid_start() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}'; }

# record NAME PID [EXTRA]
record() { echo "$2 $(pid_start "$2") ${3:-}" >"$PIDS/$1"; }

# Echo the recorded PID of NAME if that very process is still alive.
recorded_pid() {
    local f=$PIDS/$1 pid="" start="" extra=""
    [[ -r $f ]] || return 1
    read -r pid start extra <"$f" || true
    [[ -n $pid ]] && pid_live "$pid" && [[ "$(pid_start "$pid")" == "$start" ]] || return 1
    echo "$pid"
}

recorded_extra() {
    local f=$PIDS/$1 pid="" start="" extra=""
    [[ -r $f ]] || return 1
    read -r pid start extra <"$f" || true
    echo "$extra"
}

# wait_gone SECONDS PID...: true once none of the PIDs is alive.
wait_gone() {
    local secs=$1 i p any
    shift
    for ((i = 0; i <= secs * 10; i++)); do
        any=0
        for p in "$@"; do pid_live "$p" && { any=1; break; }; done
        ((any)) || return 0
        sleep 0.1
    done
    return 1
}

# terminate GRACE PID...: SIGTERM, then SIGKILL after GRACE seconds; bounded either way.
terminate() {
    local grace=$1 p
    shift
    (($#)) || return 0
    kill -TERM "$@" 2>/dev/null || true
    wait_gone "$grace" "$@" && return 0
    kill -KILL "$@" 2>/dev/null || true
    wait_gone 5 "$@" && return 0
    for p in "$@"; do pid_live "$p" && log "WARNING: pid $p survived SIGKILL"; done
    return 1
}

# Processes living in a node's UTS namespace: slurmstepd and job tasks survive a killed slurmd,
# so stopping a node means ending these too. The hostname check guards against a namespace
# inode that was freed and reused by something unrelated.
uts_members() {
    local ns=$1 node=$2 d p
    for d in /proc/[0-9]*; do
        p=${d#/proc/}
        [[ $p != "$$" && "$(readlink "$d/ns/uts" 2>/dev/null)" == "$ns" ]] || continue
        pid_live "$p" || continue
        [[ "$(nsenter -t "$p" -u hostname 2>/dev/null)" == "$node" ]] || continue
        echo "$p"
    done
}

# Run a command detached: own session, stdin from /dev/null, stdout/stderr to a fresh OUT file
# (a caller capturing our output, such as pytest, would otherwise wait for the daemon to exit).
# Sets LAUNCHED to the PID, which becomes the daemon itself because every wrapper in the chain execs.
launch() {
    local out=$1
    shift
    setsid "$@" </dev/null >"$out" 2>&1 &
    LAUNCHED=$!
}

# Wait until PID has exec'd into COMM (setsid/unshare/sh exec in turn); fail if it died first.
await_exec() {
    local pid=$1 comm=$2 out=$3 i
    for ((i = 0; i < 100; i++)); do
        [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]] && return 0
        pid_live "$pid" || break
        sleep 0.05
    done
    if pid_live "$pid"; then log "$comm did not start within 5 s; last lines of $out:"
    else log "$comm exited during startup; last lines of $out:"; fi
    tail -n 20 "$out" >&2 || true
    return 1
}

# ---------------------------------------------------------------- slurm state helpers

ctld_up() { timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; }

# "n1 idle" lines for our nodes (compact state: a trailing * means not responding).
node_states() { timeout 10 sinfo -h -N -n "$(IFS=,; echo "${NODES[*]}")" -o '%N %t' 2>/dev/null | sort -u; }

# all_nodes_in REGEX: every node's compact state matches REGEX.
all_nodes_in() {
    local states n
    states=$(node_states) || return 1
    for n in "${NODES[@]}"; do
        grep -Eq "^$n ($1)\$" <<<"$states" || return 1
    done
}

cluster_usable() { ctld_up && all_nodes_in 'idle|mix|alloc|comp'; }

# ---------------------------------------------------------------- start

ensure_packages() {
    local missing=0 tool
    for tool in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sinfo /usr/sbin/munged /usr/bin/munge; do
        [[ -x $tool ]] || missing=1
    done
    ((missing)) || return 0
    command -v apt-get >/dev/null || unavailable "slurm/munge not installed and apt-get not found"
    log "installing ${PACKAGES[*]} with apt-get (output: $LOGS/apt.log)"
    # Package scripts must not start daemons with the distribution's default config (they would
    # fight ours for the ports, and a munged started here would look "pre-existing" to stop).
    local own_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    local rc=0
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -q &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
    } >>"$LOGS/apt.log" 2>&1 || rc=$?
    ((own_policy)) && rm -f /usr/sbin/policy-rc.d
    if ((rc)); then
        tail -n 15 "$LOGS/apt.log" >&2 || true
        unavailable "apt-get could not install ${PACKAGES[*]} (rc=$rc; see $LOGS/apt.log)"
    fi
}

munge_works() { timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; }

setup_munge() {
    if recorded_pid munged >/dev/null && munge_works; then
        return 0
    fi
    if munge_works; then
        # Someone else runs munge: use it and never stop it.
        [[ -e $STATE/munge.before ]] || echo running >"$STATE/munge.before"
        return 0
    fi
    echo stopped >"$STATE/munge.before"
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --force --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    # /run is a tmpfs that nothing here recreates (no systemd-tmpfiles).
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 755 /run/munge
    # --force: a munged killed earlier leaves a socket/lock behind that would block a restart.
    runuser -u munge -- /usr/sbin/munged --force </dev/null >>"$LOGS/munged.out" 2>&1 ||
        die "munged failed to start (see $LOGS/munged.out and /var/log/munge/munged.log)"
    local i pid=""
    for ((i = 0; i < 100; i++)); do
        pid=$(cat /run/munge/munged.pid 2>/dev/null || true)
        [[ -n $pid ]] && pid_live "$pid" && munge_works && break
        pid=""
        sleep 0.1
    done
    [[ -n $pid ]] || die "munged started but does not answer (see /var/log/munge/munged.log)"
    record munged "$pid"
}

setup_hosts() {
    local n
    for n in "${NODES[@]}"; do
        if ! grep -Eq "^[^#]*[[:space:]]$n([[:space:]]|\$)" /etc/hosts; then
            echo "${NODE_ADDR[$n]} $n  # syncrl slurm/local_cluster.sh" >>/etc/hosts
        elif [[ "$(getent hosts "$n" | awk '{print $1; exit}')" != "${NODE_ADDR[$n]}" ]]; then
            log "WARNING: /etc/hosts already maps $n to $(getent hosts "$n" | awk '{print $1; exit}'), not ${NODE_ADDR[$n]}"
        fi
    done
}

write_conf() {
    local cpus mem_mb n
    cpus=$(nproc)
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    mkdir -p "$STATE/ctld-state" "$STATE/run"
    for n in "${NODES[@]}"; do mkdir -p "$STATE/spool/$n"; done
    cat >"$CONF" <<EOF
# Generated by slurm/local_cluster.sh - regenerated on every start; edit the script, not this file.
ClusterName=syncrl
# Must be \`hostname -s\`, or slurmctld refuses to run as the primary controller.
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Default 120 s: a requeued job would wait ~2 min for the old credential to expire before restarting.
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld-state
# %n: both slurmd share this host and would otherwise clobber each other's spool and pid file.
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: two slurmd on one host (and containers without a writable cgroup fs) cannot share them.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Schedule immediately instead of the default tens of seconds, so tests and requeues are quick.
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
# Trust the node lines below, not what slurmd detects: both nodes are the same machine.
SlurmdParameters=config_overrides
# A node that was DOWN (e.g. its slurmd restarted) rejoins as soon as it registers.
ReturnToService=2
JobRequeue=1
# Seconds between SIGTERM and SIGKILL on cancel/timeout: short keeps scancel and stop fast.
KillWait=5
# Finished jobs stay visible to scontrol for this long (there is no accounting database).
MinJobAge=300
InactiveLimit=0
# A node whose slurmd stops answering is declared DOWN after this long (default 300 s); its jobs end
# with NODE_FAIL and requeue. Short here so node-loss tests finish in a minute.
SlurmdTimeout=30
NodeName=n1 NodeHostname=n1 NodeAddr=${NODE_ADDR[n1]} Port=${NODE_PORT[n1]} CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=${NODE_ADDR[n2]} Port=${NODE_PORT[n2]} CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
    # Some code paths read cgroup.conf next to slurm.conf; an explicit file keeps them quiet and off cgroups.
    cat >"$STATE/cgroup.conf" <<EOF
# Generated by slurm/local_cluster.sh: cgroups are not used (see ProctrackType/TaskPlugin in slurm.conf).
CgroupPlugin=autodetect
IgnoreSystemd=yes
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
}

# Client commands read /etc/slurm/slurm.conf; point it at our config, keeping any real one aside.
link_conf() {
    mkdir -p /etc/slurm
    if [[ -L $ETC_CONF && "$(readlink "$ETC_CONF")" == "$CONF" ]]; then
        return 0
    fi
    if [[ -e $ETC_CONF || -L $ETC_CONF ]]; then
        [[ -e $ETC_BACKUP || -L $ETC_BACKUP ]] &&
            die "$ETC_CONF exists and so does $ETC_BACKUP; move one of them away and retry"
        mv "$ETC_CONF" "$ETC_BACKUP"
        echo "$ETC_BACKUP" >"$STATE/etc-conf.backup"
        log "moved the existing $ETC_CONF to $ETC_BACKUP (restored by stop)"
    fi
    ln -s "$CONF" "$ETC_CONF"
}

restore_conf() {
    if [[ -L $ETC_CONF && "$(readlink "$ETC_CONF")" == "$CONF" ]]; then
        rm -f "$ETC_CONF"
    fi
    if [[ -r $STATE/etc-conf.backup ]]; then
        local b
        b=$(cat "$STATE/etc-conf.backup")
        if [[ ! -e $ETC_CONF && ! -L $ETC_CONF && ( -e $b || -L $b ) ]]; then
            mv "$b" "$ETC_CONF"
            log "restored the original $ETC_CONF"
        fi
        rm -f "$STATE/etc-conf.backup"
    fi
}

ours_running() { recorded_pid slurmctld >/dev/null || recorded_pid slurmd-n1 >/dev/null || recorded_pid slurmd-n2 >/dev/null; }
ours_complete() { recorded_pid slurmctld >/dev/null && recorded_pid slurmd-n1 >/dev/null && recorded_pid slurmd-n2 >/dev/null; }

cmd_start() {
    [[ $(id -u) -eq 0 ]] || unavailable "must run as root (writes /etc/hosts, /etc/slurm, starts daemons)"
    [[ $STATE != *[[:space:]]* ]] || die "SYNCRL_SLURM_DIR must not contain whitespace (slurm.conf cannot quote it)"
    local tool
    for tool in unshare nsenter setsid runuser timeout; do
        command -v "$tool" >/dev/null || unavailable "$tool not found (util-linux/coreutils)"
    done
    mkdir -p "$STATE" "$PIDS" "$LOGS"

    if ours_complete && command -v sinfo >/dev/null && cluster_usable; then
        link_conf
        log "already running (state dir $STATE)"
        node_states >&2 || true
        return 0
    fi
    if ours_running; then
        log "partially running: stopping the leftovers before a clean start"
        cmd_stop
    elif command -v sinfo >/dev/null && ! [[ -e $PIDS/slurmctld ]] && cluster_usable; then
        # e.g. started with another SYNCRL_SLURM_DIR: don't start a second controller on the same ports.
        log "a cluster with nodes ${NODES[*]} is already up, not started from $STATE; leaving it alone"
        return 0
    fi

    local t0
    t0=$(date +%s%N)
    ensure_packages
    # From here on, anything that fails must not leave half a cluster behind.
    trap 'rc=$?; if ((rc)); then log "start failed: stopping what was started (logs in $LOGS)"; cmd_stop || true; fi' EXIT
    setup_munge
    setup_hosts
    write_conf
    link_conf
    # Fresh spools: steps of a previous run are dead, their stale sockets would only confuse slurmd.
    local n
    for n in "${NODES[@]}"; do rm -rf "${STATE:?}/spool/$n" && mkdir -p "$STATE/spool/$n"; done

    # -c: start from clean controller state (no jobs resurrected from a previous run).
    launch "$LOGS/slurmctld.out" /usr/sbin/slurmctld -D -c -f "$CONF"
    await_exec "$LAUNCHED" slurmctld "$LOGS/slurmctld.out"
    record slurmctld "$LAUNCHED"

    local deadline=$((SECONDS + START_TIMEOUT))
    until ctld_up; do
        pid_live "$LAUNCHED" || die "slurmctld exited; see $LOGS/slurmctld.log"
        ((SECONDS < deadline)) || die "slurmctld not answering after ${START_TIMEOUT}s; see $LOGS/slurmctld.log"
        sleep 0.2
    done

    for n in "${NODES[@]}"; do
        launch "$LOGS/slurmd-$n.out" unshare --uts sh -c 'hostname "$1" && exec /usr/sbin/slurmd -D -N "$1" -f "$2"' sh "$n" "$CONF"
        await_exec "$LAUNCHED" slurmd "$LOGS/slurmd-$n.out"
        record "slurmd-$n" "$LAUNCHED" "$(readlink "/proc/$LAUNCHED/ns/uts")"
    done

    until all_nodes_in idle; do
        for n in "${NODES[@]}"; do
            recorded_pid "slurmd-$n" >/dev/null || die "slurmd for $n exited; see $LOGS/slurmd-$n.log and $LOGS/slurmd-$n.out"
        done
        if ((SECONDS >= deadline)); then
            node_states >&2 || true
            die "nodes ${NODES[*]} not idle after ${START_TIMEOUT}s; see $LOGS/slurmctld.log and $LOGS/slurmd-n*.log"
        fi
        sleep 0.1
    done
    trap - EXIT
    log "cluster up in $(awk -v ns=$(($(date +%s%N) - t0)) 'BEGIN {printf "%.1f", ns / 1e9}')s: nodes ${NODES[*]}, partition $PARTITION (state dir $STATE)"
    timeout 10 sinfo >&2 || true
}

# ---------------------------------------------------------------- stop

# True while a node's namespace still holds anything besides its slurmd (steps, tasks).
node_work_left() {
    local n ns pid members
    for n in "${NODES[@]}"; do
        ns=$(recorded_extra "slurmd-$n" 2>/dev/null || true)
        [[ -n $ns ]] || continue
        pid=$(recorded_pid "slurmd-$n" 2>/dev/null || true)
        members=$(uts_members "$ns" "$n" | grep -vx "${pid:-none}" || true)
        [[ -n $members ]] && return 0
    done
    return 1
}

cancel_all_jobs() {
    ctld_up || return 0
    local jobs
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ') || true
    [[ -n ${jobs// /} ]] || return 0
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086  # word splitting wanted: one job id per word
    timeout 15 scancel $jobs 2>/dev/null || true
    # Let slurmd end the tasks itself (SIGTERM, KillWait, SIGKILL) before we kill it. Cancels go
    # through slurmd, so with a node's slurmd dead nothing would happen: go straight to the sweep.
    local n deadline=$((SECONDS + 15))
    while ((SECONDS < deadline)); do
        for n in "${NODES[@]}"; do
            recorded_pid "slurmd-$n" >/dev/null || return 0
        done
        [[ -z "$(timeout 10 squeue -h -o %A 2>/dev/null)" ]] && return 0
        node_work_left || return 0
        sleep 0.2
    done
    log "WARNING: job processes still running after 15 s; ending them with the nodes"
}

cmd_stop() {
    mkdir -p "$PIDS"
    cancel_all_jobs

    local n pid ns members="" daemons=()
    for n in "${NODES[@]}"; do
        if pid=$(recorded_pid "slurmd-$n"); then
            log "stopping slurmd $n (pid $pid)"
            daemons+=("$pid")
        fi
    done
    terminate 10 "${daemons[@]}" || true
    for n in "${NODES[@]}"; do
        ns=$(recorded_extra "slurmd-$n" 2>/dev/null || true)
        if [[ -n $ns ]]; then members+=" $(uts_members "$ns" "$n" | tr '\n' ' ')"; fi
    done
    if [[ -n ${members// /} ]]; then
        # Jobs were cancelled already: whatever is left gets no long grace period.
        log "ending leftover processes of the nodes: $members"
        # shellcheck disable=SC2086  # word splitting wanted: one pid per word
        terminate 2 $members || true
    fi
    for n in "${NODES[@]}"; do rm -f "$PIDS/slurmd-$n"; done

    if pid=$(recorded_pid slurmctld); then
        log "stopping slurmctld (pid $pid)"
        terminate 10 "$pid" || true
    fi
    rm -f "$PIDS/slurmctld"

    if pid=$(recorded_pid munged); then
        log "stopping munged (pid $pid; it was not running before start)"
        terminate 10 "$pid" || true
    elif [[ "$(cat "$STATE/munge.before" 2>/dev/null)" == running ]]; then
        log "leaving munged running (it was running before start)"
    fi
    rm -f "$PIDS/munged" "$STATE/munge.before"

    restore_conf
    log "stopped"
}

# ---------------------------------------------------------------- node loss (fault injection)

# What losing a machine looks like to SLURM and to the job: the node's slurmd and every process in
# its namespace (slurmstepd, the job's tasks) vanish at once, with no chance to clean up.
cmd_fail_node() {
    local n=${1:-} pid ns members
    [[ " ${NODES[*]} " == *" $n "* ]] || die "fail-node needs a node name: ${NODES[*]}"
    pid=$(recorded_pid "slurmd-$n") || die "slurmd $n is not running"
    ns=$(recorded_extra "slurmd-$n")
    members=$(uts_members "$ns" "$n" | tr '\n' ' ')
    log "node $n lost: SIGKILL to slurmd (pid $pid) and its processes: $members"
    # shellcheck disable=SC2086  # word splitting wanted: one pid per word
    kill -KILL $members 2>/dev/null || true
    wait_gone 10 $members || true
    rm -f "$PIDS/slurmd-$n"
}

# Bring a failed node back: a fresh slurmd in a fresh namespace; ReturnToService=2 lets it rejoin.
cmd_revive_node() {
    local n=${1:-} deadline
    [[ " ${NODES[*]} " == *" $n "* ]] || die "revive-node needs a node name: ${NODES[*]}"
    recorded_pid "slurmd-$n" >/dev/null && { log "slurmd $n already running"; return 0; }
    launch "$LOGS/slurmd-$n.out" unshare --uts sh -c 'hostname "$1" && exec /usr/sbin/slurmd -D -N "$1" -f "$2"' sh "$n" "$CONF"
    await_exec "$LAUNCHED" slurmd "$LOGS/slurmd-$n.out"
    record "slurmd-$n" "$LAUNCHED" "$(readlink "/proc/$LAUNCHED/ns/uts")"
    deadline=$((SECONDS + START_TIMEOUT))
    until timeout 10 sinfo -h -N -n "$n" -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc|comp)$'; do
        ((SECONDS < deadline)) || die "node $n not back after ${START_TIMEOUT}s; see $LOGS/slurmd-$n.log"
        sleep 0.2
    done
    log "node $n is back"
}

# ---------------------------------------------------------------- status

cmd_status() {
    local ok=0 pid n
    printf 'state dir: %s\n' "$STATE"
    if munge_works; then
        if pid=$(recorded_pid munged); then echo "munged:    up (pid $pid, started by this script)"
        else echo "munged:    up (not started by this script)"; fi
    else
        echo "munged:    DOWN"; ok=1
    fi
    if pid=$(recorded_pid slurmctld); then echo "slurmctld: up (pid $pid)"; else echo "slurmctld: DOWN"; ok=1; fi
    for n in "${NODES[@]}"; do
        if pid=$(recorded_pid "slurmd-$n"); then echo "slurmd $n: up (pid $pid)"; else echo "slurmd $n: DOWN"; ok=1; fi
    done
    if [[ -L $ETC_CONF && "$(readlink "$ETC_CONF")" == "$CONF" ]]; then
        echo "client config: $ETC_CONF -> $CONF"
    else
        echo "client config: $ETC_CONF does NOT point at $CONF"; ok=1
    fi
    if command -v sinfo >/dev/null; then
        echo "--- sinfo"
        timeout 10 sinfo 2>&1 || true
        cluster_usable || ok=1
    else
        echo "sinfo: not installed"; ok=1
    fi
    if ((ok)); then echo "cluster: NOT usable"; else echo "cluster: usable"; fi
    return "$ok"
}

case "${1:-}" in
start) cmd_start ;;
stop) [[ $(id -u) -eq 0 ]] || die "must run as root"; cmd_stop ;;
status) cmd_status ;;
fail-node) cmd_fail_node "${2:-}" ;;
revive-node) cmd_revive_node "${2:-}" ;;
*)
    echo "usage: $0 start|stop|status|fail-node NODE|revive-node NODE   (see the header of this script)" >&2
    exit 2
    ;;
esac
