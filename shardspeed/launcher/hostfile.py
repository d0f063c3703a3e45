"""Resource pools: hostfile parsing and host/slot selection (pure functions).

A *resource pool* is an ordered ``{host: [slot, ...]}`` map. On GPU nodes a slot is a
device id; on CPU nodes it only counts processes. Dict order is node order: node rank
``r`` runs on the ``r``-th host, so global ranks follow the hostfile.

Selection follows DeepSpeed's launcher: ``--include``/``--exclude`` take
``NAME[:SLOT[,SLOT]]@NAME...`` (e.g. ``worker-0@worker-1:0,2`` or ``localhost:0,1``), then
``--num_nodes`` keeps the first N hosts and ``--num_gpus`` the first N slots of each.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardspeed.launcher.errors import LauncherError

ResourcePool = dict[str, list[int]]

_HOST_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_SPEC_HELP = "use NAME[:SLOT[,SLOT]]@NAME..., e.g. 'worker-0@worker-1:0,2'"


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Parse MPI-style ``HOSTNAME slots=N`` lines into an ordered ``{host: num_slots}``.

    ``#`` starts a comment (whole line or trailing); blank lines are skipped. Raises
    :class:`LauncherError` naming ``source`` and the line number for bad syntax, a
    non-positive slot count, an invalid host name, a duplicate host or an empty file.
    """
    hosts: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise LauncherError(
                f"{source} line {line_no}: expected 'HOSTNAME slots=N', got {line!r}. "
                "Write one host per line, e.g. 'worker-0 slots=8'."
            )
        host, slots_field = fields
        if not _HOST_RE.match(host):
            raise LauncherError(
                f"{source} line {line_no}: invalid host name {host!r}; use letters, digits, "
                "'.', '-' and '_' only."
            )
        value = slots_field[len("slots=") :]
        if not value.isdigit() or int(value) < 1:
            raise LauncherError(
                f"{source} line {line_no}: slots for host {host!r} must be a positive "
                f"integer, got {value!r}."
            )
        if host in hosts:
            raise LauncherError(
                f"{source} line {line_no}: host {host!r} is listed twice (first on line "
                f"{first_seen[host]}); list each host once."
            )
        hosts[host] = int(value)
        first_seen[host] = line_no
    if not hosts:
        raise LauncherError(f"{source} lists no hosts; add lines like 'worker-0 slots=8'.")
    return hosts


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Read and parse a hostfile; a missing file is a :class:`LauncherError` naming ``-H``."""
    path = Path(path)
    if not path.is_file():
        raise LauncherError(f"-H/--hostfile {str(path)!r}: file not found.")
    return parse_hostfile(path.read_text(), source=f"hostfile {str(path)!r}")


def pool_from_hostfile(hosts: dict[str, int]) -> ResourcePool:
    """``{host: num_slots}`` -> ``{host: [0, ..., num_slots - 1]}``."""
    return {host: list(range(count)) for host, count in hosts.items()}


def parse_host_slot_spec(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parse ``NAME[:SLOT[,SLOT]]@NAME...`` into ``{host: slots or None (= all slots)}``.

    ``flag`` (``--include`` or ``--exclude``) is named in every error message.
    """
    selected: dict[str, list[int] | None] = {}
    for entry in spec.split("@"):
        entry = entry.strip()
        if not entry:
            raise LauncherError(f"{flag} {spec!r}: empty host entry; {_SPEC_HELP}.")
        host, sep, slot_text = entry.partition(":")
        if not _HOST_RE.match(host):
            raise LauncherError(f"{flag} {spec!r}: invalid host name {host!r}; {_SPEC_HELP}.")
        slots: list[int] | None = None
        if sep:
            try:
                slots = [int(s) for s in slot_text.split(",")]
            except ValueError:
                raise LauncherError(
                    f"{flag} {spec!r}: slots for host {host!r} must be comma-separated "
                    f"integers, got {slot_text!r}; {_SPEC_HELP}."
                ) from None
            if any(s < 0 for s in slots):
                raise LauncherError(
                    f"{flag} {spec!r}: slot ids are >= 0, got {slot_text!r} for {host!r}."
                )
        if host in selected:
            raise LauncherError(
                f"{flag} {spec!r}: host {host!r} appears twice; name each host once and "
                "list all its slots there."
            )
        selected[host] = slots
    return selected


def select_resources(pool: ResourcePool, include: str = "", exclude: str = "") -> ResourcePool:
    """Apply ``--include`` or ``--exclude`` to ``pool``; the result keeps pool order."""
    if include and exclude:
        raise LauncherError(
            f"--include {include!r} and --exclude {exclude!r} are mutually exclusive; "
            "pass only one of them."
        )
    if not include and not exclude:
        return {host: list(slots) for host, slots in pool.items()}
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    selected = parse_host_slot_spec(spec, flag)
    for host, slots in selected.items():
        if host not in pool:
            raise LauncherError(
                f"{flag} {spec!r}: unknown host {host!r}; known hosts: {', '.join(pool)}."
            )
        for slot in slots or ():
            if slot not in pool[host]:
                raise LauncherError(
                    f"{flag} {spec!r}: host {host!r} has no slot {slot}; its slots are "
                    f"{','.join(map(str, pool[host]))}."
                )
    result: ResourcePool = {}
    for host, slots in pool.items():
        wanted = selected.get(host, None)
        if include:
            if host in selected:
                result[host] = [s for s in slots if wanted is None or s in wanted]
        elif host not in selected:
            result[host] = list(slots)
        elif wanted is not None:
            kept = [s for s in slots if s not in wanted]
            if kept:
                result[host] = kept
    if not result:
        raise LauncherError(f"--exclude {spec!r} removes every slot; nothing is left to launch.")
    return result


def limit_resources(pool: ResourcePool, num_nodes: int = -1, num_gpus: int = -1) -> ResourcePool:
    """Keep the first ``num_nodes`` hosts and the first ``num_gpus`` slots of each (-1: all)."""
    for flag, value in (("--num_nodes", num_nodes), ("--num_gpus/--nproc", num_gpus)):
        if value == 0 or value < -1:
            raise LauncherError(f"{flag} must be a positive integer (or -1 for all), got {value}.")
    if num_nodes > len(pool):
        raise LauncherError(
            f"--num_nodes {num_nodes} is larger than the {len(pool)} host(s) available "
            f"({', '.join(pool)}); lower it or add hosts to the hostfile."
        )
    hosts = list(pool)[:num_nodes] if num_nodes > 0 else list(pool)
    result: ResourcePool = {}
    for host in hosts:
        slots = pool[host]
        if num_gpus > len(slots):
            raise LauncherError(
                f"--num_gpus/--nproc {num_gpus} exceeds the {len(slots)} slot(s) of host "
                f"{host!r}; lower it or raise that host's slots."
            )
        result[host] = list(slots[:num_gpus]) if num_gpus > 0 else list(slots)
    return result
