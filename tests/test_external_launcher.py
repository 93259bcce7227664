"""External launcher mode, for real: two torchrun agents ("nodes") of two ranks each on localhost.

One launch runs both tests/_runtime_external_case.py (the runtime on the launcher's world) and a
slice of the reference suite at world sizes 1, 2 and 4 (sub-groups of the 4-rank job, within a node
and across the two). The suite's verdicts must equal those of the same cases on the single-process
rank pools; rank 0 alone prints pytest's session; every rank exits 0.
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from qgather.tools.external_demo import clean_env, compare, launch, placements, pool_run, verdicts

RUN_TIMEOUT_S = 240.0
RESULT_TAG = "QGATHER_EXTERNAL_RESULT "  # pytest's progress dots may precede it on the line
SUITE = ["cases/test_alignment.py", "--formats", "nvfp4_2d", "--world-sizes", "1,2,4", "--device", "cpu"]
CASES = "128x64 or 136x64 or 4x64"  # aligned, a split scale block (REJECTED at 2 and 4), zero-row ranks
EXTERNAL = "test_cases_run_in_the_launchers_world or test_world_size_is_fixed_by_the_launcher"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs torchrun and process groups on Linux")
def test_two_torchrun_agents_run_the_suite_on_sub_groups_with_one_report(tmp_path):
    env = clean_env(OMP_NUM_THREADS="1")
    common = ["-q", "-s", "-p", "no:cacheprovider"]
    with ThreadPoolExecutor(1) as executor:  # the pool run alongside: both mostly wait for startups
        pool_run_done = executor.submit(pool_run, [*SUITE, "-k", CASES, *common], tmp_path / "pool.json",
                                        RUN_TIMEOUT_S, env)
        launched = launch(["tests/_runtime_external_case.py", *SUITE, "-k", f"{CASES} or {EXTERNAL}", *common,
                           "--qgather-json", str(tmp_path / "launched.json")], tmp_path, 2, 2, RUN_TIMEOUT_S, env)
        code, pool_output = pool_run_done.result()
    output = "\n".join([*launched.agent_logs, *(f"--- rank {r} stdout:\n{t}" for r, t in launched.stdout.items()),
                        *(f"--- rank {r} stderr:\n{t}" for r, t in launched.stderr.items())])
    assert launched.agent_codes == [0, 0], f"agents exited {launched.agent_codes}:\n{output[-6000:]}"
    assert launched.rank_codes == {0: 0, 1: 0, 2: 0, 3: 0}, output[-6000:]

    summaries = {rank: len(re.findall(r"\b\d+ passed\b", text)) for rank, text in launched.stdout.items()}
    assert summaries == {0: 1, 1: 0, 2: 0, 3: 0}, f"rank 0 alone prints the session:\n{output[-6000:]}"
    assert all(not text.strip() for rank, text in launched.stdout.items() if rank), output[-6000:]

    assert code == 0, pool_output[-4000:]
    pool, ours = verdicts(tmp_path / "pool.json"), verdicts(tmp_path / "launched.json")
    assert len(pool) == 9 and set(pool.values()) >= {"EXACT", "REJECTED"}, pool
    assert compare(pool, ours) == [], "verdicts differ from the single-process pools"
    kinds = placements(tmp_path / "launched.json")
    assert set(kinds.values()) == {"intra-node", "cross-node"}, kinds
    assert all(kinds[c] == "intra-node" for c in kinds if ":ws1:" in c), kinds
    assert all(kinds[c] == "cross-node" for c in kinds if ":ws4:" in c), kinds
    records = json.loads((tmp_path / "launched.json").read_text())
    assert all(r["configuration"].endswith(r["placement"]) for r in records), records

    results = [json.loads(found) for found in re.findall(RESULT_TAG + r"(\{.*\})", output)]
    assert len(results) == 1, f"exactly the reporting rank prints the result:\n{output[-6000:]}"
    slow = results[0].pop("slow")
    assert re.fullmatch(r"HANG after \d+\.\d s: ranks 0,1,2,3 were in overruns_its_timeout "
                        r"\(_runtime_external_case\.py:\d+\)", slow), slow
    assert results[0] == {
        "gather": [0, 1, 2, 3],
        "fsdp2": {"local_rows": 2, "matches": True},
        "reject": "rank 3 raised ValueError: 136 columns are not a multiple of 16",
        "after_error": "ok",
    }
