#!/usr/bin/env bash
# A real SLURM cluster on one machine, for tests and benchmarks (root only).
#
#   scripts/slurm_cluster.sh up     [--nodes N] [--dir D] [--subnet 10.203.17] [--gpus 8,2]
#   scripts/slurm_cluster.sh down   [--dir D]
#   scripts/slurm_cluster.sh status [--dir D]
#   scripts/slurm_cluster.sh env    [--dir D]      # prints: export SLURM_CONF=...
#
# A --dir other than the default gets names of its own (namespaces osl<tag>-nodeK, bridge oslurm<tag>, its own
# /etc/hosts block; <tag> from the dir's path): a benchmark cluster never touches the tests' one, also when its `up`
# fails and tears down. Only one cluster runs at a time (munged's default socket is shared, see start_munge): `up`
# refuses, before creating anything, while another cluster's munged serves it. Give it its own --subnet too.
#
# --gpus: fake GPUs per node (GRES gpu on char devices made with mknod c 1 3), one count per node, the last one
# repeated: the default 8,2 gives node1 gpu:8 and node2 gpu:2 (uneven on purpose: a 2-node job asking 8 per node is
# refused, 2 per node fits). CPU jobs ask for no GRES and are not affected. ORCHESTRATE_SLURM_GPUS sets the default.
#
# Layout (root namespace): munged (private socket/key), a private MariaDB (own datadir and
# socket, 127.0.0.1 on a spare port), slurmdbd, slurmctld. Each slurmd runs in its own network
# + UTS namespace (hostname nodeK, address SUBNET.(10+K)) on a bridge made for the cluster.
# /etc/hosts gets a marked block (removed by `down`); /etc/slurm/slurm.conf becomes a symlink to
# the generated config when no slurm.conf exists there, so plain `srun`/`sbatch` work too.
#
# Teardown kills only what this script started: by pid file (checking the pid still runs the
# expected binary) and every process left in the node namespaces (`ip netns pids`). It is safe
# to run on a half-up cluster and is run automatically when `up` fails part way.
# Do not pipe `up` into `head`: a SIGPIPE would stop it half way (all output also goes to
# DIR/log/cluster.log).
set -uo pipefail

CMD="${1:-}"; shift || true
NODES=2
DIR="${ORCHESTRATE_SLURM_DIR:-/tmp/orchestrate-slurm}"
SUBNET="10.203.17"          # /24, bridge .1, nodeK .(10+K)
BRIDGE="oslurm0"
NS_PREFIX="osl-"
GPUS="${ORCHESTRATE_SLURM_GPUS:-8,2}"   # fake GPUs per node (gres on /dev/null-like char devices), see --gpus
CPUS_PER_NODE=2
MEM_PER_NODE=2000
PARTITION="debug"
CLUSTER_NAME="orchestrate"
MARK_BEGIN="# BEGIN orchestrate-slurm-testbed"
MARK_END="# END orchestrate-slurm-testbed"
VETH_PREFIX="${NS_PREFIX}node"  # host side of node K's veth: ${VETH_PREFIX}K-h (at most 15 characters)

while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES="$2"; shift 2;;
        --dir) DIR="$2"; shift 2;;
        --subnet) SUBNET="$2"; shift 2;;
        --gpus) GPUS="$2"; shift 2;;
        -h|--help) sed -n '2,30p' "$0"; exit 0;;
        *) echo "slurm_cluster.sh: unknown argument $1" >&2; exit 2;;
    esac
done
if [ "$DIR" != /tmp/orchestrate-slurm ]; then  # names of its own (see the top)
    TAG=$(printf '%s' "$DIR" | cksum | awk '{printf "%04x", $1 % 65536}')
    NS_PREFIX="osl${TAG}-"; BRIDGE="oslurm${TAG}"; VETH_PREFIX="o${TAG}-n"
    MARK_BEGIN="$MARK_BEGIN $TAG"; MARK_END="$MARK_END $TAG"
fi

