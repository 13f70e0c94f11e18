"""``python -m mcallreduce.bench``: the allreduce benchmark (run it under mpirun).

    python -m mcallreduce.launch -np 2 -- python -m mcallreduce.bench --sizes 4K,1M,64M
"""
import sys

from .allreduce import main as allreduce_main


def main(argv=None) -> int:
    return allreduce_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
