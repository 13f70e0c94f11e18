"""The per-thread CPU sampler tells a job's threads apart: main, progress, other, workers."""
import subprocess
import sys
import textwrap
import time

from mcallreduce.bench.thread_cpu import ThreadCpu

# A "rank" whose progress thread (named as the engine names it) and a worker process each burn
# about a CPU-second, and whose main thread only sleeps.
JOB = textwrap.dedent("""
    import multiprocessing, sys, threading, time
    from mcallreduce.engine import PROGRESS_THREAD_OS_NAME, _name_os_thread

    def burn(seconds, name=None):
        if name:
            _name_os_thread(name)
        clock = time.thread_time if name else time.process_time
        end = clock() + seconds
        while clock() < end:
            pass

    if __name__ == "__main__":
        worker = multiprocessing.get_context("fork").Process(target=burn, args=(1.0,))
        worker.start()
        thread = threading.Thread(target=burn, args=(1.0, PROGRESS_THREAD_OS_NAME))
        thread.start()
        thread.join()
        worker.join()
        time.sleep(0.5)
""")


def test_sampler_splits_a_jobs_cpu_by_kind_of_thread(tmp_path):
    script = tmp_path / "fake_rank_job.py"
    script.write_text(JOB)
    sampler = ThreadCpu(script.name, interval=0.05)
    sampler.start()
    subprocess.run([sys.executable, str(script)], check=True, timeout=60)
    time.sleep(0.1)
    cpu = sampler.stop()
    seconds = {kind: v["user_s"] + v["system_s"] for kind, v in cpu["threads"].items()}
    assert 0.8 <= seconds["progress"] <= 1.3, seconds
    assert 0.8 <= seconds["workers"] <= 1.3, seconds
    assert seconds["main"] < 0.8 and seconds["other"] < 0.3, seconds   # start-up imports only
    assert cpu["wall_s"] >= 1.0 and cpu["machine"]["busy_s"] >= sum(seconds.values()) * 0.9, cpu
