"""Generation: continue prompts with a trained, Hugging Face or user's NNX model, with a
key/value cache, prefill and decode in one compiled loop.

    from jphantom import generate, GenerationConfig
    out = generate(model, [[1, 2, 3], [4, 5]], GenerationConfig(max_new_tokens=16))
    out.completions                                     # each prompt's new token ids

One idea a module:

- :mod:`~jphantom.generation.config`: :class:`GenerationConfig`, validated.
- :mod:`~jphantom.generation.sampling`: greedy, temperature, top-k, top-p.
- :mod:`~jphantom.generation.cache`: the key/value cache swapped into a model's attention.
- :mod:`~jphantom.generation.loop`: prefill and the decode ``lax.while_loop`` in one jit.
- :mod:`~jphantom.generation.api`: :func:`generate`, prompts bucketed and padded.
"""

from jphantom.generation.api import Generation, bucket_of, check_prompts, generate
from jphantom.generation.cache import with_cache
from jphantom.generation.config import GenerationConfig

__all__ = ["generate", "Generation", "GenerationConfig", "with_cache", "bucket_of",
           "check_prompts"]
