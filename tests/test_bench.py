"""The benchmarks' command lines at tiny sizes: every case runs, every pyshm row is measured
and compared with each baseline, the targets are evaluated, and --json is valid JSON."""

import json
import subprocess
import sys


def run_json(*args):
    done = subprocess.run([sys.executable, "-m", *args, "--json"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_bench_cases_rows_and_targets():
    result, report = run_json(
        "pyshm", "bench", "--no-torch", "--repeats", "2", "--count", "2", "--threads", "1,2",
        "--big-mib", "4", "--small-count", "50", "--cases", "seed,big,small")
    cases = {case["case"]: case for case in result["cases"]}
    assert set(cases) == {"seed", "big", "small"}
    for case in cases.values():
        pyshm_rows = [row for row in case["rows"] if row["method"] == "pyshm"]
        assert pyshm_rows and all(row["error"] is None for row in pyshm_rows)
        for row in pyshm_rows:
            assert len(row["seconds"]) == 2 and row["min_s"] <= row["median_s"]
            assert set(row["ratios"]) == {"shm", "ceiling"}  # torch not asked for
    # the recycling pool is not measured on the seed arrays, only where it is used
    assert "pyshm_recycled" not in {row["method"] for row in cases["seed"]["rows"]}
    assert "pyshm_recycled" in {row["method"] for row in cases["big"]["rows"]}
    assert cases["small"]["rows"][0]["min_us_per_share"] > 0
    targets = {target["name"]: target for target in result["targets"]}
    assert targets["4 KiB arrays, pyshm us per share"]["value"] > 0
    assert targets["4 KiB arrays, pyshm us per share"]["note"].startswith("median ")
    assert all(target["text"] for target in targets.values())
    assert targets["seed workload, ThreadPool(2), pyshm time / torch time"]["text"] == (
        "not measured: not run (--no-torch)")
    assert "targets (judged on min times)" in report


def test_bench_processes_rows():
    result, _ = run_json("pyshm.bench_processes", "--no-torch", "--count", "256",
                         "--single", "4", "--repeats", "1")
    rows = result["case"]["rows"]
    labels = {row["label"] for row in rows}
    assert {"pyshm slab, batch", "pyshm in place, batch", "SharedMemory, batch"} <= labels
    for row in rows:
        assert row["error"] is None and row["min_us_per_share"] > 0
        if row["method"] != "shm":
            assert "shm" in row["ratios"]
