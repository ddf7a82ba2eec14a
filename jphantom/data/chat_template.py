"""Chat templates: a checkpoint's Jinja template rendered as Hugging Face transformers renders it,
with the character spans of its ``{% generation %}`` blocks.

A chat model's checkpoint carries its template: ``chat_template.jinja`` (what transformers >= 4.5x
saves) or the ``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}`` of which ``default`` is taken), the file taking precedence as in
transformers; :func:`load_chat_template` reads either from a folder, or a template file given by
``--chat-template FILE`` (a ``.jinja`` file, or a ``tokenizer_config.json``).

:class:`ChatTemplate` compiles it the way transformers' ``chat_template_utils`` does: jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML (``json.dumps`` with
``ensure_ascii=False``), the globals ``raise_exception`` and ``strftime_now``, and the
``{% generation %}...{% endgeneration %}`` block tag. The template sees ``messages`` (keys whose
value is None dropped; a message's ``reasoning_content``, ``thinking`` or ``reasoning`` also
under the first two names), ``tools``, ``documents``, ``add_generation_prompt`` and the
checkpoint's named special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``,
``pad_token``, ``cls_token``, ``mask_token`` from ``tokenizer_config.json``), as
``apply_chat_template`` passes them.

A generation block marks an assistant turn: while rendering, the block records where its text
starts and ends in the output, counted as transformers counts them (the length of what the
template has yielded so far), and :meth:`ChatTemplate.render` returns those spans beside the text.
:func:`token_mask` turns spans into a per-token mask from the tokenizer's character offsets:
a token is masked when it overlaps a span, transformers' ``return_assistant_tokens_mask`` rule.
For a template without generation blocks, :meth:`ChatTemplate.assistant_spans` finds each
assistant turn by rendering prefixes: the conversation up to the turn with the generation prompt,
then through the turn; the turn's span is what the second adds to the first, and the whole
rendering must start with both (else the template rewrites earlier turns, as Qwen3's drops
earlier reasoning, and the turn cannot be located: a ConfigError naming the template).
jinja2 is the ``data`` extra (``pip install 'jphantom[data]'``).
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

from jphantom.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ConfigError("chat templates need jinja2: pip install 'jphantom[data]' (or "
                          "jinja2)") from None
    return jinja2


def _environment(jinja2):
    """A sandboxed environment configured as transformers configures its own."""

    class GenerationBlocks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and, while a recorder
        is set, records the body's (start, end) in the output rendered so far."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.recorder = None  # (blocks yielded so far, spans) during a recorded render
            environment.extend(generation_blocks=self)

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body
                                          ).set_lineno(line)

        def _record(self, caller):
            text = caller()
            if self.recorder is not None:
                blocks, spans = self.recorder
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


class ChatTemplate:
    """A compiled chat template (module docstring). ``source``: the Jinja text; ``special``: the
    named special tokens it sees (``{"eos_token": "<|im_end|>", ...}``); ``name``: where it came
    from, for messages."""

    def __init__(self, source: str, special: dict | None = None, name: str = "chat template"):
        jinja2 = _jinja()
        if not source.strip():
            raise ConfigError(f"chat template {name!r} is empty: give its Jinja text (a .jinja "
                              "file, or a tokenizer_config.json's 'chat_template')")
        self.source, self.name = source, name
        self.special = dict(special or {})
        self.has_generation = bool(GENERATION_TAG.search(source))
        self._environment = _environment(jinja2)
        try:
            self._template = self._environment.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ConfigError(f"{name} is not a Jinja template ({error.message}, line "
                              f"{error.lineno})") from None
        self._error = jinja2.exceptions.TemplateError

    def render(self, messages, *, add_generation_prompt: bool = False, tools=None,
               documents=None, **kwargs) -> tuple[str, list[tuple[int, int]]]:
        """(text, spans): the conversation rendered, and the (start, end) characters of each
        ``{% generation %}`` block in it (none without such blocks)."""
        variables = {**self.special, **kwargs, "messages": normalize_messages(messages),
                     "tools": tools, "documents": documents,
                     "add_generation_prompt": add_generation_prompt}
        blocks, spans = [], []
        tracker = self._environment.generation_blocks
        tracker.recorder = (blocks, spans)
        try:
            for block in self._template.generate(**variables):
                blocks.append(block)
        except self._error as error:  # raise_exception, an undefined name, the sandbox
            raise ConfigError(f"{self.name}{_line_of(error)} refused the conversation: "
                              f"{_first_line(error)}") from None
        except Exception as error:  # Python's own inside the template: a TypeError on a value
            raise ConfigError(f"{self.name}{_line_of(error)} failed on the conversation: "
                              f"{type(error).__name__}: {_first_line(error)}") from None
        finally:
            tracker.recorder = None
        return "".join(blocks), spans

    def assistant_spans(self, messages, **kwargs) -> tuple[str, list[tuple[int, int]]]:
        """(text, spans of the assistant turns): the generation blocks' spans, or, for a template
        without them, each assistant turn found by rendering prefixes (module docstring)."""
        text, spans = self.render(messages, **kwargs)
        if self.has_generation:
            return text, spans
        spans = []
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before, _ = self.render(messages[:index], add_generation_prompt=True, **kwargs)
            through, _ = self.render(messages[:index + 1], **kwargs)
            if not (text.startswith(through) and through.startswith(before)):
                raise ConfigError(
                    f"{self.name} has no {{% generation %}} block and renders a conversation's "
                    f"start differently from the whole (message {index}), so its assistant "
                    "turns cannot be found: give a template with {% generation %} blocks "
                    "(--chat-template FILE) or use --loss-on all")
            spans.append((len(before), len(through)))
        return text, spans


def _line_of(error: Exception) -> str:
    """`` (line N)``: the template line ``error`` was raised at (jinja2 rewrites tracebacks so
    that a template's frames read ``<template>``), else nothing."""
    traceback, line = error.__traceback__, None
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return "" if line is None else f" (line {line})"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def normalize_messages(messages) -> list[dict]:
    """The messages as transformers hands them to a template: keys whose value is None dropped,
    a reasoning text (``reasoning_content``, ``thinking`` or ``reasoning``) under
    ``reasoning_content`` and ``thinking`` both."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def token_mask(offsets, spans) -> list[int]:
    """1 for each token (``offsets``: its (start, end) characters) that overlaps a span, else 0:
    transformers' ``return_assistant_tokens_mask`` rule."""
    mask, span = [0] * len(offsets), 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[index] = 1
    return mask


def special_tokens(config: dict) -> dict:
    """The named special tokens of a ``tokenizer_config.json`` (strings, or AddedToken objects
    saved as ``{"content": ...}``)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _template_of_config(config: dict, where: str) -> str | None:
    found = config.get("chat_template")
    if isinstance(found, list):  # transformers' legacy form of several named templates
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
        if found is None:
            raise ConfigError(f"{where} holds chat templates {sorted(named)} but none named "
                              "'default': give one with --chat-template FILE")
    return found if isinstance(found, str) else None


def read_tokenizer_config(folder: str | os.PathLike) -> dict:
    """``folder``'s ``tokenizer_config.json`` ({} when there is none)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{str(path)!r} cannot be read as JSON ({error})") from None


def load_chat_template(source: str | os.PathLike, special: dict | None = None
                       ) -> ChatTemplate | None:
    """The chat template of ``source``: a checkpoint folder (its ``chat_template.jinja``, else its
    ``tokenizer_config.json``'s ``chat_template``; None when it has neither), or a template file
    (a ``.json`` file is read as a ``tokenizer_config.json``). The special tokens are the
    folder's (or the file's folder's) ``tokenizer_config.json``'s, updated by ``special``."""
    path = Path(source)
    folder = path if path.is_dir() else path.parent
    config = read_tokenizer_config(folder)
    tokens = {**special_tokens(config), **(special or {})}
    if path.is_dir():
        if (path / TEMPLATE_FILE).is_file():
            return ChatTemplate((path / TEMPLATE_FILE).read_text(encoding="utf-8-sig"), tokens,
                                str(path / TEMPLATE_FILE))
        text = _template_of_config(config, str(path / CONFIG_FILE))
        return None if text is None else ChatTemplate(text, tokens, str(path / CONFIG_FILE))
    if not path.is_file():
        raise ConfigError(f"chat_template={str(source)!r} does not exist: give a .jinja file, a "
                          "tokenizer_config.json or a checkpoint folder")
    if path.suffix == ".json":
        try:
            own = json.loads(path.read_text(encoding="utf-8-sig"))
        except json.JSONDecodeError as error:
            raise ConfigError(f"chat_template={str(source)!r} is not JSON ({error.msg})") from None
        text = _template_of_config(own, str(path))
        if text is None:
            raise ConfigError(f"chat_template={str(source)!r} has no 'chat_template' entry")
        return ChatTemplate(text, {**tokens, **special_tokens(own)}, str(path))
    return ChatTemplate(path.read_text(encoding="utf-8-sig"), tokens, str(path))


def tokenizer_and_template(value: str, from_hf: str | None = None,
                           chat_template: str | None = None):
    """``(tokenizer, template or None, special tokens)`` as ``train`` picks them: the tokenizer
    ``value`` names; the special tokens and chat template of the first of ``from_hf``, ``value``
    (a folder) or ``value``'s folder (a file) that has them, unless ``chat_template`` names one."""
    from jphantom.data.tokenizers import load_tokenizer

    loaded = load_tokenizer(value)
    folders = [f for f in (from_hf, value) if f and Path(f).is_dir()]
    if Path(value).is_file():
        folders.append(str(Path(value).parent))
    special = next((special_tokens(c) for c in map(read_tokenizer_config, folders) if c), {})
    template = (load_chat_template(chat_template) if chat_template else
                next(filter(None, map(load_chat_template, folders)), None))
    return loaded, template, special
