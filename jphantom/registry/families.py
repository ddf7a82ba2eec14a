"""The model families: one registry that ``train``, ``inspect``, ``compile``, ``plan``,
:class:`jphantom.config.RunConfig`, the metrics and :mod:`jphantom.models.hf` read.

A family is declared once, in the module that holds it, by :func:`register`::

    register(Family(
        name="qwen3", description="Qwen3 (per-head q/k RMSNorm, tied embeddings)",
        config_type=LlamaConfig, module=Llama, from_flags=_qwen3_from_flags,
        flags=("kv_heads", "intermediate", "ghost_width"), hf_types=("qwen3",),
        config_from_hf=config_from_hf, load_hf=load_hf, save_hf=save_hf,
        flops_per_token=flops_per_token, plan_shape=plan_shape))

What a family declares:

- ``config_type`` and ``module``: its typed, validated configuration and its Flax NNX model
  (``module(config, rngs=...)``, holding no collective, with ``loss(tokens, targets[, mask])``);
  ``matches(config)`` picks the family of a configuration when several share a type (the Llama
  variants share :class:`~jphantom.models.llama.LlamaConfig`); ``check(section)`` refuses a
  model section the family cannot build, before anything else runs;
- ``from_flags(section, phantom)``: its configuration from the flat model section of a run
  (:class:`jphantom.config.ModelConfig`: ``layers``, ``hidden``, ``heads``, ``seq_len``,
  ``vocab``, ``dtype`` for every language model, the fields it declares in ``fields`` and the
  fields of other declarations it names in ``flags``; a field it does not read, set away from its
  default, is refused by name);
- ``fields``: the model-section settings it owns, each a :class:`Field` (name, type, default,
  help, least value) declared once in the family's module (:data:`GHOST_WIDTH` and the routed
  experts' :data:`MOE_EVERY`, :data:`EXPERTS`, :data:`TOP_K`, which several families read, here).
  :class:`jphantom.config.ModelConfig` is built from these declarations: its fields, their
  validation and the ``train``/``inspect``/``compile`` flags and help (prefixed with the families
  that read each) come from them. Its fields are fixed when :mod:`jphantom.config` is first
  imported: a family registered later may read fields declared by then, and declaring a new one
  is refused by name;
- its Hugging Face mapping: the ``model_type``\\ s it reads (``hf_types``), ``config_from_hf``,
  ``load_hf`` and ``save_hf`` (tensor names, tied weights and key aliases live with them);
- ``flops_per_token(config, seq_len)`` (forward + backward model FLOPs, for MFU) and
  ``plan_shape(config)`` (the dense-block shape :mod:`jphantom.planner` prices, a
  :class:`jphantom.perf.axonn_model.GPTShape`; ``None``: the planner refuses it by name);
- ``plan(model, **options)``: its model's Megatron plan (path -> style; ``options``:
  ``sequence_parallel``, ``dtd``, ``collective_matmul``), which ``tensor`` applies and ``gspmd``
  annotates (:mod:`jphantom.registry.layer_plans`), declared by path as torchtitan's ``parallelize_llama``
  declares Llama's; ``None`` (for the family, or returned for a model) leaves it to
  :mod:`jphantom.plans`' walkers, which recognise the layers by type and name, as phantom and
  pmm3d always do (GPT-2 declares its Megatron plan, :mod:`jphantom.models.gpt2.plan`, and the
  Llama family for every variant, :mod:`jphantom.models.llama.plan`; a user's family may take the
  walkers);
- what it runs: every strategy whose layers' plan splits its model
  (:meth:`jphantom.registry.strategies.Strategy.runs`: a builder for its ``program``; pmm3d not with
  ``per_head_norms``, per-head q/k norms such as Qwen3's, which need a whole head where pmm3d
  splits a head's features over ``y``); ``strategies``: the names it runs instead, when it says
  so;
  ``program``: ``"lm"`` (a language model: the layers' plans' ``lm`` builders) or ``"ffn"``
  (their ``ffn`` builders), which :attr:`Family.is_language_model` reads for the callers that
  treat token sequences and the FFN's rows differently; ``defaults``: the column of
  ``inspect``'s and ``compile``'s defaults (``"lm"`` or ``"ffn"``);
- ``build(config, strategy, mesh, **options)``: its
  :class:`~jphantom.registry.program.Program`, declared by the family that builds its own (the
  FFN's, :func:`jphantom.models.ffn.program.build`, a :class:`Lazy` reference: it sits in the
  program layer); ``None``: a language model's, :func:`jphantom.registry.program.lm_build`.

The zoo's families are the packages of :data:`BUILTIN`, imported on the first lookup; a user's
family registers from anywhere (``tests/models/test_families.py`` declares one in the test file and
drives it through ``train``, ``inspect``, ``plan`` and ``compile``).

**No jax until a model is built.** A configuration reads the registry as it validates
(:class:`jphantom.config.ModelConfig`: the names, the fields each family reads, its ``check``;
:class:`jphantom.config.RunConfig`: ``from_flags``, the strategies), and configuration is data:
it imports neither jax, flax nor numpy. So a family's declarative facts, its configuration type
and ``from_flags`` live in modules that import no jax, and whatever needs jax (its NNX
``module``, its Hugging Face reader and writer) may be given as a :class:`Lazy` reference,
``Lazy("jphantom.models.llama.model", "Llama")``, which the family imports when the field is
first read (building a model, loading a checkpoint); :meth:`Family.declares` says whether a
field is given without importing it. The zoo's families declare themselves so, each in its
package's ``family`` module (``ffn``, ``gpt2``, ``llama`` with its ``variants``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from typing import Any

from jphantom.errors import ConfigError
from jphantom.registry.lazy import Lazy, resolved

BUILTIN = ("ffn", "gpt2", "llama")
"""The zoo's family packages under ``jphantom.models`` (``llama`` registers its presets too:
mistral, qwen2, qwen3, qwen3_moe, gemma3); importing one registers its families and imports no
jax."""

COMMON_FLAGS = ("layers", "hidden", "heads", "seq_len", "vocab", "dtype", "from_hf")
"""The model section's fields every language model takes."""



