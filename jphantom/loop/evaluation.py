"""The held-out evaluation of a training run (:class:`Evaluator`): every ``eval_every`` steps
and after the last, the mean validation loss (MoE models: the cross-entropy without the
auxiliary losses, and the fraction of token-expert assignments dropped; the FFN: the held-out
MSE weighted by rows). The step watchdog covers it, except the first, which compiles."""

from __future__ import annotations

import jax
import numpy as np


class Evaluator:
    """Evaluates ``built``'s model (:class:`jphantom.config.built.Built`: its jitted ``loss`` and
    ``metrics``) on ``source``'s validation batches, placed by ``place``."""

    def __init__(self, built, source, place, train, watchdog):
        self.built, self.source, self.place = built, source, place
        self.every, self.steps = train.eval_every, train.steps
        self.watchdog = watchdog
        self.compiled = False  # the first evaluation compiles: the watchdog does not time it

    def due(self, index: int) -> bool:
        """Whether the run evaluates after step ``index`` (0-based)."""
        return (index + 1) % self.every == 0 or index + 1 == self.steps

    def __call__(self, params, index: int) -> tuple[float, float | None]:
        """(validation loss, dropped fraction or None) after step ``index``."""
        if self.compiled:
            self.watchdog.arm(f"the evaluation after step {index + 1}")
        else:
            self.watchdog.disarm()
        found = self._evaluate(params)
        self.watchdog.arm(f"step {index + 1}")
        self.compiled = True
        return found

    def _evaluate(self, params) -> tuple[float, float | None]:
        b = self.built
        documents = getattr(self.source, "arrays", 2) == 4  # packed or padded documents
        if b.metrics is None or documents:
            total = count = 0.0
            for pair in self.source.validation():
                # each batch's loss is its mean over rows, or over the targets that count
                weight = np.count_nonzero(pair[1] >= 0) if documents else np.shape(pair[0])[0]
                total += float(b.loss(params, *self.place(pair))) * weight
                count += weight
            return total / count, None
        found = [jax.device_get(b.metrics(params, *self.place(pair)))
                 for pair in self.source.validation()]
        cross_entropy = float(np.mean([float(m["cross_entropy"]) for m in found]))
        if "dropped" not in found[0]:
            return cross_entropy, None
        dropped = (sum(float(m["dropped"]) for m in found)
                   / sum(float(m["assignments"]) for m in found))  # means per token: a ratio
        return cross_entropy, dropped
