"""The benchmarks' command lines at tiny sizes: every case runs, every pyshm row is measured
and compared with each baseline, the targets are evaluated, and --json is valid JSON."""

import importlib.util
import json
import subprocess
import sys

import pytest


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
            # torch not asked for; no huge-page ceiling or memcpy row for 4 KiB arrays
            assert set(row["ratios"]) == ({"shm", "ceiling"} if case["case"] == "small" else
                                          {"shm", "ceiling", "ceiling_huge", "memcpy"})
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


def test_bench_receiver_and_huge_off_cases():
    result, report = run_json(
        "pyshm", "bench", "--no-torch", "--repeats", "1", "--count", "1",
        "--receiver-mib", "8", "--cases", "receiver,huge_off")
    cases = {case["case"]: case for case in result["cases"]}
    # the huge-off round runs the seed workload (at ThreadPool(2)) and the receiver again
    assert set(cases) == {"receiver", "seed_huge_off", "receiver_huge_off"}
    for key in ("receiver", "receiver_huge_off"):
        rows = {row["method"]: row for row in cases[key]["rows"]}
        assert set(rows) == {"pyshm", "shm"}
        assert all(row["error"] is None and len(row["seconds"]) == 1 for row in rows.values())
        assert cases[key]["bytes"] == 8 << 20 and "shm" in rows["pyshm"]["ratios"]
    seed = [row for row in cases["seed_huge_off"]["rows"] if row["method"] == "pyshm"]
    assert [row["threads"] for row in seed] == [2] and seed[0]["error"] is None
    assert "Huge pages off (LSHM_HUGE=0)" in report
    targets = {target["name"]: target for target in result["targets"]}
    assert targets["a spawned worker's first read, pyshm time / torch time"]["text"] == (
        "not measured: not run (--no-torch)")
    off = "huge pages off (LSHM_HUGE=0): seed workload, ThreadPool(2), pyshm time / torch time"
    assert targets[off]["text"] == "not measured: not run (--no-torch)"


def test_bench_engines_case():
    pytest.importorskip("joblib")
    pytest.importorskip("distributed")
    result, report = run_json("pyshm", "bench", "--no-torch", "--repeats", "2",
                              "--cases", "engines")
    (case,) = result["cases"]
    rows = {(row["engine"], row["method"]): row for row in case["rows"]}
    engines = ("joblib", "dask", "dask submit") + (
        ("ray",) if importlib.util.find_spec("ray") else ())
    assert set(rows) == {(engine, method) for engine in engines
                         for method in ("own", "pyshm")} | {
        (engine, method) for engine in ("dask", "ray") if engine in engines
        for method in ("once", "pyshm once")}
    from pyshm.bench.engines import ONCE, ONCE_RUNS

    assert all(row["error"] is None and
               len(row["seconds"]) == 2 * (ONCE_RUNS if method in ONCE else 1)
               for (_, method), row in rows.items())
    assert "own" in rows["joblib", "pyshm"]["ratios"]
    targets = {target["name"]: target for target in result["targets"]}
    assert targets["joblib: 64 MiB round trip, pyshm time / the engine's own"]["value"] > 0
    # the array sent once: pyshm (its worker's write checked in the parent) against the
    # engine's own (a read); the round trip is no target against that
    once = "dask: 64 MiB round trip, pyshm time / the engine's own, both sent once"
    assert targets[once]["value"] > 0 and set(rows["dask", "pyshm once"]["ratios"]) == {"once"}
    assert {name for name in targets if name.startswith("dask:")} == {
        "dask: 64 MiB round trip, pyshm time / the engine's own", once}
    assert targets["torch: 64 MiB round trip"]["text"] == "not run (--no-torch)"
    assert "vs own way" in report


def test_a_failed_huge_off_child_is_reported():
    from pyshm.bench import runner

    config = {"cases": ["seed"], "repeats": 1, "count": 0, "receiver_bytes": 8 << 20,
              "quick": False}  # --count 0: the child refuses its command line
    (case,) = runner._huge_off_cases(config, use_torch=False)
    (row,) = case["rows"]
    assert case["case"] == "seed_huge_off" and not row["seconds"]
    assert row["error"].startswith("child process failed: ") and "--count" in row["error"]


def test_bench_processes_rows():
    result, _ = run_json("pyshm.bench.processes", "--no-torch", "--count", "256",
                         "--single", "4", "--repeats", "1")
    rows = result["case"]["rows"]
    labels = {row["label"] for row in rows}
    assert {"pyshm slab, batch", "pyshm in place, batch", "SharedMemory, batch",
            "pyshm slab, busy", "SharedMemory, busy"} <= labels
    for row in rows:
        assert row["error"] is None and row["min_us_per_share"] > 0
        if row["method"] != "shm":
            assert "shm" in row["ratios"]


def test_the_runtime_never_imports_the_benchmark():
    code = ("import sys, pyshm, pyshm.arena, pyshm.engines, pyshm.planner, pyshm.reduction; "
            "print(sorted(m for m in sys.modules if m.startswith('pyshm.bench')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_binding_cost_tool_times_every_alternative_it_names():
    # (tools/bench_binding.py: what the per-call figures in pyshm's comments were measured with)
    import os

    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "bench_binding.py")
    done = subprocess.run([sys.executable, tool, "--repeat", "1", "--number", "5"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    cases = {row[0] for row in rows}
    assert cases == {"gil", "typed", "errcheck", "convert", "release", "address", "peers"}
    for row in rows:
        low, median = float(row[-5]), float(row[-2])
        assert 0 < low <= median, row
    assert sum(row[0] == "typed" for row in rows) == sum(row[0] == "release" for row in rows) == 3
