"""What a compiled step keeps for its backward, per layer: the arrays a loop of the optimised
program carries with one entry per layer, per sequence and per token.

Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
count the bytes a layer's forward stores for its backward (their Eq. 1-2: 34 s b h / t under
tensor + sequence parallelism with a fused attention kernel). The peak of a step's temporaries
is a different quantity: it may sit where the backward's gradients are being written or
reduced, and then grows with the layers by what those buffers hold, not by the activations. The
stored activations themselves are visible in the optimised HLO: jphantom's layers run under
``lax.scan``, so the forward loop's result tuple holds each saved tensor stacked over the layers
([L, b, s, ...]); a pipeline's executor carries its stash slots ([slots, layers, b, s, ...]),
which are all there is to see where a chunk's layers run unrolled (no layer loop).
:func:`saved_residuals` finds, among the arrays the program's ``while`` loops return, those whose
dimensions begin with (layers, rows, tokens), or hold them after one leading dimension (a stash's
slots), and sums one set of them for the loop that returns the most
(loops nested in it pass the same buffers through); and how many sets of them the program holds
at most (a pipeline's stash slots)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from jphantom.analysis.hlo.text import nbytes, parse_module, parse_shapes


def _position(dims: tuple[int, ...], layers: int, rows: int, tokens: set[int]) -> int:
    """Where ``dims`` holds ``layers``, ``rows`` and one of ``tokens`` consecutively (-1: not)."""
    return next((i for i in range(len(dims) - 2)
                 if dims[i:i + 2] == (layers, rows) and dims[i + 2] in tokens), -1)


_FLOATING = re.compile(r"(bf|f)\d+")


def saved_residuals(hlo_text: str, *, layers: int, rows: int, tokens: Iterable[int]) -> dict:
    """The arrays stored per layer for the backward (module docstring) in ``hlo_text``: those a
    ``while`` returns whose dimensions hold ``layers`` (the layers the loop's program runs on
    this device), ``rows`` (sequences per pass) and one of ``tokens`` (a sequence's tokens as a
    layer splits them: S, S/t, S/c) in turn; for the loop returning the most. ``{"bytes",
    "shapes", "copies"}``: ``copies``, the most sets of a stored array any array of the program
    holds ([slots, *stored shape]: a pipeline stash's slots; 1 elsewhere)."""
    tokens = set(tokens)
    best, arrays, stored = {"bytes": 0, "shapes": [], "copies": 1}, set(), set()
    for computation in parse_module(hlo_text).values():
        for instr in computation.instructions:
            shapes = parse_shapes(instr.type_text)
            arrays.update(tuple(dims) for _, dims in shapes)
            if instr.opcode != "while":
                continue
            kept = []
            for dtype, dims in shapes:  # stacked over the layers, or [slots, layers, ...]
                if not _FLOATING.match(dtype):  # token ids a loop carries are no residual
                    continue
                at = _position(tuple(dims), layers, rows, tokens)
                if at in (0, 1):
                    kept.append((dtype, tuple(dims[at:])))
            if nbytes(kept) > best["bytes"]:
                best.update(bytes=nbytes(kept),
                            shapes=[f"{d}[{','.join(map(str, s))}]" for d, s in kept])
                stored = {tuple(dims) for _, dims in kept}
    for dims in arrays:  # an array of whole sets of stored ones: [slots, *stored shape]
        for at in range(1, len(dims)):
            if dims[at:] in stored:
                best["copies"] = max(best["copies"], math.prod(dims[:at]))
    return best


__all__ = ["saved_residuals"]
