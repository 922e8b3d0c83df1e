"""Launching WORLD processes on loopback (gloo, CPU), as torchrun would, for the
distributed tests: a free port, the environment torchrun sets, a watchdog, and
one fresh launch when the ranks hung (a stalled rendezvous on a busy machine
tells itself apart from a hang hmp causes, which hangs again)."""

import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(rank, port, world=WORLD):
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        # tests/ too: a worker imports the helpers package as the tests do
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    return env


def launch(out_dir, worker, args, ranks=WORLD, timeout=150, env=None):
    """Start ``ranks`` processes of ``worker`` on a free port (``ranks=1``: one
    process that starts the others itself, as Lightning does); return
    (returncode, output) per process, with a negative code for one killed
    after ``timeout`` seconds (the workers' own watchdogs fire earlier)."""
    port = free_port()
    procs = []
    for rank in range(ranks):
        rank_env = env_for(rank, port)
        if ranks == 1:  # the launcher sets the ranks of what it starts
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                rank_env.pop(k)
        rank_env.update(env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), str(out_dir), *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # the launcher's children go with it when it is killed
            )
        )
    results = []
    try:
        for p in procs:
            try:
                out = p.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                out = p.communicate()[0]
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return results


def hung(results):
    # faulthandler's watchdog in the worker prints this before it exits
    return any(re.search(r"^Timeout \(\d+:\d\d:\d\d\)!", out, re.M) or code < 0 for code, out in results)


def run_ranks(out_dir, worker, *args, **kwargs):
    """launch(), once more if the ranks hung; assert every process exited 0. Returns the outputs."""
    results = launch(out_dir, worker, args, **kwargs)
    if hung(results):
        first = "\n".join(f"rank {r} (exit {code}):\n{out}" for r, (code, out) in enumerate(results))
        warnings.warn(f"the ranks hung once; launched again. Their output:\n{first}", stacklevel=2)
        results = launch(out_dir, worker, args, **kwargs)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} failed (exit {code}):\n{out}"
    return [out for _, out in results]
