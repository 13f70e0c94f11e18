"""``python -m mcallreduce.bench``: the allreduce benchmark (run it under mpirun), and

    python -m mcallreduce.bench tune     # write the model-based tuning table (docs/data/tuning.json)
    python -m mcallreduce.bench report   # emulated-cluster sweep + model -> docs/benchmarks.md (root)
    python -m mcallreduce.bench ddp      # DDP on gloo vs the multicolor hook / backend (docs/ddp.md)
    python -m mcallreduce.bench e2e      # the ImageNet example's ablation on the emulated cluster (docs/e2e.md)
    python -m mcallreduce.bench accuracy # top-1 on real digits: folder vs memory shuffles, stock vs plugin

    python -m mcallreduce.launch -np 2 -- python -m mcallreduce.bench --sizes 4K,1M,64M
"""
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tune"]:
        from .tune import main as tune_main
        return tune_main(argv[1:])
    if argv[:1] == ["report"]:
        from .report import main as report_main
        return report_main(argv[1:])
    if argv[:1] == ["ddp"]:
        from .ddp import main as ddp_main
        return ddp_main(argv[1:])
    if argv[:1] == ["accuracy"]:
        from .accuracy import main as accuracy_main
        return accuracy_main(argv[1:])
    if argv[:1] == ["e2e"]:
        from .e2e import main as e2e_main
        return e2e_main(argv[1:])
    from .allreduce import main as allreduce_main
    return allreduce_main(argv)


if __name__ == "__main__":
    sys.exit(main())
