"""Hugging Face GPT-2 checkpoints: read and write a ``GPT2LMHeadModel`` directory without torch.

A directory as written by ``GPT2LMHeadModel.save_pretrained`` holds ``config.json`` and
``model.safetensors`` (or, for large models, ``model.safetensors.index.json`` with its shards).
:func:`load` turns it into a :class:`TransformerConfig` and GPT-2's
dense parameter layout below (which :func:`from_dense` / ``to_dense``
turn into the NNX module and back); :func:`save` writes the inverse, a directory that
``GPT2LMHeadModel.from_pretrained`` loads. Only ``numpy`` and ``safetensors`` are used.

Tensor names (``P`` is ``transformer.``, the prefix a ``GPT2LMHeadModel`` state dict has; a
``GPT2Model`` and older checkpoints, such as the ``gpt2`` files on the Hub, have none: both load)::

    Hugging Face (x @ W, Conv1D)             jphantom dense layout
    P wte.weight            [V, h]           wte                          [V, h]
    P wpe.weight            [S, h]           wpe                          [S, h]
    P h.{i}.ln_1.weight/bias [h]             blocks.ln1.scale/bias        [L, h]
    P h.{i}.attn.c_attn.weight [h, 3h]       blocks.qkv.weight            [L, h, 3, h]
    P h.{i}.attn.c_attn.bias   [3h]          blocks.qkv.bias              [L, 3, h]
    P h.{i}.attn.c_proj.weight/bias          blocks.attn_out.weight/bias  [L, h, h] / [L, h]
    P h.{i}.ln_2.weight/bias                 blocks.ln2.scale/bias        [L, h]
    P h.{i}.mlp.c_fc.weight/bias             blocks.mlp_up.weight/bias    [L, h, 4h] / [L, 4h]
    P h.{i}.mlp.c_proj.weight/bias           blocks.mlp_down.weight/bias  [L, 4h, h] / [L, h]
    P ln_f.weight/bias                       ln_f.scale/bias              [h]

``c_attn``'s 3h output features are q | k | v, each with the heads contiguous (head j of q is
features j*d .. (j+1)*d), so reshaping [h, 3h] to [h, 3, h] is exactly jphantom's ``qkv`` layout.
``lm_head.weight`` is tied to ``wte`` and is not stored by current transformers; when a file has
it, it must equal ``wte``. The causal-mask buffers ``h.{i}.attn.bias`` / ``h.{i}.attn.masked_bias``
of old checkpoints are ignored.

Every tensor keeps its stored dtype and bits (float32, float16, bfloat16 via ``ml_dtypes``, or
float64): load -> save -> load is bit-exact, and a directory saved by transformers gives back the
same tensor bytes under the same names after load -> save. bfloat16 needs safetensors >= 0.6
(earlier numpy bindings do not know the dtype).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re

import numpy as np

from jphantom.errors import ConfigError
from jphantom.models.gpt2.config import TransformerConfig
from jphantom.models.gpt2.dense import from_dense, to_dense
from jphantom.models.gpt2.model import GPT2

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PREFIX = "transformer."  # what GPT2LMHeadModel.save_pretrained writes (transformers 4.x and 5.x)

# Activations that Hugging Face computes as the tanh approximation of GELU (the only one jphantom's
# block has): NewGELUActivation, PytorchGELUTanh and FastGELUActivation are the same function.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

# GPT2Config's defaults, used for fields a config.json leaves out (as transformers does).
HF_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
               "n_head": 12, "layer_norm_epsilon": 1e-5}

# Stored dtype <-> TransformerConfig.dtype.
_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "float64": "float64"}

# (Hugging Face name inside block i, jphantom group, jphantom leaf); shapes come from _block_shapes.
_BLOCK_TENSORS = (
    ("ln_1.weight", "ln1", "scale"), ("ln_1.bias", "ln1", "bias"),
    ("attn.c_attn.weight", "qkv", "weight"), ("attn.c_attn.bias", "qkv", "bias"),
    ("attn.c_proj.weight", "attn_out", "weight"), ("attn.c_proj.bias", "attn_out", "bias"),
    ("ln_2.weight", "ln2", "scale"), ("ln_2.bias", "ln2", "bias"),
    ("mlp.c_fc.weight", "mlp_up", "weight"), ("mlp.c_fc.bias", "mlp_up", "bias"),
    ("mlp.c_proj.weight", "mlp_down", "weight"), ("mlp.c_proj.bias", "mlp_down", "bias"),
)
_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$|^lm_head\.weight$")


def _block_shapes(h: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """HF name -> (HF shape, jphantom per-layer shape)."""
    return {
        "ln_1.weight": ((h,), (h,)), "ln_1.bias": ((h,), (h,)),
        "attn.c_attn.weight": ((h, 3 * h), (h, 3, h)), "attn.c_attn.bias": ((3 * h,), (3, h)),
        "attn.c_proj.weight": ((h, h), (h, h)), "attn.c_proj.bias": ((h,), (h,)),
        "ln_2.weight": ((h,), (h,)), "ln_2.bias": ((h,), (h,)),
        "mlp.c_fc.weight": ((h, 4 * h), (h, 4 * h)), "mlp.c_fc.bias": ((4 * h,), (4 * h,)),
        "mlp.c_proj.weight": ((4 * h, h), (4 * h, h)), "mlp.c_proj.bias": ((h,), (h,)),
    }


# --------------------------------------------------------------------------- config.json


def config_from_hf(hf: dict) -> TransformerConfig:
    """A :class:`TransformerConfig` from a GPT-2 ``config.json`` dict.

    Reads ``vocab_size``, ``n_positions``, ``n_embd``, ``n_head``, ``n_layer`` and
    ``layer_norm_epsilon`` (GPT2Config's defaults where absent). Raises :class:`ConfigError`, naming
    the field and the fix, for anything jphantom's GPT-2 block does not compute: an activation other
    than tanh-GELU, an untied LM head, ``n_inner`` other than 4 * n_embd, unscaled or layer-scaled
    attention, cross-attention. Dropout fields are ignored (jphantom has no dropout). The dtype is
    that of the tensors, set by :func:`load`; this returns float32.
    """
    if not isinstance(hf, dict):
        raise ConfigError(f"{CONFIG_FILE} holds {type(hf).__name__}, expected a JSON object")
    model_type = hf.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ConfigError(f"{CONFIG_FILE}: model_type={model_type!r}; only 'gpt2' checkpoints "
                          "(GPT2LMHeadModel / GPT2Model) can be loaded")
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise ConfigError(f"{CONFIG_FILE}: activation_function={act!r}; jphantom's GPT-2 MLP uses "
                          f"the tanh approximation of GELU: use one of {TANH_GELUS} (GPT-2's is "
                          "'gelu_new')")
    tie = hf.get("tie_word_embeddings", True)
    if tie is not True:
        raise ConfigError(f"{CONFIG_FILE}: tie_word_embeddings={tie!r}; only a head tied to wte is "
                          "supported: set it to true (and drop lm_head.weight) or use a tied model")
    for field, want, fix in (
            ("scale_attn_weights", True, "true (scores divided by sqrt(head_dim))"),
            ("scale_attn_by_inverse_layer_idx", False, "false"),
            ("add_cross_attention", False, "false (a decoder-only GPT-2)")):
        value = hf.get(field, want)
        if value is not want:
            raise ConfigError(f"{CONFIG_FILE}: {field}={value!r} is not supported; set it to {fix}")
    values = {}
    for field in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer"):
        value = hf.get(field, HF_DEFAULTS[field])
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{CONFIG_FILE}: {field}={value!r} must be an integer >= 1")
        values[field] = value
    if values["n_embd"] % values["n_head"]:
        raise ConfigError(f"{CONFIG_FILE}: n_embd={values['n_embd']} is not divisible by "
                          f"n_head={values['n_head']}; fix one of them")
    inner = hf.get("n_inner")
    if inner is not None and inner != 4 * values["n_embd"]:
        raise ConfigError(f"{CONFIG_FILE}: n_inner={inner!r}; jphantom's MLP is 4 * n_embd = "
                          f"{4 * values['n_embd']} wide: set n_inner to null")
    eps = hf.get("layer_norm_epsilon", HF_DEFAULTS["layer_norm_epsilon"])
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and
                                                                          math.isfinite(eps)):
        raise ConfigError(f"{CONFIG_FILE}: layer_norm_epsilon={eps!r} must be a positive number")
    return TransformerConfig(vocab_size=values["vocab_size"], seq_len=values["n_positions"],
                             hidden=values["n_embd"], heads=values["n_head"],
                             layers=values["n_layer"], layer_norm_eps=float(eps))


def config_to_hf(config: TransformerConfig) -> dict:
    """A complete GPT-2 ``config.json`` dict (as transformers 5 writes it) for ``config``.

    Dropout probabilities are 0.0, which is what jphantom trains with; ``bos_token_id`` and
    ``eos_token_id`` are the last token (GPT-2's 50256 for its 50257-token vocabulary)."""
    _check_savable(config)
    last = config.vocab_size - 1
    return {
        "activation_function": "gelu_new",
        "add_cross_attention": False,
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "bos_token_id": last,
        "dtype": config.dtype,
        "embd_pdrop": 0.0,
        "eos_token_id": last,
        "initializer_range": 0.02,
        "layer_norm_epsilon": config.layer_norm_eps,
        "model_type": "gpt2",
        "n_embd": config.hidden,
        "n_head": config.heads,
        "n_inner": None,
        "n_layer": config.layers,
        "n_positions": config.seq_len,
        "pad_token_id": None,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.0,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_activation": None,
        "summary_first_dropout": 0.0,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": config.vocab_size,
    }


def _check_savable(config: TransformerConfig) -> None:
    if not isinstance(config, TransformerConfig):
        raise ConfigError(f"config is a {type(config).__name__}; save() takes a TransformerConfig")
    if not config.tied_head:
        raise ConfigError("config.tied_head=False: a GPT2LMHeadModel's head is tied to wte (and "
                          "has no bias); only tied-head models can be saved")


# --------------------------------------------------------------------------- tensors


def _safetensors():
    """The safetensors package (imported on use, so that jphantom imports without it)."""
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ImportError("jphantom.models.gpt2 needs the safetensors package (>= 0.6 for "
                          "bfloat16): pip install 'safetensors>=0.6'") from None
    return safetensors


def read_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (one file, or the shards an index names), copied into
    memory so that no array maps a file that a later :func:`save` may replace."""
    safe_open = _safetensors().safe_open
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{index}: not a readable safetensors index ({err})") from None
    else:
        other = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.h5")]
        hint = (f" (it has {', '.join(sorted(other))}: re-save it with transformers' "
                "save_pretrained(..., safe_serialization=True) to get model.safetensors)"
                if other else "")
        raise ConfigError(f"{directory} has no {WEIGHTS_FILE} (nor {INDEX_FILE}){hint}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="np") as f:
                for name in f.keys():
                    if name in tensors:
                        raise ConfigError(f"tensor {name!r} is stored twice (again in {path})")
                    tensors[name] = np.array(f.get_tensor(name), copy=True)
        except ConfigError:
            raise
        except Exception as err:  # safetensors raises its own error types; OSError if missing
            raise ConfigError(f"cannot read {path} as safetensors: {err}") from None
    return tensors


def load(directory) -> tuple[TransformerConfig, dict]:
    """Load a Hugging Face GPT-2 directory (``config.json`` + ``model.safetensors``).

    Returns ``(config, params)``: ``config`` a :class:`TransformerConfig` whose ``dtype`` is the
    stored one, ``params`` GPT-2's dense layout (module docstring above for the name map) as numpy
    arrays of the stored dtype, bit for bit: pass them to :func:`from_dense` (the NNX GPT-2) or ``jax.device_put`` them. Names with or without the
    ``transformer.`` prefix are accepted. Raises :class:`ConfigError` for a missing or unreadable
    file, an unsupported config field, a missing, unexpected or mis-shaped tensor, or tensors of
    different dtypes.
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory; pass the folder that save_pretrained "
                          f"wrote (with {CONFIG_FILE} and {WEIGHTS_FILE})")
    config_path = directory / CONFIG_FILE
    try:
        hf = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{directory} has no {CONFIG_FILE}; a Hugging Face GPT-2 directory "
                          "holds config.json and model.safetensors") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {config_path} as JSON: {err}") from None
    config = config_from_hf(hf)
    tensors = read_tensors(directory)

    prefix = PREFIX if PREFIX + "wte.weight" in tensors else ""
    h, L, V, S = config.hidden, config.layers, config.vocab_size, config.seq_len
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        full = prefix + name
        if full not in tensors:
            other = f" (nor {PREFIX + name})" if not prefix else ""
            raise ConfigError(f"tensor {full!r}{other} is missing from {directory}; the checkpoint "
                              f"does not match {CONFIG_FILE} (n_layer={L}) or is not a GPT-2")
        value = tensors[full]
        if tuple(value.shape) != shape:
            raise ConfigError(f"tensor {full!r} has shape {list(value.shape)}; {CONFIG_FILE} "
                              f"(n_embd={h}, vocab_size={V}, n_positions={S}) needs {list(shape)}")
        used.add(full)
        return value

    wte = take("wte.weight", (V, h))
    dtype_name = _DTYPE_NAMES.get(wte.dtype.name)
    if dtype_name is None:
        raise ConfigError(f"tensor {prefix}wte.weight is {wte.dtype.name}; supported dtypes are "
                          f"{sorted(_DTYPE_NAMES)}")
    params = {"wte": wte, "wpe": take("wpe.weight", (S, h)),
              "ln_f": {"scale": take("ln_f.weight", (h,)), "bias": take("ln_f.bias", (h,))}}
    shapes = _block_shapes(h)
    blocks: dict[str, dict[str, np.ndarray]] = {}
    for hf_name, group, leaf in _BLOCK_TENSORS:
        hf_shape, ours = shapes[hf_name]
        layers = [take(f"h.{i}.{hf_name}", hf_shape).reshape(ours) for i in range(L)]
        blocks.setdefault(group, {})[leaf] = np.stack(layers)
    params["blocks"] = blocks

    for name, value in tensors.items():
        if name in used:
            if value.dtype != wte.dtype:
                raise ConfigError(f"tensor {name!r} is {value.dtype.name} but {prefix}wte.weight "
                                  f"is {wte.dtype.name}; jphantom keeps one dtype per model: "
                                  "convert the checkpoint to one dtype first")
        elif name == "lm_head.weight":
            if value.shape != wte.shape or value.tobytes() != wte.tobytes():
                raise ConfigError("tensor 'lm_head.weight' differs from wte.weight: the head is "
                                  "not tied, and jphantom's GPT-2 needs a tied head")
        elif not _IGNORED.match(name):
            raise ConfigError(f"unexpected tensor {name!r} in {directory}: not part of a "
                              f"GPT2LMHeadModel with n_layer={L} (a different architecture, or "
                              f"{CONFIG_FILE} has the wrong n_layer)")
    return dataclasses.replace(config, dtype=dtype_name), params


