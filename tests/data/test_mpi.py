"""The store under real mpirun jobs (launched by mcallreduce.launch): one shared copy per host,
no shared memory left behind, the memory budget, and the cross-host exchange."""
import glob
import json
import os

from _mpi import run_job

JOB = os.path.join(os.path.dirname(__file__), "mpi_job.py")


def mpi(np_, scenario, path, env=None, ok=True):
    env = {"MCALLREDUCE_DATA_PROGRESS": "0", **(env or {})}
    # -m mpi4py: an unhandled exception on one rank aborts the job (else its peers wait forever).
    result = run_job(np_, JOB, scenario, path, timeout=150, env=env, abort_on_exception=True)
    if ok:
        assert result.returncode == 0, result.stderr[-4000:]
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(chunk)[0] for chunk in result.stdout.split("RESULT ")[1:]]   # lines may interleave
    return result, sorted(rows, key=lambda r: r["rank"])


def our_segments():
    return glob.glob("/dev/shm/mcallreduce-data-*")


def test_two_ranks_on_a_host_share_one_copy(packed):
    path, report = packed
    before = set(our_segments())
    _, rows = mpi(2, "shared", path)
    assert len(rows) == 2 and {r["local_size"] for r in rows} == {2} and {r["hosts"] for r in rows} == {1}
    size = rows[0]["segment_bytes"]
    assert size >= report.blob_bytes
    for r in rows:
        assert r["blob_crc"] == r["file_crc"]           # bytes identical to the file's blob
        assert r["segment_rss"] >= 0.95 * size            # each rank maps (and touched) all of it ...
        assert r["names_left"] == []                      # ... and the name is already gone
    total = sum(r["segment_pss"] for r in rows)
    assert total <= 1.1 * size                            # ... yet the host holds it once, not twice
    assert set(our_segments()) <= before


def test_no_segment_left_when_a_rank_raises(packed):
    before = set(our_segments())
    result, rows = mpi(2, "raise", packed[0], ok=False)
    assert result.returncode != 0 and "fails on purpose" in result.stderr
    assert [r["names_left"] for r in rows] == [[], []]
    assert set(our_segments()) <= before


def test_memory_budget_error_is_clear_and_collective(packed):
    _, rows = mpi(2, "budget", packed[0], env={"MCALLREDUCE_DATA_MEMORY_LIMIT": "1M"})
    assert len(rows) == 2
    for r in rows:
        assert r["error"] and "needs" in r["error"] and "bytes" in r["error"] and "MCALLREDUCE_DATA_MEMORY_LIMIT" in r["error"]
        assert r["names_left"] == []


def test_damaged_blob_fails_on_every_rank(packed, copy_of):
    from mcallreduce.data import StoreFile
    damaged = copy_of(packed[0])
    f = StoreFile(damaged)
    with open(damaged, "r+b") as out:
        out.seek(f.blob_offset + f.blob_bytes // 2)
        out.write(b"\x00\x01\x02\x03")
    before = set(our_segments())
    _, rows = mpi(2, "corrupt", damaged)
    assert len(rows) == 2 and all("CRC32" in r["error"] for r in rows)
    assert set(our_segments()) <= before


def test_two_emulated_hosts_exchange_samples_for_global_and_partial_shuffles(packed):
    _, rows = mpi(4, "exchange", packed[0], env={"MCALLREDUCE_RANKS_PER_HOST": "2"})
    assert len(rows) == 4 and rows[0]["hosts"] == 2
    n = rows[0]["total"]
    assert sum(r["held"] for r in rows[::2]) == n                 # the two hosts split the set
    assert abs(rows[0]["held"] - n / 2) <= 1
    for epoch in (0, 1):
        for mode in ("local", "global", "partial"):
            key = f"{mode}{epoch}"
            assert {r[key]["n"] for r in rows} == {-(-n // 4)}
            assert all(r[key]["bad"] == 0 for r in rows)          # every byte read equals the file's
            assert set().union(*(r[key]["order"] for r in rows)) == set(range(n))
        assert all(r[f"local{epoch}"]["foreign"] == 0 for r in rows)       # local: no traffic
        assert all(r[f"global{epoch}"]["same_as_distributedsampler"] for r in rows)
        assert sum(r[f"global{epoch}"]["foreign"] for r in rows) > n / 4    # about half came from the other host
        assert 0 < sum(r[f"partial{epoch}"]["foreign"] for r in rows) < sum(r[f"global{epoch}"]["foreign"] for r in rows)
    assert all(r["loader_shapes"] == [[3, 224, 224]] for r in rows)


def test_validation_on_a_store_split_across_hosts_visits_every_sample(packed):
    _, rows = mpi(4, "validate", packed[0], env={"MCALLREDUCE_RANKS_PER_HOST": "2"})
    assert len(rows) == 4
    n = rows[0]["n"]
    for r in rows:     # a stock DistributedSampler hits samples of the other host: told what to use instead
        assert r["stock_error"] and "stock DistributedSampler" in r["stock_error"] and "partition='full'" in r["stock_error"]
        assert r["read"] == len(r["order"]) == -(-n // 4)          # DistributedSampler's length on every rank
    visited = [i for r in rows for i in r["order"]]
    assert set(visited) == set(range(n))                            # every sample once ...
    assert len(visited) - n < 4                                      # ... plus at most the padding
