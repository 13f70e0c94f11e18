"""The kernel's autogroups, switched off while an emulated cluster is up, and restored after.

With ``kernel.sched_autogroup_enabled`` on, every session is a scheduling group of its own,
and each emulated host is one: ``orted`` starts a session per host. A thread that waits in MPI
with ``mpi_yield_when_idle`` calls ``sched_yield`` in a loop, and alone in its group it yields
to no one: two such threads held both cores of this machine for tens of seconds while the other
hosts' runnable ranks waited (docs/cluster.md, "Autogroups"). Separate machines have no such
coupling, so the cluster turns autogroups off for as long as any cluster that asked is up;
``cluster up --keep-autogroups`` leaves them as they are.

Clusters of different prefixes may be up at once: ``autogroups.json`` under the state root names
those that need autogroups off and the value to restore when the last of them goes down.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from mcallreduce.bench.output import write_text

__all__ = ["SWITCH", "Autogroups", "state_word"]

SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def state_word(enabled: Optional[bool]) -> str:
    """:meth:`Autogroups.enabled` in a word: "on", "off", or "absent" (a kernel without them)."""
    return "absent" if enabled is None else "on" if enabled else "off"


class Autogroups:
    """Who holds autogroups off (``state_root/autogroups.json``), and the switch itself."""

    def __init__(self, state_root: Path, switch: Path = SWITCH):
        self.record = Path(state_root) / "autogroups.json"
        self.switch = Path(switch)

    def enabled(self) -> Optional[bool]:
        """The kernel's setting; None where it has no autogroups."""
        try:
            return self.switch.read_text().strip() != "0"
        except OSError:
            return None

    def _read(self) -> dict:
        try:
            return json.loads(self.record.read_text())
        except (OSError, ValueError):
            return {}

    def _write(self, record: dict) -> None:
        write_text(self.record, json.dumps(record) + "\n")

    def hold_off(self, prefix: str) -> None:
        """Turn autogroups off for cluster ``prefix`` (idempotent)."""
        record = self._read()
        if not record:
            if not self.enabled():
                return          # already off (or absent): nothing to restore later
            record = {"restore": "1", "holders": []}
        if prefix not in record["holders"]:
            record["holders"].append(prefix)
        self._write(record)
        self.switch.write_text("0\n")

    def release(self, prefix: str) -> bool:
        """Cluster ``prefix`` no longer needs them off; the last holder restores the old value.
        True when this call restored it."""
        record = self._read()
        if prefix not in record.get("holders", []):
            return False
        record["holders"].remove(prefix)
        if record["holders"]:
            self._write(record)
            return False
        try:
            self.switch.write_text(record["restore"] + "\n")
        finally:
            self.record.unlink(missing_ok=True)
        return True

    def holders(self) -> list:
        return list(self._read().get("holders", []))
