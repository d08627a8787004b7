"""The C side, from the one test command: meson's C tests (plain, under ASan+UBSan and under
ThreadSanitizer), the installed header/library/pkg-config file used by a C program outside the
tree, and the exported symbol table of liblshm.

Each build lives in a temporary folder, so a source checkout's own build dirs are untouched.
The ThreadSanitizer stage needs clang with its TSan runtime, which .ci/run installs: with
CI=true its absence fails that test; elsewhere it skips it.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

pytestmark = pytest.mark.skipif(
    not (ROOT / "meson.build").exists(), reason="needs the source tree (meson.build)"
)


def meson() -> list:
    exe = shutil.which("meson")
    return [exe] if exe else [sys.executable, "-m", "mesonbuild.mesonmain"]


def run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} failed ({result.returncode}):\n"
                    f"{result.stdout[-6000:]}\n{result.stderr[-4000:]}")
    return result


def assert_all_passed(summary: str) -> None:
    counts = {}
    for line in summary.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Ok", "Fail", "Timeout", "Expected Fail", "Unexpected Pass"):
            counts[key.strip()] = int(value)
    assert counts.get("Ok", 0) >= 5, summary[-3000:]
    assert counts.get("Fail", 0) == 0 and counts.get("Timeout", 0) == 0, summary[-3000:]


@pytest.fixture(scope="module")
def plain_build(tmp_path_factory):
    build = tmp_path_factory.mktemp("build-plain")
    prefix = tmp_path_factory.mktemp("prefix")
    run(meson() + ["setup", str(build), str(ROOT), f"--prefix={prefix}", "--libdir=lib"])
    run(meson() + ["compile", "-C", str(build)])
    return build, prefix


def test_meson_c_tests(plain_build):
    build, _ = plain_build
    result = run(meson() + ["test", "-C", str(build), "--print-errorlogs", "--num-processes", "2"])
    assert_all_passed(result.stdout)


def test_meson_c_tests_under_sanitizers(tmp_path):
    build = tmp_path / "build-asan"
    run(meson() + ["setup", str(build), str(ROOT), "-Db_sanitize=address,undefined",
                   "-Db_lundef=false", "--buildtype=debug"])
    env = dict(os.environ,
               ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
    result = run(meson() + ["test", "-C", str(build), "--print-errorlogs", "--num-processes", "2",
                            "--timeout-multiplier", "3"], env=env)
    assert_all_passed(result.stdout)


def tsan_clang(tmp_path) -> str:
    """clang, if it builds and runs a program under ThreadSanitizer here. Otherwise the test
    skips, or fails with CI=true. (TSan of clang before 18 cannot start where the kernel
    randomises mmap with more than 28 bits, vm.mmap_rnd_bits: the probe's run says so.)"""
    clang = shutil.which("clang")
    why = None if clang else "clang is not installed"
    if clang:
        probe = tmp_path / "tsan_probe"
        source = tmp_path / "tsan_probe.c"
        source.write_text("int main(void) { return 0; }\n")
        built = subprocess.run([clang, "-fsanitize=thread", str(source), "-o", str(probe)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            why = f"clang -fsanitize=thread cannot build here: {built.stderr[-800:].strip()}"
        else:
            ran = subprocess.run([str(probe)], capture_output=True, text=True)
            if ran.returncode != 0:
                why = f"a ThreadSanitizer program does not run here: {ran.stderr[-800:].strip()}"
    if why is not None:
        if IN_CI:
            pytest.fail(f"{why}; but CI=true: this stage must run (.ci/run installs clang)")
        pytest.skip(why)
    return clang


def test_meson_c_tests_under_thread_sanitizer(tmp_path):
    """No data race and no lock misuse in the C tests, several of which share, resize and
    close the userfaultfd from threads at once. No suppressions: what TSan cannot see (the
    share's write fence orders a writer thread's accesses, fork.c's child reinitialises a lock)
    is told to it in the sources, under LSHM__TSAN. About 80 s on a 2-CPU VM, build included."""
    clang = tsan_clang(tmp_path)
    build = tmp_path / "build-tsan"
    env = dict(os.environ, CC=clang,
               TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1")
    run(meson() + ["setup", str(build), str(ROOT), "-Db_sanitize=thread", "-Db_lundef=false"],
        env=env)
    result = run(meson() + ["test", "-C", str(build), "--print-errorlogs", "--num-processes", "2",
                            "--timeout-multiplier", "3"], env=env)
    assert_all_passed(result.stdout)


def test_installed_library_builds_a_c_program_with_pkg_config(plain_build, tmp_path):
    build, prefix = plain_build
    run(meson() + ["install", "-C", str(build), "--quiet"])
    assert (prefix / "include" / "lshm.h").exists()
    pc_dir = prefix / "lib" / "pkgconfig"
    assert (pc_dir / "lshm.pc").exists()
    env = dict(os.environ, PKG_CONFIG_PATH=str(pc_dir))
    flags = run(["pkg-config", "--cflags", "--libs", "lshm"], env=env).stdout.split()
    exe = tmp_path / "example_share"
    run(["cc", "-std=c11", "-Wall", "-Werror", str(ROOT / "tools" / "example_share.c"),
         "-o", str(exe), *flags, f"-Wl,-rpath,{prefix / 'lib'}"])
    result = run([str(exe)])
    assert "OK" in result.stdout
    # It really used the installed copy.
    ldd = run(["ldd", str(exe)]).stdout
    assert str(prefix / "lib" / "liblshm.so") in ldd


def test_only_lshm_symbols_are_exported():
    import pyshm

    result = run(["nm", "-D", "--defined-only", pyshm.LIBRARY_PATH])
    names = [line.split()[-1] for line in result.stdout.splitlines() if line.strip()]
    exported = [n for n in names if not n.startswith("_")]
    assert exported and all(n.startswith("lshm_") for n in exported), exported


def test_every_package_file_is_installed():
    """meson.build lists the package's files one by one: a module missing there is missing
    from every installed copy (the tests of a source checkout would not notice)."""
    build = (ROOT / "meson.build").read_text()
    package = sorted(p.name for p in (ROOT / "pyshm").iterdir()
                     if p.suffix in (".py", ".typed"))
    missing = [name for name in package if f"'pyshm/{name}'" not in build]
    assert not missing, f"not installed by meson.build: {missing}"
