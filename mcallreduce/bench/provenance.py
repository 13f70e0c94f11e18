"""What a benchmark record says about where it ran: when, on which machine, and on which emulated
cluster, with the settings that change its figures (rate, layout, CPU budget, MTU, TCP congestion
control, autogroups), so that a record read later says what it measured.

``cluster run`` hands its cluster's settings to every rank in ``MCALLREDUCE_BENCH_CLUSTER``; a rank
that writes a record finds them there, and a job started any other way records ``"cluster": null``.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict
from typing import Any, Dict, Optional

__all__ = ["CLUSTER_ENV", "cluster_env", "machine", "provenance", "utc_now"]

CLUSTER_ENV = "MCALLREDUCE_BENCH_CLUSTER"


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def machine() -> Dict[str, Any]:
    """The machine this process runs on."""
    return {"node": platform.node(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def cluster_env(config) -> Dict[str, str]:
    """The variable that tells a job's ranks which cluster settings they run under (``config``: a
    :class:`~mcallreduce.bench.cluster_state.ClusterConfig`)."""
    return {CLUSTER_ENV: json.dumps(asdict(config), separators=(",", ":"))}


def _cluster_from_env() -> Optional[Dict[str, Any]]:
    text = os.environ.get(CLUSTER_ENV)
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"unreadable": text}


def provenance(started: str, cluster=None) -> Dict[str, Any]:
    """The fields every record carries: ``started`` (from :func:`utc_now`), ``finished`` (now), the
    machine, and the cluster: ``cluster`` (a ClusterConfig) where the caller drove it, else the one
    ``cluster run`` named in this rank's environment, else None."""
    settings = asdict(cluster) if cluster is not None else _cluster_from_env()
    return {"started": started, "finished": utc_now(), "machine": machine(), "cluster": settings}