say() { echo "slurm_cluster: $*"; [ -d "$DIR/log" ] && echo "$(date +%T.%N) $*" >> "$DIR/log/cluster.log"; return 0; }
die() { echo "slurm_cluster: ERROR: $*" >&2; [ -d "$DIR/log" ] && echo "$(date +%T.%N) ERROR $*" >> "$DIR/log/cluster.log"; return 1; }

now() { date +%s.%N; }

# ---------------------------------------------------------------------------------------------
# processes

# pid_runs PID NAME: the pid is alive (not a zombie) and its executable is NAME
pid_runs() {
    local pid="$1" name="$2" exe st
    [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
    st=$(awk '/^State:/{print $2}' "/proc/$pid/status" 2>/dev/null)
    [ "$st" = "Z" ] && return 1
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null)
    [ "$(basename "${exe% (deleted)}")" = "$name" ] && return 0
    # fall back on comm (exe may be unreadable)
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${name:0:15}" ]
}

# kill_pidfile FILE NAME: TERM, wait up to 5 s, then KILL; only if the pid runs NAME
kill_pidfile() {
    local f="$1" name="$2" pid i
    [ -f "$f" ] || return 0
    pid=$(tr -dc '0-9' < "$f")
    if pid_runs "$pid" "$name"; then
        kill -TERM "$pid" 2>/dev/null
        for i in $(seq 1 50); do pid_runs "$pid" "$name" || break; sleep 0.1; done
        if pid_runs "$pid" "$name"; then kill -KILL "$pid" 2>/dev/null; sleep 0.1; fi
    fi
    rm -f "$f"
}

# kill_netns NS: every process in the namespace (all of them were started in it by us)
kill_netns() {
    local ns="$1" pids i
    [ -e "/run/netns/$ns" ] || return 0
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [ -n "${pids// /}" ] || return 0
    kill -TERM $pids 2>/dev/null
    for i in $(seq 1 30); do
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
        local alive=""
        for p in $pids; do
            st=$(awk '/^State:/{print $2}' "/proc/$p/status" 2>/dev/null)
            [ -n "$st" ] && [ "$st" != "Z" ] && alive="$alive $p"
        done
        [ -z "$alive" ] && return 0
        sleep 0.1
    done
    kill -KILL $alive 2>/dev/null
    return 0
}

free_port() {  # free_port START: first port >= START nobody listens on (TCP, root namespace)
    local p="$1" used
    used=$(ss -Htln 2>/dev/null | awk '{print $4}' | sed 's/.*://' | sort -u)
    while grep -qx "$p" <<<"$used"; do p=$((p + 1)); done
    echo "$p"
}

wait_for() {  # wait_for SECONDS DESCRIPTION CMD...: poll CMD every 0.1 s
    local limit="$1" what="$2"; shift 2
    local end; end=$(( $(date +%s) + limit ))
    while ! "$@" >/dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$end" ]; then die "timed out after ${limit}s waiting for $what"; return 1; fi
        sleep 0.1
    done
}

tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# ---------------------------------------------------------------------------------------------
# /etc/hosts and /etc/slurm/slurm.conf (written in place: /etc/hosts may be a bind mount)

hosts_remove_block() {
    grep -qF "$MARK_BEGIN" /etc/hosts 2>/dev/null || return 0
    local tmp; tmp=$(mktemp)
    awk -v b="$MARK_BEGIN" -v e="$MARK_END" '$0==b{skip=1;next} $0==e{skip=0;next} !skip' /etc/hosts > "$tmp"
    cat "$tmp" > /etc/hosts; rm -f "$tmp"
}

hosts_add_block() {
    hosts_remove_block
    {
        echo "$MARK_BEGIN"
        for k in $(seq 1 "$NODES"); do echo "$SUBNET.$((10 + k)) node$k"; done
        # torch's c10d store listens dual-stack and reverse-resolves each peer as an IPv4-mapped IPv6 address;
        # with no entry for that form the lookup goes to DNS, unreachable from the node namespaces, and every
        # rendezvous waited ~10 s per peer (37 s to the first step instead of ~14 s).
        for k in $(seq 1 "$NODES"); do echo "::ffff:$SUBNET.$((10 + k)) node$k"; done
        echo "$MARK_END"
    } >> /etc/hosts
}

