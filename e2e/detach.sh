# Starting detached processes and reading their command lines, by which cluster.sh and node.sh (which source this)
# recognise their own processes.
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

# cmdline_of PID: prints PID's command line (its arguments joined by spaces). While a process execs, the kernel has
# installed the new program's memory but not yet its arguments, and the command line reads empty (seen in 2 of 40
# starts of `setsid kube-controller-manager`); that is waited out (up to 2 s), never taken for a process that is
# gone. Fails when PID does not exist or is a zombie (exited, not yet reaped).
cmdline_of() {
    local pid=$1 args=() state
    for _ in $(seq 200); do
        # mapfile, a builtin: no fork per read (stop_recorded and wait_healthy read often).
        { mapfile -d '' -t args <"/proc/$pid/cmdline"; } 2>/dev/null || return 1
        if [[ ${#args[@]} -gt 0 ]]; then
            printf '%s ' "${args[@]}"
            return 0
        fi
        # The state follows the parenthesised name, which may itself hold spaces.
        state=$({ sed 's/.*) //' <"/proc/$pid/stat"; } 2>/dev/null) || return 1
        [[ "${state%% *}" == Z || -z "$state" ]] && return 1
        sleep 0.01
    done
    return 1
}
