"""What the engine's process boundary costs per token: the edge engine in-process against
in its own process (a Unix socket speaking HTTP/1.1 through the worker's lean pool).

    .venv/bin/python bench/engine_transport.py [--streams 16] [--tokens 300] [--json FILE]

Processes (each started here, stopped here by PID; traffic only on 127.0.0.1): the gateway,
``python -m gateway serve``, with the embedded SmolLM2 as its edge engine
(``edge.num_threads: 1``), once in-process and once with ``edge.process: true``. For each,
``--streams`` clients each stream ``--tokens`` tokens (``ignore_eos``) at once, read to
``[DONE]``; the CPU time of each process's threads is read from ``/proc`` before and after
(and over a quiet spell before them, ``--idle-seconds``, whose rate is subtracted: the
workers poll the engine process's stats every 50 ms whether tokens flow or not):

- the *event loops* (each process's main thread): in-process, the gateway's relay of the
  engine's tokens; in its own process, the worker's relay (its read of the engine's SSE
  from the Unix socket, and its write to the client) plus the engine process's server
  (serialising each token as an SSE event and writing it to the socket);
- the *engine*: every other thread (the step thread and torch's), the model's work.

Per token, the event loops' CPU is what carrying a token costs; the difference between
the two modes is the process boundary's cost, to set against the engine's own CPU per
token. That comparison is what a cheaper transport (shared memory) would have to win.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.edge_contention import start_ready  # noqa: E402
from bench.overload import free_port, stop  # noqa: E402

MODEL = "smollm2-135m-instruct"
CLK = os.sysconf("SC_CLK_TCK")


def gateway_config(port: int, process: bool) -> dict:
    edge = {"enabled": True, "num_threads": 1, "max_num_seqs": 32, "process": process}
    return {"listen": {"host": "127.0.0.1", "port": port, "log_level": "warning"}, "cache": {"backend": "off"}, "edge": edge}


def thread_cpu(pid: int) -> tuple[float, float]:
    """(main thread, other threads) CPU seconds of ``pid``."""
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / CLK  # utime, stime
        if int(tid) == pid:
            main += seconds
        else:
            other += seconds
    return main, other


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the supervisor's workers and engine)."""
    pids = [pid]
    for p in pids:
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return pids


def cpu(pids: list[int]) -> tuple[float, float]:
    mains, others = zip(*(thread_cpu(p) for p in pids))
    return sum(mains), sum(others)


def stream(port: int, tokens: int, counts: list[int]) -> None:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": tokens, "stream": True, "ignore_eos": True}
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        data = b""
        while b"data: [DONE]" not in data[-64:]:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    counts.append(data.count(b'"content":'))


def measure(process: bool, args, workdir: str) -> dict:
    port = free_port()
    gw = start_ready(gateway_config(port, process), port, workdir)
    try:
        warm: list[int] = []
        stream(port, 8, warm)
        pids = tree(gw.pid)
        quiet = cpu(pids)
        time.sleep(args.idle_seconds)  # what the event loops spend with nothing to relay (polls, timers)
        before = cpu(pids)
        idle_cores = (before[0] - quiet[0]) / args.idle_seconds
        counts: list[int] = []
        threads = [threading.Thread(target=stream, args=(port, args.tokens, counts)) for _ in range(args.streams)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
        after = cpu(pids)
    finally:
        stop(gw)
    tokens = sum(counts)
    loops, engine = after[0] - before[0], after[1] - before[1]
    return {
        "engine": "own process" if process else "in-process",
        "streams": len(counts),
        "tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "idle_loop_cores": round(idle_cores, 4),
        "loops_us_per_token": round(loops / tokens * 1e6, 1),
        "loops_above_idle_us_per_token": round((loops - idle_cores * wall) / tokens * 1e6, 1),
        "engine_us_per_token": round(engine / tokens * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="quiet spell measured first, subtracted")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for process in (False, True):
            rows.append(measure(process, args, workdir))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| engine | tokens | tokens/s | event loops idle (cores) | event loops µs/token (above idle) | engine threads µs/token |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['tokens']} | {r['tokens_per_s']} | {r['idle_loop_cores']} | "
            f"{r['loops_us_per_token']} ({r['loops_above_idle_us_per_token']}) | {r['engine_us_per_token']} |"
        )
    boundary = rows[1]["loops_above_idle_us_per_token"] - rows[0]["loops_above_idle_us_per_token"]
    print(f"\nthe process boundary: {boundary:+.1f} µs of event-loop CPU per token, "
          f"{100 * boundary / rows[0]['engine_us_per_token']:+.1f} % of the engine's own CPU per token")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