# ---------------------------------------------------------------------------------------------
# down

load_state() {
    if [ -f "$DIR/cluster.env" ]; then
        # shellcheck disable=SC1091
        . "$DIR/cluster.env"
    fi
}

do_down() {
    load_state
    local t0; t0=$(now)
    # nodes first: slurmd and everything it started (job steps, ranks) in each namespace
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${NS_PREFIX}node[0-9]*$"); do
        local node="${ns#"$NS_PREFIX"}"
        kill_pidfile "$DIR/run/slurmd-$node.pid" slurmd
        kill_netns "$ns"
        ip netns del "$ns" 2>/dev/null
        ip link del "${VETH_PREFIX}${node#node}-h" 2>/dev/null
    done
    for f in "$DIR"/run/slurmd-*.pid; do [ -f "$f" ] && kill_pidfile "$f" slurmd; done
    kill_pidfile "$DIR/run/slurmctld.pid" slurmctld
    kill_pidfile "$DIR/run/slurmdbd.pid" slurmdbd
    kill_pidfile "$DIR/run/mariadb.pid" mariadbd
    kill_pidfile "$DIR/munge/munged.pid" munged
    ip link del "$BRIDGE" 2>/dev/null
    hosts_remove_block
    if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$DIR/etc/slurm.conf" ]; then
        rm -f /etc/slurm/slurm.conf
    fi
    rm -f "$DIR/cluster.env"
    say "down in $(awk -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}') s"
}

# ---------------------------------------------------------------------------------------------
# up

gpus_of() {  # gpus_of K: node K's fake GPU count from --gpus (a comma list, the last count repeated)
    local k="$1" IFS=, n=0 i=0 c
    for c in $GPUS; do i=$((i + 1)); n="$c"; [ "$i" -ge "$k" ] && break; done
    echo "${n:-0}"
}

write_configs() {
    local first_job_id="$1"
    mkdir -p "$DIR/etc" "$DIR/dev"
    : > "$DIR/etc/plugstack.conf"
    cat > "$DIR/etc/slurm.conf" <<EOF
# generated by scripts/slurm_cluster.sh -- a test cluster on one machine
ClusterName=$CLUSTER_NAME
SlurmctldHost=$CTLD_HOST($SUBNET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
PlugStackConfig=$DIR/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
SchedulerParameters=sched_interval=1,bf_interval=1
KillWait=5
MinJobAge=300
ReturnToService=2
InactiveLimit=0
MailProg=/bin/true
FirstJobId=$first_job_id
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobCompType=jobcomp/none
GresTypes=gpu
EOF
    : > "$DIR/etc/gres.conf"
    echo "AutoDetect=off" >> "$DIR/etc/gres.conf"
    for k in $(seq 1 "$NODES"); do
        local n; n=$(gpus_of "$k")
        local gres=""; [ "$n" -gt 0 ] && gres="Gres=gpu:$n "
        echo "NodeName=node$k NodeHostname=node$k NodeAddr=$SUBNET.$((10 + k)) CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE ${gres}State=UNKNOWN" >> "$DIR/etc/slurm.conf"
        [ "$n" -gt 0 ] || continue
        local files=""
        for g in $(seq 0 $((n - 1))); do
            local dev="$DIR/dev/node$k-gpu$g"
            [ -e "$dev" ] || mknod "$dev" c 1 3
            files="$files${files:+,}$dev"
        done
        echo "NodeName=node$k Name=gpu File=$files" >> "$DIR/etc/gres.conf"
    done
    echo "PartitionName=$PARTITION Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >> "$DIR/etc/slurm.conf"

    cat > "$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=root
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/etc/slurmdbd.conf"
}

next_first_job_id() {
    # Controller state is wiped on every start and job ids would restart: a reused id makes
    # submitit (and sacct) read a stale record. A persistent counter moves the range each start.
    local f="$DIR/persist/next_job_id" n
    n=""; [ -f "$f" ] && n=$(tr -dc '0-9' < "$f")
    [ -n "$n" ] || n=$(( ( $(date +%s) % 3000 ) * 20000 + 1000 ))
    [ "$n" -lt 60000000 ] || n=1000
    echo $((n + 20000)) > "$f"
    echo "$n"
}

munge_other() {  # the pid of a munged serving SOCK that this cluster did not start (empty: none)
    local sock="$1" p cmd
    for p in /proc/[0-9]*; do
        [ "$(cat "$p/comm" 2>/dev/null)" = munged ] || continue
        pid_runs "${p#/proc/}" munged || continue
        cmd=$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null)
        case "$cmd" in *"$DIR/munge/munged.pid"*) continue;; esac
        case "$cmd" in *"--socket=$sock"*|*"--socket $sock"*) echo "${p#/proc/}"; return 0;; esac
    done
    local sys; sys=$(cat /run/munge/munged.pid 2>/dev/null)
    if [ -S "$sock" ] && pid_runs "$sys" munged && [ "$sys" != "$(cat "$DIR/munge/munged.pid" 2>/dev/null)" ]; then
        echo "$sys"
    fi
}

