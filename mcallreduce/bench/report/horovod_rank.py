"""One rank of the report's stock-Horovod arm: ``horovod.torch``'s allreduce timed per size.

    python -m mcallreduce.bench.report.horovod_rank SIZES ITERS SECONDS MIN_ITERS

SIZES are bytes, comma-separated; ITERS 0 times about SECONDS per size (at least MIN_ITERS,
at most 200, agreed by all ranks). Rank 0 prints ``HOROVOD <json records>``.
"""
import json
import sys
import time

import numpy as np
import torch


def main(argv=None) -> int:
    import horovod.torch as hvd
    sizes, iters_arg, seconds, min_iters = (sys.argv[1:] if argv is None else argv)
    hvd.init()
    out = []
    for size in [int(s) for s in sizes.split(",")]:
        x = torch.ones(size // 4)
        for _ in range(2):
            hvd.allreduce(x, op=hvd.Sum)
        iters = int(iters_arg)
        if iters <= 0:
            t0 = time.perf_counter()
            hvd.allreduce(x, op=hvd.Sum)
            one = float(hvd.allreduce(torch.tensor([time.perf_counter() - t0]), op=hvd.Max)[0])
            iters = int(min(200, max(int(min_iters), float(seconds) / max(one, 1e-6))))
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            hvd.allreduce(x, op=hvd.Sum)
            ts.append(time.perf_counter() - t0)
        t = float(np.median(hvd.allreduce(torch.tensor(ts), op=hvd.Max).numpy()))
        p = hvd.size()
        out.append({"algorithm": "horovod", "size_bytes": size, "ranks": p, "time_s": t,
                    "algbw_Bps": size / t, "busbw_Bps": size / t * 2 * (p - 1) / p, "correct": True})
    if hvd.rank() == 0:
        print("HOROVOD " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
