"""Training checkpoints with Orbax: asynchronous, atomic, keep-last-k, resumable, and
restorable onto another mesh.

A checkpoint at step ``n`` holds the parameters and the optimizer state (``state``, Orbax's
``StandardSave`` of the sharded arrays: every process writes its shards) and a JSON ``meta`` item:
the step, the run's history so far, the shape of every parameter, the data stream's position
(``data``) and whatever the caller adds. Byte-level text and the teacher are pure functions of the
step index and the seed, so for them the step is the position (``data`` is ``None``); a token
reader (:class:`jphantom.data.tokens.TokenBatches`) has an explicit position, its epoch and the
windows consumed in it, which :meth:`Checkpointer.save` stores beside the step and
:meth:`Checkpointer.restore` returns in ``meta["data"]``, so a resumed run reads exactly the
batches an uninterrupted run would. Nothing else in a step draws random numbers.

- **Asynchronous**: :meth:`Checkpointer.save` returns once the arrays are copied off the devices
  (the training step may then donate them); the files are written in the background.
- **Atomic**: Orbax writes a step into a temporary directory and renames it when complete, so a
  save killed midway never shadows the last complete checkpoint (:meth:`latest_step` skips it).
- **Keep-last-k**: older steps are deleted once a newer one is complete.
- **Resharding**: :meth:`restore` takes the target's abstract arrays with their shardings (the
  program on the new mesh): a tensor-parallel run saved on ``data=2,model=4`` restores on
  ``model=2``, since the core keeps dense-shaped weights. A model whose shapes depend on the mesh
  (phantom: p is part of the model) is refused with a :class:`ConfigError` naming the parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jphantom.errors import ConfigError, check_int


def _shapes(tree) -> dict[str, list[int]]:
    return {jax.tree_util.keystr(path): list(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _quiet_closed_loop_callbacks() -> None:
    """After a failed restore, TensorStore's reads still in flight finish on Orbax's closed
    asyncio loop, and Python prints each ``RuntimeError('Event loop is closed')`` they raise as
    an unraisable exception (hundreds of tracebacks before the one warning that says what
    happened). Those alone are dropped; every other unraisable exception still reaches the
    previous hook."""
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "_jphantom_quiet", False):
        return

    def hook(unraisable):
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        previous(unraisable)

    hook._jphantom_quiet = True
    sys.unraisablehook = hook


class Checkpointer:
    """Orbax ``CheckpointManager`` for jphantom's training state in ``directory``: save every
    ``save_every`` steps (0: only when asked), keep the last ``keep``."""

    def __init__(self, directory: str | Path, *, save_every: int = 0, keep: int = 3,
                 asynchronous: bool = True):
        check_int("save_every", save_every, 0)
        check_int("keep", keep)
        path = Path(directory).absolute()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"checkpoint_dir={str(directory)!r} is a file: give a folder")
        self.directory, self.save_every = path, save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                               enable_async_checkpointing=asynchronous)
        self.manager = ocp.CheckpointManager(path, options=options)

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based, after the update) is a save point."""
        return bool(self.save_every) and step % self.save_every == 0

    def save(self, step: int, params, opt_state, meta: dict | None = None, *,
             data: dict | None = None) -> None:
        """Start saving the state after ``step`` steps (returns once the arrays are off the
        devices); ``data``: the data reader's position after that step (JSON-ready)."""
        meta = {**(meta or {}), "step": step, "data": data, "shapes": _shapes(params),
                "optimizer_state": _shapes(opt_state)}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
            meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (None if there is none)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, params_like, opt_state_like, step: int | None = None
                ) -> tuple[Any, Any, dict]:
        """``(params, opt_state, meta)`` of ``step`` (default the latest), placed as the abstract
        targets say (``jax.ShapeDtypeStruct`` with shardings, or arrays): the mesh may differ
        from the one that saved."""
        if step is not None:
            return self._restore(step, params_like, opt_state_like)
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise ConfigError(f"no complete checkpoint in {self.directory}: train without "
                              "--resume first, or give the folder that holds one")
        failures, damaged = [], []
        for step in steps:  # the newest that restores; a damaged one is skipped, and said so
            try:
                restored = self._restore(step, params_like, opt_state_like)
            except ConfigError:
                raise
            except Exception as error:  # noqa: BLE001 (Orbax raises many kinds for damaged files)
                _quiet_closed_loop_callbacks()
                failures.append(f"step {step}: {reason_of(error)}")
                damaged.append(step)
                continue
            if failures:
                import warnings

                from jphantom.errors import JPhantomWarning

                for bad in damaged:  # kept for inspection, out of the run's way
                    (self.directory / str(bad)).rename(self.directory / f"{bad}.damaged")
                self.manager.reload()
                warnings.warn(f"newer checkpoints in {self.directory} do not restore ("
                              + "; ".join(failures) + f"): resumed from step {step}; the "
                              "damaged ones are renamed <step>.damaged", JPhantomWarning,
                              stacklevel=2)
            return restored
        raise ConfigError(f"no checkpoint in {self.directory} restores: " + "; ".join(failures))

    def meta(self, step: int | None = None) -> dict | None:
        """The JSON saved beside checkpoint ``step`` (default the newest; None if there is
        none): the step, history, shapes, and what the run put there (its model, its data)."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"]

    def _restore(self, step: int, params_like, opt_state_like):
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"]
        self.check_layout(meta, params_like, opt_state_like)
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            {"params": params_like, "opt_state": opt_state_like})
        state = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
        return state["params"], state["opt_state"], meta

    @staticmethod
    def check_layout(meta: dict, params_like, opt_state_like) -> None:
        """ConfigError when the checkpoint whose :meth:`meta` is ``meta`` holds parameters or an
        optimizer state of other shapes than ``params_like`` / ``opt_state_like`` (arrays or
        ``ShapeDtypeStruct``s: an abstract state is enough, nothing is read but the JSON)."""
        step = meta["step"]
        wanted = _shapes(params_like)
        for name, shape in meta["shapes"].items():
            if wanted.get(name) != shape:
                raise ConfigError(
                    f"checkpoint step {step} has parameter {name} of shape {tuple(shape)} but the "
                    f"model on this mesh has {tuple(wanted.get(name) or ())}: the model's shapes "
                    "depend on the mesh (phantom: p is part of the model); restore on the mesh "
                    "that saved it")
        saved_opt, wanted_opt = meta.get("optimizer_state"), _shapes(opt_state_like)
        if saved_opt is not None and saved_opt != wanted_opt:
            first = next((k for k in sorted(set(saved_opt) | set(wanted_opt))
                          if saved_opt.get(k) != wanted_opt.get(k)), "?")
            raise ConfigError(
                f"checkpoint step {step} holds another optimizer's state (at {first}: saved "
                f"{saved_opt.get(first, 'nothing')}, this run's {wanted_opt.get(first, 'nothing')}"
                f"; {len(saved_opt)} saved leaves, {len(wanted_opt)} here): resume with the "
                "optimizer (and step options) that saved it")

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def reason_of(error: BaseException) -> str:
    """One line of why a checkpoint did not restore: the error's type and its first line that
    says something, without the ``<bound method ...>`` reprs some bindings put in messages."""
    text = str(error)
    for prefix in ("<bound method ", "<built-in method ", "<function ", "<method "):
        while (at := text.find(prefix)) >= 0:  # drop the repr, its nested <...> too
            depth, end = 0, at
            for end in range(at, len(text)):
                depth += {"<": 1, ">": -1}.get(text[end], 0)
                if depth == 0:
                    break
            text = text[:at] + text[end + 1:]
    lines = [line.strip(" :;,") for line in text.splitlines() if line.strip(" :;,()")]
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__
