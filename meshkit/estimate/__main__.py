"""`python -m meshkit.estimate`: memory, FLOPs, communication and step time of one plan, per rank.

See docs/estimate.md; `python -m meshkit.estimate.search` (`meshkit.estimate.search`) ranks many plans.
"""

from __future__ import annotations

import sys

from meshkit.estimate.core import estimate
from meshkit.estimate.report import (
    add_plan_args,
    build_parser,
    config_from_args,
    device_from_args,
    plan_and_workload,
    render,
)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = build_parser(__doc__.split("\n\n")[0], prog="python -m meshkit.estimate")
    add_plan_args(parser)
    parser.add_argument("--no-flop-check", action="store_true", help="skip the FlopCounterMode cross-check")
    args = parser.parse_args(argv)
    config = config_from_args(args)
    plan, workload = plan_and_workload(args)
    print(render(estimate(config, plan, args.world, workload, device_from_args(args)), not args.no_flop_check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
