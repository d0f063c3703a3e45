#!/bin/bash
# A stand-in for `ssh` in the launcher tests (no sshd on the test machine): runs the remote
# command inside the host's network namespace, as sshd on that host would run it.
#   ssh [-p PORT] [-o OPTION]... HOST COMMAND
# SS_FAKE_SSH_HOSTS: "ADDR=NETNS:IFNAME:LABEL;..."; every call is appended to SS_FAKE_SSH_LOG.
port=22
while [[ "$1" == -* ]]; do
    case "$1" in
        -p) port="$2"; shift 2 ;;
        -o) shift 2 ;;
        *) shift ;;
    esac
done
host="$1"; shift
IFS=';' read -ra entries <<< "$SS_FAKE_SSH_HOSTS"
for entry in "${entries[@]}"; do
    if [[ "${entry%%=*}" == "$host" ]]; then
        IFS=':' read -r netns ifname label <<< "${entry#*=}"
        printf '%s port=%s %s\n' "$host" "$port" "$*" >> "$SS_FAKE_SSH_LOG"
        # a host's own settings (its shell profile): gloo's interface and its name
        exec ip netns exec "$netns" env -i PATH="$PATH" HOME="$HOME" \
            GLOO_SOCKET_IFNAME="$ifname" SS_TEST_HOST="$label" bash -c "$*"
    fi
done
echo "ssh: Could not resolve hostname $host: Name or service not known" >&2
exit 255
