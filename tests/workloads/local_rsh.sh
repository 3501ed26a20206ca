#!/bin/sh
# A stand-in for ssh as Open MPI's rsh launcher calls it (plm_rsh_agent): `AGENT HOST
# COMMAND...`, the command one string for the remote shell. It runs the command on this
# machine instead, detached from mpirun (its own session, its parent init), as sshd would
# run it on another node; inside the memory cgroup $TW_RSH_CGROUP when that is set. A test
# gives mpirun two loopback addresses as two hosts: one job of two "nodes", each with the
# process that starts its ranks there (mpirun on the first, orted on the second).
shift  # the host
if [ -n "$TW_RSH_CGROUP" ]; then
  exec setsid -f sh -c "echo \$\$ > '$TW_RSH_CGROUP/cgroup.procs' && exec $*" </dev/null
fi
exec setsid -f sh -c "exec $*" </dev/null
