"""``die_with_parent`` in a child of PID 1: a container's init (``zserve up`` as the entrypoint, an engine pod
starting its grammar compiler) is a live parent, not the sign of a dead one. Run in a PID namespace of the
test's own, where the parent is PID 1 for real."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

_PARENT = textwrap.dedent(
    """
    import subprocess, sys
    from zserve.transport import child_env
    child = "from zserve.transport import die_with_parent; die_with_parent(); print('alive', flush=True)"
    env = child_env() if sys.argv[1] == "named" else None
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60)
    print(f"pid={__import__('os').getpid()} rc={out.returncode} out={out.stdout.strip()}")
    """
)


def _in_pid_namespace(mode: str) -> str:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _PARENT, mode],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip("unshare --pid is not permitted here")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_child_of_pid_1_that_names_its_parent_lives():
    assert _in_pid_namespace("named") == "pid=1 rc=0 out=alive"


def test_without_the_parent_named_a_parent_of_1_still_reads_as_dead():
    # the rule for children started by something else than zserve: re-parented to init means orphaned
    assert _in_pid_namespace("unnamed") == "pid=1 rc=-15 out="
