#!/usr/bin/env bash
# Install what scripts/localslurm.py needs to run a private multi-node Slurm cluster on this machine:
# munge + slurmctld + slurmd + clients, and (for `sacct`) mariadb-server + slurmdbd + the mysql plugin.
#
# Idempotent and fast: when every binary/package is already present it does nothing (no apt-get update).
# Installing never leaves a system MariaDB/munge/slurm daemon running: a temporary policy-rc.d forbids
# package scripts from starting services while apt runs (localslurm.py starts its own private daemons).
#
# Usage: sudo scripts/install-slurm.sh      (must run as root)
set -euo pipefail

PACKAGES=(
  munge slurmctld slurmd slurm-client slurm-wlm-basic-plugins
  mariadb-server slurmdbd slurm-wlm-mysql-plugin
)
BINARIES=(munged slurmctld slurmd sbatch squeue scontrol sinfo scancel sacct sacctmgr slurmdbd mariadbd mariadb-install-db)

missing_pkgs=()
for p in "${PACKAGES[@]}"; do
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]]; then
    missing_pkgs+=("$p")
  fi
done
missing_bins=()
for b in "${BINARIES[@]}"; do
  # mariadbd/mariadb-install-db live in /usr/sbin and /usr/bin; PATH of a non-login shell may lack sbin.
  if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$b" >/dev/null 2>&1; then
    missing_bins+=("$b")
  fi
done

if [[ ${#missing_pkgs[@]} -eq 0 && ${#missing_bins[@]} -eq 0 ]]; then
  echo "install-slurm: all packages already installed" >&2
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  echo "install-slurm: must run as root (missing: ${missing_pkgs[*]:-} ${missing_bins[*]:-})" >&2
  exit 1
fi

echo "install-slurm: installing ${missing_pkgs[*]:-${PACKAGES[*]}}" >&2

# Keep package maintainer scripts from starting system daemons (mariadb, munge, slurm*) while installing.
POLICY=/usr/sbin/policy-rc.d
policy_created=0
if [[ ! -e $POLICY ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$POLICY"
  chmod 755 "$POLICY"
  policy_created=1
fi
cleanup() { if [[ $policy_created -eq 1 ]]; then rm -f "$POLICY"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null

# Double check nothing system-wide got started anyway (e.g. a pre-existing policy-rc.d allowing it):
# a system mariadbd on port 3306 / slurm daemons reading /etc/slurm would only get in the way.
# Only services of packages installed just now are touched; daemons that were already there are left alone.
declare -A SERVICE_OF=([mariadb-server]=mariadb [munge]=munge [slurmctld]=slurmctld [slurmd]=slurmd [slurmdbd]=slurmdbd)
for p in "${missing_pkgs[@]}"; do
  svc=${SERVICE_OF[$p]:-}
  if [[ -n $svc && -x /etc/init.d/$svc ]] && command -v service >/dev/null 2>&1; then
    service "$svc" stop >/dev/null 2>&1 || true
  fi
done

for b in "${BINARIES[@]}"; do
  if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$b" >/dev/null 2>&1; then
    echo "install-slurm: $b still missing after install" >&2
    exit 1
  fi
done
echo "install-slurm: done ($(PATH="$PATH:/usr/sbin" slurmctld -V 2>/dev/null || echo slurm))" >&2
