"""The one training loop: a :class:`Trainer` whose loop calls callbacks
(:class:`jphantom.loop.callbacks.Callback`). ``jphantom train``, ``jphantom compare`` and the
experiments run it (:func:`run`).

The trainer takes a :class:`jphantom.config.RunConfig` (validated on construction; the program and
its step are built, nothing compiled, before any data is read) and trains: FFN runs on Seal et al.'s
teacher task, language models on byte-level text, or on tokens (:mod:`jphantom.loop.sources`). The
loop itself owns what the state's safety needs: the step, evaluation every ``eval_every`` steps
and at the end (held-out loss; MoE models: the cross-entropy without the auxiliary losses and the
fraction of dropped token-expert assignments), Orbax checkpoints, the energy window (opened after
the first step and closed after the last, both after ``jax.block_until_ready``, as Seal et al.
exclude initialisation), preemption, the watchdog and the non-finite policy
(:mod:`jphantom.runtime.resilience`). Everything that only observes a step is a callback, called with the
step's record (the line ``metrics.jsonl`` gets):

- :class:`jphantom.loop.callbacks.MetricsFile`: ``metrics.jsonl``, one line per step (loss, learning rate, gradient norm,
  step time, tokens/s, model TFLOP/s per device and MFU, peak memory, energy:
  :mod:`jphantom.costs.metrics`) and per evaluation (``validation_loss``), flushed as written;
- :class:`~jphantom.loop.callbacks.TensorBoardEvents` (``tensorboard``): the same records as TensorBoard events;
- :class:`~jphantom.loop.callbacks.ProgressBar` (``progress``): tqdm, with the loss, rate and last validation loss;
- :class:`~jphantom.loop.callbacks.EarlyStop` (``target_loss``): stops the run once a validation loss reaches the target.

A user adds their own (``Trainer(config, callbacks=[MyCallback()])``, docs/training.md): any of
``on_train_start(trainer)``, ``on_step_end(trainer, record)``, ``on_train_end(trainer, results)``
and ``close()``; ``trainer.request_stop(reason)`` ends the run after the current step, with a
checkpoint. :meth:`Trainer.fit` returns the run's :class:`jphantom.loop.RunResults`, read by
attribute (the configuration, final and best validation loss, the step time, the parameters,
for text the unigram cross-entropy and the ratio, the pipeline and the step options); at the
end ``train.out`` (unless ``None``) gets ``curves.png`` (training and validation loss against
steps) and ``results.json`` (:meth:`RunResults.as_dict`).

Runs that differ only in their seed share one compiled step (:meth:`RunConfig.build`), as the
seeds of a comparison do.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from jphantom.loop.callbacks import Callback, default_callbacks
from jphantom.config import Built, RunConfig, check_vocabulary, pipeline_summary
from jphantom.errors import ConfigError, TrainingDiverged
from jphantom.loop import (Evaluator, NonFinitePolicy, RolledBack, RunCheckpoints, RunResults,
                           SkippedBatch, StepClock, StepRecord, Stopping, fresh_history)
from jphantom.loop.checkpoints import nonfinite_loss
from jphantom.costs.metrics import flops_per_token, grad_norm_of
from jphantom.runtime.resilience import AUTO_TIMEOUT_S, Watchdog
from jphantom.loop.sources import TeacherSource, document_data, process_rows, text_source
from jphantom.step.finite import state_is_finite


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------


class _Batches:
    """The run's data: its ``source``, where the stream restarts on a rollback to step 0, and
    how this process's rows of a training batch are placed on the mesh."""

    def __init__(self, source, place: Callable):
        self.source, self.place = source, place
        self.initial = self.position()

    def read(self, index: int):
        """Training batch ``index`` (read even when skipped: the stream stays in step)."""
        return self.source.train(index)

    def position(self):
        """Where the stream is (None for a source without a position)."""
        return getattr(self.source, "state", lambda: None)()

    def rewind(self) -> None:
        """Back to where the run's stream began (a rollback to step 0)."""
        if self.initial is not None:
            self.source.restore(self.initial)


