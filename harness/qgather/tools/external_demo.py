"""The same cases on the single-process rank pools and under torchrun agents: identical verdicts?

    python -m qgather.tools.external_demo --device cuda --nnodes 2 --nproc-per-node 1 \\
        --world-sizes 1,2 -- cases/test_alignment.py --formats nvfp4_2d

runs the pytest arguments after `--` twice, each time writing every case's verdict as JSON:
once as a plain pytest (RankPool: one process spawns each world size's ranks), once under
`--nnodes` torchrun agents on this host with a static rendezvous (each agent a "node" of its
own, with its own GPUs on CUDA), then prints one line comparing the verdicts and exits 1 on any
difference, on a launched rank's non-zero exit code, or when one of the runs did not finish.
`--as-rank DIR -- ARGS` is what each launched rank runs: pytest, then its exit code into DIR.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]  # harness/qgather/tools/ -> the checkout
# Launcher state that must not leak into the runs from an enclosing job (or an xdist worker).
INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST",
             "PYTEST_ADDOPTS", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_LOCALID", "SLURM_NODEID")


@dataclass
class Launched:
    """What a launched run left: per-agent exit codes, per job rank exit codes and output."""

    agent_codes: list[int | None]
    rank_codes: dict[int, int] = field(default_factory=dict)
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    agent_logs: list[str] = field(default_factory=list)
    seconds: float = 0.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "harness"), env.get("PYTHONPATH")]))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra)
    return env


def pool_run(pytest_args: list[str], json_path: Path, timeout: float, env: dict[str, str]) -> tuple[int | None, str]:
    """The cases as a plain pytest: (exit code or None on timeout, output)."""
    return finish_pool_run(start_pool_run(pytest_args, json_path, env), timeout)


def start_pool_run(pytest_args: list[str], json_path: Path, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "pytest", *pytest_args, "--qgather-json", str(json_path)]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def finish_pool_run(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        return None, ""
    finally:
        _kill_group(proc)


def launch(pytest_args: list[str], out: Path, nnodes: int, nproc: int, timeout: float, env: dict[str, str],
           gpus_per_agent: list[str] | None = None) -> Launched:
    """`nnodes` torchrun agents on this host (static rendezvous, node ranks 0..nnodes-1), each
    running pytest with `pytest_args` on `nproc` ranks; waits at most `timeout` seconds."""
    port, codes_dir = free_port(), out / "codes"
    codes_dir.mkdir(parents=True, exist_ok=True)
    agents, logs = [], []
    start = time.monotonic()
    try:
        for node in range(nnodes):
            agent_env = dict(env, TMPDIR=str(out))
            if gpus_per_agent is not None:
                agent_env["CUDA_VISIBLE_DEVICES"] = gpus_per_agent[node]
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                       "--nproc-per-node", str(nproc), "--node-rank", str(node), "--master-addr", "127.0.0.1",
                       "--master-port", str(port), "--max-restarts", "0", "--log-dir", str(out / f"agent{node}"),
                       "--redirects", "3", "-m", "qgather.tools.external_demo", "--as-rank", str(codes_dir), "--",
                       *pytest_args]
            log = out / f"agent{node}.log"
            logs.append(log)
            with open(log, "w") as fh:
                agents.append(subprocess.Popen(command, cwd=REPO, env=agent_env, stdout=fh, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))
        agent_codes = _wait_all(agents, start + timeout)
    finally:
        for agent in agents:
            _kill_group(agent)
    result = Launched(agent_codes, seconds=time.monotonic() - start,
                      agent_logs=[p.read_text(errors="replace") for p in logs])
    for node in range(nnodes):
        for local in range(nproc):
            rank = node * nproc + local
            for name, into in (("stdout", result.stdout), ("stderr", result.stderr)):
                found = sorted((out / f"agent{node}").glob(f"**/attempt_0/{local}/{name}.log"))
                into[rank] = found[-1].read_text(errors="replace") if found else ""
    for path in codes_dir.glob("rank*.code"):
        result.rank_codes[int(path.stem[4:])] = int(path.read_text().split()[0])
    return result


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> list[int | None]:
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def _kill_group(proc: subprocess.Popen) -> None:
    """The process and everything in its session (an agent's ranks)."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=10)
            if signum == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a session whose leader left
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        break


def verdicts(path: Path) -> dict[str, str]:
    return {r["case"]: r["verdict"] for r in json.loads(path.read_text())} if path.exists() else {}


def placements(path: Path) -> dict[str, str]:
    return {r["case"]: r.get("placement", "") for r in json.loads(path.read_text())} if path.exists() else {}


def compare(pool: dict[str, str], launched: dict[str, str]) -> list[str]:
    """Differences, one line each (empty: identical)."""
    lines = [f"{case}: pool {pool.get(case, 'missing')}, launched {launched.get(case, 'missing')}"
             for case in sorted(set(pool) | set(launched)) if pool.get(case) != launched.get(case)]
    return lines


def _as_rank(codes_dir: str, pytest_args: list[str]) -> int:
    # This module imported qgather before pytest could mark it for assertion rewriting: nothing to warn about.
    code = int(pytest.main(["-W", "ignore:Module already imported so cannot be rewritten; qgather"
                                  ":pytest.PytestAssertRewriteWarning", *pytest_args]))
    rank = os.environ.get("RANK", "x")
    Path(codes_dir, f"rank{rank}.code").write_text(f"{code} {time.time()}")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m qgather.tools.external_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--as-rank", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--case-timeout", type=float, default=None)
    parser.add_argument("--out", default=None, help="directory for the JSON verdicts and logs (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds for each of the two runs")
    args = parser.parse_args(ours)
    if args.as_rank:
        code = _as_rank(args.as_rank, pytest_args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    started = time.monotonic()
    try:
        return _demo(args, pytest_args or ["cases/test_alignment.py", "--formats", "nvfp4_2d"])
    except KeyboardInterrupt:
        # The runs' process groups are gone by now (each run's finally); say so in one line.
        print(f"external_demo: interrupted after {time.monotonic() - started:.0f} s, before its comparison; "
              "no verdicts compared", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace, suite: list[str]) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="qgather-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    common = [*suite, "-q", "-p", "no:cacheprovider", "--device", args.device, "--backend", args.backend,
              "--world-sizes", args.world_sizes]
    if args.case_timeout:
        common += ["--case-timeout", str(args.case_timeout)]
    env = clean_env(OMP_NUM_THREADS="1") if args.device == "cpu" else clean_env()
    gpus = None
    if args.device == "cuda":
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [n.strip() for n in listed.split(",")] if listed else [str(i) for i in range(64)]
        names = names[:args.nnodes * args.nproc_per_node]
        per = args.nproc_per_node
        gpus = [",".join(names[i * per:(i + 1) * per]) for i in range(args.nnodes)]
    # Both runs at once: they share the GPUs as the suite's own pools do (one communicator's ranks on
    # distinct GPUs), and the comparison then waits for the longer run, not for the sum of both.
    proc = start_pool_run(common, out / "pool.json", env)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as background:
        try:
            pooled = background.submit(finish_pool_run, proc, args.timeout)
            run = launch([*common, "--qgather-json", str(out / "launched.json")], out, args.nnodes,
                         args.nproc_per_node, args.timeout, env, gpus)
            print(f"launched run: ended in {run.seconds:.0f} s", flush=True)
            pool_code, pool_out = pooled.result()
        finally:
            _kill_group(proc)  # an interrupt: the pool run's processes go too, and the wait for it ends
    pool, launched = verdicts(out / "pool.json"), verdicts(out / "launched.json")
    kinds = sorted(set(placements(out / "launched.json").values()))
    diffs = compare(pool, launched)
    codes = sorted(set(run.rank_codes.values()))
    ok = bool(pool) and not diffs and pool_code is not None and None not in run.agent_codes \
        and len(run.rank_codes) == args.nnodes * args.nproc_per_node and len(codes) == 1 and codes[0] == pool_code
    setup = f"{args.nnodes} agents x {args.nproc_per_node} ({args.device})"
    print(f"{'SAME' if ok else 'DIFFERENT'}: {len(pool)} pool cases vs {len(launched)} launched cases "
          f"({setup}, placements {','.join(kinds) or 'none'}), {len(diffs)} verdict differences, exit codes: pool "
          f"{pool_code}, ranks {dict(sorted(run.rank_codes.items()))}, agents {run.agent_codes}; logs in {out}")
    for line in diffs[:20]:
        print(f"  {line}")
    if not pool:
        print(pool_out[-3000:])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
