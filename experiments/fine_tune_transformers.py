"""A chat model fine-tuned by jphantom, loaded in Hugging Face ``transformers``: the same token ids,
the same assistant mask, the same logits and the same answer-only loss.

It runs docs/fine-tuning.md's walkthrough (``jphantom train --from-hf`` the tests' Qwen3 fixture,
``--tokenizer`` the chat fixture, three conversations, ``--pack --loss-on assistant --save-hf``),
then, for each conversation:

- **jphantom**: the saved folder read back (:func:`jphantom.models.hf.load`), the conversation
  rendered with the folder's chat template and masked (:class:`jphantom.data.RowTokenizer`,
  ``--loss-on assistant``), its logits, and the answer-only loss through
  :func:`jphantom.models.packed_lm_loss` (one segment, positions 0..S-1);
- **transformers**, in another interpreter with torch (``--python``; torch is never jphantom's
  dependency; see experiments/hf_parity.py for the one-time venv): ``AutoTokenizer`` and
  ``AutoModelForCausalLM.from_pretrained`` on the same folder, ``apply_chat_template(...,
  return_assistant_tokens_mask=True)``, logits, and the loss with labels -100 outside the
  assistant mask (transformers' own shifted cross-entropy).

It prints a line per conversation and writes ``results.json`` under ``--out``
(``experiments/results/fine_tune_transformers/``).

    python experiments/fine_tune_transformers.py [--python /tmp/hfenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "fine_tune_transformers"
# the chat fixture's conversations (tests/fixtures/make_chat_reference.py), the walkthrough's too
CONVERSATIONS = [c["messages"] for c in json.loads(
    (ROOT / "tests/fixtures/chat/reference.json").read_text())["conversations"]]
HF_SIDE = '''
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, conversations, out = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
rows = {}
for i, messages in enumerate(conversations):
    found = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
    ids = torch.tensor([found["input_ids"]])
    mask = torch.tensor([found["assistant_masks"]])
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    with torch.no_grad():
        result = model(input_ids=ids, labels=labels)
    rows[f"ids{i}"] = ids[0].numpy()
    rows[f"mask{i}"] = mask[0].numpy()
    rows[f"logits{i}"] = result.logits[0].float().numpy()
    rows[f"loss{i}"] = np.array(float(result.loss))
np.savez(out, **rows)
import transformers
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}))
'''


def fine_tune(work: Path) -> Path:
    """docs/fine-tuning.md's command, into ``work``; returns the saved folder."""
    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 4))
    tuned = work / "tuned"
    subprocess.run([sys.executable, "-m", "jphantom", "train", "--model", "qwen3", "--from-hf",
                    str(ROOT / "tests/fixtures/hf/qwen3"), "--tokenizer",
                    str(ROOT / "tests/fixtures/chat"), "--data", str(data), "--pack",
                    "--loss-on", "assistant", "--seq-len", "32", "--batch", "2", "--steps", "2",
                    "--eval-every", "2", "--eval-batches", "1", "--save-hf", str(tuned), "--out",
                    str(work / "run")], check=True, capture_output=True, text=True)
    return tuned


def ours(tuned: Path, messages: list[dict]) -> dict:
    """jphantom's ids, mask, logits and answer-only loss for one conversation."""
    import jax.numpy as jnp

    from jphantom.data import RowTokenizer, load_chat_template
    from jphantom.data.tokenizers import load_tokenizer
    from jphantom.models import hf, packed_lm_loss

    model = hf.load(str(tuned))
    tokenizer = load_tokenizer(str(tuned))
    ids, mask = RowTokenizer(tokenizer, load_chat_template(str(tuned)), tokenizer.eot,
                             "assistant")({"messages": messages})
    tokens = jnp.asarray([ids], jnp.int32)
    mask = np.asarray(mask)
    targets = np.full((1, len(ids)), -100, np.int32)  # token t predicts t + 1 where t + 1 counts
    targets[0, :-1] = np.where(mask[1:] == 1, np.asarray(ids[1:]), -100)
    segments = jnp.ones_like(tokens)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    total, weight = packed_lm_loss(model, tokens, jnp.asarray(targets), segments, positions)[:2]
    return {"ids": np.asarray(ids), "mask": mask, "logits": np.asarray(model(tokens))[0],
            "loss": float(total / weight)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="/tmp/hfenv/bin/python",
                        help="an interpreter with torch and transformers")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    if not Path(args.python).exists():
        print(f"fine_tune_transformers: no interpreter at {args.python}: make one with torch and "
              "transformers (experiments/hf_parity.py's docstring)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        tuned = fine_tune(work)
        (work / "conversations.json").write_text(json.dumps(CONVERSATIONS))
        (work / "hf_side.py").write_text(HF_SIDE)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([args.python, str(work / "hf_side.py"), str(tuned),
                               str(work / "conversations.json"), str(work / "hf.npz")],
                              capture_output=True, text=True, env=env)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        versions = json.loads(done.stdout.strip().splitlines()[-1])
        theirs = np.load(work / "hf.npz")
        rows = []
        for i, messages in enumerate(CONVERSATIONS):
            mine = ours(tuned, messages)
            row = {"conversation": i, "tokens": int(len(mine["ids"])),
                   "same_ids": bool(np.array_equal(mine["ids"], theirs[f"ids{i}"])),
                   "same_assistant_mask": bool(np.array_equal(mine["mask"], theirs[f"mask{i}"])),
                   "max_abs_logit_difference": float(np.max(np.abs(
                       mine["logits"] - theirs[f"logits{i}"]))),
                   "loss_jphantom": mine["loss"], "loss_transformers": float(theirs[f"loss{i}"])}
            rows.append(row)
            print(f"conversation {i}: {row['tokens']} tokens, ids equal {row['same_ids']}, "
                  f"assistant mask equal {row['same_assistant_mask']}, max |logit difference| "
                  f"{row['max_abs_logit_difference']:.2e}, answer-only loss "
                  f"{row['loss_jphantom']:.6f} (jphantom) {row['loss_transformers']:.6f} "
                  "(transformers)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "versions": versions},
                                                 indent=2) + "\n")
    print(f"wrote {out}/results.json ({versions})")
    return 0 if all(r["same_ids"] and r["same_assistant_mask"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
