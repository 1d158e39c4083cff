"""meshkit.data: prepare throughput against the tokenizer's own batch encode, the loader's data stall
with and without prefetch, and peak memory over a memory-mapped store against reading it into memory.

    python -m benchmarks.data [--quick] [--out benchmarks/results/data.md]
    python -m benchmarks.data --scaling [--scaling-mb 1,4,16] [--out benchmarks/results/data_scaling.md]

1. Prepare: part of the Python standard library's source (real text every machine has), tokenized by
   the same byte-level BPE both ways: the peer reads the files and calls `tokenizers`' `encode_batch`
   in one process (its Rust threads off, as `prepare` runs them); meshkit runs the whole `prepare`
   (datasets, Dataset.map, the flat array, checksums, the atomic rename) with 1 and 2 processes.
   Tokens/s and the ratio to the peer, paired repetitions. Both produce the same tokens (checked).
2. Loader stall: a consumer that computes for `--step-ms` per step (torch matmuls, like a CPU training
   step) reads batches of the demo's shape and a long-sequence shape; the time `next()` waits per step
   with the prefetch thread, against building the batch synchronously (prefetch=0).
3. Scaling (`--scaling`, only this section): growing prefixes of the whole standard library's source
   (1, 4, 16 MB by default), `prepare` forced to 1 and 2 tokenizing processes (the per-process cap
   lifted), beside the peer: where a second process starts to pay, which sets `BYTES_PER_PROCESS`.
4. Memory: a generated store of `--store-mb` (1 GB by default) read by a fresh process through the
   loader for many random rows, against a fresh process that reads the token file into memory
   (`np.fromfile`): the growth of peak RSS over the process's baseline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process on both sides, before any tokenizer runs

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from benchmarks.report import emit, machine_line, paired, table  # noqa: E402
from meshkit.data import PackedLoader, TokenStore  # noqa: E402
from meshkit.data import prepare as prepare_module  # noqa: E402
from meshkit.data.prepare import prepare, tokenizing_processes  # noqa: E402
from meshkit.data.store import TOKENS, finish_store, token_dtype  # noqa: E402
from meshkit.data.tokenizer import train_bpe  # noqa: E402

QUICK_DIRS = ("json", "email", "http", "logging")
FULL_DIRS = QUICK_DIRS + ("asyncio", "xml", "urllib", "importlib", "concurrent", "collections")


def _corpus(dirs: tuple[str, ...]) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for d in dirs for f in (root / d).rglob("*.py") if f.stat().st_size and "__pycache__" not in f.parts)


def _peer(files: list[Path], tok_file: Path) -> tuple[float, list[list[int]]]:
    """Read the files and batch-encode them with the tokenizer itself: the bar `prepare` is held to."""
    start = time.perf_counter()
    tok = Tokenizer.from_file(str(tok_file))
    texts = [f.read_text(encoding="utf-8") for f in files]
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    return time.perf_counter() - start, ids


def _meshkit(files: list[Path], tok_dir: Path, out: Path, workers: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    prepare([str(f) for f in files], out, tokenizer=tok_dir, workers=workers, progress=False)
    return time.perf_counter() - start


def prepare_table(files: list[Path], work: Path, reps: int) -> list[str]:
    tok_dir = work / "tok"
    train_bpe((f.read_text(encoding="utf-8") for f in files), 4096, tok_dir)
    peer_s, mk1_s, mk2_s = [], [], []
    for _ in range(reps):  # interleaved, so load that drifts hits every method alike
        seconds, ids = _peer(files, tok_dir / "tokenizer.json")
        peer_s.append(seconds)
        mk1_s.append(_meshkit(files, tok_dir, work / "store1", 1))
        mk2_s.append(_meshkit(files, tok_dir, work / "store2", 2))
    store = TokenStore(work / "store1")
    eos = store.eos_id
    expected = np.concatenate([np.asarray(i + [eos]) for i in ids])
    same = np.array_equal(np.asarray(store.tokens), expected) and np.array_equal(
        np.asarray(TokenStore(work / "store2").tokens), expected)
    n = store.num_tokens
    mb = sum(f.stat().st_size for f in files) / 1e6
    rows = [["tokenizers encode_batch (peer: read files + encode)", 1, f"{n / min(peer_s):,.0f}", "1.00"],
            ["meshkit prepare", 1, f"{n / min(mk1_s):,.0f}", f"{paired(peer_s, mk1_s):.2f}"],
            ["meshkit prepare --workers 2", tokenizing_processes(2, int(mb * 1e6)), f"{n / min(mk2_s):,.0f}",
             f"{paired(peer_s, mk2_s):.2f}"]]
    return [f"## Prepare: {len(files)} files, {mb:.1f} MB of stdlib source, {n:,} tokens (BPE 4096)", "",
            f"Best of {reps} paired repetitions; ratio = median over repetitions of peer time / meshkit time "
            f"(>= 1: meshkit faster). Same tokens both ways: {'yes' if same else 'NO'}.", "",
            *table(["method", "processes", "tokens/s", "ratio vs peer"], rows)]


def _stdlib_prefix(megabytes: float) -> list[Path]:
    """The standard library's .py files in path order until `megabytes` of source: every machine has them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "__pycache__" in f.parts or "site-packages" in f.parts or not f.stat().st_size:
            continue
        try:
            f.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a few test files are deliberately not UTF-8
            continue
        files.append(f)
        total += f.stat().st_size
        if total >= megabytes * 1e6:
            return files
    raise ValueError(f"the standard library holds only {total / 1e6:.1f} MB of source; fix: a smaller --scaling-mb")


