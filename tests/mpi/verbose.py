"""MCALLREDUCE_VERBOSE=1: rank 0 reports each new kind of allreduce once, on stderr."""
import numpy as np, mcallreduce
x = np.ones(1 << 20, np.float32)
mcallreduce.allreduce(x); mcallreduce.allreduce(x)
