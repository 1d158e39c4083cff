"""`python -m meshkit.estimate`: memory, FLOPs, communication and step time of one plan, per rank.

See docs/estimate.md; `python -m meshkit.estimate.search` (`meshkit.estimate.search`) ranks many plans.
"""

from __future__ import annotations

import dataclasses
import sys

from meshkit.activation_checkpoint import AC_MODES
from meshkit.estimate.core import estimate
from meshkit.estimate.report import build_parser, config_from_args, device_from_args, parse_tokens, render
from meshkit.estimate.spec import Workload
from meshkit.plan import Plan


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = build_parser(__doc__.split("\n\n")[0], prog="python -m meshkit.estimate")
    parser.add_argument("--plan", default="", help='e.g. "tp=8,dp_shard=-1" (meshkit.Plan.from_string)')
    parser.add_argument("--mbs", type=int, default=1, help="sequences per microbatch per data-parallel rank")
    parser.add_argument("--ac", choices=AC_MODES, help="activation checkpointing (overrides the plan)")
    parser.add_argument("--microbatches", type=int,
                        help="per step per data rank (default: the plan's pp_microbatches, or 1 without pipeline)")
    parser.add_argument("--global-batch-tokens", help="e.g. 1M; sets microbatches = tokens / (dp*mbs*seq)")
    parser.add_argument("--no-flop-check", action="store_true", help="skip the FlopCounterMode cross-check")
    Plan.add_cli_args(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    plan = Plan.from_cli_args(args, Plan.from_string(args.plan))
    given = args.plan.replace(" ", "")
    if "param_dtype=" not in given and getattr(args, "plan_param_dtype", None) is None:
        plan = dataclasses.replace(plan, param_dtype="bfloat16")  # the recipes' mixed precision
    if args.ac:
        plan = dataclasses.replace(plan, activation_checkpointing=args.ac)
    plan = plan.resolve(args.world)
    m = args.microbatches or plan.microbatches
    if args.global_batch_tokens:
        m = max(1, round(parse_tokens(args.global_batch_tokens) / (plan.dp * args.mbs * args.seq)))
    if plan.pp > 1 and plan.pp_microbatches is None:
        plan = dataclasses.replace(plan, pp_microbatches=m)  # one pipeline call per step
    workload = Workload(args.seq, args.mbs, m, args.mfu)
    print(render(estimate(config, plan, args.world, workload, device_from_args(args)), not args.no_flop_check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