def scaling_table(sizes_mb: list[float], work: Path, reps: int) -> list[str]:
    """prepare with 1 and 2 processes (cap lifted) on growing corpora, each repetition interleaved with the peer."""
    tok_dir = work / "tok"
    train_bpe((f.read_text(encoding="utf-8") for f in _stdlib_prefix(1.0)), 4096, tok_dir)
    cap = prepare_module.BYTES_PER_PROCESS
    prepare_module.BYTES_PER_PROCESS = 1  # measure the processes asked for, not what the cap would allow
    rows = []
    try:
        for size in sizes_mb:
            files = _stdlib_prefix(size)
            peer_s, mk1_s, mk2_s = [], [], []
            for _ in range(reps):
                peer_s.append(_peer(files, tok_dir / "tokenizer.json")[0])
                mk1_s.append(_meshkit(files, tok_dir, work / "s1", 1))
                mk2_s.append(_meshkit(files, tok_dir, work / "s2", 2))
            n = TokenStore(work / "s1").num_tokens
            mb = sum(f.stat().st_size for f in files) / 1e6
            rows.append([f"{mb:.1f}", len(files), f"{n:,}", f"{n / min(peer_s):,.0f}", f"{n / min(mk1_s):,.0f}",
                         f"{n / min(mk2_s):,.0f}", f"{paired(peer_s, mk1_s):.2f}", f"{paired(peer_s, mk2_s):.2f}",
                         f"{paired(mk1_s, mk2_s):.2f}"])
    finally:
        prepare_module.BYTES_PER_PROCESS = cap
    return [f"## Prepare scaling with processes (stdlib source prefixes, BPE 4096, best of {reps})", "",
            "tokens/s of the peer (tokenizers encode_batch, one process) and of `prepare` forced to 1 and 2",
            "processes; ratios are medians of paired repetitions (>= 1: the second is faster).", "",
            *table(["MB", "files", "tokens", "peer tok/s", "prepare 1 proc tok/s", "prepare 2 proc tok/s",
                    "1 proc / peer", "2 proc / peer", "2 proc / 1 proc"], rows)]


