"""`strata serve` stops within 10 s of a real signal, with every Ray process it started gone.

A signal to the process group (a supervisor's ``kill -TERM -PGID``) reaches the embedded Ray's
GCS and raylet too; the server used to wait a minute for the GCS that had already exited.
``tests/e2e/test_serve.py`` stops its server with Ctrl-C to the group (SIGINT) through the same
checks (``stop_and_check``)."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args: list[str], log: Path, port: int) -> subprocess.Popen:
    """``strata serve`` in a session of its own, as a terminal or a supervisor starts it;
    returns once it answers /health (at most 180 s)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "serve", *args, "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"strata serve exited early:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail(f"strata serve did not become healthy:\n{log.read_text()[-3000:]}")


def started_processes(process: subprocess.Popen) -> list[psutil.Process]:
    """Every process ``process`` started (its embedded Ray: GCS, raylet, agents, workers), and
    any other process of that Ray session (found by its session name on the command line)."""
    tree = psutil.Process(process.pid).children(recursive=True)
    sessions = {
        arg.split("=", 1)[1]
        for p in tree
        for arg in _cmdline(p)
        if arg.startswith("--session-name=")
    }
    assert sessions, "no Ray session among the server's processes"
    same_session = [
        p
        for p in psutil.process_iter()
        if any(name in arg for arg in _cmdline(p) for name in sessions)
    ]
    return list({p.pid: p for p in [*tree, *same_session]}.values())


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_and_check(
    process: subprocess.Popen, sig: signal.Signals, *, to_group: bool, log: Path
) -> None:
    """Sends ``sig`` to the server (its process group, or its pid only) and checks that it
    exits with status 0 within ``STOP_WITHIN_S`` and that no process it started runs on."""
    started = started_processes(process)
    sent = time.monotonic()
    if to_group:
        os.killpg(process.pid, sig)
    else:
        process.send_signal(sig)
    try:
        code = process.wait(timeout=STOP_WITHIN_S)
        took = time.monotonic() - sent
        assert code == 0, f"exit {code}:\n{log.read_text()[-3000:]}"
        left = [p for p in started if _running(p)]
        assert not left, f"still running after {took:.1f} s: {[p.name() for p in left]}"
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit within {STOP_WITHIN_S} s of {sig.name}:\n{log.read_text()[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        for leftover in started:  # only what this test's server started
            if _running(leftover):
                leftover.kill()


def test_sigterm_to_the_process_group_stops_serve_and_its_ray(tmp_path):
    log = tmp_path / "serve.log"
    process = start_serve(["tiny", "-dp", "1", "--num-cpus", "1"], log, free_port())
    stop_and_check(process, signal.SIGTERM, to_group=True, log=log)
    assert "strata: stopped" in log.read_text()
