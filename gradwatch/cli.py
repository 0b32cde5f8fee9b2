"""The `gradwatch` command line: demo and report."""

from __future__ import annotations

import argparse
import sys

from .demo import FAULTS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradwatch", description="Gradient-health monitor for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small model on generated data with the monitor")
    demo.add_argument("--logdir", default="runs/gradwatch-demo",
                      help="parent folder; each demo writes its own run folder in it, named by fault and time "
                           "(default: %(default)s)")  # fmt: skip
    demo.add_argument("--steps", type=_positive_int, default=300, help="optimizer steps (default: %(default)s)")
    demo.add_argument("--fault", choices=FAULTS, default="none", help="a gradient pathology to make on purpose")

    report = sub.add_parser("report", help="summarise gradwatch's TensorBoard logs; exit 1 if they hold alerts")
    report.add_argument("logdir", help="folder with TensorBoard event files")
    report.add_argument("--format", choices=("text", "json"), default="text")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gradwatch` console script. Returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        run_demo(logdir=args.logdir, steps=args.steps, fault=args.fault)
        return 0
    from .report import ReportError, read_runs, to_json, to_text

    try:
        reports = read_runs(args.logdir)
    except ReportError as exc:
        print(f"gradwatch report: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(to_json(reports) + "\n" if args.format == "json" else to_text(reports))
    return 1 if any(r.alerts for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
