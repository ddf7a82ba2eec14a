"""Mistral (Jiang et al. 2023, Hugging Face's ``MistralForCausalLM``): the Llama block with
sliding-window attention, each token attending itself and the ``sliding_window`` - 1 tokens
before it (the model of :mod:`jphantom.models.llama` with ``sliding_window``). A window shorter
than the sequence changes the result; on GPUs it runs on cuDNN's fused kernel, under all-gather
context attention as a position mask, and ring attention refuses it by name.

    jphantom train --model mistral --sliding-window 64 --seq-len 256 ...
"""

from jphantom.models.llama import register_variant

FAMILY = register_variant(
    "mistral", "Mistral: Llama blocks with sliding-window attention (--sliding-window)",
    ("mistral",), flags=("sliding_window",), sliding_window=lambda s: s.sliding_window,
    hf_type="mistral")
