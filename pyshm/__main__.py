"""Command line: ``python -m pyshm {demo,bench,plan}``."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Optional, Sequence


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(count=args.count, threads=args.threads)


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    import time

    from . import planner

    ids, sizes, firsts, lasts, lines = planner.read_trace_lines(args.trace)
    start = time.perf_counter()
    try:
        result = planner.plan(
            sizes, firsts, lasts,
            alignment=args.alignment, inclusive=args.inclusive, time_limit=args.time_limit,
            capacity=args.capacity,
        )
    except ValueError as exc:
        # The library names tensors by index: name the file's line instead.
        found = re.search(r"\btensor (\d+)\b", str(exc))
        if found is None or int(found.group(1)) >= len(lines):
            raise
        i = int(found.group(1))
        raise ValueError(f"{args.trace}:{lines[i]}: (id {ids[i]}) {exc}") from None
    seconds = time.perf_counter() - start
    # (with --capacity, the goal is a plan that fits: the best plan above it is a failure)
    fits = args.capacity == 0 or result.arena_size <= args.capacity
    if args.output and fits:
        planner.write_trace(args.output, ids, sizes, firsts, lasts, result.offsets)
    print(f"trace        {args.trace}")
    print(f"tensors      {len(sizes)}")
    print(f"lower bound  {result.lower_bound}")
    print(f"arena size   {result.arena_size}")
    print(f"ratio        {result.ratio:.4f}{' (optimal)' if result.optimal else ''}")
    print(f"strategy     {result.strategy}")
    print(f"time         {seconds * 1e3:.1f} ms")
    if args.capacity:
        print(f"capacity     {args.capacity} ({'met' if fits else 'not met'})")
    if not fits:
        print(f"pyshm: error: no plan found fits in --capacity {args.capacity} bytes "
              f"(best: {result.arena_size}){'; nothing written' if args.output else ''}",
              file=sys.stderr)
        return 1
    if args.output:
        print(f"offsets      written to {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyshm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="share the seed workload in place from a ThreadPool")
    demo.add_argument("--count", type=int, default=None,
                      help="number of 39 MB arrays (default: a quarter of free memory, <= 64)")
    demo.add_argument("--threads", type=int, default=None,
                      help="ThreadPool size (default: number of CPUs)")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmark against torch and SharedMemory")
    from . import bench as bench_module

    bench_module.add_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    plan = sub.add_parser("plan", help="plan a trace CSV (id,lower,upper,size)")
    plan.add_argument("trace")
    plan.add_argument("--output", "-o", help="write the rows with an added offset column")
    plan.add_argument("--time-limit", type=float, default=1.0,
                      help="seconds for improvement and exact search (default 1)")
    plan.add_argument("--alignment", type=int, default=1, help="offset alignment (default 1)")
    plan.add_argument("--capacity", type=int, default=0,
                      help="target arena bytes: stop at a plan that fits, exit 1 when none is "
                      "found (default 0: minimise)")
    plan.add_argument("--inclusive", action="store_true",
                      help="ranges are [lower, upper] instead of [lower, upper)")
    plan.set_defaults(func=_cmd_plan)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, OverflowError) as exc:
        message = " ".join(str(exc).split())  # one line
        print(f"pyshm: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (Ctrl-C: one line and the shell's status for SIGINT)
        print("pyshm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
