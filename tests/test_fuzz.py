"""Coverage-guided fuzzing in the one test command (issue 9, point 8).

The C targets in tests/fuzz (planner input, attach of hostile fds, arena operations) are built
with clang, libFuzzer, ASan and UBSan into a temporary folder by tools/fuzz.py, and each runs
for PYSHM_FUZZ_SECONDS (default 30) over a copy of its seed corpus, two at a time; the CSV
reader of ``python -m pyshm plan`` runs the same way under atheris. Any crash, leak, timeout or
broken property fails with the reproducer's path and the end of the log. The committed corpus
is also replayed once as a regression test.

clang and atheris are installed by .ci/run: with CI=true their absence fails these tests;
elsewhere it skips them. A known, unfixed library bug would be stepped around (tools/fuzz.py
KNOWN_BUGS, empty today) and its reproducer kept in tests/fuzz/crashes, where every test run
checks that it still crashes (none is kept today: those tests skip).
"""

import importlib.util
import os
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FUZZ_DIR = ROOT / "tests" / "fuzz"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SECONDS = int(os.environ.get("PYSHM_FUZZ_SECONDS", "30"))

pytestmark = pytest.mark.skipif(
    not (ROOT / "libshm" / "src").is_dir() or not (ROOT / "tools" / "fuzz.py").exists(),
    reason="needs the source tree (libshm/src, tools/fuzz.py)")


def _load_tool():
    spec = importlib.util.spec_from_file_location("lshm_fuzz_tool", ROOT / "tools" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz = _load_tool() if (ROOT / "tools" / "fuzz.py").exists() else None


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is missing but CI=true: .ci/run must install it")
    pytest.skip(f"{what} not installed (tools are installed by .ci/run)")


def _need(target: str) -> None:
    if target in fuzz.PY_TARGETS:
        if importlib.util.find_spec("atheris") is None:
            _missing("atheris")
    elif fuzz.clang() is None:
        _missing("clang")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-build")


@pytest.fixture(scope="module")
def binaries(build_dir):
    """target -> fuzzer binary (None for the Python target), building what can be built."""
    out = {}
    for target in fuzz.C_TARGETS:
        if fuzz.clang() is not None:
            out[target] = fuzz.build_target(target, build_dir)
    for target in fuzz.PY_TARGETS:
        out[target] = None
    return out


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def fuzz_runs(binaries, tmp_path_factory):
    """Run every available target for SECONDS, two at a time; target -> (rc, log, artifacts)."""
    work = tmp_path_factory.mktemp("fuzz-runs")
    todo = [t for t in fuzz.TARGETS if t in binaries and
            (t not in fuzz.PY_TARGETS or importlib.util.find_spec("atheris") is not None)]
    results, running = {}, []
    while todo or running:
        while todo and len(running) < 2:
            target = todo.pop(0)
            corpus = work / "corpus" / target
            shutil.copytree(FUZZ_DIR / "corpus" / target, corpus)
            artifacts = work / "artifacts" / target
            log = work / f"{target}.log"
            proc = fuzz.start(target, binaries[target], corpus, SECONDS, artifacts, log)
            running.append((target, proc, log, artifacts, time.monotonic()))
        for item in list(running):
            target, proc, log, artifacts, started = item
            if proc.poll() is None and time.monotonic() - started > SECONDS + 120:
                proc.kill()  # libFuzzer ignored -max_total_time: report it as a hang
                proc.wait()
            if proc.poll() is not None:
                running.remove(item)
                results[target] = (proc.returncode, log.read_text(errors="replace"), artifacts)
        time.sleep(0.2)
    return results


@pytest.mark.parametrize("target", ["plan", "attach", "arena", "csv", "request"])
def test_fuzz_target_finds_nothing(target, fuzz_runs, capsys):
    _need(target)
    rc, log, artifacts = fuzz_runs[target]
    found = sorted(p for p in artifacts.glob("*") if p.name.split("-")[0] in
                   ("crash", "leak", "timeout", "oom", "slow-unit"))
    st = fuzz.stats(log)
    summary = (f"fuzz_{target}: {st.get('number_of_executed_units', '?')} executions in "
               f"{SECONDS} s, {st.get('average_exec_per_sec', '?')} exec/s, "
               f"cov {st.get('last_cov', '?')}, ft {st.get('last_ft', '?')}, "
               f"corpus {st.get('last_corp', '?')}")
    with capsys.disabled():
        print(f"\n{summary}")
    bad = [p for p in found if not p.name.startswith("slow-unit")]
    assert rc == 0 and not bad, (
        f"{summary}\nexit {rc}; reproducer(s): {[str(p) for p in bad]}\n"
        f"replay: {fuzz.py_command(target, bad, []) if target in fuzz.PY_TARGETS else f'fuzz_{target} FILE'}\n"
        f"--- log tail ---\n{_tail(log)}")
    assert int(st.get("number_of_executed_units", "0")) > 0, _tail(log)


@pytest.mark.parametrize("target", ["plan", "attach", "arena", "csv", "request"])
def test_seed_corpus_replays_cleanly(target, binaries):
    _need(target)
    files = sorted((FUZZ_DIR / "corpus" / target).glob("*"))
    assert len(files) >= 3, f"seed corpus of {target} is missing"
    result = fuzz.run_files(target, binaries.get(target), files)
    assert result.returncode == 0, _tail(result.stdout + result.stderr)


@pytest.mark.parametrize("target", ["plan", "attach", "arena", "csv", "request"])
def test_known_crashes_still_reproduce(target, build_dir):
    """Each file in tests/fuzz/crashes/<target> still crashes the strict build; once one does
    not, its bug is fixed: drop its KNOWN_BUGS switch and move the file to the corpus."""
    _need(target)
    files = sorted((FUZZ_DIR / "crashes" / target).glob("*"))
    if not files:
        pytest.skip(f"no known crashes for {target}")
    exe = None if target in fuzz.PY_TARGETS else fuzz.build_target(target, build_dir,
                                                                    strict=True)
    fixed = [f.name for f in files
             if fuzz.run_files(target, exe, [f], strict=True).returncode == 0]
    assert not fixed, f"fixed now (update tools/fuzz.py KNOWN_BUGS): {fixed}"
