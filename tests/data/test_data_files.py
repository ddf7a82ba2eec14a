"""Dataset files (jphantom.data.dataset_files): every format gives the same rows, a folder's
files split by whole words of their paths (others skipped and named), a row of no known shape is refused naming the file, the
row and its keys, and JSON arrays are decoded a row at a time across block boundaries."""

import json

import pytest

from jphantom.data import dataset_files
from jphantom.data.dataset_files import read_rows, row_kind, split_files
from jphantom.errors import ConfigError

ROWS = [{"text": "plain text"},
        {"prompt": "2 + 2 =", "completion": " 4"},
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]}]


def _write(path, rows):
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    else:
        import pyarrow as pa
        import pyarrow.feather as feather
        import pyarrow.parquet as pq

        table = pa.Table.from_struct_array(pa.array(rows))  # every row's keys as columns
        if suffix == ".parquet":
            pq.write_table(table, path, row_group_size=2)
        elif suffix == ".feather":
            feather.write_feather(table, path)
        else:  # .arrow in the IPC stream format, as datasets' save_to_disk writes
            with pa.ipc.new_stream(str(path), table.schema) as writer:
                writer.write_table(table, max_chunksize=2)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".arrow", ".feather"])
def test_every_format_reads_the_same_rows(tmp_path, suffix):
    """pyarrow fills absent columns with None; a None counts as an absent key."""
    rows = list(read_rows(_write(tmp_path / f"d{suffix}", ROWS)))
    assert len(rows) == 3
    assert [row_kind(r, "d", i) for i, r in enumerate(rows, 1)] == [
        "text", "prompt_completion", "messages"]
    clean = [{k: v for k, v in r.items() if v is not None} for r in rows]
    if suffix in (".parquet", ".arrow", ".feather"):  # struct fields of a list: None-filled too
        assert clean[2]["messages"][1]["content"] == "hello"
        clean[2]["messages"] = ROWS[2]["messages"]
    assert clean == ROWS


def test_json_array_streams_across_blocks(tmp_path, monkeypatch):
    """A JSON array decoded from 7-byte blocks gives its rows (a row spans several blocks)."""
    monkeypatch.setattr(dataset_files, "BLOCK_BYTES", 7)
    path = _write(tmp_path / "a.json", ROWS * 3)
    assert list(read_rows(path)) == ROWS * 3
    lines = _write(tmp_path / "b.jsonl", ROWS * 3)
    assert list(read_rows(lines)) == ROWS * 3


