"""mcallreduce: the multi-color allreduce of Kumar et al. 2017 over MPI.

    import mcallreduce
    mcallreduce.allreduce(buf)                      # in place, sum over COMM_WORLD
    h = mcallreduce.allreduce_async(buf, op="average"); ...; h.wait()
"""
__version__ = "0.1.0"
