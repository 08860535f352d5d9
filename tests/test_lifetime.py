"""common/lifetime.py: a child that called die_with_parent is killed by the kernel when its parent
dies, even while it is blocked (here in a sleep that never polls)."""

import os
import subprocess
import sys
import time

import pytest

CHILD = (
    "import os, sys, time; from pdserve.common.lifetime import die_with_parent; "
    "die_with_parent(int(sys.argv[1])); print('armed', flush=True); time.sleep(600)"
)
PARENT = """import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(__import__("os").getpid())],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
__import__("time").sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_blocked_child_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the child outlived its parent"
    finally:
        parent.kill()


def test_a_child_whose_parent_is_already_gone_exits():
    # Not our parent's pid: as if the parent had died before the call.
    code = subprocess.run(
        [sys.executable, "-c", CHILD, str(os.getpid() + 999999)], capture_output=True, timeout=60
    ).returncode
    assert code == 1
