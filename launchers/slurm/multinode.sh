#!/usr/bin/env bash
# A multi-node SLURM cluster on this one machine: `multinode.sh up|down|status N`, reached
# through `up.sh --nodes N`, `down.sh --nodes N` and `status.sh --nodes N` (N >= 2).
#
# Each compute node is a network namespace with its own hostname (node1, node2, ...) and an
# eth0 on a private bridge (10.77.0.0/24 by default) that exists only inside this machine: no
# default route in the namespaces, no forwarding on the host. The controller (slurmctld,
# slurmdbd with its own MariaDB, its own munged) stays in the host's network on the bridge's
# address. Ports, configs and the state folder are its own, so it runs beside the one-node
# cluster of up.sh. Names resolve through a private hosts file bind-mounted over /etc/hosts in
# each daemon's own mount namespace; the machine's /etc/hosts is never touched.
# See README.md in this folder.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
. "$HERE/common.sh"

ACTION="${1:-}"; NODES="${2:-}"
case "$ACTION" in up|down|status) ;; *) die "usage: multinode.sh up|down|status N" ;; esac
case "$NODES" in [2-9]) ;; *) die "--nodes $NODES: allowed: 1 (the one-node cluster) or 2 to 9" ;; esac

D="${PPSPLIT_SLURM_NODES_DIR:-/tmp/ppsplit-slurm-nodes}"
ETC="$D/etc"; PIDS="$D/pids"; LOGS="$D/log"; RUN="$D/run"
export SLURM_CONF="$ETC/slurm.conf"
CLUSTER="${PPSPLIT_SLURM_NODES_CLUSTER:-ppsplitnodes}"
PARTITION="${PPSPLIT_SLURM_NODES_PARTITION:-nodes}"
NET="${PPSPLIT_SLURM_NODES_NET:-10.77.0}"     # the bridge is $NET.1, node K is $NET.1K
CTL=ppsplit-ctl                               # the controller's name (resolves to $NET.1)
BRIDGE=ppsplit-br0
CTLD_PORT=6827 SLURMD_PORT=6828 DBD_PORT=6829 DB_PORT=3317
MUNGE_DIR="$D/munge"; MUNGE_SOCK="$MUNGE_DIR/munge.socket"
DB_SOCK="$D/mysqld/mysqld.sock"
HOSTS="$ETC/hosts"
CPUS="${PPSPLIT_SLURM_CPUS:-8}"               # CPUs each node advertises (see up.sh)
TIMEOUT="${PPSPLIT_SLURM_TIMEOUT:-120}"

NODE_NAMES=$(seq -f 'node%g' 1 "$NODES")
netns() { echo "ppsplit-$1"; }                # node1 -> its namespace
veth() { echo "ppsplit-v${1#node}"; }         # node1 -> the host end of its link
node_addr() { echo "$NET.1${1#node}"; }
DAEMONS="mariadb munged slurmdbd slurmctld $(for n in $NODE_NAMES; do printf 'slurmd-%s ' "$n"; done)"

T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 ))s"; }
wait_for() {  # what cmd...
    local what="$1"; shift
    local end=$(( $(date +%s) + TIMEOUT ))
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$end" ] || die "timed out after ${TIMEOUT}s waiting for $what (logs: $LOGS)"
        sleep 0.3
    done
}
in_ns() { [ -e "/run/netns/$(netns "$1")" ]; }

# ---------------------------------------------------------------- status
node_states() { timeout 10 sinfo -h -N -p "$PARTITION" -o '%N %T' 2>/dev/null; }
nodes_ok() {
    local states; states=$(node_states) || return 1
    [ "$(grep -cE ' (idle|mixed|allocated|completing)$' <<<"$states")" = "$NODES" ]
}
all_up() {
    local d
    for d in $DAEMONS; do daemon_pid "$d" >/dev/null || return 1; done
    timeout 10 scontrol ping 2>/dev/null | grep 'is UP' >/dev/null
}

status() {
    local up=1 d pid
    for d in $DAEMONS; do
        if pid=$(daemon_pid "$d"); then printf '  %-14s running (pid %s)\n' "$d" "$pid"
        else printf '  %-14s not running\n' "$d"; up=0; fi
    done
    if [ "$up" = 1 ] && node_states >/dev/null; then
        node_states | sed 's/^/  /'
        if nodes_ok; then
            say "UP: $NODES nodes in partition $PARTITION (cluster $CLUSTER); clients need SLURM_CONF=$SLURM_CONF"
            exit 0
        fi
        say "daemons running but not every node is idle (run up.sh --nodes $NODES to resume them)"; exit 1
    fi
    say "DOWN ($NODES-node cluster, state folder $D)"; exit 1
}

