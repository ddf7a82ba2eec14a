"""Nested parameter dicts (``nnx.to_pure_dict``'s, a checkpoint's) addressed by key paths: what
the Hugging Face and dense mappings of GPT-2 and Llama read and write."""

from __future__ import annotations


def get_path(tree, path):
    """``tree[path[0]][path[1]]...``."""
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree, path, value) -> None:
    """``tree[path[0]]...[path[-1]] = value``, creating the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
