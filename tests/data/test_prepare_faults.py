"""`prepare` under faults and hostile inputs: killed midway, a damaged store, NUL bytes, one huge line,
a held-out share the documents cannot give.

Each case was reproduced against the previous `prepare`: two orphan workers of 1.9 GB and a 27 MB
temporary left by a killed run, a same-size corrupted store reported "up to date", a file of NUL
bytes accepted as text, 2.5 GB to tokenize one 15 MB line, `--val-fraction` refused only after
tokenizing.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from meshkit.data import TokenStore, sources
from meshkit.data import prepare as prepare_module
from meshkit.data.prepare import prepare
from meshkit.data.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta.", "gamma\n", "delta\n\n", "eps  ", "12345,", "x_y_z", "  ", "\t", "!!", "café", "東京"]


def _text(chars: int, seed: int = 0) -> str:
    """Words, spaces, tabs, newline runs, digits, punctuation and non-ASCII: every kind of boundary."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < chars:
        part = rng.choice(WORDS) + rng.choice(["", " "])
        parts.append(part)
        size += len(part)
    return "".join(parts)[:chars]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "bpe"
    train_bpe([_text(20_000, seed) for seed in range(5)], 300, out)
    return out


def _prepare(inputs, out, **kw):
    kw.setdefault("progress", False)
    return prepare([str(i) for i in inputs], str(out), **kw)


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            todo.extend(c for c in children if c not in found)
            found.update(children)
    return found


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie waiting for a reaper is dead


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers die with their parent on Linux")
def test_a_killed_prepare_leaves_no_worker_and_the_next_prepare_cleans_up(tmp_path, tokenizer_dir):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):  # 3 MiB: two tokenizing processes (one per MiB, --workers 2)
        (corpus / f"{i}.txt").write_text(_text(1 << 20, seed=i))
    out = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "meshkit.data", "prepare", str(corpus), "--output", str(out),
               "--tokenizer", str(tokenizer_dir), "--workers", "2", "--quiet"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    # Killed while two workers are tokenizing: idle pool workers exit on their own once the parent's
    # end of the task pipe closes; busy ones (and the pool's manager) lived on indefinitely.
    while sum(_cpu_s(w) > 0.3 for w in workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
        workers |= _descendants(proc.pid)
        time.sleep(0.01)
    try:
        assert len(workers) >= 2, f"no tokenizing workers seen (exit {proc.poll()}): {proc.stderr.read()[-2000:]}"
        proc.kill()  # SIGKILL: no handler of the parent runs
        proc.wait()
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "workers outlived the killed prepare"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    left = sorted(p.name for p in tmp_path.glob(".store.tmp-*"))
    assert left, "the killed prepare left no temporary directory (it was killed too late to test the cleanup)"

    (tmp_path / "small.txt").write_text(_text(2000))
    result = _prepare([tmp_path / "small.txt"], out, tokenizer=tokenizer_dir)
    assert not result.skipped and TokenStore(out).num_documents == 1
    assert not list(tmp_path.glob(".store.tmp-*")), "the stale temporary of the killed prepare is still there"


def test_a_live_prepares_temporary_is_left_alone(tmp_path):
    out = tmp_path / "store"
    mine = tmp_path / f".store.tmp-{prepare_module._ME}"  # this process: alive
    dead = tmp_path / ".store.tmp-999999999"  # the older naming, pid only: this host
    other = tmp_path / ".store.old-another-host-1"
    for d in (mine, dead, other):
        d.mkdir()
    assert prepare_module.remove_stale_temporaries(out) == [str(dead)]
    assert mine.is_dir() and other.is_dir() and not dead.exists()


def test_a_store_that_fails_its_checksums_is_never_up_to_date(tmp_path, tokenizer_dir, capsys):
    (tmp_path / "a.txt").write_text(_text(5000))
    out = tmp_path / "store"
    _prepare([tmp_path / "a.txt"], out, tokenizer=tokenizer_dir)
    good = (out / "tokens.bin").read_bytes()
    damaged = bytearray(good)
    damaged[10] ^= 0xFF  # same size: only the checksum can tell
    (out / "tokens.bin").write_bytes(bytes(damaged))
    again = _prepare([tmp_path / "a.txt"], out, tokenizer=tokenizer_dir, progress=True)
    assert not again.skipped and (out / "tokens.bin").read_bytes() == good
    assert "the existing store does not verify" in capsys.readouterr().err
    assert _prepare([tmp_path / "a.txt"], out, tokenizer=tokenizer_dir).skipped  # and now it is up to date


def test_nul_bytes_are_not_text(tmp_path, tokenizer_dir):
    (tmp_path / "zeros.txt").write_bytes(b"\x00" * 4096)
    with pytest.raises(ValueError, match=r"zeros.txt: binary data, not text \(a NUL byte at offset 0\)"):
        _prepare([tmp_path / "zeros.txt"], tmp_path / "s", tokenizer=tokenizer_dir)
    (tmp_path / "utf16.txt").write_bytes("hello".encode("utf-16-le"))
    with pytest.raises(ValueError, match=r"utf16.txt: binary data, not text \(a NUL byte at offset 1\).*UTF-16"):
        _prepare([tmp_path / "utf16.txt"], tmp_path / "s", tokenizer=tokenizer_dir)


def test_a_long_document_is_encoded_in_bounded_calls_with_the_tokens_of_the_whole(tmp_path, tokenizer_dir,
                                                                                     monkeypatch):
    """Limits lowered 256x so a 60 kB line stands for a 15 MB one: every tokenizer call gets at most
    CALL_CHARS characters, and the store holds exactly the tokens of encoding the whole document."""
    monkeypatch.setattr(sources, "PIECE_CHARS", 1024)
    monkeypatch.setattr(sources, "CALL_CHARS", 4096)
    calls: list[int] = []
    original = PreTrainedTokenizerFast.__call__

    def counting(self, text, *args, **kwargs):
        calls.append(sum(map(len, text)) if isinstance(text, list) else len(text))
        return original(self, text, *args, **kwargs)

    long = _text(60_000, seed=7)
    (tmp_path / "long.txt").write_text(long)
    (tmp_path / "short.txt").write_text("a short one")
    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", counting)
    store = TokenStore(_prepare([tmp_path / "long.txt", tmp_path / "short.txt"], tmp_path / "s",
                                tokenizer=tokenizer_dir).path)
    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", original)
    assert calls and max(calls) <= 4096, calls
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for index, text in enumerate([long, "a short one"]):
        assert store.document(index).tolist() == tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    # A line without a single space is cut hard; a trained BPE still round-trips every byte.
    blob = "".join(random.Random(3).choice("abcdef0123456789") for _ in range(10_000))
    (tmp_path / "blob.txt").write_text(blob)
    trained = TokenStore(_prepare([tmp_path / "blob.txt"], tmp_path / "b", vocab_size=300).path)
    bpe = AutoTokenizer.from_pretrained(str(trained.tokenizer_dir()))
    assert bpe.decode(trained.document(0)[:-1].tolist()) == blob


def test_a_val_fraction_the_documents_cannot_give_is_refused_before_tokenizing(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(_text(5000))
    (tmp_path / "b.txt").write_text(_text(5000, seed=1))

    def never(*args, **kwargs):
        raise AssertionError("tokenizing started before the split was checked")

    monkeypatch.setattr(prepare_module.tokenizers_lib, "train_bpe", never)
    monkeypatch.setattr(prepare_module, "_encode_batch", never)
    with pytest.raises(ValueError, match=r"--val-fraction 0.9 of 2 documents holds out 2; fix"):
        _prepare([tmp_path], tmp_path / "s", vocab_size=300, val_fraction=0.9)
    assert not (tmp_path / "s").exists()


@pytest.mark.slow  # tokenizes 15 MB: minutes on a loaded 2-core machine
@pytest.mark.parametrize("spaces", [True, False], ids=["words", "no-spaces"])
def test_a_15_mb_line_is_prepared_in_bounded_memory(tmp_path, tokenizer_dir, spaces):
    """The reproduction: one 15 MB line took 2.5 GB of RSS; now the pieces bound it (imports included),
    for a line of words and for one without a single space (cut hard)."""
    line = _text(15_000_000).replace("\n", " ") if spaces else \
        "".join(random.Random(0).choice("abcdefghij0123456789") for _ in range(15_000_000))
    (tmp_path / "line.txt").write_text(line)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "meshkit.data", "prepare", str(tmp_path / "line.txt"),
                             "--output", str(tmp_path / "s"), "--tokenizer", str(tokenizer_dir), "--quiet"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, proc.stderr.read()[-2000:]
    peak_gib = usage.ru_maxrss / 2**20  # KiB on Linux
    assert peak_gib < 1.0, f"peak RSS {peak_gib:.2f} GiB"
    assert TokenStore(tmp_path / "s").num_documents == 1
