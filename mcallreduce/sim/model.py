"""The cluster the cost model plays schedules on: an alpha-beta-gamma machine with ports.

A :class:`ClusterModel` describes

* ``hosts`` x ``ranks_per_host`` ranks (rank r lives on host r // ranks_per_host, the
  layout mcallreduce and mpirun's by-slot mapping use);
* ``nics`` full-duplex NICs per host, ``nic_Bps`` per NIC *and direction*, with a
  per-message latency ``alpha``. Which NIC a message uses is ``nic_policy``:
  ``stripe`` (every message spread over all NICs, Open MPI's TCP BTL does that:
  one port of nics x nic_Bps), ``rank`` (local rank i uses NIC i mod nics, the GPU's
  nearest NIC) or ``color`` (the step's color c uses NIC c mod nics, BG/Q-style);
* an intra-host link per rank (``intra_Bps`` per direction, ``intra_alpha``):
  shared memory on the emulated cluster, NVLink on a Minsky node;
* ``overhead``: CPU time the rank spends per step it posts (the compiled executor:
  posting Isend/Irecv, completion and dependency bookkeeping), and ``gamma`` seconds per
  byte of a REDUCE, both executed on the rank's own CPU thread;
* ``cores``: when set, all ranks of the machine share that many cores (the emulated
  cluster: every "host" runs on the same 2 cores); None = every rank has its own.
  How they share them is ``polling``: False, a rank waiting for a message sleeps and
  ranks queue for the cores only while they have work (FIFO); True, a waiting rank
  polls (the executor polls for its first millisecond of a wait, MPI's own progress loop
  for all of it), so every rank competes for the cores all the time and, with more
  ranks than cores, each one's CPU work runs at cores / ranks of a core (processor
  sharing). With ranks <= cores, or ``cores`` None (the paper's scale), it changes nothing;
* a switch layer: ``hosts_per_switch`` hosts per leaf switch whose uplinks carry
  ``hosts_per_switch * nics * nic_Bps / oversubscription`` each way (None: one
  non-blocking switch);
* ``eager_bytes``: messages up to this size are sent eagerly; larger ones pay a
  rendezvous round trip (request to send, clear to send) before the data moves;
* two effects of the emulated cluster, measured by the calibration: ``burst_bytes``
  / ``peak_Bps``, the token bucket of a tc tbf shaper (a message that finds tokens
  passes at ``peak_Bps``, the rest at the rate: time = max(n/peak, (n - tokens)/rate)),
  and ``duplex``, the per-direction rate of a rank pair that exchanges bulk data both
  ways at once over its TCP connection (docs/model.md, "Calibration"). The loss is
  the rendezvous protocol's: a message above the eager limit waits for a clear-to-send
  that queues behind the other direction's data, so ``duplex_eager`` (messages up to
  ``eager_bytes``) is separate.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

from ..shaping import tbf_burst_bytes
from ..config import EAGER_HEADER_BYTES, EAGER_LIMIT_BYTES
from ..units import parse_rate

__all__ = ["ClusterModel", "emulated", "link_bytes_per_s", "load_calibration", "paper", "CALIBRATION_FILE"]

#: the built-in calibration of the emulated cluster: the report's last measurement and fit
#: (``python -m mcallreduce.bench report`` writes it; docs/model.md, "Calibration")
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


def link_bytes_per_s(rate: str) -> float:
    """'200mbit' -> 25e6 bytes/s (tc units, k = 1000)."""
    return parse_rate(rate) / 8


@dataclass(frozen=True)
class ClusterModel:
    hosts: int
    ranks_per_host: int = 1
    nics: int = 1
    nic_Bps: float = 25e6
    nic_policy: str = "stripe"          # stripe | rank | color
    alpha: float = 100e-6
    intra_Bps: float = 2e9
    intra_alpha: float = 20e-6
    overhead: float = 15e-6
    gamma: float = 1.0 / 2e9
    eager_bytes: int = 65536
    burst_bytes: int = 0                # token bucket of a shaped NIC (tc tbf burst); 0: none
    peak_Bps: float = 0.0               # speed of a burst while the bucket has tokens
    duplex: float = 1.0                 # per-direction rate while a connection carries data both ways
    duplex_min_bytes: int = 1 << 20     # ... for messages at least this large (bulk TCP transfers)
    duplex_small: float = 1.0           # the same for smaller (pipelined) messages
    duplex_eager: float = 1.0           # the same for messages sent eagerly (<= eager_bytes): no handshake
    mpi_overhead: float = 2e-6          # CPU per step inside MPI's own (C) collectives
    cores: Optional[int] = None
    polling: bool = False               # with cores: waiting ranks poll, the cores are shared by all ranks
    hosts_per_switch: Optional[int] = None
    oversubscription: float = 1.0
    name: str = ""

    def __post_init__(self):
        if self.nic_policy not in ("stripe", "rank", "color"):
            raise ValueError(f"nic_policy must be stripe, rank or color, not {self.nic_policy!r}")
        if self.hosts < 1 or self.ranks_per_host < 1 or self.nics < 1:
            raise ValueError("hosts, ranks_per_host and nics must be >= 1")
        # a negative, zero or NaN constant once gave faster-than-possible times or divided by zero
        rates = ("nic_Bps", "intra_Bps", "oversubscription")
        costs = ("alpha", "intra_alpha", "overhead", "gamma", "peak_Bps", "mpi_overhead")
        wrong = [n for n in rates if not 0 < getattr(self, n) < math.inf]
        wrong += [n for n in costs if not 0 <= getattr(self, n) < math.inf]
        if wrong or (self.cores is not None and self.cores < 1):
            raise ValueError(f"model constants out of range: {', '.join(wrong) or 'cores'} (rates > 0, "
                             f"costs >= 0, cores >= 1, all finite)")

    @property
    def nranks(self) -> int:
        return self.hosts * self.ranks_per_host

    def layout(self) -> List[List[int]]:
        """Rank lists per host, as mcallreduce's runtime sees them."""
        r = self.ranks_per_host
        return [list(range(h * r, (h + 1) * r)) for h in range(self.hosts)]

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def with_(self, **changes) -> "ClusterModel":
        return replace(self, **changes)

    def to_dict(self) -> Dict:
        return asdict(self)

    def describe(self) -> str:
        link = f"{self.nics} x {self.nic_Bps / 1e6:g} MB/s NIC{'s' if self.nics > 1 else ''} ({self.nic_policy})"
        cpu = (f"{self.cores} shared cores{' (polling ranks)' if self.polling else ''}" if self.cores
               else "a core per rank")
        return (f"{self.name or 'cluster'}: {self.hosts} hosts x {self.ranks_per_host} ranks, {link}, "
                f"alpha {self.alpha * 1e6:.0f} us, intra {self.intra_Bps / 1e9:g} GB/s, "
                f"overhead {self.overhead * 1e6:.1f} us/step, reduce {1 / self.gamma / 1e9:.2f} GB/s, {cpu}")