@dataclasses.dataclass
class _Run:
    """What :meth:`Trainer.fit` builds once, before the loop: the loop's parts, and the step
    the state is at."""

    data: _Batches
    clock: StepClock
    checkpoints: RunCheckpoints
    policy: NonFinitePolicy
    evaluator: Evaluator
    watchdog: Watchdog
    callbacks: list
    learning_rates: np.ndarray
    kernels: dict | None
    memory: dict
    state_step: int = 0  # the step the state is at (a step still computing included)


class Trainer:
    """Train ``config`` (:meth:`fit`): the loop of the module docstring. ``built``:
    :meth:`RunConfig.build`'s program, mesh and step where the caller has built them (``jphantom
    train`` has: the run builds once), else :meth:`fit` builds them; ``teacher``: the FFN's data
    (default: the seed's); ``meter``: an energy meter (:class:`jphantom.energy.NvmlEnergyMeter`)
    whose window spans every step after the first; ``callbacks``: the user's, called after the
    built-in ones.

    What callbacks can read: ``config``, ``program``, ``mesh``, ``step`` (the
    :class:`jphantom.step.train_step.TrainStep`), ``state`` (the current parameters and optimizer
    state), ``history`` (steps, training and validation losses so far), ``first_step`` (0, or
    the checkpoint's step on resume) and ``out`` (the run's folder, or None)."""

    def __init__(self, config: RunConfig, *, built: Built | None = None, teacher=None,
                 meter=None, callbacks: Sequence[Callback] = ()):
        bad = [c for c in callbacks if not isinstance(c, Callback)]
        if bad:
            raise ConfigError(f"callbacks must be jphantom.loop.callbacks.Callback instances, got "
                              f"{type(bad[0]).__name__}: subclass Callback and override its hooks")
        self.config, self.built, self.teacher, self.meter = config, built, teacher, meter
        self.user_callbacks = list(callbacks)
        self.out = Path(config.train.out) if config.train.out is not None else None
        self.program = self.mesh = self.step = self.state = None
        self.history, self.first_step = fresh_history(), 0
        self.stopping = Stopping()

    def request_stop(self, reason: str) -> None:
        """End the run after the current step (a checkpoint of it is written, as at the last
        step); ``reason`` is recorded in ``results.json`` as ``stopped_by``."""
        self.stopping.request(reason)

    def fit(self) -> RunResults:
        """Train; returns (and writes, with ``train.out``) the run's :class:`RunResults`."""
        run = self._setup()
        energy = diverged = None
        try:
            for callback in run.callbacks:
                callback.on_train_start(self)
            index, going = self.first_step, True
            while going and index < self.config.train.steps:
                if index > self.first_step:  # the whole iteration (not the first: it compiles)
                    run.watchdog.arm(f"step {index + 1}")
                index, going = self._iteration(run, index)
            run.watchdog.disarm()
            if run.clock.meter_running:
                jax.block_until_ready(self.state)  # the energy window closes on idle devices
        except KeyboardInterrupt:  # a second signal: stop now, keep what the run has
            self._interrupted_now(run)
        except TrainingDiverged as error:  # results.json still records the run, then it fails
            diverged = error
        finally:
            energy = self._close(run)
        results, diverged = self._finish(run, energy, diverged)
        if diverged is not None:
            diverged.results = results  # what the run wrote, for callers of run()
            raise diverged
        return results

    # -- before the loop -------------------------------------------------------------------------
    def _setup(self) -> _Run:
        """Build the program, step and data, check the memory, place the state (restored on
        ``--resume``) and make the loop's parts; nothing is trained."""
        config, train = self.config, self.config.train
        start = time.perf_counter()
        check_vocabulary(config)  # the data against the model, before anything is built
        documents = document_data(config)  # dataset files: read once, a bad row refused now
        b = self.built = self.built if self.built is not None else config.build()
        program, mesh, step = b.program, b.mesh, b.step
        identity = {"model": {"name": config.model.name, **_asdict(program.config)},
                    "corpus": {"data": train.data, "tokenizer": train.tokenizer}}
        checkpoints = RunCheckpoints(train, identity)
        if train.resume:  # the checkpoint's JSON against the run, before the step compiles
            checkpoints.check_same_run(step.abstract_state(), train.steps)
        memory = check_memory(config, b, compiled=True)  # compiles the step, allocates nothing
        self.program, self.mesh, self.step = program, mesh, step
        source, seq_len, place, place_train = self._data(b, documents)
        if jax.process_index() == 0 and self.out is not None:  # process 0 alone writes
            self.out.mkdir(parents=True, exist_ok=True)
        kernels = attention_kernels(config, program, step)
        if kernels and jax.process_index() == 0:  # the kernel choice is never silent
            print("attention: " + "; ".join(f"{name} {what}" for name, what in kernels.items()))
        self.state = program.init(step, seed=train.seed)
        data = _Batches(source, place_train)
        if train.resume:  # the state, the history and the data stream's position (the step)
            self.state, self.first_step, self.history = checkpoints.restore(self.state, source)
            checkpoints.check_before(self.first_step, train.steps)  # an older one restored
        per_token = flops_per_token(program.config, config.parallel.strategy,
                                    seq_len if seq_len is not None else 1)
        watchdog = Watchdog(train.step_timeout, rank=jax.process_index(),
                            processes=jax.process_count())
        run = _Run(
            data=data, clock=StepClock(list(mesh.devices.flat), per_token, self.meter, start),
            checkpoints=checkpoints, policy=NonFinitePolicy(config, self.state.opt_state),
            evaluator=Evaluator(b, source, place, train, watchdog), watchdog=watchdog,
            callbacks=default_callbacks(config) + self.user_callbacks,
            learning_rates=_learning_rates(train), kernels=kernels, memory=memory,
            state_step=self.first_step)
        self.stopping.listen()  # SIGTERM / Ctrl-C: finish this step, save, stop
        return run

    def _data(self, b, documents):
        """The data source (of ``documents``, the run's dataset files read by :meth:`_setup`,
        where it has them), the sequence length (None for the FFN), and how a batch is placed
        on the mesh: whole (validation) and this process's rows of the global batch (training)."""
        config, train = self.config, self.config.train
        rows = None  # the rows of each training batch this process reads (None: all of them)
        if _text_model(config):
            seq_len = min(getattr(b.program.config, "seq_len", config.model.seq_len),
                          config.model.seq_len)
            source = text_source(config, seq_len,
                                 process_rows(b.shardings[0], (train.batch, seq_len)), documents)
            rows = getattr(source, "rows", None)
        else:
            seq_len = None
            source = TeacherSource(config, self.teacher)
        # the batch arrays' shardings: (tokens, targets), or a document source's four
        shardings = b.step.batch_shardings(getattr(source, "arrays", len(b.shardings)))
        place = lambda pair: tuple(jax.device_put(np.asarray(a), s)
                                   for a, s in zip(pair, shardings))
        if rows is None:
            return source, seq_len, place, place
        place_train = lambda pair: tuple(  # this process's rows of the global batch
            jax.make_array_from_process_local_data(s, np.asarray(a),
                                                   (train.batch, *np.shape(a)[1:]))
            for a, s in zip(pair, shardings))
        return source, seq_len, place, place_train

    # -- one iteration ---------------------------------------------------------------------------
    def _iteration(self, run: _Run, index: int) -> tuple[int, bool]:
        """Step ``index`` (0-based): the batch, the update, the non-finite policy, the record,
        the evaluation, the checkpoint. Returns the next index and whether to go on."""
        pair = run.data.read(index)
        if run.policy.skips_batch(index):  # the batch that gave a rolled-back non-finite loss
            self._emit(run, SkippedBatch(index + 1))
            return index + 1, True
        loss, elapsed, joules, skipped = self._update(run, index, pair)
        if skipped:  # nothing to count (a global weight of 0): no update
            run.policy.nothing_counted(index)
            self._emit(run, SkippedBatch(index + 1, reason="nothing to count"))
            return self._end_of_step(run, index)
        finite = (not run.policy.checks_state) or bool(state_is_finite(self.state))
        verdict = run.policy.judge(index, loss, self.state.opt_state,
                                   run.checkpoints.last_good, finite)
        if verdict == "rollback":
            return self._roll_back(run, index, loss, finite), True
        if verdict == "warned":
            tqdm.write(run.policy.warning(index, loss))
        record = self._record(run, index, loss, elapsed, joules, verdict == "skipped")
        if run.evaluator.due(index):
            self._evaluate(run, index, record)
        self._emit(run, record)
        return self._end_of_step(run, index)

    def _update(self, run: _Run, index: int, pair) -> tuple[float, float, float | None, bool]:
        """Train on ``pair``: (loss, seconds, joules, whether the batch was skipped for want of
        tokens). The step's window opens on idle devices and closes once its work is done; the
        first step compiles and is not timed."""
        batch = run.data.place(pair)
        jax.block_until_ready(batch)
        run.clock.begin()
        self.state, out = self.step.run(self.state, *batch)
        run.state_step = index + 1  # the state is this step's (still computing)
        jax.block_until_ready((self.state, out.loss))
        elapsed, joules = run.clock.end()
        if index == self.first_step:
            run.clock.compiled(self.state, more=self.config.train.steps > self.first_step + 1)
        else:
            run.clock.timed(elapsed)
            seconds = run.clock.step_seconds
            if self.config.train.step_timeout is None and jax.process_count() > 1 and len(
                    seconds) >= 2 and run.watchdog.timeout is None:
                # several processes: an automatic limit once compiled
                run.watchdog.set_timeout(max(AUTO_TIMEOUT_S, 50 * max(seconds)))
        return float(out.loss), elapsed, joules, out.skipped

    def _roll_back(self, run: _Run, index: int, loss: float, finite: bool) -> int:
        """The rollback policy: the state, history and data position of the newest checkpoint
        whose recorded losses and parameters are finite (or the start's); returns the step to go
        on from."""
        run.policy.rolling_back(index, loss, finite, run.checkpoints.last_good)
        found = None
        for step in run.checkpoints.good_steps():  # newest first, their recorded losses finite
            found = run.checkpoints.restore(self.state, run.data.source, step)
            if bool(state_is_finite(found[0])):
                break
            found = None  # a non-finite checkpoint (an older run's): an older one
        if found is not None:
            self.state, back, restored = found
            where = (f"the checkpoint of step {back} in {run.checkpoints.checkpointer.directory} "
                     "(the newest whose recorded loss and parameters are finite)")
        else:  # nothing finite saved yet: from the start
            self.state, back, restored = self.program.init(
                self.step, seed=self.config.train.seed), 0, fresh_history()
            run.data.rewind()
            where = "the start, step 0 (no checkpoint's recorded loss and parameters are finite)"
        dropped = run.checkpoints.drop_after(back) if run.checkpoints else []
        if dropped:  # the run writes these steps again
            where += (f"; deleted the newer checkpoint(s) of step(s) "
                      f"{', '.join(map(str, dropped))}, whose loss or parameters are not finite")
        self.history.clear()
        self.history.update(restored)
        run.policy.rolled_back(index, back, self.state.opt_state)
        tqdm.write(f"{run.policy.describe(index, loss, finite)}: rolled back to {where}; "
                   "its batch will be skipped")
        self._emit(run, RolledBack(index + 1, back))
        return back

    def _record(self, run: _Run, index: int, loss: float, elapsed: float,
                joules: float | None, skipped: bool) -> StepRecord:
        """The step's record; the history gets the steps that updated the model."""
        grad_norm = grad_norm_of(self.state.opt_state)
        rates = run.learning_rates
        record = StepRecord(
            step=index + 1, train_loss=loss if math.isfinite(loss) else None,
            learning_rate=float(rates[min(index, len(rates) - 1)]),
            grad_norm=None if grad_norm is None else float(grad_norm),
            **run.clock.measures(elapsed, joules, run.data.source.tokens_per_batch))
        if self.config.train.on_nonfinite in ("skip", "rollback"):
            record.update_skipped = skipped
            if skipped:  # the optimizer's state (and its recorded norm) did not move
                record.grad_norm = None
        if index == self.first_step:
            record.compiled = True  # this step's time includes compiling it
        if not skipped:
            self.history["step"].append(index + 1)
            self.history["train_loss"].append(loss)
        return record

    def _evaluate(self, run: _Run, index: int, record: StepRecord) -> None:
        record.validation_loss, dropped = run.evaluator(self.state.params, index)
        if dropped is not None:
            record.dropped_fraction = dropped
            self.history["dropped_fraction"].append(dropped)
        self.history["validation_step"].append(index + 1)
        self.history["validation_loss"].append(record.validation_loss)

    def _emit(self, run: _Run, record) -> None:
        """Every callback's ``on_step_end`` with the record as a dictionary."""
        found = record.as_dict()
        for callback in run.callbacks:
            callback.on_step_end(self, found)

    def _end_of_step(self, run: _Run, index: int) -> tuple[int, bool]:
        """Stop requests (a callback's, a signal's: every process agrees) and the checkpoint."""
        stops, _ = self.stopping.after(index + 1)
        last = stops or index + 1 == self.config.train.steps
        if run.checkpoints and (run.checkpoints.due(index + 1) or last):
            self._save(run, index + 1)
        return index + 1, not stops

    def _save(self, run: _Run, at: int) -> None:
        """The checkpoint of step ``at``, written only from a finite state whose recorded
        losses are finite (the state a rollback or ``--resume`` may go back to)."""
        if not bool(state_is_finite(self.state)):
            tqdm.write(f"not writing the checkpoint of step {at}: its parameters or optimizer "
                       "state are not finite")
            return
        loss = nonfinite_loss(self.history)
        if loss is not None:
            tqdm.write(f"not writing the checkpoint of step {at}: its {loss}")
            return
        run.checkpoints.save(at, self.state, self.history, run.data.position())
        run.policy.saved()

    # -- after the loop --------------------------------------------------------------------------
    def _interrupted_now(self, run: _Run) -> None:
        """A second signal: the state reached is saved if it is whole and not saved yet."""
        self.stopping.interrupted = True
        tqdm.write(f"interrupted after step {run.state_step}: writing what the run has")
        alive = not any(getattr(a, "is_deleted", lambda: False)()
                        for a in jax.tree.leaves(self.state))
        if (run.checkpoints and alive and run.state_step > self.first_step
                and run.state_step != run.checkpoints.saved_step):
            self._save(run, run.state_step)

    def _close(self, run: _Run):
        """Close what the loop opened; the metered energy (None without a meter)."""
        run.watchdog.close()
        self.stopping.close()
        for callback in run.callbacks:
            callback.close()
        run.checkpoints.close()
        return run.clock.close()

    def _finish(self, run: _Run, energy,
                diverged=None) -> tuple[RunResults, TrainingDiverged | None]:
        """:class:`RunResults` to the callbacks and ``results.json``; the Hugging Face copy
        (not of a diverged run). Returns the results and how the run diverged: ``diverged``,
        or the end's non-finite state or final loss (:func:`_ended_nonfinite`), which
        ``results.json`` records as the run prints it."""
        alive = self.state is not None and not any(
            getattr(a, "is_deleted", lambda: False)() for a in jax.tree.leaves(self.state))
        nonfinite = run.policy.record()
        nonfinite["final_state_finite"] = bool(state_is_finite(self.state)) if alive else None
        final = self.history["validation_loss"][-1] if self.history["validation_loss"] else None
        if diverged is None:  # the run ends well but for its final state or loss: it fails too
            diverged = _ended_nonfinite(final, run.state_step, nonfinite,
                                        self.config.train.on_nonfinite)
        nonfinite["diverged"] = None if diverged is None else str(diverged)
        results = self._results(run, energy, nonfinite)
        for callback in run.callbacks:
            callback.on_train_end(self, results)
        if jax.process_index() == 0 and self.out is not None:
            (self.out / "results.json").write_text(json.dumps(results.as_dict(), indent=2))
            plot(self.history, self.out / "curves.png", results)
        train, source = self.config.train, run.data.source
        if (train.save_hf and jax.process_index() == 0 and not self.stopping.interrupted
                and diverged is None and nonfinite["final_state_finite"]):
            from jphantom import plans
            from jphantom.models import hf
            hf.save(train.save_hf, plans.dense_equivalent(self.step.model(self.state)))
            if hasattr(source, "save_tokenizer"):  # the tokenizer and chat template too
                source.save_tokenizer(train.save_hf)
        return results, diverged

    def _results(self, run: _Run, energy, nonfinite: dict) -> RunResults:
        config, program, history, source = self.config, self.program, self.history, run.data.source
        flat = config.flat()
        if config.model.from_hf:  # the loaded model's shape, not the flags' defaults
            for name, attribute in (("layers", "layers"), ("hidden", "hidden"),
                                    ("heads", "heads"), ("vocab", "vocab_size"),
                                    ("kv_heads", "kv_heads"), ("intermediate", "intermediate")):
                if name in flat and getattr(program.config, attribute, None) is not None:
                    flat[name] = getattr(program.config, attribute)
        final = history["validation_loss"][-1] if history["validation_loss"] else None
        return RunResults(
            config=flat, mesh=str(program.mesh), devices=[str(d) for d in run.clock.devices],
            params=program.param_count, final_validation_loss=final,
            best_validation_loss=min(history["validation_loss"], default=None),
            interrupted=self.stopping.interrupted, stopped_by=self.stopping.stopped_by(),
            steps_done=run.state_step, nonfinite=nonfinite,
            compiled_memory_bytes=run.memory["compiled"] or None,
            iterations_to_target=self.stopping.iterations_to_target(),
            data=source.describe(), history=history,
            loss_units="nats per token" if _text_model(config) else "MSE",
            step={"zero": config.step.zero, "accumulate": config.step.accumulate,
                  "clip_norm": config.step.clip_norm, "precision": config.step.precision,
                  "master_weights": config.step.master_weights, "remat": config.step.step_remat},
            attention=run.kernels, model={"name": config.model.name, **_asdict(program.config)},
            checkpoints=run.checkpoints.describe(self.first_step),
            **run.clock.results(energy, source.tokens_per_batch),
            **self._where_they_apply(source, final))

    def _where_they_apply(self, source, final: float | None) -> dict:
        """The results that only some runs have, beside the metered energy: routed MoE blocks'
        shape and drops, the pipeline, a text run's unigram baseline."""
        config, program, history, found = self.config, self.program, self.history, {}
        if history["dropped_fraction"]:  # routed MoE blocks (GPT-2's): their shape and drops
            model_config = program.config
            count = getattr(model_config, "param_count", None)
            found["moe"] = {"moe_every": model_config.moe_every, "experts": model_config.experts,
                            "top_k": model_config.top_k,
                            "capacity_factor": model_config.capacity_factor,
                            "dtd": config.parallel.dtd,
                            "active_params": count(active=True) if count else None,
                            "final_dropped_fraction": history["dropped_fraction"][-1]}
        if self.step.pipeline is not None:
            found["pipeline"] = pipeline_summary(self.step.pipeline, program.mesh)
        if _text_model(config):
            found["unigram_cross_entropy"] = unigram = source.unigram_cross_entropy()
            found["validation_over_unigram"] = None if final is None else final / unigram
        return found


