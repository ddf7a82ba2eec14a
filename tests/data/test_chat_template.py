"""Chat templates against transformers itself (tests/fixtures/chat, made by
tests/fixtures/make_chat_reference.py with transformers' ``apply_chat_template``): the same text,
token ids and assistant mask; the prefix-rendering spans of a template without
``{% generation %}`` equal transformers' generation spans; the loss on the answers is the mean
over the assistant tokens; and what each ``--loss-on`` takes from each kind of row."""

import json
import pathlib

import numpy as np
import pytest

from jphantom.data.chat_template import ChatTemplate, load_chat_template, token_mask
from jphantom.data.documents import RowTokenizer, encode_with_offsets, targets
from jphantom.data.tokenizers import load_tokenizer
from jphantom.errors import ConfigError

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "chat"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())["conversations"]


@pytest.fixture(scope="module")
def chat():
    return load_tokenizer(str(FIXTURE)), load_chat_template(FIXTURE)


def _plain(template: ChatTemplate) -> ChatTemplate:
    """The same template without its generation tags."""
    source = template.source.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert source != template.source
    return ChatTemplate(source, template.special)


@pytest.mark.parametrize("index", range(len(REFERENCE)))
def test_ids_and_assistant_mask_equal_transformers(chat, index):
    tokenizer, template = chat
    record = REFERENCE[index]
    ids, mask = RowTokenizer(tokenizer, template, loss_on="assistant")(
        {"messages": record["messages"]})
    assert ids == record["input_ids"] and mask == record["assistant_masks"]
    assert template.render(record["messages"])[0] == record["text"]
    prompt, _ = template.render(record["messages"][:-1], add_generation_prompt=True)
    assert prompt == record["prompt_text"]
    assert encode_with_offsets(tokenizer, prompt)[0] == record["prompt_ids"]
    # without {% generation %}: each assistant turn found by rendering prefixes, the same mask
    text, spans = _plain(template).assistant_spans(record["messages"])
    assert token_mask(encode_with_offsets(tokenizer, text)[1], spans) == record["assistant_masks"]


def test_template_sources(chat, tmp_path):
    """chat_template.jinja takes precedence over tokenizer_config.json's entry; a .jinja file
    or a tokenizer_config.json given alone; the special tokens come from the config."""
    _, template = chat
    assert template.has_generation and template.special["eos_token"] == "<|im_end|>"
    config = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}{{ messages | length }}")
    found = load_chat_template(tmp_path)
    assert found.render([{"role": "user", "content": "x"}])[0] == "<|im_end|>1"
    assert load_chat_template(FIXTURE / "tokenizer_config.json").source == template.source
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "t.jinja").write_text("{{ messages[0]['content'] | tojson }}")
    assert load_chat_template(alone / "t.jinja").render(
        [{"role": "user", "content": "é<"}])[0] == '"é<"'  # not escaped, as transformers'
    assert load_chat_template(alone) is None


def test_template_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="refused the conversation: only user"):
        ChatTemplate("{{ raise_exception('only user') }}").render([])
    with pytest.raises(ConfigError, match="not a Jinja template"):
        ChatTemplate("{% for %}")
    rewriting = ChatTemplate("{% for m in messages %}{{ m['content'] if loop.last else 'x' }}"
                             "{% endfor %}", name="rewriting.jinja")
    with pytest.raises(ConfigError, match="rewriting.jinja has no .* cannot be found"):
        rewriting.assistant_spans([{"role": "user", "content": "a"},
                                   {"role": "assistant", "content": "b"},
                                   {"role": "user", "content": "c"}])


def test_loss_on_each_kind_of_row(chat):
    """text: every token and EOS appended; prompt/completion: the completion by default (TRL's
    completion_only_loss); messages: all by default (TRL's assistant_only_loss=False);
    conversational prompt/completion: what follows the prompt's generation prompt."""
    tokenizer, template = chat
    eos = tokenizer.tokenizer.token_to_id("<|im_end|>")
    make = lambda loss_on=None: RowTokenizer(tokenizer, template, eos=eos, loss_on=loss_on)
    ids, mask = make()({"text": "Blue sky"})
    assert ids[-1] == eos and mask == [1] * len(ids)
    prompt = tokenizer.encode("Name a prime")
    ids, mask = make()({"prompt": "Name a prime", "completion": " number."})
    assert ids[:len(prompt)] == prompt and ids[-1] == eos
    assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    ids, mask = make("all")({"prompt": "a", "completion": "b"})
    assert ids[-1] == eos and mask == [1] * len(ids)
    record = REFERENCE[0]
    ids, mask = make()({"messages": record["messages"]})
    assert ids == record["input_ids"] and mask == [1] * len(ids)
    row = {"prompt": record["messages"][:-1], "completion": record["messages"][-1:]}
    ids, mask = make()(row)
    assert ids == record["input_ids"]
    assert mask == [0] * len(record["prompt_ids"]) + [1] * (len(ids) - len(record["prompt_ids"]))
    two = REFERENCE[1]  # the completion's assistant turn, not the prompt's
    row = {"prompt": two["messages"][:3], "completion": two["messages"][3:]}
    ids, mask = make("assistant")(row)
    cut = len(tokenizer.encode(template.render(two["messages"][:3], add_generation_prompt=True)[0]))
    assert ids == two["input_ids"] and sum(two["assistant_masks"][:cut]) > 0
    assert mask == [0] * cut + two["assistant_masks"][cut:]
    with pytest.raises(ConfigError, match="row 5: .* a completion starts with the assistant"):
        make()({"prompt": two["messages"][:2], "completion": two["messages"][2:]}, "c.jsonl", 5)
    for loss_on, bad, words in (("assistant", {"text": "t"}, "a text row has no answer"),
                                ("assistant", {"prompt": "p", "completion": "c"},
                                 "strings has no assistant turns"),
                                ("completion", {"messages": record["messages"]},
                                 "has no completion")):
        with pytest.raises(ConfigError, match=f"--loss-on {loss_on} does not apply to .*{words}"):
            make(loss_on)(bad, "chat.jsonl", 7)
    class Lengths:  # any tokenizer with encode (tiktoken's): text rows; templates need offsets
        name = "lengths"

        def encode(self, text):
            return [len(word) for word in text.split()]

    assert RowTokenizer(Lengths(), eos=0)({"text": "a bb ccc"}) == ([1, 2, 3, 0], [1] * 4)
    with pytest.raises(ConfigError, match="'lengths' gives no character offsets"):
        RowTokenizer(Lengths(), template)({"messages": record["messages"]})
    with pytest.raises(ConfigError, match="row 3 is a conversation but there is no chat template"):
        RowTokenizer(tokenizer)({"messages": record["messages"]}, "chat.jsonl", 3)


