"""The xinfer-launch supervisor: the named process tree, ordered start-up, start-up failures,
the death of the API, of the supervisor itself, and the restart window. A tiny random Llama
keeps each launch short; the drain on SIGTERM is tested in test_server.py."""
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import free_port, start_server

CHILDREN = {"xinfer::worker-fork", "xinfer::detokenizer", "xinfer::parser"}


def _title(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
        return cmd[0] if cmd else ""
    except psutil.Error:
        return ""


def _tree(pid: int) -> list[psutil.Process]:
    """The xinfer processes under `pid` (not the resource tracker multiprocessing may start)."""
    return [c for c in psutil.Process(pid).children(recursive=True) if _title(c).startswith("xinfer::")]


def _named(pid: int, title: str) -> psutil.Process:
    found = [c for c in _tree(pid) if _title(c) == title]
    assert len(found) == 1, [_title(c) for c in _tree(pid)]
    return found[0]


def _survivors(procs, within: float) -> list[str]:
    """Wait up to `within` seconds for every process to be gone (a zombie has no title)."""
    deadline = time.time() + within
    while True:
        alive = [f"{_title(p)} ({p.pid})" for p in procs if _title(p).startswith("xinfer::")]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def _runtime_dir(supervisor: psutil.Process) -> str:
    paths = [c.laddr for c in supervisor.net_connections(kind="unix") if c.laddr.endswith("/launch")]
    assert len(paths) == 1
    return os.path.dirname(paths[0])


@pytest.fixture
def launched(request):
    """Start procs through start_server; whatever is left is killed at the end."""
    started = []

    def launch(*args):
        proc, base, saw_503 = start_server(*args)
        started.append((proc, _tree(proc.pid)))
        return proc, base, saw_503

    yield launch
    for proc, tree in started:
        for p in [proc, *tree]:
            try:
                p.kill()
            except (OSError, psutil.Error):
                pass
        proc.wait(10)


def test_named_tree_ordered_start_and_kill_9_of_the_supervisor(launched, tiny_llama_path):
    """xinfer::launch -> xinfer::api, xinfer::scheduler -> worker-fork (-> worker-0), detokenizer, parser; /health
    is 503 before 200; after kill -9 of the supervisor every child is gone within 5 s."""
    proc, base, saw_503 = launched("--m", tiny_llama_path)
    assert saw_503  # the API listens first and answers 503 while the model loads
    sup = psutil.Process(proc.pid)
    assert _title(sup) == "xinfer::launch"
    # (the other child, multiprocessing's resource tracker, exits with the last of them)
    assert sorted(_title(c) for c in sup.children() if _title(c).startswith("xinfer::")) == \
        ["xinfer::api", "xinfer::scheduler"]
    sched = _named(proc.pid, "xinfer::scheduler")
    assert {_title(c) for c in sched.children() if _title(c).startswith("xinfer::")} == CHILDREN
    assert [_title(c) for c in _named(proc.pid, "xinfer::worker-fork").children()] == ["xinfer::worker-0"]
    assert not _named(proc.pid, "xinfer::api").children()
    rundir = _runtime_dir(sup)
    assert os.stat(rundir).st_mode & 0o777 == 0o700
    tree = _tree(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert _survivors(tree, 5) == []


def test_kill_9_of_the_api_stops_everything_nonzero(launched, tiny_llama_path):
    proc, base, _ = launched("--m", tiny_llama_path)
    rundir = _runtime_dir(psutil.Process(proc.pid))
    tree = _tree(proc.pid)
    os.kill(_named(proc.pid, "xinfer::api").pid, signal.SIGKILL)
    assert proc.wait(60) == 1
    out = proc.stdout.read()
    assert "xinfer::api exited unexpectedly" in out and "Traceback" not in out
    assert _survivors(tree, 5) == []
    assert not os.path.exists(rundir)


def _launch_until_exit(*args):
    """Run a launch that should fail; returns (exit code, output, every process its tree had)."""
    proc = subprocess.Popen([sys.executable, "-m", "xinfer.cli", "--log-level", "warning", "serve",
                             "--port", str(free_port()), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen: dict[int, psutil.Process] = {}
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:  # collect the tree as it grows
        try:
            for c in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(c.pid, c)
        except psutil.Error:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(), proc.stdout.read(), list(seen.values())


def test_bad_model_path_stops_the_launch_with_its_message():
    code, out, seen = _launch_until_exit("--m", "/no/such/model")
    assert code == 1
    assert "xinfer: error: xinfer::api failed to start: model '/no/such/model' not found" in out
    assert "Traceback" not in out
    assert _survivors(seen, 5) == []


def test_bad_flag_caught_at_load_stops_the_launch(tiny_llama_path):
    """--attention-backend is only checked when the worker loads the model: the worker's own
    error reaches the user, and nothing is left running."""
    code, out, seen = _launch_until_exit("--m", tiny_llama_path, "--attention-backend", "bogus")
    assert code == 1
    assert "xinfer: error: xinfer::worker-0 failed to start: ValueError: unknown attention backend 'bogus'" in out
    assert "Traceback" not in out
    assert _survivors(seen, 5) == []


def test_startup_timeout_stops_the_launch(tiny_llama_path):
    # The API process starts in well under a second (it imports no torch): a tiny limit stops the launch
    # while the API or the scheduler is still starting
    code, out, seen = _launch_until_exit("--m", tiny_llama_path, "--startup-timeout", "0.05")
    assert code == 1
    assert re.search(r"xinfer: error: start-up timed out after 0\.05s waiting for xinfer::(api|scheduler) ", out)
    assert "Traceback" not in out
    assert _survivors(seen, 5) == []


def test_too_many_restarts_in_the_window_shut_down_cleanly(launched, tiny_llama_path):
    """--max-restarts 1 --restart-window 60: the first worker death is repaired, the second
    stops the server with a message naming the child, exit code 1, nothing left running."""
    proc, base, _ = launched("--m", tiny_llama_path, "--max-restarts", "1", "--restart-window", "60")
    tree = _tree(proc.pid)
    first = _named(proc.pid, "xinfer::worker-0")
    first.kill()
    deadline = time.time() + 60  # the scheduler replaces a worker that died while idle
    while time.time() < deadline:
        new = [c for c in _tree(proc.pid) if _title(c) == "xinfer::worker-0" and c.pid != first.pid]
        if new:
            break
        time.sleep(0.1)
    assert new, "the worker was not restarted"
    assert proc.poll() is None
    tree += new
    new[0].kill()
    assert proc.wait(60) == 1
    out = proc.stdout.read()
    assert "xinfer::worker-0 died" in out and "more than --max-restarts 1" in out, out
    assert "Traceback" not in out
    assert _survivors(tree, 5) == []