def to_hf_tensors(config: TransformerConfig, params: dict) -> dict[str, np.ndarray]:
    """The Hugging Face state dict (``transformer.``-prefixed names, no ``lm_head.weight``: what
    transformers 5 writes for a tied ``GPT2LMHeadModel``) of dense ``params``, as contiguous numpy
    arrays of the parameters' own dtype (jax arrays are fetched to the host)."""
    _check_savable(config)
    h, L, V, S = config.hidden, config.layers, config.vocab_size, config.seq_len
    if "head" in params:
        raise ConfigError("params have an untied 'head'; a GPT2LMHeadModel's head is wte itself")

    def get(path: str, shape: tuple[int, ...]) -> np.ndarray:
        node = params
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise ConfigError(f"params have no {path!r}; expected GPT-2's dense layout "
                                  "(load, to_dense)")
            node = node[key]
        value = np.asarray(node)
        if tuple(value.shape) != shape:
            raise ConfigError(f"params {path!r} have shape {list(value.shape)}; the config needs "
                              f"{list(shape)}")
        return value

    out = {PREFIX + "wte.weight": get("wte", (V, h)), PREFIX + "wpe.weight": get("wpe", (S, h)),
           PREFIX + "ln_f.weight": get("ln_f.scale", (h,)),
           PREFIX + "ln_f.bias": get("ln_f.bias", (h,))}
    for hf_name, group, leaf in _BLOCK_TENSORS:
        hf_shape, ours = _block_shapes(h)[hf_name]
        stacked = get(f"blocks.{group}.{leaf}", (L, *ours))
        for i in range(L):
            out[f"{PREFIX}h.{i}.{hf_name}"] = stacked[i].reshape(hf_shape)
    dtype = out[PREFIX + "wte.weight"].dtype
    for name, value in out.items():
        if value.dtype != dtype:
            raise ConfigError(f"{name} is {value.dtype.name} but wte is {dtype.name}: a GPT-2 "
                              "checkpoint has one dtype; cast the params first")
    if _DTYPE_NAMES.get(dtype.name) is None:
        raise ConfigError(f"params are {dtype.name}; supported dtypes are {sorted(_DTYPE_NAMES)}")
    return {name: np.ascontiguousarray(value) for name, value in out.items()}