def test_answer_only_loss_is_the_mean_over_assistant_tokens(chat):
    """The targets of a conversation count exactly its assistant tokens (each predicted from the
    token before it), and ``jphantom.models.packed_lm_loss`` of the Qwen3 fixture on the padded
    row is numpy's mean over those tokens of the model's own next-token cross-entropy."""
    import jax.numpy as jnp
    from flax import nnx

    from jphantom.data.documents import Documents
    from jphantom.data.packing import pad
    from jphantom.models import hf, packed_lm_loss

    tokenizer, template = chat
    record = REFERENCE[1]
    ids, mask = RowTokenizer(tokenizer, template, loss_on="assistant")(
        {"messages": record["messages"]})
    found = targets(ids, mask)
    assistant = np.flatnonzero(record["assistant_masks"])
    assert list(np.flatnonzero(found >= 0)) == list(assistant - 1)
    assert list(found[assistant - 1]) == [ids[i] for i in assistant]
    model = hf.load(pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3")
    batch = pad(Documents.of([(ids, mask)]), np.array([0]), len(ids) + 3)  # 3 pads
    both = nnx.jit(lambda m, b, t: (packed_lm_loss(m, *b)[:2], m(t)))  # one compilation
    (total, weight), logits = both(model, tuple(map(jnp.asarray, batch)), jnp.asarray([ids]))
    logits = np.asarray(logits, np.float64)[0]  # [S, V]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.mean([log_probs[i - 1, ids[i]] for i in assistant])
    assert float(weight) == len(assistant)
    np.testing.assert_allclose(float(total) / float(weight), expected, rtol=1e-5)


def test_content_as_a_list_of_text_parts_reads_as_its_text(chat):
    """OpenAI's and TRL's list form of content: its text parts concatenated."""
    tokenizer, template = chat
    turns = lambda first, second: {"messages": [{"role": "user", "content": first},
                                                {"role": "assistant", "content": second}]}
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    make = RowTokenizer(tokenizer, template, loss_on="assistant")
    assert make(turns(parts, [{"type": "text", "text": "yo"}])) == make(turns("hi there", "yo"))


@pytest.mark.parametrize("source, words", [
    ("{% for i in range(100000000) %}x{% endfor %}",
     "(line 1) failed on the conversation: OverflowError: Range too big"),
    ("{{ 'a' }}\n{{ messages[0]['content'] + 1 }}",
     "(line 2) failed on the conversation: TypeError: can only concatenate str"),
    ("{{ raise_exception('only user turns') }}", "(line 1) refused the conversation: only user"),
])
def test_an_error_inside_a_template_is_one_line_naming_it_and_the_row(chat, source, words):
    tokenizer, _ = chat
    make = RowTokenizer(tokenizer, ChatTemplate(source, name="mine.jinja"))
    with pytest.raises(ConfigError) as error:
        make({"messages": [{"role": "user", "content": "hi"}]}, "chat.jsonl", 4)
    message = str(error.value)
    assert message.startswith("data file 'chat.jsonl' row 4: mine.jinja (line ")
    assert words in message and "\n" not in message


def test_a_conversation_rendered_as_nothing_is_refused(chat):
    """A template that writes nothing for a row: named with the row, not dropped unseen."""
    tokenizer, _ = chat
    make = RowTokenizer(tokenizer, ChatTemplate("{% if false %}x{% endif %}", name="mine.jinja"))
    with pytest.raises(ConfigError, match="row 2: mine.jinja renders the conversation as ''"):
        make({"messages": [{"role": "user", "content": "hi"}]}, "chat.jsonl", 2)
