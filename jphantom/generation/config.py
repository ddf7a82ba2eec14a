"""What :func:`jphantom.generate` is asked for: :class:`GenerationConfig`, one validated frozen
dataclass (sampling, stop tokens, lengths), each bad value a :class:`~jphantom.errors.ConfigError`
that names it and the fix."""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError, check_int, check_real


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to continue each prompt.

    ``max_new_tokens``: tokens generated per prompt at most (the cache holds the prompt's bucket
    and these). ``temperature`` 0 (the default) is greedy decoding (argmax); above 0 the
    next token is sampled from ``softmax(logits / temperature)`` restricted to the ``top_k``
    most probable tokens (0: all) and then to the smallest set whose probability reaches
    ``top_p`` (1.0: all), in that order (transformers' order of its logits warpers), with
    ``jax.random`` keys from ``seed``. ``stop_tokens``: ids that end a sequence (the stop token
    is kept in its output; the sequence then stops growing). ``return_logits``: also return each
    step's logits [B, max_new_tokens, V] (float32). ``bucket``: prompts are right-padded to
    the next multiple of ``bucket`` tokens at least (rounded up to a power of two times it), so a
    few prompt lengths share one compiled program."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    return_logits: bool = False
    bucket: int = 16

    def __post_init__(self):
        check_int("max_new_tokens", self.max_new_tokens,
                  fix="ask for at least one new token (GenerationConfig(max_new_tokens=32))")
        check_real("temperature", self.temperature,
                   fix="0 for greedy decoding, or a positive temperature such as 0.7")
        check_int("top_k", self.top_k, minimum=0, fix="0 keeps every token")
        check_real("top_p", self.top_p, low=0.0, high=1.0, low_inclusive=False,
                   fix="1.0 keeps every token; 0.9 keeps the smallest set holding 90%")
        check_int("seed", self.seed, minimum=0, fix="a non-negative integer")
        check_int("bucket", self.bucket, fix="16 pads prompts to 16, 32, 64, ... tokens")
        if not isinstance(self.return_logits, bool):
            raise ConfigError(f"return_logits={self.return_logits!r} must be True or False")
        stops = self.stop_tokens
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (tuple, list)):
            raise ConfigError(f"stop_tokens={stops!r} must be a tuple of token ids, e.g. "
                              "stop_tokens=(2,)")
        for token in stops:
            check_int("stop_tokens", token, minimum=0, fix="give token ids (integers >= 0)")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in stops))

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (``temperature`` 0)."""
        return self.temperature == 0.0
