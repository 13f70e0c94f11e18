"""``python -m mcallreduce.bench``: the allreduce benchmark (run it under mpirun), and its subcommands.

    python -m mcallreduce.launch -np 2 -- python -m mcallreduce.bench --sizes 4K,1M,64M
"""
import importlib
import sys

# subcommand (and its module under mcallreduce.bench) -> what it does; the --help epilog is made from it
COMMANDS = {
    "tune": "the tuning table: from the cost model, or --measure on this cluster",
    "report": "emulated-cluster sweep + model -> docs/report.md (root)",
    "ddp": "DDP on gloo vs the multicolor hook / backend (docs/ddp.md)",
    "e2e": "the ImageNet example's ablation on the emulated cluster (docs/e2e.md)",
    "accuracy": "top-1 on real digits: folder vs memory shuffles, stock vs plugin",
    "goals": "the allreduce's goals measured again, layout by layout (docs/benchmarks.md)",
    "loader-start": "a DataLoader's first batch per epoch: new, preloaded, persistent workers",
}
_WIDTH = max(map(len, COMMANDS)) + 1
SUBCOMMANDS = "".join(f"    python -m mcallreduce.bench {name:<{_WIDTH}}# {what}\n" for name, what in COMMANDS.items())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in COMMANDS:
        module = importlib.import_module(f".{argv[0].replace('-', '_')}", __package__)
        return module.main(argv[1:])
    from .allreduce import main as allreduce_main
    return allreduce_main(argv)


if __name__ == "__main__":
    sys.exit(main())
