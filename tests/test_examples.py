"""The engine example runs as documented (the Horovod examples are covered in tests/horovod)."""
import sys
from pathlib import Path

from mcallreduce.launch import run

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_allreduce_basic_example():
    r = run(3, [sys.executable, str(EXAMPLES / "allreduce_basic.py")], timeout=120)
    assert r.returncode == 0 and "ok: 3 ranks" in r.stdout, r.stdout + r.stderr