# ---------------------------------------------------------------- down
# Every process left in a node's namespace was started by that node's slurmd (job steps and
# the job's own processes): end them before the namespace goes.
end_node_processes() {
    local ns="$1" pids
    [ -e "/run/netns/$ns" ] || return 0
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [ -n "${pids// }" ] || return 0
    say "ending what is left in $ns: $pids"
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    local end=$(( $(date +%s) + 5 ))
    while [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 0.2; done
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    # shellcheck disable=SC2086
    [ -z "${pids// }" ] || kill -KILL $pids 2>/dev/null || true
}

down() {
    local stopped=0 d n
    cancel_jobs "$PARTITION"
    for d in $(echo "$DAEMONS" | tr ' ' '\n' | tac); do
        [ -n "$d" ] || continue
        stop_daemon "$d" && stopped=$((stopped + 1))
    done
    # The namespaces, their links and the bridge; ip netns leaves a bind mount on /run/netns.
    for n in $(seq -f 'node%g' 1 9); do
        if in_ns "$n"; then
            end_node_processes "$(netns "$n")"
            ip netns del "$(netns "$n")" 2>/dev/null || true
        fi
        ip link show "$(veth "$n")" >/dev/null 2>&1 && ip link del "$(veth "$n")" 2>/dev/null || true
    done
    ip link show "$BRIDGE" >/dev/null 2>&1 && { ip link del "$BRIDGE"; say "removed bridge $BRIDGE and the node namespaces"; }
    if [ -d /run/netns ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ] && mountpoint -q /run/netns; then
        umount /run/netns 2>/dev/null || true
    fi
    rm -f "$D/nodes"
    if [ "${PPSPLIT_SLURM_WIPE:-0}" = 1 ]; then say "removing state folder $D"; rm -rf "$D"; fi
    if [ "$stopped" = 0 ]; then say "nothing was running"; else say "stopped $stopped daemon(s)"; fi
}

# ---------------------------------------------------------------- up
start() {  # name cmd...: in its own session, PID recorded; the PID must become the daemon's
    local name="$1"; shift
    if daemon_pid "$name" >/dev/null; then return 0; fi
    setsid "$@" </dev/null >>"$LOGS/$name.out" 2>&1 &
    echo "$!" >"$PIDS/$name.pid"
    local end=$(( $(date +%s) + 5 ))
    until daemon_pid "$name" >/dev/null; do  # nsenter/unshare/sh exec into the daemon
        if ! kill -0 "$(cat "$PIDS/$name.pid")" 2>/dev/null || [ "$(date +%s)" -ge "$end" ]; then
            die "$name did not start (see $LOGS/$name.out and $LOGS/$name.log)"
        fi
        sleep 0.1
    done
    say "started $name (pid $(daemon_pid "$name"))"
}

port_free_or_ours() {  # daemon port
    daemon_pid "$1" >/dev/null && return 0
    if ss -Hltn "sport = :$2" 2>/dev/null | grep . >/dev/null; then
        die "port $2 is in use by a process this script did not start ($(ss -Hltnp "sport = :$2" | sed -n 1p))"
    fi
}

# A daemon of the controller side: host network, but its own hostname ($CTL) and hosts file,
# so that the name in slurm.conf resolves to the bridge address and the daemon binds there.
start_controller() {  # name command
    start "$1" unshare --uts --mount sh -c "mount --bind '$HOSTS' /etc/hosts && hostname $CTL && exec $2"
}

network_up() {
    local n ns addr
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        local routes; routes=$(ip -4 route show)  # (grep -q in a pipe under pipefail can fail on SIGPIPE)
        if grep -q "^$NET\.0/24" <<<"$routes"; then
            die "$NET.0/24 is already routed on this machine; set PPSPLIT_SLURM_NODES_NET to a free 10.x.y"
        fi
        ip link add "$BRIDGE" type bridge
        ip addr add "$NET.1/24" dev "$BRIDGE"
        ip link set "$BRIDGE" up
    fi
    for n in $NODE_NAMES; do
        ns=$(netns "$n"); addr=$(node_addr "$n")
        in_ns "$n" || ip netns add "$ns"
        if ! ip link show "$(veth "$n")" >/dev/null 2>&1; then
            ip link add "$(veth "$n")" type veth peer name eth0 netns "$ns"
            ip link set "$(veth "$n")" master "$BRIDGE" up
        fi
        ip -n "$ns" link set lo up
        local have; have=$(ip -n "$ns" addr show dev eth0)
        grep -q "inet $addr/" <<<"$have" || ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

write_if_changed() {  # file mode < content
    local f="$1" mode="$2" tmp; tmp=$(mktemp "$f.XXXXXX")
    cat >"$tmp"; chmod "$mode" "$tmp"
    if [ -f "$f" ] && cmp -s "$tmp" "$f"; then rm -f "$tmp"; else mv -f "$tmp" "$f"; fi
}

write_configs() {
    local n line mem real_cpus cpus
    {
        echo "127.0.0.1 localhost"
        echo "$NET.1 $CTL"
        for n in $NODE_NAMES; do echo "$(node_addr "$n") $n"; done
    } | write_if_changed "$HOSTS" 644
    # The nodes share the machine: each gets the real memory split between them.
    line=$(slurmd -C 2>/dev/null | sed -n 1p)
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$line")
    real_cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$line")
    cpus=$CPUS; [ "$cpus" -ge "$real_cpus" ] || cpus=$real_cpus
    [ -f "$ETC/dbpass" ] || { head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$ETC/dbpass"; chmod 600 "$ETC/dbpass"; }
    write_if_changed "$SLURM_CONF" 644 <<EOF
# Written by ppsplit launchers/slurm/multinode.sh -- regenerated on every start.
ClusterName=$CLUSTER
SlurmctldHost=$CTL($NET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
# slurmctld binds to what $CTL resolves to in its own hosts file: the bridge address.
CommunicationParameters=NoCtldInAddrAny
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# LLN: each job goes to the least loaded node, so concurrent jobs spread over the nodes.
SelectTypeParameters=CR_Core,CR_LLN
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
FirstJobId=$(cat "$D/first_job_id")
StateSaveLocation=$D/state/ctld
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=300
# A preempted job is signalled first (SIGUSR2, submitit's), as a job near its time limit is.
SlurmctldParameters=preempt_send_user_signal
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$NET.1
AccountingStoragePort=$DBD_PORT
# The accounting clients take munge's socket from here, not from AuthInfo.
AccountingStoragePass=$MUNGE_SOCK
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
NodeName=node[1-$NODES] NodeAddr=$NET.1[1-$NODES] CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$(( mem * 9 / 10 / NODES )) State=UNKNOWN
PartitionName=$PARTITION Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOF
    write_if_changed "$ETC/slurmdbd.conf" 600 <<EOF
# Written by ppsplit launchers/slurm/multinode.sh -- regenerated on every start.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$CTL
DbdPort=$DBD_PORT
CommunicationParameters=NoInAddrAny
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$ETC/dbpass")
StorageLoc=ppsplit_nodes_acct
EOF
}

db() { mariadb --no-defaults --socket="$DB_SOCK" "$@"; }

up() {
    local n st end
    if [ -f "$D/nodes" ] && [ "$(cat "$D/nodes")" != "$NODES" ] && any_running; then
        die "a $(cat "$D/nodes")-node cluster is up; stop it first (down.sh --nodes $(cat "$D/nodes"))"
    fi
    if all_up && nodes_ok; then
        say "already up ($NODES nodes in partition $PARTITION); nothing to do"; exit 0
    fi
    if ! any_running; then
        if [ "${PPSPLIT_SLURM_FRESH:-0}" = 1 ] || [ ! -d "$D/mysql/mysql" ] || [ ! -f "$D/first_job_id" ] \
                || [ ! -d "$D/state/ctld" ]; then
            rm -rf "$D/mysql" "$D/state" "$D/spool" "$RUN" "$PIDS" "$D/first_job_id"
        fi
    fi
    mkdir -p "$ETC" "$PIDS" "$LOGS" "$RUN" "$D/state/ctld" "$D/mysqld" "$MUNGE_DIR"
    for n in $NODE_NAMES; do mkdir -p "$D/spool/$n"; done
    chmod 755 "$D"
    echo "$NODES" >"$D/nodes"
    [ -f "$D/first_job_id" ] || echo $(( ($(date +%s) % 15000000) + 50001000 )) >"$D/first_job_id"
    network_up
    write_configs

    # MariaDB on its own socket and a loopback port (Debian's client config points the
    # default socket at the one-node cluster's server).
    if ! daemon_pid mariadb >/dev/null; then
        port_free_or_ours mariadb "$DB_PORT"
        init_mariadb_datadir
        chown mysql:mysql "$D/mysqld"; rm -f "$DB_SOCK"
        touch "$LOGS/mariadb.log"; chown mysql:mysql "$LOGS/mariadb.log"
        start mariadb /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$D/mysql" \
            --socket="$DB_SOCK" --bind-address=127.0.0.1 --port="$DB_PORT" \
            --pid-file="$D/mysqld/mariadb.pid" --log-error="$LOGS/mariadb.log" \
            --innodb-buffer-pool-size=32M --innodb-log-file-size=16M
    fi
    wait_for "MariaDB on $DB_SOCK" db -e 'select 1'
    db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$ETC/dbpass")';
           ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$ETC/dbpass")';
           GRANT ALL ON ppsplit_nodes_acct.* TO 'slurm'@'127.0.0.1';" \
        || die "could not create the accounting user in MariaDB"

    # munged on its own socket, with the machine's key.
    if ! daemon_pid munged >/dev/null; then
        if [ ! -s /etc/munge/munge.key ]; then
            say "creating /etc/munge/munge.key"
            mkdir -p /etc/munge
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
            chown munge:munge /etc/munge /etc/munge/munge.key; chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
        fi
        chown munge:munge "$MUNGE_DIR"; chmod 0755 "$MUNGE_DIR"
        start munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F --force \
            --socket="$MUNGE_SOCK" --pid-file="$MUNGE_DIR/munged.pid" --seed-file="$MUNGE_DIR/munged.seed" \
            --log-file="$MUNGE_DIR/munged.log"
    fi
    wait_for "munged" sh -c "munge -S '$MUNGE_SOCK' -n | unmunge -S '$MUNGE_SOCK'"

    port_free_or_ours slurmdbd "$DBD_PORT"
    start_controller slurmdbd "/usr/sbin/slurmdbd -D"
    wait_for "slurmdbd" sacctmgr -n list cluster
    if ! sacctmgr -n -P list cluster format=cluster | grep -x "$CLUSTER" >/dev/null; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    if ! sacctmgr -n -P list account format=account | grep -x ppsplit >/dev/null; then
        sacctmgr -i add account ppsplit cluster="$CLUSTER" Description=ppsplit Organization=ppsplit >/dev/null
    fi
    if ! sacctmgr -n -P list user root format=user,defaultaccount | grep '^root|ppsplit$' >/dev/null; then
        sacctmgr -i add user root account=ppsplit defaultaccount=ppsplit cluster="$CLUSTER" >/dev/null 2>&1 || true
    fi

    local ctld_was_up=""; daemon_pid slurmctld >/dev/null && ctld_was_up=1
    port_free_or_ours slurmctld "$CTLD_PORT"
    start_controller slurmctld "/usr/sbin/slurmctld -D -i"
    wait_for "slurmctld" sh -c 'scontrol ping | grep "is UP"'

    # Each slurmd in its node: nsenter (not `ip netns exec`, which remounts /sys) into the
    # node's network, then its own hostname and hosts file.
    for n in $NODE_NAMES; do
        # A node whose slurmd died under a running controller lost its jobs with it: say so, or
        # they stay "completing" until the controller's next retry (a minute or more).
        if ! daemon_pid "slurmd-$n" >/dev/null && [ -n "$ctld_was_up" ]; then
            scontrol update nodename="$n" state=down reason="slurmd restarted by up.sh" 2>/dev/null || true
        fi
        start "slurmd-$n" nsenter --net="/run/netns/$(netns "$n")" unshare --uts --mount \
            sh -c "mount --bind '$HOSTS' /etc/hosts && hostname $n && exec /usr/sbin/slurmd -D -N $n"
    done
    end=$(( $(date +%s) + TIMEOUT ))
    until nodes_ok; do
        while read -r n st; do
            case "$st" in *drain*|*down*|*fail*|*inval*)
                scontrol update nodename="$n" state=resume 2>/dev/null || true ;;
            esac
        done < <(node_states)
        [ "$(date +%s)" -lt "$end" ] || die "nodes not idle after ${TIMEOUT}s: $(node_states | tr '\n' ' ') (logs: $LOGS)"
        sleep 0.5
    done
    # One task on every node, each reporting its own hostname.
    scancel --name=ppsplit-smoke 2>/dev/null || true
    local out="$D/smoke.out"; rm -f "$out"
    sbatch -W -N "$NODES" --ntasks-per-node=1 -t 1 -J ppsplit-smoke -p "$PARTITION" -o "$out" \
        --wrap 'srun hostname' >/dev/null </dev/null || die "smoke-test job failed (logs: $LOGS)"
    [ "$(sort "$out" | tr '\n' ' ')" = "$(echo $NODE_NAMES) " ] \
        || die "smoke test: expected one task on each of $(echo $NODE_NAMES), got: $(tr '\n' ' ' <"$out")"
    say "up in $(elapsed): $NODES nodes ($(echo $NODE_NAMES)) in partition $PARTITION, cluster $CLUSTER, state in $D"
    say "clients: export SLURM_CONF=$SLURM_CONF"
}

any_running() { local d; for d in $DAEMONS; do daemon_pid "$d" >/dev/null && return 0; done; return 1; }

case "$ACTION" in
    up) up ;;
    down) down ;;
    status) status ;;
esac
