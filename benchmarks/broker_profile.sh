#!/usr/bin/env bash
# Where the broker's CPU goes, per request, against HAProxy: instructions (callgrind, which
# counts them whatever the host's load) and syscalls (strace -c) for a fixed number of
# requests, one at a time (-c 1: each request meets an idle proxy, as at 1,000 req/s).
#
#   cargo build --profile profiling -p admitgate-broker
#   benchmarks/broker_profile.sh target/profiling/admitgate-broker /tmp/profile [N]
#
# Needs nginx, haproxy, h2load (Debian's nginx, haproxy, nghttp2-client), valgrind and
# strace. The subject is pinned to one CPU (taskset -c 0: one broker worker thread, HAProxy's
# nbthread 1), h2load and nginx to the other. Prints, per subject and protocol pair, the
# instructions and syscalls per request; leaves the callgrind dumps (callgrind_annotate
# --inclusive=yes DUMP) and strace summaries in the output folder.
set -euo pipefail

# PAIRS="h1 h2" and SUBJECTS="haproxy broker" narrow the run; CONNECTIONS=16 loads it with
# 16 requests in flight instead of one.
usage() {
    echo "broker_profile.sh: error: $* (usage: broker_profile.sh BROKER_BINARY OUTDIR [N])" >&2
    exit 2
}
[ $# -ge 2 ] && [ $# -le 3 ] || usage "expected BROKER_BINARY OUTDIR [N], got $# arguments"
[ -x "$1" ] || usage "BROKER_BINARY: not an executable file: '$1'"
n=${3:-1000}
[[ $n =~ ^[1-9][0-9]*$ ]] || usage "N: must be a whole number of requests >= 1, got '$n'"
case ${CONNECTIONS:-1} in
'' | *[!0-9]* | 0*) usage "CONNECTIONS: must be a whole number >= 1, got '${CONNECTIONS}'" ;;
esac
for pair in ${PAIRS:-h1 h2}; do
    case $pair in h1 | h2) ;; *) usage "PAIRS: each must be h1 or h2, got '$pair'" ;; esac
done
for subject in ${SUBJECTS:-haproxy broker}; do
    case $subject in haproxy | broker) ;; *) usage "SUBJECTS: each must be haproxy or broker, got '$subject'" ;; esac
done
broker=$(realpath "$1")
out=$2
mkdir -p "$out"
out=$(realpath "$out")
body="$out/body.json"
printf '%s' '{"message":{"role":"ROLE_USER","parts":[{"text":"x"}]}}' >"$body"

up_h1=18181
up_h2=18182
subject_port=18183

cat >"$out/nginx.conf" <<EOF
daemon off;
worker_processes 1;
pid $out/nginx.pid;
error_log $out/nginx.err warn;
events { worker_connections 1024; }
http {
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 60s;
    client_body_temp_path $out;
    server {
        listen 127.0.0.1:$up_h1;
        listen 127.0.0.1:$up_h2 http2;
        location / { return 200 "ok\n"; }
    }
}
EOF
taskset -c 1 nginx -c "$out/nginx.conf" -p "$out" 2>/dev/null &
nginx_pid=$!
trap 'kill $nginx_pid 2>/dev/null || true' EXIT

wait_port() {
    for _ in $(seq 1 600); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    echo "port $1 never opened" >&2
    return 1
}
wait_port $up_h1
wait_port $up_h2

# subject_command SUBJECT PAIR: the command line serving PAIR on $subject_port.
subject_command() {
    local upstream proto
    if [ "$2" = h1 ]; then upstream=$up_h1 proto=http1; else upstream=$up_h2 proto=h2; fi
    case $1 in
    broker)
        echo "$broker --listen 127.0.0.1:$subject_port --upstream http://127.0.0.1:$upstream" \
            "--upstream-protocol $proto --max-in-flight 100000 --upstream-idle-timeout 30"
        ;;
    haproxy)
        local bind="" server=""
        if [ "$2" = h2 ]; then bind=" proto h2" server=" proto h2"; fi
        cat >"$out/haproxy.$2.cfg" <<EOF
global
    maxconn 8000
    nbthread 1
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout queue 10s
    option http-keep-alive
frontend f
    bind 127.0.0.1:$subject_port$bind
    default_backend b
backend b
    server nginx 127.0.0.1:$upstream$server maxconn 10000
EOF
        echo "haproxy -f $out/haproxy.$2.cfg"
        ;;
    esac
}

load() {
    local flags=()
    if [ "$1" = h1 ]; then flags=(--h1); fi
    taskset -c 1 h2load "${flags[@]}" -n "$2" -c "${CONNECTIONS:-1}" -m 1 -d "$body" \
        -H 'content-type: application/json' "http://127.0.0.1:$subject_port/message:send" \
        >"$out/h2load.last" 2>&1
    grep -q "$2 succeeded" "$out/h2load.last" || {
        cat "$out/h2load.last" >&2
        return 1
    }
}

stop() {
    kill -INT "$1" 2>/dev/null || true
    sleep 0.5
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}

printf '%-8s %-5s %14s %14s\n' subject pair instr/request syscalls/request
for pair in ${PAIRS:-h1 h2}; do
    for subject in ${SUBJECTS:-haproxy broker}; do
        # Instructions: warm up (connections, pools, lazy statics), zero, N requests, dump.
        rm -f "$out/cg.$subject.$pair" "$out/cg.$subject.$pair".*
        # shellcheck disable=SC2046
        taskset -c 0 valgrind --tool=callgrind --callgrind-out-file="$out/cg.$subject.$pair" \
            $(subject_command $subject $pair) 2>"$out/valgrind.$subject.$pair.log" &
        pid=$!
        wait_port $subject_port
        load $pair 200
        callgrind_control -z $pid >/dev/null
        load $pair "$n"
        callgrind_control -d "$subject.$pair" $pid >/dev/null
        sleep 1
        stop $pid
        # The dump taken after the N requests (callgrind names it OUT.1).
        ir=$(awk '/^summary:/ {print $2}' "$out/cg.$subject.$pair.1")
        # Syscalls: the same requests, natively, under strace -c.
        # shellcheck disable=SC2046
        taskset -c 0 $(subject_command $subject $pair) 2>/dev/null &
        pid=$!
        wait_port $subject_port
        load $pair 200
        strace -f -c -p $pid -o "$out/strace.$subject.$pair" 2>/dev/null &
        strace_pid=$!
        sleep 1
        load $pair "$n"
        kill -INT $strace_pid
        wait $strace_pid 2>/dev/null || true
        stop $pid
        calls=$(awk '/total$/ {print $4}' "$out/strace.$subject.$pair")
        printf '%-8s %-5s %14d %14.2f\n' $subject $pair $((ir / n)) "$(echo "$calls / $n" | bc -l)"
    done
done
