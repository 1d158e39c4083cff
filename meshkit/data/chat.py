"""Chat data for supervised fine-tuning: `{"messages": [{"role", "content"}, ...]}` records to documents
whose loss mask is 1 on the assistant's tokens only.

    python -m meshkit.data prepare chats.jsonl --output DIR --tokenizer MODEL_DIR --chat

Each conversation is rendered by the tokenizer's own `apply_chat_template`, so the tokens are exactly
what the model will see when it is used as a chat model. Which tokens are the assistant's is found
turn by turn, which works for every template (HF's `return_assistant_tokens_mask` needs templates
with `{% generation %}` blocks, which most do not have): rendering the first k messages gives a
prefix of the rendering of the first k + 1, and an assistant message's own tokens are those past
the rendering of the conversation before it *with the generation prompt* (the assistant header,
never a target) up to the rendering that includes it (its content and end-of-turn marker, which the
model must learn to emit). A template for which the renderings are not prefixes of each other (one
that rewrites earlier turns) is refused with the record's location.

A conversation is one document: packing keeps conversations apart as it keeps documents apart (the
position ids restart, no target crosses the boundary), and mask 0 becomes label -100 in the loader.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from meshkit.data.sources import DocumentSource, Encoded

__all__ = ["CHAT", "ROLES", "encode_conversation"]

ROLES = ("system", "user", "assistant", "tool")


def _messages_value(value: Any, where: str) -> str:
    """The record's `messages`, checked, as canonical JSON text (the `text` column `prepare` stores)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: messages is a string that is not JSON") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects, got "
                         f"{type(value).__name__}")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: messages[{i}] must be an object with a string 'content'")
        if message.get("role") not in ROLES:
            raise ValueError(f"{where}: messages[{i}] has role {message.get('role')!r}; expected one of {ROLES}")
    if not any(m["role"] == "assistant" for m in value):
        raise ValueError(f"{where}: no assistant message, so nothing to train on; fix: drop the record")
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in value], ensure_ascii=False)


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers versions differ: a BatchEncoding or ids
        out = out["input_ids"]
    return list(out)


def encode_conversation(tokenizer: Any, messages: list[dict]) -> Encoded:
    """(token ids, loss mask) of one conversation: mask 1 exactly on the assistant turns' own tokens."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat: the tokenizer has no chat template (tokenizer_config.json 'chat_template'); fix: "
                         "the chat model's own tokenizer directory")
    ids: list[int] = []
    mask: list[int] = []
    for k, message in enumerate(messages):
        upto = _render(tokenizer, messages[:k + 1], generation_prompt=False)
        start = len(ids)
        if message["role"] == "assistant":
            header = _render(tokenizer, messages[:k], generation_prompt=True)
            if header[:start] != ids or upto[:len(header)] != header:
                raise ValueError(f"--chat: the chat template does not render message {k}'s conversation as an "
                                 "extension of the one before it; meshkit cannot tell the assistant's tokens")
            mask += [0] * (len(header) - start) + [1] * (len(upto) - len(header))
        else:
            mask += [0] * (len(upto) - start)
        if upto[:start] != ids:
            raise ValueError(f"--chat: the chat template renders messages[:{k + 1}] differently from the "
                             f"messages before it; meshkit cannot tell the assistant's tokens")
        ids = upto
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):  # the document's end, a target after an assistant turn
        ids.append(eos)
        mask.append(1 if messages[-1]["role"] == "assistant" else 0)
    return ids, mask


def _encode(tokenizer: Any, values: Sequence[str]) -> list[Encoded]:
    return [encode_conversation(tokenizer, json.loads(v)) for v in values]


CHAT = DocumentSource("chat", _encode, column_value=_messages_value, field="messages", text_files=False)
