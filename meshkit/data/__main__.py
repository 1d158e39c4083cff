"""`python -m meshkit.data prepare INPUT... --output DIR (--tokenizer DIR | --vocab-size N)`.

Writes a token store (see `meshkit.data.store`); `python -m meshkit.data info DIR` describes one
(`meshkit.data.info`). Exit status 2 with a one-line message for every bad input, as the recipe does.

`prepare` needs `datasets` and a tokenizer library (a second or two of imports); `info` needs numpy.
So the writing side is imported only when the command is `prepare` (`importlib`, the same
first-use loading as the package's names), and `info` answers in well under a second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from meshkit.data import info as info_lib


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshkit.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text into a memory-mapped token store",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files or directories: .txt/.md/.py (or --glob), .jsonl, .parquet, save_to_disk directories")
    p.add_argument("--output", required=True, metavar="DIR", help="the token store directory to write")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", metavar="DIR", help="a local Hugging Face tokenizer directory (e.g. the model's)")
    how.add_argument("--vocab-size", type=int, metavar="N", help="train a byte-level BPE of N tokens on the input")
    p.add_argument("--val", nargs="+", metavar="INPUT", help="held-out inputs (instead of --val-fraction)")
    p.add_argument("--val-fraction", type=float, default=0.0, help="share of documents held out (deterministic)")
    p.add_argument("--text-field", default="text", help="the jsonl / parquet / datasets field holding the text")
    p.add_argument("--chat", action="store_true",
                   help="chat records {'messages': [{'role', 'content'}...]} through the tokenizer's chat template; "
                        "only assistant tokens are targets (supervised fine-tuning; meshkit.data.chat)")
    p.add_argument("--glob", action="append", dest="globs", metavar="PATTERN",
                   help="text file pattern inside directories (repeatable; default *.txt *.md *.py)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="non-UTF-8 bytes: an error naming file and offset, or U+FFFD")
    p.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8), help="most tokenizing processes (one per MiB of input at most: below that, start-up costs more than it saves)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --val-fraction choice")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    info = sub.add_parser("info", help="describe a token store: splits, loss mask, targets, checksums")
    info.add_argument("store", metavar="DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            return info_lib.main(args.store)
        return _prepare(args)
    except ValueError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2


def _prepare(args: argparse.Namespace) -> int:
    writer = importlib.import_module("meshkit.data.prepare")
    source = importlib.import_module("meshkit.data.chat" if args.chat else "meshkit.data.sources")
    source = source.CHAT if args.chat else source.TEXT
    result = writer.prepare(args.inputs, args.output, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                            val=args.val, val_fraction=args.val_fraction, text_field=args.text_field,
                            globs=args.globs, errors=args.errors, workers=args.workers, seed=args.seed,
                            progress=not args.quiet, source=source)
    m = result.manifest
    state = "up to date (inputs unchanged): nothing to do" if result.skipped else "written"
    print(f"{result.path}: {state} | {m['num_documents']} documents, {m['num_tokens']:,} tokens ({m['dtype']}), "
          f"vocab {m['vocab_size']}, train {m['splits']['train']['tokens']:,} / val {m['splits']['val']['tokens']:,} "
          "tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
