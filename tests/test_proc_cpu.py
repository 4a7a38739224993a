"""lazy_rag.bench.proc_cpu: a busy child process's CPU time is found and grouped by its command line."""
import subprocess
import sys
import time

import pytest

from lazy_rag.bench.proc_cpu import cores_by_group, process_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def test_a_busy_process_is_counted_in_its_group_and_an_idle_one_is_not():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass",
                             "busy-marker"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)", "idle-marker"])
    try:
        time.sleep(0.2)
        before = process_cpu()
        assert busy.pid in before and idle.pid in before
        time.sleep(1.0)
        after = process_cpu()
    finally:
        busy.wait(), idle.wait()

    def classify(pid, cmd):
        return "busy" if "busy-marker" in cmd else "idle" if "idle-marker" in cmd else None

    cores = cores_by_group(before, after, 1.0, classify)
    assert set(cores) == {"cpu_cores_busy", "cpu_cores_busy_busiest", "cpu_cores_idle", "cpu_cores_idle_busiest"}
    # a spinning interpreter: about one core on a quiet machine, but a share of one when the
    # machine's cores are taken (0.26 seen with the suite's two workers and another job on 2 cores)
    assert cores["cpu_cores_busy"] > 0.15
    assert cores["cpu_cores_idle"] < 0.2 and cores["cpu_cores_busy"] > 2 * cores["cpu_cores_idle"]
    assert cores["cpu_cores_busy"] == cores["cpu_cores_busy_busiest"]  # one process in the group


def test_a_process_that_started_between_the_snapshots_counts_from_zero_and_groups_sum():
    before = {1: ("a", 10.0)}
    after = {1: ("a", 11.0), 2: ("a", 0.5), 3: ("b", 4.0), 4: ("skip", 9.0)}
    cores = cores_by_group(before, after, 2.0, lambda pid, cmd: None if cmd == "skip" else cmd)
    assert cores == {"cpu_cores_a": 0.75, "cpu_cores_a_busiest": 0.5, "cpu_cores_b": 2.0, "cpu_cores_b_busiest": 2.0}
    with pytest.raises(ValueError):
        cores_by_group(before, after, 0, lambda pid, cmd: cmd)