@dataclasses.dataclass(frozen=True)
class Field:
    """One setting of a run's model section that a family declares (module docstring): the flat
    ``name`` (the flag ``--name``), its ``type`` (``int``, ``float``, ``bool``, ``str`` or
    ``X | None``), ``default``, command-line ``help``, and the least value it takes
    (``minimum``; ``above``: the minimum itself excluded)."""

    name: str
    type: Any
    default: Any
    help: str
    minimum: int | float | None = None
    above: bool = False

    def check(self, value) -> None:
        """Refuse ``value`` below the least value, by name."""
        if self.minimum is None or value is None:
            return
        if self.above and not value > self.minimum:
            raise ConfigError(f"{self.name}={value} must be > {self.minimum}")
        if not self.above and value < self.minimum:
            raise ConfigError(f"{self.name}={value!r} must be at least {self.minimum}")


GHOST_WIDTH = Field("ghost_width", int | None, None,
                    "phantom: k ghost neurons per rank (and token)", minimum=1)
"""Phantom parallelism's k, read by every zoo family (under a phantom strategy only)."""
MOE_EVERY = Field("moe_every", int, 0, "every n-th block is a mixture of experts (0: none; with "
                  "an expert=G mesh axis the experts are split over G ranks)", minimum=0)
EXPERTS = Field("experts", int, 8, "MoE: experts E per MoE block", minimum=1)
TOP_K = Field("top_k", int, 2, "MoE: experts each token visits", minimum=1)
"""The routed experts' settings that GPT-2 and the Llama family's MoE presets read."""

@dataclasses.dataclass(frozen=True)
class Family:
    """One model family (module docstring). A field given as a :class:`Lazy` reference reads as
    the object it names, imported on the first read."""

    name: str
    description: str
    config_type: type
    module: Callable[..., Any] | Lazy
    from_flags: Callable[[Any, bool], Any]
    flags: tuple[str, ...] = ()
    fields: tuple[Field, ...] = ()
    strategies: tuple[str, ...] | None = None
    per_head_norms: bool = False
    hf_types: tuple[str, ...] = ()
    config_from_hf: Callable[[dict], Any] | Lazy | None = None
    load_hf: Callable[[Any], Any] | Lazy | None = None
    save_hf: Callable[[Any, Any], None] | Lazy | None = None
    flops_per_token: Callable[[Any, int], int] | None = None
    plan_shape: Callable[[Any], Any] | None = None
    plan: Callable[..., Any] | Lazy | None = None
    build: Callable[..., Any] | Lazy | None = None
    matches: Callable[[Any], bool] | None = None
    check: Callable[[Any], None] | None = None
    aliases: tuple[str, ...] = ()
    program: str = "lm"
    defaults: str = "lm"
    common_flags: tuple[str, ...] = COMMON_FLAGS

    def __post_init__(self):
        if not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"family name {self.name!r}: letters, digits, - and _ only")
        if self.program not in ("lm", "ffn") or self.defaults not in ("lm", "ffn"):
            raise ConfigError(f"family {self.name!r}: program and defaults are 'lm' or 'ffn'")
        for field in self.fields:
            if not isinstance(field, Field) or field.name in ("name", *COMMON_FLAGS):
                raise ConfigError(f"family {self.name!r}: fields are jphantom.registry.families.Field "
                                  "declarations of settings the common ones do not name "
                                  f"({', '.join(COMMON_FLAGS)}), not {field!r}")

    def __getattribute__(self, name):
        return resolved(self, name)  # a Lazy field imported once, then kept as its value

    def declares(self, field: str) -> bool:
        """Whether the family gives ``field`` (not ``None``), without importing a :class:`Lazy`
        one (a configuration asks whether there is a ``save_hf``)."""
        return object.__getattribute__(self, field) is not None

    def owns(self, config) -> bool:
        """Whether ``config`` (a family configuration) is this family's."""
        if not isinstance(config, self.config_type):
            return False
        return self.matches(config) if self.matches is not None else True

    @property
    def is_language_model(self) -> bool:
        """Whether it reads token sequences (``program`` ``"lm"``: ``seq_len``, ``vocab``, the
        data and a tokenizer apply); the FFN (``"ffn"``) reads rows of ``width`` features."""
        return self.program == "lm"

    @property
    def accepted(self) -> tuple[str, ...]:
        """The model section's fields this family reads."""
        return (*self.common_flags, *self.flags, *(f.name for f in self.fields))