def _ended_nonfinite(final: float | None, steps: int, nonfinite: dict,
                     policy: str) -> TrainingDiverged | None:
    """A run that ended with a non-finite state or final validation loss (``final``) fails,
    saying so (with what ``--on-nonfinite`` did on the way, ``nonfinite``)."""
    from jphantom.loop.nonfinite import summary

    if nonfinite["final_state_finite"] is False:
        what = f"the parameters or optimizer state are not finite after step {steps}"
    elif final is not None and not math.isfinite(final):
        what = f"the final validation loss is {final} after step {steps}"
    else:
        return None
    done = summary(nonfinite, steps)
    return TrainingDiverged(f"{what} (--on-nonfinite {policy}"
                            + (f"; {done}" if done else "") + "): lower the learning rate or "
                            "check the data; results.json records the run")


def run(config: RunConfig, *, built: Built | None = None, teacher=None, meter=None,
        callbacks: Sequence[Callback] = ()) -> RunResults:
    """Train as configured (:class:`Trainer`); returns (and writes, with ``train.out``) the
    run's :class:`RunResults`."""
    return Trainer(config, built=built, teacher=teacher, meter=meter,
                   callbacks=callbacks).fit()


def check_memory(config: RunConfig, built: Built, *, compiled: bool = False) -> dict:
    """The run's per-device memory estimate (:func:`jphantom.analysis.memory.check_run`); raises
    :class:`ConfigError` naming the largest term when it cannot fit, before anything is
    allocated or compiled. ``built``: what :meth:`RunConfig.build` built of ``config``.
    ``compiled``: then the compiled step's own figures
    (:func:`jphantom.analysis.memory.check_compiled`), still before anything is allocated."""
    from jphantom.analysis.memory import check_compiled, check_run

    estimate = check_run(config, built.program, built.step)
    if compiled:
        return {"estimate": estimate,
                "compiled": check_compiled(config, built.program, built.step)}
    return estimate


