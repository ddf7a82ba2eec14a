"""The one training loop: a :class:`Trainer` whose loop calls callbacks
(:class:`jphantom.callbacks.Callback`). ``jphantom train``, ``jphantom compare`` and the
experiments run it (:func:`run`).

The trainer takes a :class:`jphantom.config.RunConfig` (validated on construction; the program and
its step are built, nothing compiled, before any data is read) and trains: FFN runs on Seal et al.'s
teacher task, language models on byte-level text, or on tokens (:mod:`jphantom.sources`). The
loop itself owns what the state's safety needs: the step, evaluation every ``eval_every`` steps
and at the end (held-out loss; MoE models: the cross-entropy without the auxiliary losses and the
fraction of dropped token-expert assignments), Orbax checkpoints, the energy window (opened after
the first step and closed after the last, both after ``jax.block_until_ready``, as Seal et al.
exclude initialisation), preemption, the watchdog and the non-finite policy
(:mod:`jphantom.resilience`). Everything that only observes a step is a callback, called with the
step's record (the line ``metrics.jsonl`` gets):

- :class:`jphantom.callbacks.MetricsFile`: ``metrics.jsonl``, one line per step (loss, learning rate, gradient norm,
  step time, tokens/s, model TFLOP/s per device and MFU, peak memory, energy:
  :mod:`jphantom.metrics`) and per evaluation (``validation_loss``), flushed as written;
- :class:`~jphantom.callbacks.TensorBoardEvents` (``tensorboard``): the same records as TensorBoard events;
- :class:`~jphantom.callbacks.ProgressBar` (``progress``): tqdm, with the loss, rate and last validation loss;
- :class:`~jphantom.callbacks.EarlyStop` (``target_loss``): stops the run once a validation loss reaches the target.

A user adds their own (``Trainer(config, callbacks=[MyCallback()])``, docs/training.md): any of
``on_train_start(trainer)``, ``on_step_end(trainer, record)``, ``on_train_end(trainer, results)``
and ``close()``; ``trainer.request_stop(reason)`` ends the run after the current step, with a
checkpoint. At the end ``train.out`` (unless ``None``) gets ``curves.png`` (training and
validation loss against steps) and ``results.json`` (the configuration, final and best validation
loss, the step time, the parameters, for text the unigram cross-entropy and the ratio, the
pipeline and the step options).

Runs that differ only in their seed share one compiled step (:meth:`RunConfig.build`), as the
seeds of a comparison do.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from jphantom import resilience
from jphantom.config import RunConfig, check_vocabulary, pipeline_summary
from jphantom.errors import ConfigError, TrainingDiverged
from jphantom.metrics import (StepEnergy, flops_per_token, grad_norm_of, peak_memory_bytes,
                              peak_tflops)
from jphantom.resilience import (AUTO_TIMEOUT_S, MAX_CONSECUTIVE_SKIPS, StopOnSignal, Watchdog,
                                 agree)
from jphantom.callbacks import Callback, default_callbacks
from jphantom.sources import TeacherSource, process_rows, text_source


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------


class Trainer:
    """Train ``config`` (:meth:`fit`): the loop of the module docstring. ``teacher``: the FFN's
    data (default: the seed's); ``meter``: an energy meter (:class:`jphantom.energy.NvmlEnergyMeter`)
    whose window spans every step after the first; ``callbacks``: the user's, called after the
    built-in ones.

    What callbacks can read: ``config``, ``program``, ``mesh``, ``step`` (the
    :class:`jphantom.train_step.TrainStep`), ``state`` (the current parameters and optimizer
    state), ``history`` (steps, training and validation losses so far), ``first_step`` (0, or
    the checkpoint's step on resume) and ``out`` (the run's folder, or None)."""

    def __init__(self, config: RunConfig, *, teacher=None, meter=None,
                 callbacks: Sequence[Callback] = ()):
        bad = [c for c in callbacks if not isinstance(c, Callback)]
        if bad:
            raise ConfigError(f"callbacks must be jphantom.callbacks.Callback instances, got "
                              f"{type(bad[0]).__name__}: subclass Callback and override its hooks")
        self.config, self.teacher, self.meter = config, teacher, meter
        self.user_callbacks = list(callbacks)
        self.out = Path(config.train.out) if config.train.out is not None else None
        self.program = self.mesh = self.step = self.state = None
        self.history, self.first_step = _fresh_history(), 0
        self._stop_reason, self._stop_step = None, None

    def request_stop(self, reason: str) -> None:
        """End the run after the current step (a checkpoint of it is written, as at the last
        step); ``reason`` is recorded in ``results.json`` as ``stopped_by``."""
        self._stop_reason = self._stop_reason or reason

    def fit(self) -> dict:
        """Train; returns (and writes, with ``train.out``) the results dictionary."""
        config = self.config
        train = config.train
        writer = jax.process_index() == 0 and self.out is not None  # process 0 alone writes
        out = self.out
        start = time.perf_counter()
        check_vocabulary(config)  # the data against the model, before anything is built
        b = config.build()
        memory = check_memory(config, compiled=True)  # compiles the step, allocates nothing
        program, mesh, step = b.program, b.mesh, b.step
        self.program, self.mesh, self.step = program, mesh, step
        rows = None  # the rows of each training batch this process reads (None: all of them)
        if _text_model(config):
            seq_len = min(getattr(program.config, "seq_len", config.model.seq_len),
                          config.model.seq_len)
            source = text_source(config, seq_len,
                                 process_rows(b.shardings[0], (train.batch, seq_len)))
            rows = getattr(source, "rows", None)
        else:
            seq_len = None
            source = TeacherSource(config, self.teacher)
        if writer:
            out.mkdir(parents=True, exist_ok=True)
        kernels = attention_kernels(config, program, step)
        if kernels and jax.process_index() == 0:  # the kernel choice is never silent
            print("attention: " + "; ".join(f"{name} {what}" for name, what in kernels.items()))
        self.state = program.init(step, seed=train.seed)
        checkpointer = None
        if train.checkpoint_dir:
            from jphantom.checkpoint import Checkpointer
            checkpointer = Checkpointer(train.checkpoint_dir, save_every=train.save_every,
                                        keep=train.keep_checkpoints)
        place = lambda pair: tuple(jax.device_put(np.asarray(a), s)
                                   for a, s in zip(pair, b.shardings))
        if rows is not None:  # this process's rows of the global batch
            place_train = lambda pair: tuple(
                jax.make_array_from_process_local_data(s, np.asarray(a), (train.batch,
                                                                          *np.shape(a)[1:]))
                for a, s in zip(pair, b.shardings))
        else:
            place_train = place

        def validate():
            """Mean validation loss (MoE: the cross-entropy without the auxiliary losses) and
            the fraction of token-expert assignments dropped; FFN: the held-out MSE weighted by
            rows."""
            params = self.state.params
            if b.metrics is None:
                total = count = 0.0
                for pair in source.validation():
                    rows = np.shape(pair[0])[0]
                    total += float(b.loss(params, *place(pair))) * rows
                    count += rows
                return total / count, None
            found = [jax.device_get(b.metrics(params, *place(pair)))
                     for pair in source.validation()]
            cross_entropy = float(np.mean([float(m["cross_entropy"]) for m in found]))
            if "dropped" not in found[0]:
                return cross_entropy, None
            dropped = (sum(float(m["dropped"]) for m in found)
                       / sum(float(m["assignments"]) for m in found))  # means per token: a ratio
            return cross_entropy, dropped

        initial_data = getattr(source, "state", lambda: None)()  # where a rollback to 0 restarts
        identity = {"model": {"name": config.model.name, **_asdict(program.config)},
                    "corpus": {"data": train.data, "tokenizer": train.tokenizer}}
        if train.resume:  # the state, the history and the data stream's position (the step)
            _check_same_run(checkpointer, identity)
            self.state, self.first_step, self.history = _restore(checkpointer, self.state,
                                                                 source)
            if self.first_step >= train.steps:
                raise ConfigError(f"the checkpoint is at step {self.first_step}, not before "
                                  f"steps={train.steps}: ask for more steps to continue")
        first = self.first_step
        callbacks = default_callbacks(config) + self.user_callbacks
        step_seconds, metered_steps, energy = [], 0, None
        compile_seconds = None
        devices = list(mesh.devices.flat)
        per_token = flops_per_token(program.config, config.parallel.strategy,
                                    seq_len if seq_len is not None else 1)
        peak = peak_tflops(devices[0])
        learning_rates = _learning_rates(train)
        step_energy = StepEnergy.for_devices(devices)
        data_state = getattr(source, "state", lambda: None)
        meter, meter_running = self.meter, False
        interrupted, state_step, saved_step = False, first, None
        stop = StopOnSignal(tqdm.write)  # SIGTERM / Ctrl-C: finish this step, checkpoint, stop
        watchdog = Watchdog(train.step_timeout, rank=jax.process_index(),
                            processes=jax.process_count())
        nonfinite = {"policy": train.on_nonfinite, "skipped_steps": [], "rollbacks": [],
                     "skipped_batches": []}
        skip_batches, consecutive = set(), 0
        dropped_before = resilience.nonfinite_total(self.state.opt_state) or 0
        evaluated = False
        history = self.history

        def write(record):
            for callback in callbacks:
                callback.on_step_end(self, record)

        def save(at: int):
            checkpointer.save(at, self.state.params, self.state.opt_state,
                              {"history": json.loads(json.dumps(history)), **identity},
                              data=data_state())

        try:
            for callback in callbacks:
                callback.on_train_start(self)
            index = first
            while index < train.steps:
                if index > first:  # the whole iteration (not the first, which compiles)
                    watchdog.arm(f"step {index + 1}")
                pair = source.train(index)  # read even when skipped: the stream stays in step
                if index in skip_batches:  # the batch that gave a rolled-back non-finite loss
                    skip_batches.discard(index)
                    nonfinite["skipped_batches"].append(index + 1)
                    write({"step": index + 1, "skipped_batch": True})
                    index += 1
                    continue
                batch = place_train(pair)
                jax.block_until_ready(batch)  # the step's window opens on idle devices ...
                step_energy.begin()
                tick = time.perf_counter()
                self.state, loss = step(self.state, *batch)
                state_step = index + 1  # the state is this step's (still computing)
                jax.block_until_ready((self.state, loss))  # ... and closes once its work is done
                elapsed = time.perf_counter() - tick
                joules = step_energy.end(elapsed)
                loss = float(loss)
                if index == first:
                    compile_seconds = time.perf_counter() - start
                    if meter is not None and train.steps > first + 1:
                        jax.block_until_ready(self.state)  # the window opens on an idle device
                        meter.start()
                        meter_running = True
                else:  # the first step compiles
                    step_seconds.append(elapsed)
                    metered_steps += meter is not None
                    if train.step_timeout is None and jax.process_count() > 1 and len(
                            step_seconds) >= 2 and watchdog.timeout is None:
                        # several processes: an automatic limit once compiled
                        watchdog.set_timeout(max(AUTO_TIMEOUT_S, 50 * max(step_seconds)))
                skipped = False  # skip: optax.apply_if_finite counted a dropped update
                if train.on_nonfinite == "skip":
                    dropped = resilience.nonfinite_total(self.state.opt_state)
                    skipped, dropped_before = dropped > dropped_before, dropped
                if not math.isfinite(loss) or skipped:
                    what = (f"training loss is {loss} at step {index + 1} ({config.model.name}, "
                            f"{config.parallel.strategy}, precision {config.step.precision}, "
                            f"dtype {config.model.dtype}, learning_rate="
                            f"{train.learning_rate:g})")
                    if train.on_nonfinite == "rollback":
                        if checkpointer is not None:
                            checkpointer.wait()
                        if checkpointer is not None and checkpointer.all_steps():
                            self.state, back, restored = _restore(checkpointer, self.state,
                                                                  source)
                        else:  # nothing saved yet: from the start
                            self.state, back, restored = program.init(
                                step, seed=train.seed), 0, _fresh_history()
                            if initial_data is not None:
                                source.restore(initial_data)
                        history.clear()
                        history.update(restored)
                        dropped_before = resilience.nonfinite_total(self.state.opt_state) or 0
                        nonfinite["rollbacks"].append({"at_step": index + 1, "to_step": back})
                        tqdm.write(f"{what}: rolled back to step {back}; its batch will be "
                                   "skipped")
                        write({"step": index + 1, "train_loss": None, "nonfinite": True,
                               "rolled_back_to": back})
                        skip_batches.add(index)
                        index = back
                        continue
                    if train.on_nonfinite == "skip" and skipped:
                        consecutive += 1
                        nonfinite["skipped_steps"].append(index + 1)
                        if consecutive >= MAX_CONSECUTIVE_SKIPS:
                            raise TrainingDiverged(f"{what}; {consecutive} updates in a row "
                                                   "were skipped: lower the learning rate or "
                                                   "check the data" + _last_good(checkpointer))
                    else:
                        raise TrainingDiverged(f"{what}: lower the learning rate or check the "
                                               "data" + _last_good(checkpointer))
                else:
                    consecutive = 0
                rate = source.tokens_per_batch / elapsed
                grad_norm = grad_norm_of(self.state.opt_state)
                tflops = (None if per_token is None else
                          per_token * source.tokens_per_batch / elapsed / len(devices) / 1e12)
                record = {
                    "step": index + 1, "train_loss": loss if math.isfinite(loss) else None,
                    "learning_rate": float(learning_rates[min(index, len(learning_rates) - 1)]),
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "step_seconds": elapsed, "tokens_per_second": rate,
                    "model_tflops_per_device": tflops,
                    "mfu": None if tflops is None or peak is None else tflops / peak,
                    "peak_memory_bytes": peak_memory_bytes(devices),
                    "energy_joules": joules,
                    "joules_per_token": step_energy.joules_per_token(
                        joules, source.tokens_per_batch),
                    "energy_source": step_energy.source}
                if train.on_nonfinite != "stop":
                    record["update_skipped"] = skipped
                    if skipped:  # the optimizer's state (and its recorded norm) did not move
                        record["grad_norm"] = None
                if index == first:
                    record["compiled"] = True  # this step's time includes compiling it
                if not skipped:  # the history holds the steps that updated the model
                    history["step"].append(index + 1)
                    history["train_loss"].append(loss)
                if (index + 1) % train.eval_every == 0 or index + 1 == train.steps:
                    if evaluated:  # the first evaluation compiles: not timed
                        watchdog.arm(f"the evaluation after step {index + 1}")
                    else:
                        watchdog.disarm()
                    record["validation_loss"], dropped = validate()
                    watchdog.arm(f"step {index + 1}")
                    evaluated = True
                    if dropped is not None:
                        record["dropped_fraction"] = dropped
                        history["dropped_fraction"].append(dropped)
                    history["validation_step"].append(index + 1)
                    history["validation_loss"].append(record["validation_loss"])
                write(record)
                if self._stop_reason is not None and self._stop_step is None:
                    self._stop_step = index + 1
                stopping = agree(stop.requested)
                last = (index + 1 == train.steps or self._stop_reason is not None
                        or stopping)
                if checkpointer is not None and (checkpointer.due(index + 1) or last):
                    save(index + 1)
                    saved_step = index + 1
                index += 1
                if stopping:
                    interrupted = True
                    break
                if self._stop_reason is not None:
                    break
            watchdog.disarm()
            if meter_running:
                jax.block_until_ready(self.state)  # ... and closes once the work is done
        except KeyboardInterrupt:  # a second signal: stop now, keep what the run has
            interrupted = True
            tqdm.write(f"interrupted after step {state_step}: writing what the run has")
            alive = not any(getattr(a, "is_deleted", lambda: False)()
                            for a in jax.tree.leaves(self.state))
            if (checkpointer is not None and alive and state_step > first
                    and state_step != saved_step):
                save(state_step)
                saved_step = state_step
        finally:
            watchdog.close()
            stop.restore()
            for callback in callbacks:
                callback.close()
            step_energy.close()
            if checkpointer is not None:
                checkpointer.close()
            if meter_running:
                measurement = meter.stop()
                energy = measurement if metered_steps else None
        state = self.state
        flat = config.flat()
        if config.model.from_hf:  # the loaded model's shape, not the flags' defaults
            loaded = program.config
            for name, attribute in (("layers", "layers"), ("hidden", "hidden"),
                                    ("heads", "heads"), ("vocab", "vocab_size"),
                                    ("kv_heads", "kv_heads"), ("intermediate", "intermediate")):
                if name in flat and getattr(loaded, attribute, None) is not None:
                    flat[name] = getattr(loaded, attribute)
        results = {
            "config": flat,
            "mesh": str(program.mesh),
            "devices": [str(d) for d in mesh.devices.flat],
            "params": program.param_count,
            "final_validation_loss": (history["validation_loss"][-1]
                                      if history["validation_loss"] else None),
            "best_validation_loss": min(history["validation_loss"], default=None),
            "interrupted": interrupted,
            "stopped_by": stop.name if interrupted else self._stop_reason,
            "steps_done": state_step,
            "nonfinite": nonfinite,
            "median_step_seconds": float(np.median(step_seconds)) if step_seconds else None,
            "throughput": {
                "model_flops_per_token": per_token, "devices": len(devices),
                "device_kind": str(getattr(devices[0], "device_kind", devices[0].platform)),
                "peak_tflops_per_device": peak,
                "median_mfu": (None if per_token is None or peak is None or not step_seconds
                               else per_token * source.tokens_per_batch
                               / float(np.median(step_seconds)) / len(devices) / 1e12 / peak),
                "energy_source": step_energy.source,
                "power_model": None if step_energy.source == "nvml" else dataclasses.asdict(
                    step_energy.power)},
            "step_seconds": step_seconds,
            "compile_seconds": compile_seconds,
            "compiled_memory_bytes": memory["compiled"] or None,
            "wall_seconds": time.perf_counter() - start,
            "iterations_to_target": (self._stop_step if self._stop_reason == "target_loss"
                                     else None),
            "data": source.describe(),
            "history": history,
            "loss_units": "nats per token" if _text_model(config) else "MSE",
            "step": {"zero": config.step.zero, "accumulate": config.step.accumulate,
                     "clip_norm": config.step.clip_norm, "precision": config.step.precision,
                     "remat": config.step.step_remat},
            "attention": kernels,
            "model": {"name": config.model.name, **_asdict(program.config)},
        }
        if energy is not None:
            results["energy"] = {"joules": energy.joules, "metered_steps": metered_steps,
                                 "joules_per_step": energy.joules / metered_steps,
                                 "device_names": list(energy.device_names),
                                 "mean_watts": energy.mean_watts, "method": energy.method}
        if history["dropped_fraction"]:  # routed MoE blocks (GPT-2's): their shape and drops
            model_config = program.config
            count = getattr(model_config, "param_count", None)
            results["moe"] = {"moe_every": model_config.moe_every,
                              "experts": model_config.experts, "top_k": model_config.top_k,
                              "capacity_factor": model_config.capacity_factor,
                              "dtd": config.parallel.dtd,
                              "active_params": count(active=True) if count else None,
                              "final_dropped_fraction": history["dropped_fraction"][-1]}
        if step.pipeline is not None:
            results["pipeline"] = pipeline_summary(step.pipeline, program.mesh)
        if _text_model(config):
            unigram = source.unigram_cross_entropy()
            results["unigram_cross_entropy"] = unigram
            final = results["final_validation_loss"]
            results["validation_over_unigram"] = None if final is None else final / unigram
        if checkpointer is not None:
            results["checkpoints"] = {"directory": str(checkpointer.directory),
                                      "steps": checkpointer.all_steps(), "resumed_from": first}
        for callback in callbacks:
            callback.on_train_end(self, results)
        if writer:
            (out / "results.json").write_text(json.dumps(results, indent=2))
            plot(history, out / "curves.png", results)
        if train.save_hf and jax.process_index() == 0 and not interrupted:
            from jphantom import plans
            from jphantom.models import hf
            hf.save(train.save_hf, plans.dense_equivalent(step.model(state)))
        return results


def run(config: RunConfig, *, teacher=None, meter=None,
        callbacks: Sequence[Callback] = ()) -> dict:
    """Train as configured (:class:`Trainer`); returns (and writes, with ``train.out``) the
    results dictionary."""
    return Trainer(config, teacher=teacher, meter=meter, callbacks=callbacks).fit()


def _fresh_history() -> dict:
    return {"step": [], "train_loss": [], "validation_step": [], "validation_loss": [],
            "dropped_fraction": []}


# --------------------------------------------------------------------------------------------------
# Before the loop, and its helpers
# --------------------------------------------------------------------------------------------------


def check_memory(config: RunConfig, *, compiled: bool = False) -> dict:
    """The run's per-device memory estimate (:func:`jphantom.analysis.memory.check_run`); raises
    :class:`ConfigError` naming the largest term when it cannot fit, before anything is
    allocated or compiled. ``compiled``: then the compiled step's own figures
    (:func:`jphantom.analysis.memory.check_compiled`), still before anything is allocated."""
    from jphantom.analysis.memory import check_compiled, check_run

    b = config.build()
    estimate = check_run(config, b.program, b.step)
    if compiled:
        return {"estimate": estimate, "compiled": check_compiled(config, b.program, b.step)}
    return estimate


def _text_model(config: RunConfig) -> bool:
    return config.model.name != "ffn"


def attention_kernels(config: RunConfig, program, step) -> dict[str, str] | None:
    """What runs the model's attention cores on the step's devices, and why
    (:func:`jphantom.nn.attention.kernels_of`); ``None`` for a model without attention."""
    from jphantom.nn import attention
    from jphantom.precision import Precision

    family = program.config
    heads = getattr(family, "heads", None)
    if heads is None:
        return None
    head_dim = getattr(family, "dim", None) or family.hidden // heads
    policy = Precision.named(config.step.precision)
    dtype = config.model.dtype if policy.compute == "float32" else policy.compute
    return attention.kernels_of(step.model_template, step.attention, step.platform, dtype,
                                head_dim) or None


def _learning_rates(train) -> np.ndarray:
    """The learning rate of every update (``train.schedule()`` evaluated once, not per step)."""
    schedule = train.schedule()
    if not callable(schedule):
        return np.full(1, schedule)
    return np.asarray(jax.vmap(schedule)(np.arange(train.steps)))


def _restore(checkpointer, state, source):
    """``(state, step, history)`` of the newest complete checkpoint, the data reader put back
    where that checkpoint left it."""
    from jphantom.train_step import TrainState

    params, opt_state, meta = checkpointer.restore(state.params, state.opt_state)
    if hasattr(source, "restore"):  # a reader with a position: where the checkpoint left it
        if meta.get("data") is None:
            raise ConfigError(f"the checkpoint at step {meta['step']} holds no data position (it "
                              "was saved by a run on byte-level text): resume with the data "
                              "and tokenizer that saved it")
        source.restore(meta["data"])
    return TrainState(params, opt_state), meta["step"], meta["history"]


def _check_same_run(checkpointer, identity: dict) -> None:
    """``--resume`` continues the run that saved the checkpoint: the same model (a changed
    ``--hidden`` is named, not blamed on the mesh) and the same data and tokenizer."""
    try:
        meta = checkpointer.meta()
    except Exception:  # noqa: BLE001 (a damaged newest checkpoint: restore skips it, and says so)
        return
    if meta is None:
        return  # restore says there is no checkpoint
    step = meta["step"]
    saved = meta.get("model")
    if saved is not None:
        changed = [k for k in sorted(set(saved) | set(identity["model"]))
                   if saved.get(k) != identity["model"].get(k) and k != "dtype"]
        if changed:
            k = changed[0]
            raise ConfigError(f"checkpoint step {step} was saved by model {saved.get('name')} "
                              f"with {k}={saved.get(k)!r}; this run's has "
                              f"{k}={identity['model'].get(k)!r}: resume with the model flags "
                              "that saved it, or start a new --checkpoint-dir")
    corpus = meta.get("corpus")
    if corpus is not None and corpus != identity["corpus"]:
        raise ConfigError(f"checkpoint step {step} was trained on data={corpus['data']!r} "
                          f"(tokenizer {corpus['tokenizer']!r}); this run reads "
                          f"data={identity['corpus']['data']!r} (tokenizer "
                          f"{identity['corpus']['tokenizer']!r}): resume with the data that "
                          "saved it, or start a new --checkpoint-dir")


def _last_good(checkpointer) -> str:
    """Where the last good state is, for a run that stops on a non-finite loss."""
    if checkpointer is None:
        return " (no --checkpoint-dir: no state was saved)"
    checkpointer.wait()
    steps = checkpointer.all_steps()
    if not steps:
        return f" (no checkpoint in {checkpointer.directory} yet)"
    return (f"; the last good state is the checkpoint of step {max(steps)} in "
            f"{checkpointer.directory} (--resume continues from it)")


def _asdict(config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items()
            if isinstance(v, (int, float, str, bool, type(None)))}


def plot(history, path: Path, results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(history["step"], history["train_loss"], label="train", alpha=0.6)
    axes.plot(history["validation_step"], history["validation_loss"], "o-", label="validation")
    if "unigram_cross_entropy" in results:
        axes.axhline(results["unigram_cross_entropy"], color="grey", ls="--", label="unigram")
        axes.axhline(0.8 * results["unigram_cross_entropy"], color="grey", ls=":",
                     label="0.80 x unigram")
    axes.set_xlabel("step")
    axes.set_ylabel(results["loss_units"])
    config = results["config"]
    axes.set_title(f"{config['model']} / {config['strategy']} on {results['mesh']}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