_FAMILIES: dict[str, Family] = {}
_ALIASES: dict[str, str] = {}
_loaded = False
_sealed: dict[str, Field] | None = None  # the model section's fields, once it was built


def _declared(families) -> dict[str, Field]:
    """Every field the ``families`` declare, by name, in declaration order; one name declared
    two ways is refused by name."""
    declared: dict[str, tuple[Field, str]] = {}
    for family in families:
        for field in family.fields:
            first = declared.setdefault(field.name, (field, family.name))
            if first[0] != field:
                raise ConfigError(f"family {family.name!r} declares the model field "
                                  f"{field.name!r} differently from family {first[1]!r}: "
                                  "declare it once and give both families that Field")
    return {name: field for name, (field, _) in declared.items()}


def register(family: Family, *, replace: bool = False) -> Family:
    """Add ``family`` to the registry (``replace``: a family of that name may be replaced, e.g.
    re-registered by a test); returns it."""
    taken = family.name in _FAMILIES or family.name in _ALIASES
    if taken and not replace:
        raise ConfigError(f"a model family named {family.name!r} is registered already: pick "
                          "another name, or register(..., replace=True)")
    others = [f for f in _FAMILIES.values() if f.name != family.name]
    declared = _declared([*others, family])
    if _sealed is not None:
        new = [name for name, field in declared.items() if _sealed.get(name) != field]
        if new:
            raise ConfigError(f"family {family.name!r} declares the model field(s) {new} after "
                              "jphantom.config built the model section: register it before "
                              "jphantom.config is imported, or read fields declared already")
    _FAMILIES[family.name] = family
    for alias in family.aliases:
        _ALIASES[alias] = family.name
    return family


def unregister(name: str) -> None:
    """Remove the family ``name`` (and its aliases) from the registry."""
    family = _FAMILIES.pop(name, None)
    for alias in getattr(family, "aliases", ()):
        _ALIASES.pop(alias, None)


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            importlib.import_module(f"jphantom.models.{module}")


def _rank(family: Family) -> int:
    """The zoo's families first, in :data:`BUILTIN` order (whatever imported them first)."""
    module = object.__getattribute__(family, "module")  # a Lazy one stays unimported
    module = module.module if isinstance(module, Lazy) else getattr(module, "__module__", "")
    if module.startswith("jphantom.models."):  # a zoo package's: jphantom.models.llama.model
        module = module.removeprefix("jphantom.models.").split(".")[0]
    return BUILTIN.index(module) if module in BUILTIN else len(BUILTIN)


def section_fields() -> dict[str, tuple[Field, tuple[str, ...]]]:
    """Every field the registered families declare (the zoo's imported first), by name, with the
    families that read it; what :class:`jphantom.config.ModelConfig` is built from, once (later
    registrations may declare no new field)."""
    global _sealed
    ordered = families().values()
    _sealed = _declared(ordered)
    return {name: (field, tuple(f.name for f in ordered if name in f.accepted))
            for name, field in _sealed.items()}


def families() -> dict[str, Family]:
    """Every registered family by name (the zoo's first, in :data:`BUILTIN` order)."""
    _load()
    return {f.name: f for f in sorted(_FAMILIES.values(), key=_rank)}


def names(*, aliases: bool = False) -> tuple[str, ...]:
    """The registered families' names (``aliases``: with their aliases)."""
    ordered = tuple(families())
    return (*ordered, *_ALIASES) if aliases else ordered