def _text_model(config: RunConfig) -> bool:
    return config.model.family.is_language_model


def attention_kernels(config: RunConfig, program, step) -> dict[str, str] | None:
    """What runs the model's attention cores on the step's devices, and why
    (:func:`jphantom.nn.attention.kernels_of`); ``None`` for a model without attention."""
    from jphantom.nn import attention
    from jphantom.step.precision import Precision

    family = program.config
    heads = getattr(family, "heads", None)
    if heads is None:
        return None
    head_dim = getattr(family, "dim", None) or family.hidden // heads
    policy = Precision.named(config.step.precision)
    dtype = config.model.dtype if policy.compute == "float32" else policy.compute
    from jphantom.data.dataset_files import is_dataset_data

    return attention.kernels_of(step.model_template, step.attention, step.platform, dtype,
                                head_dim, packed=is_dataset_data(config.train.data)) or None


def _learning_rates(train) -> np.ndarray:
    """The learning rate of every update (``train.schedule()`` evaluated once, not per step)."""
    schedule = train.schedule()
    if not callable(schedule):
        return np.full(1, schedule)
    return np.asarray(jax.jit(jax.vmap(schedule))(np.arange(train.steps)))  # one program


def _asdict(config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items()
            if isinstance(v, (int, float, str, bool, type(None)))}


def plot(history, path: Path, results: RunResults) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(history["step"], history["train_loss"], label="train", alpha=0.6)
    axes.plot(history["validation_step"], history["validation_loss"], "o-", label="validation")
    unigram = results.unigram_cross_entropy
    if unigram is not None:
        axes.axhline(unigram, color="grey", ls="--", label="unigram")
        axes.axhline(0.8 * unigram, color="grey", ls=":", label="0.80 x unigram")
    axes.set_xlabel("step")
    axes.set_ylabel(results.loss_units)
    config = results.config
    axes.set_title(f"{config['model']} / {config['strategy']} on {results.mesh}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
