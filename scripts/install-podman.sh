#!/usr/bin/env bash
# Install podman (and mmdebstrap, to make a base image when no registry answers) from Debian,
# and write a containers.conf that works on a CI runner or inside another container:
# runc, cgroupfs, file events, and ulimits within this machine's hard limits.
# Idempotent: a second run changes nothing. Needs root (apt-get, /etc/containers).
set -euo pipefail

need=()
for cmd in podman mmdebstrap runc curl; do
    command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
# podman build's networking and rootless helpers; fuse-overlayfs for kernels without overlay in a
# user namespace; catatonit for the pause image of `podman kube play`'s pods
dpkg -s uidmap slirp4netns fuse-overlayfs catatonit >/dev/null 2>&1 || need+=(uidmap slirp4netns fuse-overlayfs catatonit)
if [ "${#need[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends podman mmdebstrap runc uidmap slirp4netns fuse-overlayfs \
        containernetworking-plugins iptables catatonit ca-certificates curl >/dev/null
fi

# default_ulimits above the hard limit make every container start fail with
# "setrlimit RLIMIT_NOFILE: Operation not permitted": stay at or under it
hard=$(ulimit -Hn)
[ "$hard" = unlimited ] && hard=1048576
nofile=$(( hard < 65536 ? hard : 65536 ))
conf=/etc/containers/containers.conf
mkdir -p /etc/containers
want=$(cat <<CONF
# written by edgegw's scripts/install-podman.sh
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
)
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$want" ]; then
    if [ -f "$conf" ] && ! grep -q "edgegw's scripts/install-podman.sh" "$conf"; then
        cp "$conf" "$conf.before-edgegw"
    fi
    printf '%s\n' "$want" > "$conf"
fi
podman --version
