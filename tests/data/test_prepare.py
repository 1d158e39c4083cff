"""`prepare` and `TokenStore`: exact tokens, atomic writes, no-op re-runs, and every bad input refused.

The reference for exactness is the tokenizer's own `encode` of each document plus EOS, read back
through the memory-mapped store.
"""

from __future__ import annotations

import json
import os

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from meshkit.data import TokenStore
from meshkit.data import prepare as prepare_module
from meshkit.data import store as store_module
from meshkit.data.__main__ import main as cli
from meshkit.data.prepare import prepare
from meshkit.data.sources import DocumentSource

TEXTS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\nAnd again: the quick brown fox.\n",
    "b.md": "# Title\n\nSome *markdown* text, with unicode: café, naïve, 東京.\n",
    "sub/c.py": "def f(x):\n    return x * 2  # doubled\n\nprint(f(21))\n",
    "sub/d.txt": "Another document. " * 20,
}
JSONL = [{"text": "json document one"}, {"text": "json document two, longer than the first"}, {"text": "three"}]


def _corpus(root):
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "sub" / "empty.py").write_text("")  # skipped inside a directory
    (root / "x.jsonl").write_text("\n".join(json.dumps(r) for r in JSONL) + "\n")
    return root


def _documents_in_order():
    text = [TEXTS[k] for k in sorted(TEXTS, key=lambda k: str(k))]
    return text, [r["text"] for r in JSONL]


def _run(inputs, out, **kw):
    kw.setdefault("progress", False)
    return prepare([str(i) for i in inputs], str(out), **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def bpe_store(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("stores") / "bpe"
    _run([corpus], out, vocab_size=300)
    return out


def test_store_is_exactly_the_tokenizers_encode_plus_eos(bpe_store):
    store = TokenStore(bpe_store)
    tok = AutoTokenizer.from_pretrained(str(store.tokenizer_dir()))
    text, jsonl = _documents_in_order()
    # text files in sorted path order (a.txt, b.md, sub/c.py, sub/d.txt), then the jsonl lines
    assert store.num_documents == len(text) + len(jsonl)
    for index, doc in enumerate(text + jsonl):
        expected = tok.encode(doc, add_special_tokens=False) + [tok.eos_token_id]
        assert store.document(index).tolist() == expected, f"document {index}"
        assert tok.decode(store.document(index)[:-1].tolist()) == doc
    assert store.dtype == np.uint16 and store.loss_mask is None
    assert store.vocab_size == len(tok) == 300 and store.eos_id == tok.eos_token_id
    assert store.split_info("train").documents == store.num_documents and store.split_info("val").documents == 0


def test_existing_tokenizer_with_a_large_vocabulary_gives_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<unk>"], vocab["</s>"] = 70_000, 70_001
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    (tmp_path / "in.txt").write_text("w69999 w5 w65536 nope")
    _run([tmp_path / "in.txt"], tmp_path / "store", tokenizer=str(tmp_path / "tok"))
    store = TokenStore(tmp_path / "store")
    assert store.dtype == np.uint32
    assert store.document(0).tolist() == [69999, 5, 65536, 70_000, 70_001]


def test_val_fraction_is_deterministic_and_by_document(corpus, tmp_path):
    a = TokenStore(_run([corpus], tmp_path / "a", vocab_size=300, val_fraction=0.3, seed=3).path)
    b = TokenStore(_run([corpus], tmp_path / "b", vocab_size=300, val_fraction=0.3, seed=3).path)
    assert np.array_equal(a.split_ids, b.split_ids) and a.split_info("val").documents == round(0.3 * 7)
    train, val = a.split_info("train"), a.split_info("val")
    assert train.tokens + val.tokens == a.num_tokens
    # --val INPUT: those documents, after the training ones
    c = TokenStore(_run([corpus / "a.txt", corpus / "b.md"], tmp_path / "c", vocab_size=300,
                        val=[str(corpus / "x.jsonl")]).path)
    assert c.split_ids.tolist() == [0, 0, 1, 1, 1]


def test_small_inputs_tokenize_in_fewer_processes():
    """Start-up dominates small inputs: a process per BYTES_PER_PROCESS of input, at most `workers`."""
    per = prepare_module.BYTES_PER_PROCESS
    assert prepare_module.tokenizing_processes(8, 800_000) == 1  # the demo corpus (0.8 MB of stdlib source)
    assert prepare_module.tokenizing_processes(8, 3 * per) == 3
    assert prepare_module.tokenizing_processes(2, 100 * per) == 2
    assert prepare_module.tokenizing_processes(1, 100 * per) == 1


def test_workers_parquet_and_saved_datasets_read_the_same_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "BYTES_PER_PROCESS", 1)  # two processes even for this tiny input
    texts = [f"row {i}: " + "lorem ipsum " * (i % 5) for i in range(40)]
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "t.parquet"))
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "saved"))
    one = TokenStore(_run([tmp_path / "t.parquet"], tmp_path / "one", vocab_size=280, text_field="body").path)
    two = TokenStore(_run([tmp_path / "t.parquet"], tmp_path / "two", vocab_size=280, text_field="body",
                          workers=2).path)
    saved = TokenStore(_run([tmp_path / "saved"], tmp_path / "saved_store", vocab_size=280, text_field="body").path)
    assert np.array_equal(one.tokens, two.tokens) and np.array_equal(one.tokens, saved.tokens)
    tok = AutoTokenizer.from_pretrained(str(one.tokenizer_dir()))
    assert [one.document(i).tolist() for i in range(40)] == \
        [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]


