"""The prompts of ``jphantom generate`` as token ids: ``--prompt`` texts, or a file of plain text
lines or of JSON Lines rows (``{"messages": [...]}`` rendered with the chat template exactly as
``train`` renders conversations, with the generation prompt; ``{"prompt": "..."}`` or
``{"text": "..."}`` as text), tokenised with the run's tokenizer (``train``'s choice:
``--tokenizer``, else the ``--from-hf`` checkpoint's ``tokenizer.json``, else bytes). Every bad
input is a :class:`~jphantom.errors.ConfigError` naming the file and line, before anything
compiles."""

from __future__ import annotations

import json
from pathlib import Path

from jphantom.errors import ConfigError


def read_rows(texts, path, chats=()) -> list[dict]:
    """One row per prompt: ``{"text": ...}`` for each of ``texts`` and each line of a plain
    file, a conversation of one user message for each of ``chats``, the JSON object of each
    line of a ``.jsonl`` file (blank lines skipped)."""
    rows = [{"text": t} for t in texts or ()]
    rows += [{"messages": [{"role": "user", "content": c}], "options": {}, "where": "--chat"}
             for c in chats or ()]
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--prompts {path!r} does not exist: give a text file (one prompt "
                              "a line) or a .jsonl file of {\"messages\": [...]} rows")
        lines = file.read_text(encoding="utf-8-sig").splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            rows.append(_json_row(line, path, number) if file.suffix == ".jsonl"
                        else {"text": line})
    if not rows:
        raise ConfigError("no prompt: give --prompt TEXT, --chat TEXT (both repeatable) or "
                          "--prompts FILE")
    return rows


def _json_row(line: str, path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--prompts {path!r} line {number} is not JSON ({error.msg})") from None
    if not isinstance(row, dict) or not any(k in row for k in ("messages", "prompt", "text")):
        raise ConfigError(f"--prompts {path!r} line {number}: a row is {{\"messages\": [...]}}, "
                          "{\"prompt\": \"...\"} or {\"text\": \"...\"}")
    if "messages" not in row:
        text = row.get("prompt", row.get("text"))
        if not isinstance(text, str):
            raise ConfigError(f"--prompts {path!r} line {number}: the prompt must be a string")
        return {"text": text}
    return {"messages": row["messages"], "options": {"tools": row.get("tools"),
                                                    **(row.get("chat_template_kwargs") or {})},
            "where": f"--prompts {path!r} line {number}"}


def tokenizer_and_template(tokenizer: str | None, from_hf: str | None, chat_template=None):
    """``(tokenizer, template or None, special tokens)`` as ``train`` picks them."""
    from jphantom.data.chat_template import tokenizer_and_template as chosen

    value = tokenizer or (from_hf if from_hf and (Path(from_hf) / "tokenizer.json").is_file()
                          else "bytes")
    return chosen(value, from_hf, chat_template)


def encode(rows, tokenizer, template) -> list[list[int]]:
    """Each row's token ids: a conversation rendered with the generation prompt, then encoded
    as ``train`` encodes rendered conversations (the template writes the special tokens); a
    text with the tokenizer's special tokens (Llama's BOS)."""
    from jphantom.data.documents import encode_ids, encode_with_offsets

    out = []
    for row in rows:
        if "messages" not in row:
            out.append(encode_ids(tokenizer, row["text"], special=True))
            continue
        if template is None:
            raise ConfigError(f"{row['where']} is a conversation but there is no chat template: "
                              "give --chat-template FILE, or --from-hf a checkpoint whose folder "
                              "has one")
        text, _ = template.render(row["messages"], add_generation_prompt=True, **row["options"])
        out.append(encode_with_offsets(tokenizer, text)[0])
    return out


def stop_ids(tokenizer, special: dict) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence id (its ``tokenizer_config.json``'s ``eos_token``, else its
    end-of-text token), as ``train`` appends it: generation stops there."""
    ids = getattr(getattr(tokenizer, "tokenizer", None), "token_to_id", lambda token: None)
    eos = ids(special["eos_token"]) if "eos_token" in special else None
    eos = getattr(tokenizer, "eot", None) if eos is None else eos
    return () if eos is None else (int(eos),)
