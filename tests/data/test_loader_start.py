"""``python -m mcallreduce.bench loader-start``: a real 2-rank job per arm that writes the record its
docs table comes from."""
import json
import subprocess
import sys


def test_loader_start_times_every_epoch_of_every_rank_and_arm(packed, tmp_path):
    out = tmp_path / "loader-start.json"
    r = subprocess.run([sys.executable, "-m", "mcallreduce.bench", "loader-start", "--store", packed[0], "-np", "2",
                        "--arms", "none,persistent", "--runs", "1", "--epochs", "2", "--workers", "1",
                        "--batch-size", "16", "--image-size", "32", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads(out.read_text())
    assert record["argv"][:4] == ["python", "-m", "mcallreduce.bench", "loader-start"]
    assert [(row["arm"], row["rank"]) for row in record["runs"]] == [
        ("none", 0), ("none", 1), ("persistent", 0), ("persistent", 1)]
    assert all(len(row["seconds"]) == 2 and min(row["seconds"]) > 0 for row in record["runs"])
    rows = [line.split(" | ")[0] for line in record["table"].splitlines()[2:]]
    assert rows == ["| none", "| persistent"]


def test_loader_start_refuses_an_unknown_arm_before_starting_a_job(packed):
    r = subprocess.run([sys.executable, "-m", "mcallreduce.bench", "loader-start", "--store", packed[0],
                        "--arms", "none,eager"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown arm(s) eager" in r.stderr, r.stderr