start_munge() {
    mkdir -p "$DIR/munge"; chmod 755 "$DIR/munge"
    if [ ! -f "$DIR/persist/munge.key" ]; then
        dd if=/dev/urandom of="$DIR/persist/munge.key" bs=1024 count=1 status=none
    fi
    cp "$DIR/persist/munge.key" "$DIR/munge/munge.key"; chmod 400 "$DIR/munge/munge.key"
    # The default socket: Slurm 22.05 ignores AuthInfo=socket= on the slurmctld -> slurmdbd link.
    local sock=/run/munge/munge.socket.2
    local other; other=$(munge_other "$sock")
    [ -z "$other" ] || { die "another munged (pid $other) serves $sock; stop it first"; return 1; }
    [ -S "$sock" ] && rm -f "$sock" "$sock.lock"
    mkdir -p /run/munge
    munged --force --socket="$sock" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" </dev/null >>"$DIR/log/munged.log" 2>&1 9>&- \
        || { die "munged failed (see $DIR/log/munged.log)"; return 1; }
    wait_for 10 munged test -S "$sock"
}

start_mariadb() {
    local tpl="$DIR/persist/mysql-template"
    if [ ! -d "$tpl/mysql" ]; then
        rm -rf "$tpl"; mkdir -p "$tpl"
        mariadb-install-db --no-defaults --datadir="$tpl" --user=root --skip-test-db \
            --auth-root-authentication-method=normal >"$DIR/log/mariadb-install.log" 2>&1 \
            || { die "mariadb-install-db failed (see $DIR/log/mariadb-install.log)"; return 1; }
    fi
    rm -rf "$DIR/mysql"; cp -a "$tpl" "$DIR/mysql"
    mariadbd --no-defaults --datadir="$DIR/mysql" --socket="$DIR/run/mysqld.sock" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DIR/run/mariadb.pid" \
        --log-error="$DIR/log/mariadb.log" --user=root --skip-grant-tables --skip-name-resolve \
        --innodb-buffer-pool-size=32M --skip-log-bin --max-connections=200 \
        </dev/null >>"$DIR/log/mariadb.log" 2>&1 9>&- &
    wait_for 30 "mariadb on 127.0.0.1:$DB_PORT" tcp_open 127.0.0.1 "$DB_PORT"
}

start_netns() {
    ip link add "$BRIDGE" type bridge 2>/dev/null || { die "cannot create bridge $BRIDGE (exists already?)"; return 1; }
    ip addr add "$SUBNET.1/24" dev "$BRIDGE" || return 1
    ip link set "$BRIDGE" up || return 1
    for k in $(seq 1 "$NODES"); do
        local ns="${NS_PREFIX}node$k" hv="${VETH_PREFIX}$k-h"
        ip netns add "$ns" || return 1
        ip link add "$hv" type veth peer name eth0 netns "$ns" || return 1
        ip link set "$hv" master "$BRIDGE" up || return 1
        ip -n "$ns" addr add "$SUBNET.$((10 + k))/24" dev eth0 || return 1
        ip -n "$ns" link set eth0 up || return 1
        ip -n "$ns" link set lo up || return 1
        ip -n "$ns" route add default via "$SUBNET.1" 2>/dev/null
    done
}

