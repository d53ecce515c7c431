# Starting detached processes whose pids are later checked by command line (sourced by cluster.sh and node.sh).
#
# Both scripts record a component's pid and later signal it, or report it dead, only while its command line names
# their state directory, so a reused pid is never touched. Right after `&`, though, the pid is a fork of the calling
# shell until it execs, and its command line is the script's own: a check in that window takes a component that is
# merely slow to start (a loaded machine) for one that died, and a stop in that window leaves it running.

# detach LOG CMD...: starts CMD in its own session, output to LOG, stdin from /dev/null and without the caller's
# descriptor 9 (cluster.sh's state lock: a component holding it would block every later `up` and `down`). Sets
# DETACHED_PID and returns once that process runs CMD (or has already ended).
detach() {
    local log=$1 own cmdline; shift
    own=$(tr '\0' ' ' </proc/$$/cmdline)
    setsid "$@" >"$log" 2>&1 </dev/null 9>&- &
    DETACHED_PID=$!
    for _ in $(seq 600); do
        cmdline=$({ tr '\0' ' ' <"/proc/$DETACHED_PID/cmdline"; } 2>/dev/null) || return 0
        [[ "$cmdline" == "$own" ]] || return 0
        sleep 0.05
    done
    printf 'warning: process %s (%s) has not started after 30s\n' "$DETACHED_PID" "$1" >&2
}
