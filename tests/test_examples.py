"""The engine example runs as documented (the Horovod examples are covered in tests/horovod)."""
import sys
from pathlib import Path

from mcallreduce.launch import run

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_allreduce_basic_example():
    r = run(3, [sys.executable, str(EXAMPLES / "allreduce_basic.py")], timeout=120)
    assert r.returncode == 0 and "ok: 3 ranks" in r.stdout, r.stdout + r.stderr


def test_the_imagenet_example_differs_between_its_data_modes_by_at_most_six_lines():
    """docs/e2e.md shows this diff: a user's script changes its dataset and sampler lines only."""
    import difflib
    lines = (EXAMPLES / "pytorch_imagenet_resnet50.py").read_text().splitlines()
    start = lines.index('    if args.data == "folder":')
    middle = lines.index("    else:", start)
    end = next(i for i in range(middle + 1, len(lines)) if not lines[i].startswith("        "))
    folder, memory = lines[start + 1:middle], lines[middle + 1:end]
    changed = [d for d in difflib.unified_diff(folder, memory, lineterm="", n=0)
               if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    assert folder and memory and len(changed) // 2 <= 6, changed