start_slurmd() {
    local k="$1" ns="${NS_PREFIX}node$1"
    # nsenter (not `ip netns exec`, which remounts /sys and breaks slurmd's cgroup plugin),
    # then a new UTS namespace so the node's hostname is nodeK.
    SLURM_CONF="$DIR/etc/slurm.conf" nsenter --net="/run/netns/$ns" \
        unshare --uts sh -c "hostname node$k && exec slurmd -f '$DIR/etc/slurm.conf' -N node$k" \
        </dev/null >>"$DIR/log/slurmd-node$k.out" 2>&1 9>&-
}

nodes_idle() {
    local out
    out=$(SLURM_CONF="$DIR/etc/slurm.conf" sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    [ "$(grep -cE ' (idle|mix|alloc)$' <<<"$out")" -ge "$NODES" ]
}

do_up() {
    local t0; t0=$(now)
    for b in munged mariadbd mariadb-install-db slurmdbd slurmctld slurmd sinfo nsenter unshare ip ss; do
        command -v "$b" >/dev/null 2>&1 || { die "$b not found: run scripts/install_slurm_deps.sh"; return 1; }
    done
    if [ -f "$DIR/cluster.env" ]; then
        if do_status >/dev/null 2>&1; then say "already up ($DIR)"; return 0; fi
        say "found a half-up cluster in $DIR: tearing it down first"
        do_down >/dev/null 2>&1
    fi
    # wipe the per-start state; keep DIR/persist (munge key, job id counter, db template)
    mkdir -p "$DIR/persist"
    rm -rf "$DIR/etc" "$DIR/run" "$DIR/log" "$DIR/spool" "$DIR/mysql" "$DIR/munge" "$DIR/dev"
    mkdir -p "$DIR/run" "$DIR/log" "$DIR/spool/ctld"
    for k in $(seq 1 "$NODES"); do mkdir -p "$DIR/spool/node$k"; done

    CTLD_HOST=$(hostname -s)
    DB_PORT=$(free_port 23306)
    DBD_PORT=$(free_port 26819)
    CTLD_PORT=$(free_port 26817)
    [ "$CTLD_PORT" = "$DBD_PORT" ] && CTLD_PORT=$(free_port $((DBD_PORT + 1)))
    local first; first=$(next_first_job_id)
    cat > "$DIR/cluster.env" <<EOF
NODES=$NODES
CLUSTER_GPUS=$GPUS
SUBNET=$SUBNET
BRIDGE=$BRIDGE
NS_PREFIX=$NS_PREFIX
DB_PORT=$DB_PORT
DBD_PORT=$DBD_PORT
CTLD_PORT=$CTLD_PORT
CTLD_HOST=$CTLD_HOST
PARTITION=$PARTITION
FIRST_JOB_ID=$first
SLURM_CONF=$DIR/etc/slurm.conf
EOF
    write_configs "$first" || return 1
    if [ ! -e /etc/slurm/slurm.conf ]; then mkdir -p /etc/slurm; ln -s "$DIR/etc/slurm.conf" /etc/slurm/slurm.conf; fi
    hosts_add_block

    start_netns || { die "network namespaces"; return 1; }
    local t_net; t_net=$(now)
    start_munge || return 1
    start_mariadb || return 1
    local t_db; t_db=$(now)
    # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF
    SLURM_CONF="$DIR/etc/slurm.conf" slurmdbd </dev/null >>"$DIR/log/slurmdbd.out" 2>&1 9>&- \
        || { die "slurmdbd failed (see $DIR/log/slurmdbd.log)"; return 1; }
    wait_for 30 "slurmdbd on 127.0.0.1:$DBD_PORT" tcp_open 127.0.0.1 "$DBD_PORT" || return 1
    slurmctld -f "$DIR/etc/slurm.conf" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 9>&- \
        || { die "slurmctld failed (see $DIR/log/slurmctld.log)"; return 1; }
    wait_for 30 "slurmctld on port $CTLD_PORT" tcp_open 127.0.0.1 "$CTLD_PORT" || return 1
    for k in $(seq 1 "$NODES"); do
        start_slurmd "$k" || { die "slurmd node$k failed (see $DIR/log/slurmd-node$k.log)"; return 1; }
    done
    wait_for 60 "$NODES nodes idle in sinfo" nodes_idle || return 1
    local t1; t1=$(now)
    say "up: $NODES nodes, partition $PARTITION, first job id $first, in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}') s (netns $(awk -v a="$t0" -v b="$t_net" 'BEGIN{printf "%.2f", b-a}') s, db $(awk -v a="$t_net" -v b="$t_db" 'BEGIN{printf "%.2f", b-a}') s)"
    say "export SLURM_CONF=$DIR/etc/slurm.conf"
}

do_status() {
    load_state
    [ -f "$DIR/cluster.env" ] || { echo "down (no $DIR/cluster.env)"; return 1; }
    local ok=0
    pid_runs "$(cat "$DIR/munge/munged.pid" 2>/dev/null)" munged || { echo "munged: not running"; ok=1; }
    pid_runs "$(cat "$DIR/run/mariadb.pid" 2>/dev/null)" mariadbd || { echo "mariadbd: not running"; ok=1; }
    pid_runs "$(cat "$DIR/run/slurmdbd.pid" 2>/dev/null)" slurmdbd || { echo "slurmdbd: not running"; ok=1; }
    pid_runs "$(cat "$DIR/run/slurmctld.pid" 2>/dev/null)" slurmctld || { echo "slurmctld: not running"; ok=1; }
    for k in $(seq 1 "$NODES"); do
        pid_runs "$(cat "$DIR/run/slurmd-node$k.pid" 2>/dev/null)" slurmd || { echo "slurmd node$k: not running"; ok=1; }
    done
    SLURM_CONF="$DIR/etc/slurm.conf" sinfo -N -o '%N %P %t %c %m %G' 2>&1 || ok=1
    [ "$ok" = 0 ] && echo "up: SLURM_CONF=$DIR/etc/slurm.conf"
    return $ok
}

# ---------------------------------------------------------------------------------------------

[ "$(id -u)" -eq 0 ] || { echo "slurm_cluster.sh: must run as root (namespaces, daemons)" >&2; exit 1; }
mkdir -p "$DIR"
if [ "$CMD" = up ] || [ "$CMD" = down ]; then
    # one up/down at a time (parallel test sessions); fd 9 is closed in every daemon started
    exec 9>"$DIR.lock"
    flock -w 180 9 || { echo "slurm_cluster.sh: another up/down holds $DIR.lock" >&2; exit 1; }
fi

case "$CMD" in
    up)
        other=$(munge_other /run/munge/munge.socket.2)
        if [ -n "$other" ]; then  # before anything is created or torn down
            echo "slurm_cluster: ERROR: another cluster's munged (pid $other: $(tr '\0' ' ' < "/proc/$other/cmdline" \
                2>/dev/null | cut -c1-160)) serves /run/munge/munge.socket.2: bring that cluster down first" >&2
            exit 2
        fi
        trap 'echo "slurm_cluster: interrupted, tearing down" >&2; do_down >/dev/null 2>&1; exit 1' INT TERM HUP PIPE
        if ! do_up; then
            echo "slurm_cluster: bring-up failed; tearing down. Logs: $DIR/log/" >&2
            for f in "$DIR"/log/*.log; do [ -s "$f" ] && { echo "--- $f" >&2; tail -5 "$f" >&2; }; done
            do_down >/dev/null 2>&1
            exit 1
        fi;;
    down) do_down;;
    status) do_status;;
    env) load_state; [ -f "$DIR/cluster.env" ] && echo "export SLURM_CONF=$DIR/etc/slurm.conf" || exit 1;;
    *) echo "usage: slurm_cluster.sh up|down|status|env [--nodes N] [--dir D]" >&2; exit 2;;
esac
