"""Parity of jphantom's Llama family with Hugging Face ``transformers``, without torch in this venv.

Hugging Face's side runs in another interpreter (``--python``, one with torch and transformers; by
default ``/tmp/hfenv/bin/python``) as a subprocess that this script generates. It:

1. builds tiny random models of each family (``LlamaForCausalLM``, ``MixtralForCausalLM``,
   ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``,
   ``Gemma3ForCausalLM``: vocab 128, hidden 64, intermediate 96, 2 layers, 8 heads, 2 key/value
   heads, eager attention, float32; Mixtral with 4 experts, top 2, no sliding window; Mistral's
   window 4; Qwen3 with head_dim 16 and tied embeddings; Qwen3-MoE with 8 experts of width 24;
   Gemma 3 with a local and a global layer). Every parameter is then re-drawn, matrices with std
   1/sqrt(fan_in) and norm weights 1 + 0.2 N(0, 1), so the logits are O(1) and a 1e-4 tolerance
   means something (HF's own init, std 0.02 and norms of one, gives logits of order 1e-2);
2. ``save_pretrained(dir, safe_serialization=True)`` each one and saves the logits of fixed token
   ids [2, 16] as ``.npy``.

This interpreter (the project's venv) then loads each directory with
:func:`jphantom.models.llama.load_hf` and compares ``model(tokens)`` with HF's logits (max absolute
difference, tolerance ``--tol``). It also writes the loaded model back with
:func:`jphantom.models.llama.save_hf` and checks that every tensor transformers wrote comes back
byte for byte (names, dtypes, shapes, bytes). It also lists the ``config.json`` fields that
jphantom read differently from the file. When the logits differ, it re-runs jphantom with the
file's value of each such field, to name the cause. Finally HF reloads the ``save_hf`` directories
(``from_pretrained``) and its logits are compared with the originals.

It prints a table and writes ``results.json`` under ``--out``
(``experiments/results/hf_parity/``). The script changes nothing in the library: a layout or
config that jphantom refuses or misreads is reported by name.

    python experiments/hf_parity.py [--python /tmp/hfenv/bin/python] [--tol 1e-4]

The Hugging Face interpreter, made once outside the project (torch is never a dependency)::

    python3 -m venv /tmp/hfenv
    /tmp/hfenv/bin/pip install --no-deps "torch==2.13.0+cpu"     # the CPU build: no CUDA libraries
    /tmp/hfenv/bin/pip install filelock typing-extensions sympy networkx jinja2 fsspec mpmath \
        MarkupSafe "setuptools>=77.0.3" transformers

The loaded models also run tensor-parallel (``plans.megatron``) on ``model=4`` and ``model=8``,
more ranks than their 2 key/value heads, and those logits are compared with transformers' too.

Measured (torch 2.13.0+cpu, transformers 5.24.0, jax 0.10.2; 8 heads, 2 key/value heads), max
absolute logit difference on one device / ``model=4`` / ``model=8``: Llama 3.0e-6 / 2.9e-6 /
2.7e-6, Mixtral 2.5e-6 / 2.7e-6 / 2.4e-6, Mistral (window 4 of 16 tokens; without it the logits
move by 4.3) 2.6e-6 / 2.6e-6 / 2.6e-6, Qwen2 2.4e-6 / 2.3e-6 / 2.1e-6, Qwen3 2.6e-6 / 3.5e-6 /
3.3e-6, Qwen3-MoE 2.6e-6 / 2.7e-6 / 2.6e-6, Gemma 3 text 1.4e-5 / 1.1e-5 / 1.6e-5 (logits up to
7.3); every tensor written back byte for byte, and transformers reloading the saved directories
gives its own logits exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("llama", "mixtral", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")
BATCH, SEQ, VOCAB = 2, 16, 128

# Run by --python: ``hf_side.py build WORK`` or ``hf_side.py reload WORK``.
HF_SIDE = r'''
import json, math, os, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np
import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          Gemma3TextConfig, Gemma3ForCausalLM)

torch.set_num_threads(1)
mode, work = sys.argv[1], sys.argv[2]
tokens = torch.from_numpy(np.load(os.path.join(work, "tokens.npy")))
CLASSES = {"llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM,
           "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
           "qwen3_moe": Qwen3MoeForCausalLM, "gemma3_text": Gemma3ForCausalLM}


def logits_of(model):
    with torch.no_grad():
        return model(input_ids=tokens).logits.to(torch.float32).numpy()


def build(name, seed):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, attn_implementation="eager")
    if name == "llama":
        config = LlamaConfig(**common)
    elif name == "mistral":  # a window shorter than the sequence (16): it changes the logits
        config = MistralConfig(**common, sliding_window=4)
    elif name == "qwen2":  # biases on q, k and v
        config = Qwen2Config(**common)
    elif name == "qwen3":  # per-head q/k RMSNorm, head_dim apart from hidden/heads, tied
        config = Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    elif name == "gemma3_text":  # a local (window 4) and a global layer, two RoPE bases
        common = {k: v for k, v in common.items() if k != "num_hidden_layers"}
        config = Gemma3TextConfig(**common, num_hidden_layers=2, head_dim=8, sliding_window=4,
                                  query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention"])
    elif name == "qwen3_moe":  # fine-grained experts (narrower than the dense width), q/k norms
        config = Qwen3MoeConfig(**common, head_dim=8, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=24, norm_topk_prob=True)
    else:
        config = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=None)
    torch.manual_seed(seed)
    model = CLASSES[name](config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    in_memory = {}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            in_memory[pname] = list(p.shape)
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            if pname.endswith("bias"):
                p.copy_(0.2 * noise)
            elif p.ndim == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.2 * noise)
            else:  # [..., out, in] (embeddings [V, h]): std 1/sqrt(last dim)
                p.copy_(noise / math.sqrt(p.shape[-1]))
    return model, in_memory


def save(model, directory):
    try:
        model.save_pretrained(directory, safe_serialization=True)
        return "save_pretrained(dir, safe_serialization=True)"
    except TypeError:  # a transformers without the argument (safetensors is then the default)
        model.save_pretrained(directory)
        return "save_pretrained(dir) (safe_serialization not accepted)"


out = {"torch": torch.__version__, "transformers": transformers.__version__,
       "numpy": np.__version__, "python": sys.version.split()[0], "models": {}}
try:
    import safetensors
    out["safetensors"] = safetensors.__version__
except Exception:
    pass
for i, name in enumerate(CLASSES):
    if mode == "build":
        model, in_memory = build(name, 1000 * (i + 1))
        directory = os.path.join(work, name + "_hf")
        how = save(model, directory)
        np.save(os.path.join(work, name + "_hf_logits.npy"), logits_of(model))
        out["models"][name] = {
            "saved_with": how, "files": sorted(os.listdir(directory)),
            "attn_implementation": model.config._attn_implementation,
            "in_memory_parameters": {k: v for k, v in in_memory.items()
                                     if ".layers.0." in k or ".layers." not in k}}
    else:
        directory = os.path.join(work, name + "_jphantom")
        model = CLASSES[name].from_pretrained(directory, attn_implementation="eager",
                                              dtype=torch.float32).eval()
        np.save(os.path.join(work, name + "_reload_logits.npy"), logits_of(model))
        rope = getattr(model.config, "rope_parameters", None) or {}
        out["models"][name] = {
            "rope_theta_seen_by_hf": rope.get("rope_theta", getattr(model.config, "rope_theta",
                                                                    None)),
            "rms_norm_eps_seen_by_hf": model.config.rms_norm_eps}
with open(os.path.join(work, "hf_" + mode + ".json"), "w") as f:
    json.dump(out, f, indent=2)
'''


def run_hf(python: str, mode: str, work: Path) -> dict:
    script = work / "hf_side.py"
    script.write_text(HF_SIDE)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([python, str(script), mode, str(work)], env=env, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"the Hugging Face side ({python} hf_side.py {mode}) failed with exit "
                         f"status {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads((work / f"hf_{mode}.json").read_text())


def file_theta(hf: dict):
    """rope_theta as the file gives it: top level (transformers 4) or in ``rope_parameters``
    (transformers 5)."""
    if "rope_theta" in hf:
        return hf["rope_theta"]
    return (hf.get("rope_parameters") or {}).get("rope_theta")


def misread_fields(config, hf: dict) -> dict:
    """LlamaConfig fields whose value differs from what ``config.json`` says (HF's defaults where
    the file gives none are not checked)."""
    from jphantom.models.llama import HF_FIELDS

    out = {}
    keys = dict(HF_FIELDS)
    if config.model_type == "qwen3_moe":  # its experts' width has its own key
        keys["intermediate"] = "moe_intermediate_size"
    for name, key in keys.items():
        if (name in ("experts", "top_k") and not config.experts) or hf.get(key) is None:
            continue
        if getattr(config, name) != hf[key]:
            out[name] = {"jphantom": getattr(config, name), "file": hf[key], "file_key": key}
    theta = file_theta(hf)
    if theta is not None and "rope_theta" not in out and config.rope_theta != theta:
        out["rope_theta"] = {"jphantom": config.rope_theta, "file": theta,
                             "file_key": "rope_theta" if "rope_theta" in hf
                             else "rope_parameters.rope_theta"}
    return out


def compare_tensors(hf_file: Path, ours_file: Path) -> dict:
    from safetensors.numpy import load_file

    theirs, ours = load_file(str(hf_file)), load_file(str(ours_file))
    differ = []
    for name in sorted(set(theirs) & set(ours)):
        a, b = theirs[name], ours[name]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            differ.append({"name": name, "hf": [str(a.dtype), list(a.shape)],
                           "jphantom": [str(b.dtype), list(b.shape)]})
    missing = sorted(set(theirs) - set(ours))
    extra = sorted(set(ours) - set(theirs))
    return {"tensors": len(theirs), "identical": not (differ or missing or extra),
            "differ": differ, "missing_in_save_hf": missing, "extra_in_save_hf": extra}


def hf_layout(path: Path) -> dict:
    from safetensors.numpy import load_file

    return {k: list(v.shape) for k, v in sorted(load_file(str(path)).items())
            if ".layers." not in k or ".layers.0." in k}


def check_model(name: str, work: Path, tokens: np.ndarray, tol: float) -> dict:
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from jphantom.models import llama

    directory = work / f"{name}_hf"
    hf = json.loads((directory / "config.json").read_text())
    reference = np.load(work / f"{name}_hf_logits.npy")
    row = {"reference_max_abs_logit": float(np.abs(reference).max()),
           "reference_logit_std": float(reference.std()),
           "hf_config": {k: hf.get(k) for k in ("rope_theta", "rope_parameters", "rms_norm_eps",
                                                "head_dim", "sliding_window", "dtype",
                                                "torch_dtype") if k in hf}}
    try:
        model = llama.load_hf(directory)
    except Exception as error:  # a layout or config the loader refuses: report it precisely
        row.update(loaded=False, error=f"{type(error).__name__}: {error}",
                   layout_layer0=hf_layout(directory / "model.safetensors"))
        return row
    row["loaded"] = True
    row["jphantom_config"] = dataclasses.asdict(model.config)
    logits = np.asarray(model(jnp.asarray(tokens)))
    diff = float(np.abs(logits - reference).max())
    row.update(max_abs_diff=diff, passed=bool(diff <= tol))
    misread = misread_fields(model.config, hf)
    row["config_fields_read_differently"] = misread
    if misread and not row["passed"]:  # name the cause: the same tensors, the file's values
        fixed = dataclasses.replace(model.config, **{k: v["file"] for k, v in misread.items()})
        weights = load_file(str(directory / "model.safetensors"))
        again = np.asarray(llama.from_hf_tensors(fixed, weights)(jnp.asarray(tokens)))
        fixed_diff = float(np.abs(again - reference).max())
        row["with_file_values"] = {"fields": {k: v["file"] for k, v in misread.items()},
                                   "max_abs_diff": fixed_diff, "passed": bool(fixed_diff <= tol)}
    row["tensor_parallel"] = tensor_parallel_logits(directory, tokens, reference, tol)
    if model.config.sliding_window:  # the window must matter: without it the logits move
        weights = load_file(str(directory / "model.safetensors"))
        layers = model.config.layer_types
        full = dataclasses.replace(model.config, sliding_window=None, layer_types=None
                                   if layers is None else ("full_attention",) * len(layers))
        without = np.asarray(llama.from_hf_tensors(full, weights)(jnp.asarray(tokens)))
        row["without_the_window_max_abs_diff"] = float(np.abs(without - reference).max())
    out_dir = work / f"{name}_jphantom"
    llama.save_hf(out_dir, model)
    row["round_trip"] = compare_tensors(directory / "model.safetensors",
                                        out_dir / "model.safetensors")
    written = json.loads((out_dir / "config.json").read_text())
    row["save_hf_config_changes"] = {
        k: {"hf": hf.get(k, "<absent>"), "save_hf": written.get(k, "<absent>")}
        for k in sorted(set(hf) | set(written)) if hf.get(k, "<absent>") != written.get(
            k, "<absent>")}
    return row


def tensor_parallel_logits(directory: Path, tokens: np.ndarray, reference: np.ndarray,
                           tol: float) -> dict:
    """The loaded checkpoint under ``plans.megatron`` on ``model=4`` and ``model=8`` (more tensor
    ranks than the 2 key/value heads: each rank computes the head its query heads share,
    :class:`jphantom.nn.SharedHeadsLinear`), logits through ``make_forward_fn`` against HF's."""
    import jax
    import jax.numpy as jnp

    import jphantom
    from jphantom.models import llama

    out = {}
    for ranks in (4, 8):
        if jax.device_count() < ranks:
            out[f"model={ranks}"] = {"skipped": f"{jax.device_count()} devices"}
            continue
        mesh = jax.make_mesh((ranks,), ("model",), devices=jax.devices()[:ranks])
        model = llama.load_hf(directory)
        jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
        logits = np.asarray(jphantom.make_forward_fn(model, mesh)(jnp.asarray(tokens)))
        diff = float(np.abs(logits - reference).max())
        out[f"model={ranks}"] = {
            "max_abs_diff": diff, "passed": bool(diff <= tol),
            "key_projection": type(model.layers.block.self_attn.k_proj).__name__}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default="/tmp/hfenv/bin/python",
                        help="interpreter with torch and transformers (default: %(default)s)")
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="max absolute logit difference allowed (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token ids")
    parser.add_argument("--out", default=str(ROOT / "experiments/results/hf_parity"),
                        help="results folder (default: %(default)s)")
    parser.add_argument("--keep", default=None,
                        help="work folder to keep (checkpoints, logits); default: a temporary one")
    args = parser.parse_args(argv)
    if not Path(args.python).is_file():
        raise SystemExit(f"--python {args.python} not found: give an interpreter with torch and "
                         "transformers (see the module docstring)")

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import flax
    import jax
    import safetensors

    with tempfile.TemporaryDirectory(prefix="hf_parity_") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokens = np.random.default_rng(args.seed).integers(0, VOCAB, (BATCH, SEQ), dtype=np.int64)
        np.save(work / "tokens.npy", tokens)
        built = run_hf(args.python, "build", work)
        rows = {name: check_model(name, work, tokens, args.tol) for name in MODELS}
        for name, row in rows.items():
            row["hf_side"] = built["models"][name]
        if all(row["loaded"] for row in rows.values()):
            reloaded = run_hf(args.python, "reload", work)
            for name, row in rows.items():
                ref = np.load(work / f"{name}_hf_logits.npy")
                back = np.load(work / f"{name}_reload_logits.npy")
                diff = float(np.abs(back - ref).max())
                row["hf_reload_of_save_hf"] = dict(reloaded["models"][name], max_abs_diff=diff,
                                                   passed=bool(diff <= args.tol))

    versions = {k: built[k] for k in ("torch", "transformers") if k in built}
    versions.update(jax=jax.__version__, flax=flax.__version__, numpy=np.__version__,
                    safetensors=safetensors.__version__, python=platform.python_version(),
                    hf_side_python=built.get("python"), hf_side_numpy=built.get("numpy"))
    result = {"versions": versions, "tolerance": args.tol,
              "shape": {"vocab": VOCAB, "hidden": 64, "intermediate": 96, "layers": 2,
                        "heads": 8, "kv_heads": 2, "mixtral_experts": 4, "top_k": 2,
                        "tokens": [BATCH, SEQ], "dtype": "float32", "attention": "eager"},
              "tokens": tokens.tolist(), "models": rows}

    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"{'model':8} {'max|logit|':>10} {'max abs diff':>13} {'<= tol':>7} "
          f"{'tensors byte-identical':>23} {'HF reload of save_hf':>21}")
    for name, row in rows.items():
        if not row["loaded"]:
            print(f"{name:8} {row['reference_max_abs_logit']:10.3f}  refused by load_hf: "
                  f"{row['error']}")
            continue
        trip = row["round_trip"]
        reload_ = row.get("hf_reload_of_save_hf", {})
        print(f"{name:8} {row['reference_max_abs_logit']:10.3f} {row['max_abs_diff']:13.3e} "
              f"{'yes' if row['passed'] else 'NO':>7} "
              f"{('yes' if trip['identical'] else 'NO') + ' (' + str(trip['tensors']) + ')':>23} "
              f"{reload_.get('max_abs_diff', float('nan')):21.3e}")
    for name, row in rows.items():
        for field, v in row.get("config_fields_read_differently", {}).items():
            print(f"  {name}: config.json {v['file_key']} = {v['file']}, jphantom read "
                  f"{field} = {v['jphantom']}")
        if "with_file_values" in row:
            w = row["with_file_values"]
            print(f"  {name}: with the file's values {w['fields']}: max abs diff "
                  f"{w['max_abs_diff']:.3e} ({'passes' if w['passed'] else 'still fails'})")
        trip = row.get("round_trip", {})
        for key in ("differ", "missing_in_save_hf", "extra_in_save_hf"):
            if trip.get(key):
                print(f"  {name}: round trip {key}: {trip[key]}")
        if "without_the_window_max_abs_diff" in row:
            print(f"  {name}: without its sliding window ({row['jphantom_config']['sliding_window']}"
                  f" of {SEQ} tokens) the logits differ by {row['without_the_window_max_abs_diff']:.3f}")
        for mesh, tp in row.get("tensor_parallel", {}).items():
            print(f"  {name}: {mesh} ({tp.get('key_projection', '-')}): max abs diff "
                  f"{tp.get('max_abs_diff', float('nan')):.3e} "
                  f"{'passes' if tp.get('passed') else tp.get('skipped', 'FAILS')}")
        if "hf_reload_of_save_hf" in row:
            r = row["hf_reload_of_save_hf"]
            print(f"  {name}: transformers reading save_hf's config.json uses rope_theta "
                  f"{r['rope_theta_seen_by_hf']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out / 'results.json'}")
    return result


if __name__ == "__main__":
    main()
