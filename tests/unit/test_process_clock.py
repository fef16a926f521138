"""``--time-limit`` counts from the process's start: the clock that says when that was."""
import subprocess
import sys
import time

from planner.commands._common import process_age_s, process_started_s

CHILD = ("import time; time.sleep(0.6); "
         "from planner.commands._common import process_age_s, process_started_s; "
         "print(process_age_s(), time.perf_counter() - process_started_s())")


def test_a_process_age_includes_what_ran_before_the_question():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    age_s, since_start_s = map(float, done.stdout.split())
    assert age_s >= 0.6  # the sleep and the imports before it, which the process's own timers never saw
    assert abs(since_start_s - age_s) < 0.1


def test_this_process_started_before_now_and_its_age_grows():
    assert process_started_s() < time.perf_counter()
    first = process_age_s()
    time.sleep(0.05)
    assert process_age_s() > first