def canonical(name: str) -> str:
    """``name`` with an alias resolved (``transformer`` -> ``gpt2``)."""
    _load()
    return _ALIASES.get(name, name)


def get(name: str) -> Family:
    """The family ``name`` (or alias), with the registered names in the error."""
    _load()
    try:
        return _FAMILIES[_ALIASES.get(name, name)]
    except KeyError:
        raise ConfigError(f"model={name!r} is not a model family; use one of "
                          f"{', '.join(names())}") from None


def of_config(config) -> Family:
    """The family of a configuration object (the last registered that owns it)."""
    owners = [family for family in families().values() if family.owns(config)]
    if not owners:
        raise ConfigError(f"no model family takes a {type(config).__name__}: give one of "
                          f"{', '.join(sorted({f.config_type.__name__ for f in _FAMILIES.values()}))}")
    return owners[-1]


def hf_types() -> tuple[str, ...]:
    """Every Hugging Face ``model_type`` a registered family reads."""
    return tuple(t for family in families().values() for t in family.hf_types)


def of_hf_type(model_type: str | None) -> Family:
    """The family that reads a ``config.json``'s ``model_type``."""
    for family in families().values():
        if model_type in family.hf_types:
            return family
    raise ConfigError(f"model_type={model_type!r} is not in the zoo; supported: "
                      f"{', '.join(hf_types())}")


def _hf_json(directory) -> dict:
    """``directory/config.json`` as a dictionary (a ConfigError naming the file otherwise)."""
    from pathlib import Path

    path = Path(directory) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"--from-hf {directory}: cannot read {path} ({error.strerror}): give "
                          "a Hugging Face checkpoint folder (config.json + model.safetensors)"
                          ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} holds {type(hf).__name__}, expected a JSON object")
    return hf


def of_hf_checkpoint(directory) -> Family:
    """The family that reads the checkpoint in ``directory``, chosen by its ``config.json``'s
    ``model_type`` (``gpt2`` where it has none), as transformers' ``AutoModel`` does: what a
    ``--from-hf`` run without ``--model`` trains."""
    kind = _hf_json(directory).get("model_type", "gpt2")
    owner = next((f for f in families().values() if kind in f.hf_types), None)
    if owner is None:
        raise ConfigError(f"--from-hf {directory} holds a {kind!r} checkpoint (its config.json's "
                          f"model_type), which no model family reads: the zoo reads "
                          f"{', '.join(hf_types())}")
    return owner


def read_hf_config(directory, family: Family) -> dict:
    """``directory/config.json`` of a checkpoint that ``family`` reads (a ``--from-hf`` of
    another family is refused naming both, and the ``--model`` that reads it)."""
    hf = _hf_json(directory)
    kind = hf.get("model_type", "gpt2")
    if kind not in family.hf_types:
        owner = next((f.name for f in families().values() if kind in f.hf_types), None)
        fix = (f"leave --model out (the checkpoint's model_type chooses it) or pass --model "
               f"{owner}" if owner else f"the zoo reads {', '.join(hf_types())}")
        raise ConfigError(f"--from-hf {directory} holds a {kind!r} checkpoint, which --model "
                          f"{family.name} does not read: {fix}")
    return hf


def check_checkpoint_shape(section, config, names: dict[str, str]) -> None:
    """A ``--from-hf`` run's shape is the checkpoint's: a model-section field of ``names``
    (section field -> configuration attribute) set away from its default must equal the loaded
    configuration's, else a ConfigError naming both (it used to be ignored)."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(section))}
    for field, attribute in names.items():
        given, loaded = getattr(section, field), getattr(config, attribute, None)
        if given != defaults.get(field) and loaded is not None and given != loaded:
            flag = "--" + field.replace("_", "-")
            raise ConfigError(f"{flag} {given} disagrees with the --from-hf checkpoint's "
                              f"{attribute}={loaded}: leave {flag} out (the checkpoint sets it)")


def strategies_for(model: str) -> list[str]:
    """The strategies the family ``model`` runs (those whose layers' plan splits its model,
    :meth:`jphantom.registry.strategies.Strategy.runs`, or the names it gives), in
    :data:`jphantom.registry.strategies.STRATEGIES` order."""
    from jphantom.registry.strategies import STRATEGIES

    family = get(model)
    return [name for name, row in STRATEGIES.items()
            if (row.runs(family) if family.strategies is None else name in family.strategies)]


def running(strategy: str) -> tuple[str, ...]:
    """The registered families that run ``strategy``."""
    return tuple(name for name in families() if strategy in strategies_for(name))