def test_rerun_is_a_no_op_until_an_input_changes(corpus, tmp_path):
    first = _run([corpus], tmp_path / "s", vocab_size=300)
    tokens_mtime = os.stat(tmp_path / "s" / "tokens.bin").st_mtime_ns
    again = _run([corpus], tmp_path / "s", vocab_size=300)
    assert not first.skipped and again.skipped
    assert os.stat(tmp_path / "s" / "tokens.bin").st_mtime_ns == tokens_mtime
    assert not _run([corpus], tmp_path / "s", vocab_size=301).skipped  # other options: rewritten


def test_interrupted_prepare_leaves_the_old_store_and_no_temporary(corpus, tmp_path, monkeypatch):
    out = tmp_path / "s"
    _run([corpus / "a.txt"], out, vocab_size=300)
    before = (out / "tokens.bin").read_bytes()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(store_module, "file_entries", boom)
    with pytest.raises(KeyboardInterrupt):
        _run([corpus], out, vocab_size=300)
    assert (out / "tokens.bin").read_bytes() == before and TokenStore(out).num_documents == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no .s.tmp-* left behind
    with pytest.raises(KeyboardInterrupt):
        _run([corpus], tmp_path / "fresh", vocab_size=300)
    assert not (tmp_path / "fresh").exists()


def test_loss_mask_from_a_document_source_is_stored(tmp_path):
    """The SFT hook: a source returning masks gets loss_mask.bin; EOS appended with mask 1."""
    def encode(tok, values):
        out = []
        for v in values:
            ids = tok(v, add_special_tokens=False)["input_ids"]
            out.append((ids, [i % 2 for i in range(len(ids))]))
        return out

    (tmp_path / "m.jsonl").write_text('{"text": "masked words here"}\n{"text": "and more words"}\n')
    store = TokenStore(_run([tmp_path / "m.jsonl"], tmp_path / "s", vocab_size=270,
                            source=DocumentSource("masked", encode)).path)
    assert store.loss_mask is not None
    for d in range(2):
        n = len(store.document(d))
        lo = int(store.offsets[d])
        assert store.loss_mask[lo:lo + n].tolist() == [i % 2 for i in range(n - 1)] + [1]


# ------------------------------------------------------------------------------------ bad input


