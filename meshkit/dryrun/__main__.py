"""`python -m meshkit.dryrun`: one real training step of chosen ranks of a fake world, against the estimator.

See docs/estimate.md ("Dry run"); `meshkit.dryrun` is the API.
"""

from __future__ import annotations

import json
import sys

from meshkit.dryrun import dry_run
from meshkit.dryrun.report import render
from meshkit.estimate.report import add_plan_args, build_parser, config_from_args, plan_and_workload


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = build_parser(__doc__.split("\n\n")[0], prog="python -m meshkit.dryrun")
    add_plan_args(parser)
    parser.add_argument("--rank", type=int, action="append",
                        help="a rank to simulate (repeat for several; default: the first, middle and last "
                             "pipeline rank)")
    parser.add_argument("--jobs", type=int, default=1, help="ranks simulated at once, one process each")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    args = parser.parse_args(argv)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        config = config_from_args(args)  # --lora-r: the model as PEFT's LoRA model
        plan, workload = plan_and_workload(args)
        result = dry_run(config, plan, args.world, workload, args.rank, jobs=args.jobs, progress=progress)
    except ValueError as e:  # a plan, model or rank that cannot run: the message names the fix
        print(f"python -m meshkit.dryrun: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