def test_folder_splits_on_whole_words_of_the_path(tmp_path):
    """Hugging Face layouts: the hub's data/<split>-*.parquet, save_to_disk's <split>/ folders
    (their metadata .json files skipped, and named); one rule, a whole word, for every split:
    values.jsonl, intervals/ and contest.jsonl train."""
    for name in ("b-train.jsonl", "a-train.parquet", "val.jsonl", "notes.txt", "contest.jsonl",
                 "sub/c.arrow", "validation/data-0.arrow", "validation/state.json",
                 "test/data-0.arrow", "data/test-00000-of-00001.parquet", "dev2.jsonl",
                 "dataset_dict.json", "values.jsonl", "intervals/more.jsonl", "testing_x.json"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    train, validation, test = split_files(tmp_path)
    relative = lambda files: [p.relative_to(tmp_path).as_posix() for p in files]
    assert relative(train) == ["a-train.parquet", "b-train.jsonl", "contest.jsonl",
                               "intervals/more.jsonl", "sub/c.arrow", "values.jsonl"]
    assert relative(validation) == ["dev2.jsonl", "val.jsonl", "validation/data-0.arrow"]
    assert relative(test) == ["data/test-00000-of-00001.parquet", "test/data-0.arrow",
                              "testing_x.json"]
    skipped = dataset_files.skipped_files(tmp_path)
    assert relative(skipped) == ["dataset_dict.json", "notes.txt", "validation/state.json"]
    assert skipped[tmp_path / "notes.txt"].startswith("not a dataset file: .jsonl")
    assert dataset_files.is_dataset_data(tmp_path)
    (tmp_path / "tokens.bin").write_bytes(b"")
    assert not dataset_files.is_dataset_data(tmp_path)  # a token folder stays one


def test_every_file_is_named_by_split_or_skipped(tmp_path):
    """train's data: line names each file's split and each file skipped with why; --val-data
    replaces the folder's validation files, which are named as skipped; a file of both splits
    is refused."""
    from types import SimpleNamespace

    from jphantom.cli.train import _files_line

    for name in ("d/train.jsonl", "d/val.jsonl", "d/b.txt", "d/more/x.jsonl", "v/y.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    data = tmp_path / "d"
    line = _files_line(SimpleNamespace(data=str(data), val_data=None))
    assert line == (f"data: {data}: train more/x.jsonl, train.jsonl; validation val.jsonl; "
                    "skipped b.txt (not a dataset file: .jsonl, .json, .parquet, .arrow, "
                    ".feather)")
    files = dataset_files.data_files(data, tmp_path / "v")
    assert files["validation"] == [tmp_path / "v" / "y.jsonl"]
    assert files["skipped"][data / "val.jsonl"].startswith("a validation file of --data")
    with pytest.raises(ConfigError, match="x.jsonl' is also a training file of --data"):
        dataset_files.data_files(data, data / "more")


@pytest.mark.parametrize("row, words", [
    ({"question": "q", "answer": "a"}, "row 2 has keys ['answer', 'question'] (none of"),
    ({"text": "t", "messages": [{"role": "user", "content": "c"}]}, "more than one shape"),
    ({"prompt": "p"}, "keys ['prompt']"),
    ({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}, "must both be strings"),
    ({"messages": [{"content": "no role"}]}, "'messages'[0] has ['content']"),
    ({"text": 3}, "'text' is a number, not a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "'messages'[0] 'content'[0] is a 'image_url' part: only text parts"),
    ({"messages": [{"role": "user", "content": 7}]}, "'content' is a number, not a string or"),
])
def test_a_row_of_no_known_shape_is_refused_in_one_line(tmp_path, row, words):
    path = _write(tmp_path / "bad.jsonl", [ROWS[0], row])
    with pytest.raises(ConfigError) as error:
        for number, found in enumerate(read_rows(path), 1):
            row_kind(found, path, number)
    message = str(error.value)
    assert words in message and "bad.jsonl" in message and "\n" not in message


def test_malformed_files_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        list(read_rows(bad))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="not a Parquet file"):
        list(read_rows(broken))
    with pytest.raises(ConfigError, match="does not exist"):
        split_files(tmp_path / "missing.jsonl")


def test_a_byte_order_mark_is_read_past(tmp_path):
    """A UTF-8 BOM (a common export) before JSON Lines or a JSON array."""
    lines, array = tmp_path / "a.jsonl", tmp_path / "b.json"
    lines.write_text("\ufeff" + "".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    array.write_text("\ufeff" + json.dumps(ROWS), encoding="utf-8")
    assert list(read_rows(lines)) == ROWS and list(read_rows(array)) == ROWS


def test_json_lines_of_lists_are_refused_as_lists(tmp_path):
    """Lines of [1, 2, 3] are rows that are lists (not one array of numbers); a
    one-line array of objects is still one array of rows."""
    path = tmp_path / "lists.jsonl"
    path.write_text("[1, 2, 3]\n" * 3)
    with pytest.raises(ConfigError, match=r"row 1 is a JSON array \(\[1, 2, 3\]\), not an obj"):
        for number, found in enumerate(read_rows(path), 1):
            row_kind(found, path, number)
    one = tmp_path / "one.json"
    one.write_text(json.dumps(ROWS) + "\n")
    assert list(read_rows(one)) == ROWS
