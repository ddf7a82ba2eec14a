"""The one training loop: ``jphantom train``, ``jphantom compare`` and the experiments run it.

:func:`run` takes a :class:`jphantom.config.RunConfig` (validated on construction; the program and
its step are built, nothing compiled, before any data is read) and trains: FFN runs on Seal et al.'s
teacher task, language models (GPT-2, Llama / Mixtral) on byte-level text, or on tokens (token
files, or text through a tokenizer: :class:`TokenSource`, whose reader's position is saved in
checkpoints and restored on resume). Per step it records the
loss and the step time (the first, compiling step excluded), evaluates every ``eval_every`` steps
and at the end (held-out loss; MoE models: the cross-entropy without the auxiliary losses and the
fraction of dropped token-expert assignments), stops early at ``target_loss``, saves Orbax
checkpoints, and meters energy when given a meter (its window opens after the first step and
closes after the last, both after ``jax.block_until_ready``, as Seal et al. excludes
initialisation). Into ``train.out`` (unless ``None``) it writes:

- ``metrics.jsonl``: one line per step (loss, learning rate, gradient norm, step time, tokens/s,
  model TFLOP/s per device and MFU, peak memory, energy: :mod:`jphantom.metrics`) and per
  evaluation (``validation_loss``), flushed as written (with ``tensorboard``, also TensorBoard
  events);
- ``curves.png``: training and validation loss against steps;
- ``results.json``: the configuration, final and best validation loss, the step time, the
  parameters, for text the unigram cross-entropy and the ratio (nats/token), the pipeline and the
  step options.

Runs that differ only in their seed share one compiled step (:meth:`RunConfig.build`), as the
seeds of a comparison do.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from jphantom import resilience
from jphantom.config import RunConfig, check_vocabulary, pipeline_summary
from jphantom.errors import ConfigError, TrainingDiverged
from jphantom.metrics import (StepEnergy, TensorBoard, flops_per_token, grad_norm_of,
                              peak_memory_bytes, peak_tflops)
from jphantom.resilience import (AUTO_TIMEOUT_S, MAX_CONSECUTIVE_SKIPS, StopOnSignal, Watchdog,
                                 agree)


# --------------------------------------------------------------------------------------------------
# Data sources: batches as host arrays, placed by the caller
# --------------------------------------------------------------------------------------------------


class TextSource:
    """Byte-level text (:mod:`jphantom.data.text`): batches of ``[batch, seq_len]`` tokens, a
    pure function of (seed, step)."""

    def __init__(self, config: RunConfig, seq_len: int):
        from jphantom.data.text import TextConfig, TextCorpus
        self.corpus = TextCorpus(TextConfig(path=config.train.data, seq_len=seq_len,
                                            seed=config.train.seed))
        self.batch, self.eval_batches = config.train.batch, config.train.eval_batches
        self.tokens_per_batch = config.train.batch * seq_len

    def train(self, step):
        return self.corpus.train_batch(step, self.batch)

    def validation(self):
        return self.corpus.validation_batches(self.batch, self.eval_batches)

    def unigram_cross_entropy(self):
        return self.corpus.unigram_cross_entropy()

    def describe(self):
        return self.corpus.describe()


class TokenSource:
    """Tokens (:mod:`jphantom.data.tokens`): token files (``--data`` a ``.bin`` file or a folder
    of them), or text (``--data`` a text file, or the standard library) through ``--tokenizer``.
    Batches come from a reader with an explicit position, saved in checkpoints (:meth:`state`)
    and restored on resume; ``rows``: the rows of each global batch this process reads (default
    all)."""

    def __init__(self, config: RunConfig, seq_len: int, rows: slice | None = None):
        from jphantom.data import tokens
        from jphantom.data.text import TextConfig, TextCorpus

        train = config.train
        vocab = None
        if train.tokenizer is not None:
            from jphantom.data.tokenizers import load_tokenizer
            vocab = load_tokenizer(train.tokenizer).vocab_size
        if train.data is not None and tokens.is_token_data(train.data):
            train_files, validation_files = tokens.token_files(train.data)
            arrays = [f.tokens() for f in train_files]
            held = [f.tokens() for f in validation_files]
            if not held:
                arrays, held = tokens.hold_out(arrays, TextConfig.validation_fraction)
            source = {"source": str(Path(train.data).resolve()), "files": {
                "train": [Path(f.path).name for f in train_files],
                "validation": [Path(f.path).name for f in validation_files]},
                "format": sorted({f.format for f in train_files + validation_files}),
                "validation_split": "files" if validation_files else "last tokens held out"}
        else:
            corpus = TextCorpus(TextConfig(path=train.data, seq_len=seq_len, seed=train.seed))
            first, second = tokens.tokenize_corpus(corpus, train.tokenizer,
                                                   progress=train.progress)
            arrays, held = [first], [second]
            source = {"source": corpus.describe()["source"], "split": corpus.describe()["split"]}
        source["tokenizer"] = train.tokenizer
        self.batches = tokens.TokenBatches(arrays, held, seq_len=seq_len, batch=train.batch,
                                           seed=train.seed, vocab_size=vocab, source=source)
        self.rows, self.eval_batches = rows, train.eval_batches
        self.tokens_per_batch = train.batch * seq_len
        self.batches.validation_batches(self.eval_batches)  # enough held out? (before training)

    def train(self, step):
        del step  # the reader's position says where the next batch is
        return self.batches.next_batch(self.rows)

    def validation(self):
        return self.batches.validation_batches(self.eval_batches)

    def state(self) -> dict:
        return self.batches.state()

    def restore(self, state: dict) -> None:
        self.batches.restore(state)

    def unigram_cross_entropy(self):
        return self.batches.unigram_cross_entropy()

    def describe(self):
        return self.batches.describe()


def text_source(config: RunConfig, seq_len: int, rows: slice | None = None):
    """The data of a language model: :class:`TokenSource` for token files or a tokenizer, else
    byte-level :class:`TextSource` (the default)."""
    from jphantom.data.tokens import is_token_data

    data = config.train.data
    if config.train.tokenizer is not None or (data is not None and is_token_data(data)):
        return TokenSource(config, seq_len, rows)
    return TextSource(config, seq_len)


class TeacherSource:
    """Seal et al.'s teacher task: ``[batch, width]`` inputs and the teacher's outputs; validation
    is the first ``eval_batches`` held-out batches (every one of them with a teacher given)."""

    def __init__(self, config: RunConfig, teacher=None):
        from jphantom.data import Teacher, TeacherConfig
        self.teacher = teacher or Teacher(TeacherConfig(width=config.model.width,
                                                        seed=config.train.seed),
                                          jax.numpy.dtype(config.model.dtype))
        if self.teacher.config.width != config.model.width:
            raise ConfigError(f"teacher width {self.teacher.config.width} != model width "
                              f"{config.model.width}")
        self.batch, self.eval_batches = config.train.batch, config.train.eval_batches
        self.everything = teacher is not None
        self.tokens_per_batch = config.train.batch

    def train(self, step):
        return self.teacher.train_batch(step, self.batch)

    def validation(self):
        for index, pair in enumerate(self.teacher.eval_batches(self.batch)):
            if index >= self.eval_batches and not self.everything:
                return
            yield pair

    def describe(self):
        return {"source": "Seal et al. teacher", **dataclasses.asdict(self.teacher.config)}


# --------------------------------------------------------------------------------------------------
# Built once per configuration (up to its seed)
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


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


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


def run(config: RunConfig, *, teacher=None, meter=None) -> dict:
    """Train as configured; returns (and writes, with ``train.out``) the results dictionary.
    ``teacher``: the FFN's data (default: the seed's); ``meter``: an energy meter
    (:class:`jphantom.energy.NvmlEnergyMeter`) whose window spans every step after the first."""
    train = config.train
    writer = jax.process_index() == 0 and train.out is not None  # process 0 alone writes
    out = Path(train.out) if train.out is not None else None
    start = time.perf_counter()
    check_vocabulary(config)  # the data against the model, before anything is built
    b = config.build()
    memory = check_memory(config, compiled=True)  # compiles the step, allocates nothing
    program, mesh, step = b.program, b.mesh, b.step
    rows = None  # the rows of each training batch this process reads (None: all of them)
    if _text_model(config):
        seq_len = min(getattr(program.config, "seq_len", config.model.seq_len),
                      config.model.seq_len)
        source = text_source(config, seq_len,
                             _process_rows(b.shardings[0], (train.batch, seq_len)))
        rows = getattr(source, "rows", None)
    else:
        seq_len = None
        source = TeacherSource(config, teacher)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    kernels = attention_kernels(config, program, step)
    if kernels and jax.process_index() == 0:  # the kernel choice is never silent
        print("attention: " + "; ".join(f"{name} {what}" for name, what in kernels.items()))
    state = program.init(step, seed=train.seed)
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
        """Mean validation loss (MoE: the cross-entropy without the auxiliary losses) and the
        fraction of token-expert assignments dropped; FFN: the held-out MSE weighted by rows."""
        if b.metrics is None:
            total = count = 0.0
            for pair in source.validation():
                rows = np.shape(pair[0])[0]
                total += float(b.loss(state.params, *place(pair))) * rows
                count += rows
            return total / count, None
        found = [jax.device_get(b.metrics(state.params, *place(pair)))
                 for pair in source.validation()]
        cross_entropy = float(np.mean([float(m["cross_entropy"]) for m in found]))
        if "dropped" not in found[0]:
            return cross_entropy, None
        dropped = (sum(float(m["dropped"]) for m in found)
                   / sum(float(m["assignments"]) for m in found))  # means per token: a ratio
        return cross_entropy, dropped

    def fresh_history():
        return {"step": [], "train_loss": [], "validation_step": [], "validation_loss": [],
                "dropped_fraction": []}

    history = fresh_history()
    first = 0
    initial_data = getattr(source, "state", lambda: None)()  # where a rollback to 0 restarts
    identity = {"model": {"name": config.model.name, **_asdict(program.config)},
                "corpus": {"data": train.data, "tokenizer": train.tokenizer}}
    if train.resume:  # the state, the history and the data stream's position (the step)
        _check_same_run(checkpointer, identity)
        state, first, history = _restore(checkpointer, state, source)
        if first >= train.steps:
            raise ConfigError(f"the checkpoint is at step {first}, not before steps="
                              f"{train.steps}: ask for more steps to continue")
    metrics_file = (out / "metrics.jsonl").open("a" if train.resume else "w") if writer else None
    board = TensorBoard(out / "tensorboard") if writer and train.tensorboard else None
    step_seconds, reached, metered_steps, energy = [], None, 0, None
    compile_seconds = None
    devices = list(mesh.devices.flat)
    per_token = flops_per_token(program.config, config.parallel.strategy,
                                seq_len if seq_len is not None else 1)
    peak = peak_tflops(devices[0])
    learning_rates = _learning_rates(train)
    step_energy = StepEnergy.for_devices(devices)
    data_state = getattr(source, "state", lambda: None)
    bar = tqdm(total=train.steps, initial=first, unit="step", disable=not train.progress,
               desc=f"{config.model.name} {config.parallel.strategy} {program.mesh}")
    meter_running = False
    interrupted, state_step, saved_step = False, first, None
    stop = StopOnSignal(bar.write)  # SIGTERM / Ctrl-C: finish this step, checkpoint, stop
    watchdog = Watchdog(train.step_timeout, rank=jax.process_index(),
                        processes=jax.process_count())
    nonfinite = {"policy": train.on_nonfinite, "skipped_steps": [], "rollbacks": [],
                 "skipped_batches": []}
    skip_batches, consecutive = set(), 0
    dropped_before = resilience.nonfinite_total(state.opt_state) or 0
    evaluated = False

    def write(record):
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if board is not None:
            board.write(record)

    try:
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
                bar.update()
                continue
            batch = place_train(pair)
            jax.block_until_ready(batch)  # the step's window opens on idle devices ...
            step_energy.begin()
            tick = time.perf_counter()
            state, loss = step(state, *batch)
            state_step = index + 1  # the state is this step's (still computing)
            jax.block_until_ready((state, loss))  # ... and closes once its work is done
            elapsed = time.perf_counter() - tick
            joules = step_energy.end(elapsed)
            loss = float(loss)
            if index == first:
                compile_seconds = time.perf_counter() - start
                if meter is not None and train.steps > first + 1:
                    jax.block_until_ready(state)  # the window opens on an idle device
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
                dropped = resilience.nonfinite_total(state.opt_state)
                skipped, dropped_before = dropped > dropped_before, dropped
            if not math.isfinite(loss) or skipped:
                what = (f"training loss is {loss} at step {index + 1} ({config.model.name}, "
                        f"{config.parallel.strategy}, precision {config.step.precision}, dtype "
                        f"{config.model.dtype}, learning_rate={train.learning_rate:g})")
                if train.on_nonfinite == "rollback":
                    if checkpointer is not None:
                        checkpointer.wait()
                    if checkpointer is not None and checkpointer.all_steps():
                        state, back, history = _restore(checkpointer, state, source)
                    else:  # nothing saved yet: from the start
                        state, back, history = program.init(step, seed=train.seed), 0, \
                            fresh_history()
                        if initial_data is not None:
                            source.restore(initial_data)
                    dropped_before = resilience.nonfinite_total(state.opt_state) or 0
                    nonfinite["rollbacks"].append({"at_step": index + 1, "to_step": back})
                    write({"step": index + 1, "train_loss": None, "nonfinite": True,
                           "rolled_back_to": back})
                    bar.write(f"{what}: rolled back to step {back}; its batch will be skipped")
                    skip_batches.add(index)
                    bar.n = back
                    index = back
                    continue
                if train.on_nonfinite == "skip" and skipped:
                    consecutive += 1
                    nonfinite["skipped_steps"].append(index + 1)
                    if consecutive >= MAX_CONSECUTIVE_SKIPS:
                        raise TrainingDiverged(f"{what}; {consecutive} updates in a row were "
                                               "skipped: lower the learning rate or check the "
                                               "data" + _last_good(checkpointer))
                else:
                    raise TrainingDiverged(f"{what}: lower the learning rate or check the data"
                                           + _last_good(checkpointer))
            else:
                consecutive = 0
            rate = source.tokens_per_batch / elapsed
            grad_norm = grad_norm_of(state.opt_state)
            tflops = (None if per_token is None else
                      per_token * source.tokens_per_batch / elapsed / len(devices) / 1e12)
            record = {"step": index + 1, "train_loss": loss if math.isfinite(loss) else None,
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
                if train.target_loss is not None and record["validation_loss"] <= train.target_loss:
                    reached = index + 1
            write(record)
            stopping = agree(stop.requested)
            last = index + 1 == train.steps or reached is not None or stopping
            if checkpointer is not None and (checkpointer.due(index + 1) or last):
                checkpointer.save(index + 1, state.params, state.opt_state,
                                  {"history": json.loads(json.dumps(history)), **identity},
                                  data=data_state())
                saved_step = index + 1
            bar.set_postfix(_postfix(record, history), refresh=False)
            bar.update()
            index += 1
            if stopping:
                interrupted = True
                break
            if reached is not None:
                break
        watchdog.disarm()
        if meter_running:
            jax.block_until_ready(state)  # ... and closes once the work is done
    except KeyboardInterrupt:  # a second signal: stop now, keep what the run has
        interrupted = True
        bar.write(f"interrupted after step {state_step}: writing what the run has")
        alive = not any(getattr(a, "is_deleted", lambda: False)() for a in jax.tree.leaves(state))
        if checkpointer is not None and alive and state_step > first and state_step != saved_step:
            checkpointer.save(state_step, state.params, state.opt_state,
                              {"history": json.loads(json.dumps(history)), **identity},
                              data=data_state())
            saved_step = state_step
    finally:
        watchdog.close()
        stop.restore()
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
        if board is not None:
            board.close()
        step_energy.close()
        if checkpointer is not None:
            checkpointer.close()
        if meter_running:
            measurement = meter.stop()
            energy = measurement if metered_steps else None
    flat = config.flat()
    if config.model.from_hf:  # the loaded model's shape, not the flags' defaults
        loaded = program.config
        for name, attribute in (("layers", "layers"), ("hidden", "hidden"), ("heads", "heads"),
                                ("vocab", "vocab_size"), ("kv_heads", "kv_heads"),
                                ("intermediate", "intermediate")):
            if name in flat and getattr(loaded, attribute, None) is not None:
                flat[name] = getattr(loaded, attribute)
    results = {
        "config": flat,
        "mesh": str(program.mesh),
        "devices": [str(d) for d in mesh.devices.flat],
        "params": program.param_count,
        "final_validation_loss": (history["validation_loss"][-1] if history["validation_loss"]
                                  else None),
        "best_validation_loss": min(history["validation_loss"], default=None),
        "interrupted": interrupted,
        "stopped_by": stop.name if interrupted else None,
        "steps_done": state_step,
        "nonfinite": nonfinite,
        "median_step_seconds": float(np.median(step_seconds)) if step_seconds else None,
        "throughput": {
            "model_flops_per_token": per_token, "devices": len(devices),
            "device_kind": str(getattr(devices[0], "device_kind", devices[0].platform)),
            "peak_tflops_per_device": peak,
            "median_mfu": (None if per_token is None or peak is None or not step_seconds else
                           per_token * source.tokens_per_batch / float(np.median(step_seconds))
                           / len(devices) / 1e12 / peak),
            "energy_source": step_energy.source,
            "power_model": None if step_energy.source == "nvml" else dataclasses.asdict(
                step_energy.power)},
        "step_seconds": step_seconds,
        "compile_seconds": compile_seconds,
        "compiled_memory_bytes": memory["compiled"] or None,
        "wall_seconds": time.perf_counter() - start,
        "iterations_to_target": reached,
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
        results["moe"] = {"moe_every": model_config.moe_every, "experts": model_config.experts,
                          "top_k": model_config.top_k,
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
    if writer:
        (out / "results.json").write_text(json.dumps(results, indent=2))
        plot(history, out / "curves.png", results)
    if train.save_hf and jax.process_index() == 0 and not interrupted:
        from jphantom import plans
        from jphantom.models import hf
        hf.save(train.save_hf, plans.dense_equivalent(step.model(state)))
    return results


def _process_rows(sharding, shape: tuple[int, ...]) -> slice | None:
    """With several processes: the rows of a global array of ``shape`` this process's devices
    hold under ``sharding``, when they are one contiguous block of whole rows (the reader then
    reads only those); else ``None`` (every process reads the whole batch)."""
    if jax.process_count() == 1:
        return None
    held = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if any(i.indices(n) != (0, n, 1) for i, n in zip(index[1:], shape[1:])):
            return None  # a device holds part of a row (its sequence split): read every row
        held.update(range(*index[0].indices(shape[0])))
    low, high = min(held), max(held) + 1
    return slice(low, high) if len(held) == high - low and high - low < shape[0] else None


def _learning_rates(train) -> np.ndarray:
    """The learning rate of every update (``train.schedule()`` evaluated once, not per step)."""
    schedule = train.schedule()
    if not callable(schedule):
        return np.full(1, schedule)
    return np.asarray(jax.vmap(schedule)(np.arange(train.steps)))


def _postfix(record: dict, history: dict) -> dict:
    """The progress bar's figures: loss, learning rate, gradient norm, tokens/s, MFU (where
    known) and the last validation loss."""
    loss = record["train_loss"]
    shown = {"loss": "nan" if loss is None else f"{loss:.3f}",
             "lr": f"{record['learning_rate']:.2e}"}
    if record["grad_norm"] is not None:
        shown["gnorm"] = f"{record['grad_norm']:.3g}"
    shown["tok/s"] = f"{record['tokens_per_second']:,.0f}"
    if record["mfu"] is not None:
        shown["mfu"] = f"{100 * record['mfu']:.1f}%"
    shown["val"] = (f"{history['validation_loss'][-1]:.3f}" if history["validation_loss"]
                    else "-")
    return shown


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


def median(values):
    return statistics.median(values) if values else float("nan")