def test_bad_inputs_are_clear_value_errors(tmp_path, corpus):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt: empty file"):
        _run([tmp_path / "empty.txt"], tmp_path / "o", vocab_size=300)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="emptydir.*no non-empty file matching"):
        _run([tmp_path / "emptydir"], tmp_path / "o", vocab_size=300)
    with pytest.raises(ValueError, match=r"no non-empty file matching \*\.rst"):
        _run([corpus / "sub"], tmp_path / "o", vocab_size=300, globs=["*.rst"])
    with pytest.raises(ValueError, match="no such file or directory"):
        _run([tmp_path / "missing"], tmp_path / "o", vocab_size=300)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 ok".encode() + b" then latin-1: caf\xe9")
    with pytest.raises(ValueError, match=r"latin1.txt: not UTF-8 at byte offset 26.*--errors replace"):
        _run([bad], tmp_path / "o", vocab_size=300)
    store = TokenStore(_run([bad], tmp_path / "replaced", vocab_size=300, errors="replace").path)
    assert "\ufffd" in AutoTokenizer.from_pretrained(str(store.tokenizer_dir())).decode(store.document(0).tolist())
    (tmp_path / "j.jsonl").write_text('{"text": "fine"}\n\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"j.jsonl:3: no field 'text'"):
        _run([tmp_path / "j.jsonl"], tmp_path / "o", vocab_size=300)
    (tmp_path / "j2.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"j2.jsonl \(line 2\): not UTF-8 at byte offset 30"):
        _run([tmp_path / "j2.jsonl"], tmp_path / "o", vocab_size=300)
    (tmp_path / "nottok").mkdir()
    (tmp_path / "nottok" / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="nottok.*does not load as a Hugging Face tokenizer"):
        _run([corpus], tmp_path / "o", tokenizer=str(tmp_path / "nottok"))
    with pytest.raises(ValueError, match="exactly one of --tokenizer"):
        _run([corpus], tmp_path / "o")
    (tmp_path / "userdir").mkdir()
    (tmp_path / "userdir" / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a token store"):
        _run([corpus], tmp_path / "userdir", vocab_size=300)
    assert (tmp_path / "userdir" / "precious.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="--val-fraction 0.01 of 7 documents holds out 0"):
        _run([corpus], tmp_path / "o", vocab_size=300, val_fraction=0.01)
    assert not (tmp_path / "o").exists()


def test_damaged_stores_are_refused(bpe_store, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in bpe_store.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    tokens = (copy / "tokens.bin").read_bytes()
    (copy / "tokens.bin").write_bytes(tokens[:-2])
    with pytest.raises(ValueError, match=r"tokens.bin has \d+ bytes, the manifest says \d+ \(truncated"):
        TokenStore(copy)
    flipped = bytearray(tokens)
    flipped[10] ^= 1
    (copy / "tokens.bin").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="tokens.bin's sha256 does not match the manifest"):
        TokenStore(copy)
    TokenStore(copy, verify=False)  # sizes still agree: opening without the checksum pass works
    with pytest.raises(ValueError, match="no manifest.json there"):
        TokenStore(tmp_path)


def test_cli_exit_status_and_message(tmp_path, corpus, capsys):
    assert cli(["prepare", str(tmp_path / "nothing"), "--output", str(tmp_path / "o"), "--vocab-size", "300",
                "--quiet"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert cli(["prepare", str(corpus / "a.txt"), "--output", str(tmp_path / "o"), "--vocab-size", "300",
                "--quiet"]) == 0
    assert "1 documents" in capsys.readouterr().out
    assert cli(["info", str(tmp_path / "o")]) == 0


def test_bpe_training_says_so_and_its_progress_changes_nothing(tmp_path, corpus, bpe_store, capsys):
    """Training the BPE runs before the tokenize bar and takes minutes on a large corpus: prepare names
    it (stderr) when progress is on, and the bars do not change the tokenizer or the tokens."""
    assert cli(["prepare", str(corpus), "--output", str(tmp_path / "o"), "--vocab-size", "300"]) == 0
    err = capsys.readouterr().err
    assert f"prepare: training a byte-level BPE of 300 tokens on the {len(TEXTS) + len(JSONL)} input documents" in err, err
    loud, quiet = TokenStore(tmp_path / "o"), TokenStore(bpe_store)
    assert loud.manifest["tokenizer_sha256"] == quiet.manifest["tokenizer_sha256"]
    assert all(loud.document(i).tolist() == quiet.document(i).tolist() for i in range(quiet.num_documents))