def _compute(ms: float, a: torch.Tensor) -> None:
    """Busy for about `ms` milliseconds with torch matmuls (they release the GIL, as training does)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ a


def stall_table(store: TokenStore, step_ms: float, steps: int) -> list[str]:
    a = torch.randn(128, 128)
    rows = []
    for name, seq, batch in (("demo shape", 128, 32), ("long rows", 2048, 8)):
        waits = {}
        for prefetch in (0, 2):
            loader = PackedLoader(store, seq_len=seq, global_batch=batch, seed=0, prefetch=prefetch)
            next(loader)  # the first batch is built before any step could hide it
            loader.wait_s, build = 0.0, 0.0
            for _ in range(steps):
                start = time.perf_counter()
                next(loader)
                build += time.perf_counter() - start
                _compute(step_ms, a)
            waits[prefetch] = (loader.wait_s if prefetch else build) / steps
            loader.close()
        rows.append([name, f"{batch} x {seq}", f"{1e3 * waits[0]:.3f}", f"{1e3 * waits[2]:.3f}",
                     f"{100 * waits[2] / (step_ms / 1e3):.2f}%",
                     f"{waits[0] / max(waits[2], 1e-9):.0f}x"])
    return [f"## Loader stall per step ({steps} steps of {step_ms:.0f} ms compute)", "",
            "Synchronous: the time `next()` takes to build the batch (prefetch=0), what a loop without a",
            "prefetch thread waits; prefetched: the time `next()` waited for the thread (prefetch=2).", "",
            *table(["batch", "rows x seq_len", "synchronous ms/step", "prefetched wait ms/step",
                    "wait / step time", "less waiting"], rows)]


def generate_store(path: Path, megabytes: int) -> None:
    """A store of random tokens, `megabytes` of uint16, written in chunks (never whole in memory)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n = megabytes * (1 << 20) // 2
    lengths = rng.integers(50, 4000, n // 50 + 1)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths), n) + 1]
    lengths[-1] -= lengths.sum() - n
    with open(path / TOKENS, "wb") as f:
        for lo in range(0, n, 1 << 24):
            chunk = rng.integers(1, 32000, min(1 << 24, n - lo), dtype=np.uint16)
            f.write(chunk.tobytes())
    tokens = np.memmap(path / TOKENS, dtype=np.uint16, mode="r+")
    tokens[np.cumsum(lengths) - 1] = 0  # each document ends with EOS
    tokens.flush()
    del tokens
    finish_store(path, lengths, np.zeros(len(lengths), np.uint8), dtype=token_dtype(32000), eos_id=0,
                 vocab_size=32000, tokenizer_sha256="generated", has_mask=False)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss_child(store_path: str, mode: str, steps: int) -> None:
    """Run in a fresh process: print anonymous and file-backed RSS (KiB) before and after reading."""
    before = _rss_kib("RssAnon"), _rss_kib("RssFile")
    if mode == "loader":
        loader = PackedLoader(TokenStore(store_path, verify=False), seq_len=2048, global_batch=8, seed=0)
        for _ in range(steps):
            next(loader)
        loader.close()
    else:
        tokens = np.fromfile(Path(store_path) / TOKENS, dtype=np.uint16)
        tokens.sum()
    print(*before, _rss_kib("RssAnon"), _rss_kib("RssFile"))


def memory_table(store_path: Path, steps: int) -> list[str]:
    size_mib = (store_path / TOKENS).stat().st_size / 2**20
    rows = []
    for mode, label in (("loader", "meshkit PackedLoader (memory map)"), ("read", "np.fromfile (read into memory)")):
        out = subprocess.run([sys.executable, "-m", "benchmarks.data", "--rss-child", str(store_path), mode, str(steps)],
                             capture_output=True, text=True, check=True).stdout.split()
        anon0, file0, anon1, file1 = (int(x) / 1024 for x in out[-4:])
        rows.append([label, f"{anon1 - anon0:.0f}", f"{file1 - file0:.0f}", f"{(anon1 - anon0) / size_mib:.3f}"])
    return [f"## Memory over a {size_mib:,.0f} MiB token store ({steps} loader steps of 8 x 2048 random rows)", "",
            "Growth of the reading process's resident memory: anonymous (its own, what a copy costs) and",
            "file-backed (page-cache pages of the store mapped in, shared between ranks and reclaimable).", "",
            *table(["reader", "anonymous growth MiB", "file-backed growth MiB", "anonymous growth / store size"], rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller corpus and store, fewer repetitions")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    parser.add_argument("--store-mb", type=int, default=None, help="generated store size (default 1024; quick 256)")
    parser.add_argument("--step-ms", type=float, default=50.0, help="compute per simulated training step")
    parser.add_argument("--scaling", action="store_true", help="only the prepare-scaling section")
    parser.add_argument("--scaling-mb", default="1,4,16", help="corpus sizes for --scaling, MB, comma-separated")
    parser.add_argument("--rss-child", nargs=3, metavar=("STORE", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child[0], args.rss_child[1], int(args.rss_child[2]))
        return 0
    torch.set_num_threads(1)
    if args.scaling:
        with tempfile.TemporaryDirectory(prefix="meshkit-bench-data-") as tmp:
            sizes = [float(x) for x in args.scaling_mb.split(",")]
            emit(["# meshkit.data prepare scaling", "", machine_line(), "",
                  *scaling_table(sizes, Path(tmp), 1 if args.quick else 2)], args.out)
        return 0
    store_mb = args.store_mb or (256 if args.quick else 1024)
    with tempfile.TemporaryDirectory(prefix="meshkit-bench-data-") as tmp:
        work = Path(tmp)
        lines = ["# meshkit.data benchmark", "", machine_line(), ""]
        lines += prepare_table(_corpus(QUICK_DIRS if args.quick else FULL_DIRS), work, 2 if args.quick else 3)
        generate_store(work / "big", store_mb)
        lines += stall_table(TokenStore(work / "store1"), args.step_ms, 30 if args.quick else 100)
        lines += memory_table(work / "big", 50 if args.quick else 200)
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
