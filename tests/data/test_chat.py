"""Chat data for supervised fine-tuning: tokens from the tokenizer's chat template, labels -100 on
everything but the assistant turns (checked against labels built by hand from the template's pieces),
and a training loss that counts only assistant tokens (against a hand-built single-device reference)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.data import TokenStore
from meshkit.data.chat import CHAT
from meshkit.data.prepare import prepare
from meshkit.data.tokenizer import train_bpe
from meshkit.testing.reference import ModelSpec

SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Special tokens between the pieces: byte-level BPE never merges across them, so the hand-built
# reference below can tokenize each piece on its own.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "Green, or red."}],
    [{"role": "user", "content": "Say hello twice."}, {"role": "assistant", "content": "hello hello"}],
]


@pytest.fixture(scope="module")
def chat_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    corpus = [m["content"] for c in CONVERSATIONS for m in c] * 4
    tok = train_bpe(corpus, 300, root / "tok")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "tok"))
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    prepare([str(data)], str(root / "store"), tokenizer=str(root / "tok"), source=CHAT, progress=False)
    return root, tok


def _by_hand(tok, conversation) -> tuple[list[int], list[int]]:
    """Tokens and mask from the template's pieces: role token, content, end token; the assistant's
    content and end token are targets, its role token (the generation prompt) is not."""
    ids, mask = [], []
    for m in conversation:
        content = tok(m["content"], add_special_tokens=False)["input_ids"]
        end = tok.convert_tokens_to_ids("<|end|>")
        ids += [tok.convert_tokens_to_ids(f"<|{m['role']}|>"), *content, end]
        mask += [0] + [int(m["role"] == "assistant")] * (len(content) + 1)
    return ids + [tok.eos_token_id], mask + [1]


def test_chat_store_holds_the_template_tokens_with_assistant_masks(chat_store):
    root, tok = chat_store
    store = TokenStore(root / "store")
    offsets = np.asarray(store.offsets)
    assert len(offsets) - 1 == len(CONVERSATIONS)
    for i, conversation in enumerate(CONVERSATIONS):
        ids, mask = _by_hand(tok, conversation)
        got = np.asarray(store.tokens[offsets[i]:offsets[i + 1]]).tolist()
        assert got == ids, f"conversation {i}: {tok.decode(got)!r}"
        assert np.asarray(store.loss_mask[offsets[i]:offsets[i + 1]]).tolist() == mask, f"conversation {i}"


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
    ({"messages": "nope"}, "not JSON"),
    ({"text": "hi"}, "no field 'messages'"),
])
def test_bad_chat_records_are_refused_with_their_line(chat_store, tmp_path, record, message):
    root, _ = chat_store
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=message) as err:
        prepare([str(bad)], str(tmp_path / "out"), tokenizer=str(root / "tok"), source=CHAT, progress=False)
    assert "bad.jsonl:2" in str(err.value)


def _sft_loss_on_rank(root: str) -> dict:
    store = TokenStore(f"{root}/store")
    spec = ModelSpec(vocab=store.vocab_size + 8)
    reference = spec.build()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string("dp_shard=2"))
    # One conversation per row (pack=False, padded to seq_len), one row per data rank.
    loader = pm.dataloader(store, seq_len=48, global_batch=2, pack=False, seed=0, prefetch=0)
    ids, labels, positions = loader.rows_at(0)
    loss = pm.forward_backward(ids, labels, position_ids=positions).item()
    # The reference: each conversation of the global batch alone through the unsharded model, cross-
    # entropy summed over the tokens the store's mask (checked above against the hand-built one)
    # marks as the assistant's, divided by their number.
    total, count = torch.zeros(()), 0
    with torch.no_grad():
        for g in range(2):
            ((start, length, _),) = loader.rows.segments(*loader.rows.locate(g))
            doc = torch.as_tensor(np.asarray(store.tokens[start:start + length]), dtype=torch.int64)
            mask = torch.as_tensor(np.asarray(store.loss_mask[start:start + length]), dtype=torch.bool)
            logits = reference(input_ids=doc.unsqueeze(0), use_cache=False).logits[0]
            targets = doc[1:].masked_fill(~mask[1:], -100)
            total += F.cross_entropy(logits[:-1], targets, ignore_index=-100, reduction="sum")
            count += int(mask[1:].sum())
    return {"loss": loss, "ref": (total / count).item()}


def test_sft_loss_counts_only_assistant_tokens(dist, chat_store):
    root, _ = chat_store
    for rank, r in enumerate(dist(2).run(_sft_loss_on_rank, str(root))):
        assert abs(r["loss"] - r["ref"]) <= 1e-5, f"rank {rank}: SFT loss {r['loss']} vs hand-built {r['ref']}"


def _sft_recipe(root: str) -> dict:
    """recipes/configs/sft_chat.toml as a user runs it: --model-path, the chat store, --export-hf; only
    the number of steps (and the log directory, and one thread per rank) differ from the preset."""
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    if str(recipes) not in sys.path:
        sys.path.insert(0, str(recipes))
    spec = importlib.util.spec_from_file_location("train_llama", recipes / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_llama"] = module
    spec.loader.exec_module(module)
    args = module.build_parser().parse_args([
        "--config", str(recipes / "configs" / "sft_chat.toml"), "--model-path", f"{root}/model",
        "--path", f"{root}/store", "--export-hf", f"{root}/out", "--steps", "2", "--threads", "1",
        "--log-dir", f"{root}/runs"])
    run = module.apply_cli(module.load_config(args.config), args)
    run.train = dataclasses.replace(run.train, name="sft")
    return module.train(run)


@pytest.fixture(scope="module")
def small_sft_set(tmp_path_factory):
    """A few hundred short conversations: less than one global batch of the preset (8 rows of 512 tokens),
    and a held-out split smaller than one row."""
    root = tmp_path_factory.mktemp("sft")
    conversations = [[{"role": "user", "content": f"What is {a} plus {b}?"},
                      {"role": "assistant", "content": f"{a + b}."}] for a in range(20) for b in range(10)]
    corpus = [m["content"] for c in conversations for m in c]
    tok = train_bpe(corpus, 300, root / "tok")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "tok"))
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    prepare([str(data)], str(root / "store"), tokenizer=str(root / "tok"), source=CHAT, progress=False,
            val_fraction=0.05, workers=1)
    torch.manual_seed(0)
    start = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                         max_position_embeddings=512, tie_word_embeddings=False,
                                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=None))
    start.save_pretrained(str(root / "model"))
    tok.save_pretrained(str(root / "model"))  # the model's own tokenizer: the store's, so the check passes
    return root, tok, conversations, start


def test_sft_preset_fine_tunes_a_small_set_and_exports_model_and_tokenizer(dist, small_sft_set):
    """The preset as written on a few hundred conversations: training epochs within each batch and the
    held-out split is evaluated on what it holds (each said once), the entropy reference counts only
    target tokens, the sample answers a held-out question from its assistant header, and the export
    loads with from_pretrained (model) and AutoTokenizer (chat template included), generating exactly
    the run's own sample."""
    root, tok, conversations, start = small_sft_set
    outcomes = dist(4).run_raw(_sft_recipe, str(root))
    assert all(o.ok for o in outcomes), "\n".join(f"rank {o.rank}: {o.message}\n{o.traceback}" for o in outcomes)
    printed = "".join(o.output for o in outcomes)
    assert printed.count("fewer than one global batch of 8") == 1, printed[-3000:]
    assert printed.count("each evaluation reads them once") == 1 and "held-out loss" in printed, printed[-3000:]
    store = TokenStore(root / "store")
    counts = np.zeros(len(tok), dtype=np.int64)
    for d in store.split_documents("train"):
        ids, mask = _by_hand(tok, conversations[d])
        np.add.at(counts, [t for t, m in zip(ids, mask) if m], 1)
    p = counts[counts > 0] / counts.sum()
    entropy = float(-(p * np.log(p)).sum())
    assert f"unigram entropy of the target tokens {entropy:.4f}" in outcomes[0].output, outcomes[0].output[-2000:]

    first_val = int(store.split_documents("val")[0])
    ids, mask = _by_hand(tok, conversations[first_val])
    prompt = ids[:mask.index(1)]  # the conversation through the assistant header, not its answer
    sample = outcomes[0].value["sample"]
    assert sample[:len(prompt)] == prompt and tok.decode(prompt).endswith("<|assistant|>"), tok.decode(sample)

    exported = AutoTokenizer.from_pretrained(str(root / "out"))
    assert exported.chat_template == TEMPLATE
    assert exported.apply_chat_template(conversations[0], tokenize=True) == \
        tok.apply_chat_template(conversations[0], tokenize=True)
    tuned = AutoModelForCausalLM.from_pretrained(str(root / "out"))
    assert tok.eos_token_id in np.atleast_1d(tuned.generation_config.eos_token_id).tolist()
    moved = [n for n, p in tuned.state_dict().items() if not torch.equal(p, start.state_dict()[n])]
    assert "lm_head.weight" in moved and len(moved) > len(tuned.state_dict()) // 2, moved
    again = tuned.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=len(sample) - len(prompt))
    assert again[0].tolist() == sample
