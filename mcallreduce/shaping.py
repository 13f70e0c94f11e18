"""The emulated links' token bucket (tc tbf): one definition for the cluster that shapes its
links with it (:mod:`mcallreduce.bench.cluster_hosts`) and the cost model that plays it
(:mod:`mcallreduce.sim.model`). Pure arithmetic, no imports of either.
"""
from __future__ import annotations

__all__ = ["tbf_burst_bytes", "tbf_options"]


def tbf_burst_bytes(rate_bytes: float) -> int:
    """The shaper's bucket: it must hold what arrives between two timer ticks and a whole 64 KiB
    GSO segment (veth does TSO), or tbf caps TCP well below the rate; 5 ms of rate, at least 128 KiB."""
    return max(int(rate_bytes * 0.005), 128 * 1024)


def tbf_options(rate_bits: int) -> list[str]:
    """tc tbf arguments for ``rate_bits``: the burst of :func:`tbf_burst_bytes`, and a queue
    (limit) of 50 ms of rate, at least 1 MiB, so TCP bursts queue rather than drop (veth has
    no delay, so a deeper queue costs latency only under load; docs/cluster.md, "tbf parameters").
    """
    rate_bytes = rate_bits / 8
    burst = tbf_burst_bytes(rate_bytes)
    limit = burst + max(int(rate_bytes * 0.050), 1024 * 1024)
    return ["rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(limit)]
