"""Coverage-guided fuzzer (atheris, libFuzzer's engine for Python) for the CLI's CSV reader.

    python tests/fuzz/fuzz_csv.py [libFuzzer options] CORPUS_DIR_OR_FILES...

Each input is the bytes of a trace file. Properties, for any bytes:
  - pyshm.planner.read_trace returns equally long lists (ids are str, the numbers int) or
    raises ValueError (UnicodeDecodeError included), OverflowError or TypeError; nothing else;
  - pyshm.plan on what it read (time_limit 0, small traces) returns a plan that is valid for
    the numbers *as read* (Python ints: no wrap-around to int64/uint64), or raises one of those;
  - ``python -m pyshm plan FILE`` (pyshm.__main__.main) returns 0 or 1 and never lets an
    exception escape (a traceback is a failure).
A broken property raises AssertionError, which atheris reports as a crash (input saved).

The bugs it found (numbers of 2**64 and lifetimes of 2**63 wrapped or escaping as tracebacks,
short rows accepted with id None) are fixed; their inputs are in the corpus.
"""

import contextlib
import io
import os
import sys
import tempfile

import atheris
import numpy  # noqa: F401  (not instrumented: imported before instrument_imports)

with atheris.instrument_imports(include=["pyshm"]):
    import pyshm.__main__ as cli
    from pyshm import planner

CLEAR = (ValueError, OverflowError, TypeError)
I64 = (-(1 << 63), (1 << 63) - 1)
MAX_PLAN = 64

_dir = tempfile.mkdtemp(prefix="lshm-fuzz-csv-")
PATH = os.path.join(_dir, "trace.csv")


def _out_of_range(sizes, firsts, lasts):
    bad_size = any(not 0 <= s < 1 << 64 for s in sizes)
    bad_time = any(not I64[0] <= t <= I64[1] for t in list(firsts) + list(lasts))
    return bad_size, bad_time


def check_plan(sizes, firsts, lasts, result):
    offsets = [int(o) for o in result.offsets]
    assert len(offsets) == len(sizes)
    for i, (o, s) in enumerate(zip(offsets, sizes)):
        live = s > 0 and firsts[i] < lasts[i]
        if live:
            assert o + s <= result.arena_size, f"tensor {i} ends beyond the arena"
    for i in range(len(sizes)):
        for j in range(i + 1, len(sizes)):
            if sizes[i] == 0 or sizes[j] == 0:
                continue
            together = firsts[i] < lasts[j] and firsts[j] < lasts[i] and \
                firsts[i] < lasts[i] and firsts[j] < lasts[j]
            if together:
                assert offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i], \
                    f"tensors {i} and {j} overlap in the plan of the numbers as read"


def TestOneInput(data: bytes) -> None:
    with open(PATH, "wb") as handle:
        handle.write(data)
    try:
        ids, sizes, firsts, lasts = planner.read_trace(PATH)
    except ValueError:
        return  # the CLI prints it as "pyshm: error: ..." and exits 1
    except CLEAR:
        rows = None  # the CLI lets these escape: checked below
    else:
        rows = (ids, sizes, firsts, lasts)
        assert len(ids) == len(sizes) == len(firsts) == len(lasts)
        assert all(isinstance(x, str) for x in ids), \
            f"ids that are not strings: {[x for x in ids if not isinstance(x, str)][:3]}"
        assert all(type(x) is int for x in sizes + firsts + lasts)

    if rows is not None and len(rows[1]) <= MAX_PLAN:
        _, sizes, firsts, lasts = rows
        bad_size, bad_time = _out_of_range(sizes, firsts, lasts)
        try:
            result = planner.plan(sizes, firsts, lasts, alignment=1, time_limit=0)
        except CLEAR:
            pass
        else:
            assert not bad_size and not bad_time, \
                "a plan was returned for numbers outside uint64/int64 (wrapped)"
            check_plan(sizes, firsts, lasts, result)

    if rows is not None and len(rows[1]) > MAX_PLAN:
        return  # the CLI would plan it for a while; the reader was checked above
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["plan", PATH, "--time-limit", "0"])
    assert rc in (0, 1), f"the CLI returned {rc}"
    if rc == 1:
        assert err.getvalue().startswith("pyshm: error: "), err.getvalue()


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