def emulated(hosts: int, ranks_per_host: int = 1, rate: str = "200mbit", rails: int = 1,
             calibration: Optional[Dict] = None, cores: Optional[int] = 2,
             polling: bool = True) -> ClusterModel:
    """The emulated cluster of docs/cluster.md, with calibrated constants when given.

    Its ranks run Open MPI with ``mpi_yield_when_idle`` (launch.py), whose progress loop
    polls: ``polling`` (see :class:`ClusterModel`) is on by default.

    ``calibration`` is the dict :func:`mcallreduce.sim.calibrate.fit` returns (alpha,
    nic_efficiency, overhead, gamma, intra_Bps, intra_alpha, ...); the constants it lacks come
    from the built-in calibration (:data:`CALIBRATION_FILE`).
    """
    c = load_calibration()
    c.update(calibration or {})
    link_Bps = link_bytes_per_s(rate) * c["nic_efficiency"]
    return ClusterModel(
        hosts=hosts, ranks_per_host=ranks_per_host, nics=rails,
        nic_Bps=link_Bps, nic_policy="stripe",
        alpha=c["alpha"], intra_Bps=c["intra_Bps"], intra_alpha=c["intra_alpha"],
        overhead=c["overhead"], gamma=c["gamma"], cores=cores, polling=polling,
        eager_bytes=EAGER_LIMIT_BYTES - EAGER_HEADER_BYTES,   # Open MPI's TCP eager payload
        burst_bytes=tbf_burst_bytes(link_bytes_per_s(rate)),
        peak_Bps=max(c["peak_Bps"], link_Bps),   # a burst is never slower than the sustained rate
        duplex=c["duplex"], duplex_small=c.get("duplex_small", c["duplex"]),
        duplex_eager=c.get("duplex_eager", 1.0),
        mpi_overhead=c.get("mpi_overhead", 2e-6),
        name=f"emulated {rate}" + (f" x{rails} rails" if rails > 1 else ""))


def load_calibration(path: Optional[str] = None) -> Dict[str, float]:
    """The fitted constants of a calibration file (the built-in one by default): its ``fit``
    section, or the whole file where it is the fit alone."""
    where = Path(path) if path else CALIBRATION_FILE
    try:
        data = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"calibration file {where}: {exc}") from exc
    fitted = data.get("fit", data) if isinstance(data, dict) else None
    if not isinstance(fitted, dict):
        raise ValueError(f"calibration file {where}: expected a JSON object (a 'fit' section or the fit itself)")
    return dict(fitted)


def paper(hosts: int, nics: int = 1, ranks_per_host: int = 4, nic_policy: str = "rank",
          hosts_per_switch: Optional[int] = None, oversubscription: float = 1.0) -> ClusterModel:
    """The paper's scale: Minsky-like nodes of 4 GPUs on NVLink, EDR InfiniBand between hosts.

    EDR: 100 Gbit/s, about 12 GB/s of payload per direction; 1.5 us MPI latency plus a
    native (C/CUDA, not Python) engine at 3 us per step; NVLink 1.0 between GPU pairs,
    about 40 GB/s per direction; reduction on the GPU (HBM2, ~250 GB/s for a+b->a).
    """
    return ClusterModel(
        hosts=hosts, ranks_per_host=ranks_per_host, nics=nics, nic_Bps=12e9, nic_policy=nic_policy,
        alpha=1.5e-6, intra_Bps=40e9, intra_alpha=2e-6, overhead=3e-6, gamma=1.0 / 250e9,
        eager_bytes=16384, cores=None, hosts_per_switch=hosts_per_switch,
        oversubscription=oversubscription,
        name=f"EDR x{nics}, NVLink")