def save(directory, config: TransformerConfig, params: dict) -> None:
    """Write ``params`` (the dense layout, numpy or jax arrays) as a Hugging Face GPT-2 directory.

    Creates ``directory`` if needed and writes ``config.json`` (:func:`config_to_hf`; its ``dtype``
    is the parameters') and ``model.safetensors`` with the names and ``{"format": "pt"}`` metadata
    that ``GPT2LMHeadModel.save_pretrained`` (transformers 5) writes, so ``from_pretrained`` loads
    it. Tensors keep their dtype and bits. Files are written to a temporary name and then renamed,
    so a directory being read is never left half-written. Raises :class:`ConfigError` for an untied
    head, params that do not match ``config``, mixed dtypes, or a directory that holds a sharded
    checkpoint (``model.safetensors.index.json``, which transformers would load instead).
    """
    save_file = _safetensors().numpy.save_file
    tensors = to_hf_tensors(config, params)
    dtype_name = _DTYPE_NAMES[tensors[PREFIX + "wte.weight"].dtype.name]
    hf_config = config_to_hf(dataclasses.replace(config, dtype=dtype_name)
                             if dtype_name != config.dtype else config)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / INDEX_FILE).exists():
        raise ConfigError(f"{directory} holds a sharded checkpoint ({INDEX_FILE}); save into an "
                          "empty directory, or remove the index and its shards first")

    def write(name: str, writer) -> None:
        tmp = directory / f".{name}.{os.getpid()}.tmp"
        try:
            writer(str(tmp))
            os.replace(tmp, directory / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    write(WEIGHTS_FILE, lambda path: save_file(tensors, path, metadata={"format": "pt"}))
    write(CONFIG_FILE, lambda path: pathlib.Path(path).write_text(
        json.dumps(hf_config, indent=2, sort_keys=True) + "\n"))


# --------------------------------------------------------------------------- the module

def load_hf(path) -> GPT2:
    """A Hugging Face GPT-2 directory (:func:`load`) as a :class:`GPT2`."""
    config, params = load(path)
    return from_dense(config, params)


def save_hf(path, model: GPT2) -> None:
    """``model`` as a Hugging Face GPT-2 directory (:func:`save`)."""
    save(path, model.config, to_dense(model))
