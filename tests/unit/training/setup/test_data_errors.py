"""tune_recipes.training.setup.data: what a user can fix in a dataset is one ConfigError
naming the key (a run prints it as one line, exit 2), not a traceback at the first batch."""

import json

import pytest
from omegaconf import OmegaConf

from tune_recipes.config import ConfigError
from tune_recipes.data import tiny_tokenizer
from tune_recipes.training.setup.data import build_dataset

pytestmark = pytest.mark.unit


def _instruct(tmp_path, rows=None, **kw):
    path = tmp_path / "data.json"
    if rows is not None:
        path.write_text(json.dumps(rows))
    return OmegaConf.create({"_component_": "torchtune.datasets.instruct_dataset",
                             "source": "json", "data_files": str(path), "split": "train", **kw})


def _chat(tmp_path, rows, column, style, **kw):
    """A chat_dataset config reading ``rows`` (written to a JSON file) in ``style``."""
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(rows))
    return OmegaConf.create({"_component_": "torchtune.datasets.chat_dataset", "source": "json",
                             "data_files": str(path), "split": "train",
                             "conversation_column": column, "conversation_style": style, **kw})


def test_a_max_seq_len_that_cuts_every_response_names_the_key():
    cfg = OmegaConf.create({"_component_": "tune_recipes.data.tiny_alpaca_dataset"})
    with pytest.raises(ConfigError, match=r"tokenizer.max_seq_len=16: none of the first 16 "
                                          r"examples of dataset keeps a label token"):
        build_dataset(cfg, tiny_tokenizer(max_seq_len=16))
    # Training on the prompts too leaves label tokens: no error.
    cfg.train_on_input = True
    assert len(build_dataset(cfg, tiny_tokenizer(max_seq_len=16))) > 0
    # A list of datasets is checked part by part, named by its index.
    both = OmegaConf.create([{"_component_": "tune_recipes.data.tiny_alpaca_dataset"}])
    with pytest.raises(ConfigError, match=r"of dataset\[0\] keeps"):
        build_dataset(both, tiny_tokenizer(max_seq_len=16))


def test_a_missing_data_file_and_a_missing_column_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^dataset: torchtune.datasets.instruct_dataset"):
        build_dataset(_instruct(tmp_path), tiny_tokenizer())
    rows = [{"prompt": "hi", "answer": "yes"}] * 4
    with pytest.raises(ConfigError, match=r"dataset: example 0 has no column 'input' \(its "
                                          r"columns: prompt, answer;.*column_map"):
        build_dataset(_instruct(tmp_path, rows), tiny_tokenizer())
    ok = build_dataset(_instruct(tmp_path, rows, column_map={"input": "prompt", "output": "answer"}),
                       tiny_tokenizer())
    assert len(ok) == 4
    with pytest.raises(ConfigError, match=r"^dataset.column_map=prompt: expected a mapping"):
        build_dataset(_instruct(tmp_path, rows, column_map="prompt"), tiny_tokenizer())
    # `column_map={input:prompt}` on the command line: YAML's key "input:prompt", no value.
    with pytest.raises(ConfigError, match=r"^dataset.column_map holds 'input:prompt' with no "
                                          r"value: write a space after the colon, \{input: prompt\}"):
        build_dataset(_instruct(tmp_path, rows, column_map={"input:prompt": None}), tiny_tokenizer())


def test_an_unreadable_data_file_and_an_empty_one_name_the_key(tmp_path):
    (tmp_path / "data.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"^dataset: torchtune.datasets.instruct_dataset cannot "
                                          r"load its data"):
        build_dataset(_instruct(tmp_path), tiny_tokenizer())
    # a file cut short: arrow's parse error, with what to look at
    (tmp_path / "data.json").write_text(json.dumps([{"input": "a", "output": "b"}] * 8)[:-30])
    with pytest.raises(ConfigError, match=r"JSON parse error.*is the file complete, UTF-8 JSON"):
        build_dataset(_instruct(tmp_path), tiny_tokenizer())
    (tmp_path / "data.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"^dataset: "):
        build_dataset(_instruct(tmp_path), tiny_tokenizer())
    (tmp_path / "data.json").write_text("")  # the library: "Please pass `features` or ..."
    with pytest.raises(ConfigError, match=rf"^dataset.data_files={tmp_path / 'data.json'}: the file is empty$"):
        build_dataset(_instruct(tmp_path), tiny_tokenizer())


def test_a_dataset_that_needs_the_network_offline_is_one_line(monkeypatch):
    from torchtune import config as tt_config

    def offline(*args, **kwargs):
        try:
            raise OSError("Name or service not known")
        except OSError as cause:
            raise ConnectionError("Couldn't reach 'tatsu-lab/alpaca' on the Hub") from cause

    monkeypatch.setattr(tt_config, "instantiate", offline)
    cfg = OmegaConf.create({"_component_": "torchtune.datasets.alpaca_dataset"})
    with pytest.raises(ConfigError, match=r"^dataset: torchtune.datasets.alpaca_dataset needs the "
                                          r"network .*Couldn't reach 'tatsu-lab/alpaca'"):
        build_dataset(cfg, tiny_tokenizer())

    class LocalEntryNotFoundError(Exception):  # huggingface_hub's, matched by name
        pass

    def cache_miss(*args, **kwargs):
        raise RuntimeError("loading failed") from LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(tt_config, "instantiate", cache_miss)
    with pytest.raises(ConfigError, match="needs the network"):
        build_dataset(cfg, tiny_tokenizer())

    def bug(*args, **kwargs):
        raise RuntimeError("a bug in a dataset builder")

    monkeypatch.setattr(tt_config, "instantiate", bug)
    with pytest.raises(RuntimeError, match="a bug"):  # not ours to reword
        build_dataset(cfg, tiny_tokenizer())


def test_a_builders_own_refusal_is_one_line_naming_the_key():
    # tiny_alpaca_dataset(packed=True) without a max_seq_len raises ValueError.
    cfg = OmegaConf.create({"_component_": "tune_recipes.data.tiny_alpaca_dataset", "packed": True})
    with pytest.raises(ConfigError, match=r"^dataset: tune_recipes.data.tiny_alpaca_dataset: "
                                          r"dataset.packed=True needs tokenizer.max_seq_len"):
        build_dataset(cfg, tiny_tokenizer(max_seq_len=None))


def test_a_row_without_a_value_past_the_first_examples_is_one_line_at_setup(tmp_path):
    """Row 19 (past the examples tokenized at setup) has a null answer, or none (the loader
    fills a missing field with null): the column's nulls are counted over every row when the
    dataset is built, and one line names the column and the first such example, before any
    step, whether or not the dataset is packed."""
    rows = [{"input": f"question {i}", "output": f"answer {i}"} for i in range(24)]
    for broken in ({"input": "question 19", "output": None}, {"input": "question 19"}):
        rows[19] = broken
        with pytest.raises(ConfigError, match=r"^dataset: column 'output' has no value in 1 of 24 "
                                              r"rows \(a row without that field, or an empty "
                                              r"cell\), the first in example 19: fix or filter"):
            build_dataset(_instruct(tmp_path, rows), tiny_tokenizer())
    # Packed: checked before packing makes every row into tokens, the same line.
    with pytest.raises(ConfigError, match=r"^dataset: column 'output' has no value in 1 of 24 rows"):
        build_dataset(_instruct(tmp_path, rows, packed=True), tiny_tokenizer(max_seq_len=256))
    rows[19] = {"input": "question 19", "output": "answer 19"}
    assert len(build_dataset(_instruct(tmp_path, rows), tiny_tokenizer())) == 24


def test_alpaca_rows_without_an_input_are_not_refused(tmp_path):
    """alpaca's template reads a row's input only when it has one (a row without it, null or
    empty takes the prompt without input), and formats its instruction with str.format (a
    number is written as text): such rows load, as torchtune loads them."""
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(24)]
    rows[3]["input"] = "some context"
    del rows[19]["input"]
    del rows[7]["instruction"]  # null: str.format writes it as text, as torchtune trains on it
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(rows))
    cfg = OmegaConf.create({"_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
                            "data_files": str(path), "split": "train"})
    dataset = build_dataset(cfg, tiny_tokenizer())
    assert len(dataset) == 24 and dataset[19]["tokens"]


@pytest.mark.parametrize("style", ["sharegpt", "openai"])
def test_a_chat_message_without_text_past_the_first_examples_is_one_line_at_setup(tmp_path, style):
    """A message's null text inside the column of conversations, row 19: counted over every
    row when the dataset is built, before any step."""
    role, text, user, bot = (("from", "value", "human", "gpt") if style == "sharegpt"
                             else ("role", "content", "user", "assistant"))
    rows = [{"chat": [{role: user, text: f"q{i}"}, {role: bot, text: f"a{i}"}]} for i in range(24)]
    rows[19]["chat"][1][text] = None
    cfg = _chat(tmp_path, rows, "chat", style)
    with pytest.raises(ConfigError, match=rf"^dataset: 1 message\(s\) of column 'chat' have no "
                                          rf"'{text}' \(null\), the first in example 19: fix or "
                                          rf"filter those rows$"):
        build_dataset(cfg, tiny_tokenizer())


def test_openai_turns_of_a_role_the_template_does_not_know_warn_with_their_count(tmp_path, capsys):
    """An openai-style 'bot' turn is masked (only the assistant's train) under a 'bot' header:
    an answer so named trains nothing, silently. A warning counts such turns over every row."""
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(30)]
    rows[20]["messages"][1]["role"] = rows[25]["messages"][1]["role"] = "bot"
    cfg = _chat(tmp_path, rows, "messages", "openai")
    assert len(build_dataset(cfg, tiny_tokenizer())) == 30
    assert ("warning: dataset: 2 message(s) of column 'messages' have a role torchtune's messages "
            "do not know (system, user, assistant, ipython), the first 'bot' in example 20: such "
            "turns are masked (never trained on)") in capsys.readouterr().err


@pytest.mark.parametrize("style", ["sharegpt", "openai"])
def test_empty_answer_turns_warn_with_their_count(tmp_path, capsys, style):
    """An empty assistant turn trains the model to answer with nothing, as an empty instruct
    response does: a warning counting them over every row."""
    role, text, user, bot = (("from", "value", "human", "gpt") if style == "sharegpt"
                             else ("role", "content", "user", "assistant"))
    rows = [{"chat": [{role: user, text: f"q{i}"}, {role: bot, text: "" if i in (4, 9) else f"a{i}"}]}
            for i in range(24)]
    assert len(build_dataset(_chat(tmp_path, rows, "chat", style), tiny_tokenizer())) == 24
    assert (f"warning: dataset: 2 {bot} turn(s) of column 'chat' are empty, the first in example 4: "
            "they train the model to answer with nothing") in capsys.readouterr().err


def test_chat_rows_without_a_conversation_and_system_turns_the_config_replaces(tmp_path):
    """A row without its conversation (null) is one line at setup; a system turn without text
    is no error when new_system_prompt replaces the data's system turns (never read)."""
    rows = [{"messages": [{"role": "system", "content": None}, {"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}]} for i in range(24)]
    cfg = _chat(tmp_path, rows, "messages", "openai")
    with pytest.raises(ConfigError, match=r"^dataset: 24 message\(s\) of column 'messages' have no "
                                          r"'content' \(null\), the first in example 0"):
        build_dataset(cfg, tiny_tokenizer())
    cfg.new_system_prompt = "Be brief."
    assert len(build_dataset(cfg, tiny_tokenizer())) == 24
    rows[21] = {"messages": None}
    cfg = _chat(tmp_path, rows, "messages", "openai", new_system_prompt="Be brief.")
    with pytest.raises(ConfigError, match=r"^dataset: column 'messages' has no conversation in 1 of "
                                          r"24 rows \(a row without that field\), the first in "
                                          r"example 21"):
        build_dataset(cfg, tiny_tokenizer())


def test_an_error_met_while_packing_prints_on_a_line_of_its_own(tmp_path, capsys, monkeypatch):
    """torchtune's "Packing dataset" bar is mid-line when a bad example stops the packing: the
    error line closes the bar first instead of continuing its unfinished line."""
    from tune_recipes.config import report_config_error

    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # the bar drawn, whatever the environment
    turns = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
             for i in range(30)]
    turns[25]["conversations"][1]["from"] = "bot"
    chat = _chat(tmp_path, turns, "conversations", "sharegpt", packed=True)
    with pytest.raises(ConfigError) as e:
        build_dataset(chat, tiny_tokenizer(max_seq_len=64))
    report_config_error(e.value)
    err = capsys.readouterr().err
    assert "Packing dataset" in err, err  # the bar was drawn
    line = next(ln for ln in err.replace("\r", "\n").splitlines() if "tune: error:" in ln)
    assert line.startswith("tune: error: dataset: example 25"), repr(err[-400:])


def test_a_packed_dataset_names_the_example_its_packing_stopped_at(tmp_path):
    """A packed dataset makes every example into tokens as it is built, and torchtune's error
    names none (a role the template does not know is a traceback mid-packing; a missing
    column names no example, and lists no columns): the example is found and named as
    unpacked."""
    turns = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
             for i in range(30)]
    turns[25]["conversations"][1]["from"] = "bot"  # a role sharegpt's transform does not know
    chat = _chat(tmp_path, turns, "conversations", "sharegpt", packed=True)
    with pytest.raises(ConfigError, match=r"^dataset: example 25 holds 'bot' where the template "
                                          r"expects another value"):
        build_dataset(chat, tiny_tokenizer(max_seq_len=64))
    # a turn order the template refuses (its ValueError, not a builder's refusal of arguments)
    turns[25]["conversations"][1]["from"] = "human"
    chat = _chat(tmp_path, turns, "conversations", "sharegpt", packed=True)
    with pytest.raises(ConfigError, match=r"^dataset: example 25 cannot be made into tokens "
                                          r"\(ValueError: Two consecutive user messages"):
        build_dataset(chat, tiny_tokenizer(max_seq_len=64))
    rows = [{"input": f"question {i}", "output": f"answer {i}"} for i in range(30)]
    rows = [{"prompt": r["input"], "output": r["output"]} for r in rows]
    with pytest.raises(ConfigError, match=r"^dataset: example 0 has no column 'input' \(its "
                                          r"columns: prompt, output;.*column_map"):
        build_dataset(_instruct(tmp_path, rows, packed=True), tiny_tokenizer(max_seq_len=64))
    packed = build_dataset(_instruct(tmp_path, rows, packed=True,
                                     column_map={"input": "prompt", "output": "output"}),
                           tiny_tokenizer(max_seq_len=64))
    assert len(packed) > 0


def _openai_chat(tmp_path, answer_role, style):
    """Four openai-style rows (a "messages" column) in a file, and a chat_dataset config
    reading them in ``style``."""
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"},
                          {"role": answer_role, "content": f"yo {i}"}]} for i in range(4)]
    (tmp_path / "chat.json").write_text(json.dumps(rows))
    return rows, OmegaConf.create({
        "_component_": "torchtune.datasets.chat_dataset", "source": "json",
        "data_files": str(tmp_path / "chat.json"), "split": "train",
        "conversation_column": "messages", "conversation_style": style})


def test_examples_masked_whole_but_not_cut_are_not_blamed_on_the_length(tmp_path):
    """An assistant role the template does not train on (openai rows whose answers are role
    "bot") masks every example whole although nothing was cut: the line says so and names
    the roles to check, not tokenizer.max_seq_len."""
    rows, cfg = _openai_chat(tmp_path, answer_role="bot", style="openai")
    with pytest.raises(ConfigError, match=r"^dataset: none of the first 4 examples keeps a label "
                                          r"token, and none is cut \(tokenizer.max_seq_len=256\): "
                                          r"each is masked whole .*conversation_style"):
        build_dataset(cfg, tiny_tokenizer(max_seq_len=256))
    rows = [{"messages": [m if m["role"] == "user" else {**m, "role": "assistant"}
                          for m in r["messages"]]} for r in rows]
    (tmp_path / "chat.json").write_text(json.dumps(rows))
    assert len(build_dataset(cfg, tiny_tokenizer(max_seq_len=256))) == 4


def test_chat_rows_in_another_style_or_column_name_the_fix(tmp_path):
    """openai rows read as sharegpt: 'from' is a field of a message, not a column to map; a
    conversation_column the rows lack names the column that holds the messages."""
    _, cfg = _openai_chat(tmp_path, answer_role="assistant", style="sharegpt")
    with pytest.raises(ConfigError, match=r"^dataset: example 0's messages have no field 'from' "
                                          r"\(their fields: content, role\); set "
                                          r"dataset.conversation_style=openai$"):
        build_dataset(cfg, tiny_tokenizer())
    cfg.conversation_style, cfg.conversation_column = "openai", "conversations"
    with pytest.raises(ConfigError, match=r"^dataset: example 0 has no column 'conversations' \(its "
                                          r"columns: messages\); chat data: set "
                                          r"dataset.conversation_column=messages"):
        build_dataset(cfg, tiny_tokenizer())
    cfg.conversation_column = "messages"
    assert len(build_dataset(cfg, tiny_tokenizer())) == 4
    # Instruct rows with a column of mappings are no chat rows: a missing column is column_map's.
    rows = [{"prompt": "hi", "output": "yo", "sources": [{"url": "u", "title": "t"}]}] * 4
    for packed in (False, True):
        with pytest.raises(ConfigError, match=r"^dataset: example 0 has no column 'input' \(its "
                                              r"columns: prompt, output, sources; map them with "
                                              r"dataset.column_map"):
            build_dataset(_instruct(tmp_path, rows, packed=packed), tiny_tokenizer(max_seq_len=64))


def test_a_data_file_that_is_not_utf8_names_its_encoding(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"".join(b'{"input": "caf\xe9 %d", "output": "ok"}\n' % i for i in range(4)))
    cfg = OmegaConf.create({"_component_": "torchtune.datasets.instruct_dataset", "source": "json",
                            "data_files": str(path), "split": "train"})
    with pytest.raises(ConfigError, match=r"^dataset: example 0 cannot be made into tokens "
                                          r"\(UnicodeDecodeError: .*\); the data file is not UTF-8: "
                                          r"re-encode it, or name its encoding \(dataset.encoding=latin-1"):
        build_dataset(cfg, tiny_tokenizer())
    cfg.encoding = "latin-1"  # what the line says works
    assert len(build_dataset(cfg, tiny_tokenizer())) == 4


def test_a_preference_dataset_in_a_supervised_recipe_is_one_line_at_setup(tmp_path):
    """torchtune's preference datasets yield chosen/rejected pairs; the recipes' collate met
    them at the first batch, after the model was built, as a KeyError 'tokens' traceback."""
    pair = {"role": "user", "content": "hi"}
    rows = [{"chosen": [pair, {"role": "assistant", "content": "hello"}],
             "rejected": [pair, {"role": "assistant", "content": "go away"}]}] * 4
    (tmp_path / "pairs.json").write_text(json.dumps(rows))
    cfg = OmegaConf.create({"_component_": "torchtune.datasets.preference_dataset", "source": "json",
                            "data_files": str(tmp_path / "pairs.json"), "split": "train"})
    with pytest.raises(ConfigError, match=r"^dataset: its examples are preference pairs "
                                          r"\(chosen_input_ids, rejected_input_ids\)"):
        build_dataset(cfg, tiny_tokenizer())


@pytest.mark.parametrize("value, read_as", [(4, "int64"), (["a", "b"], "list<item: string>")])
def test_answers_that_are_not_text_are_one_line_at_setup(tmp_path, value, read_as):
    rows = [{"input": f"question {i}", "output": value} for i in range(4)]
    with pytest.raises(ConfigError, match=rf"^dataset: column 'output' was read as {read_as}, "
                                          rf"not text, and the template reads it as text"):
        build_dataset(_instruct(tmp_path, rows), tiny_tokenizer())


def _csv(tmp_path, answers):
    """An instruct_dataset config reading a CSV of 20 questions with ``answers(i)``."""
    path = tmp_path / "data.csv"
    path.write_text("input,output\n" + "".join(f"question {i},{answers(i)}\n" for i in range(20)))
    return OmegaConf.create({"_component_": "torchtune.datasets.instruct_dataset", "source": "csv",
                             "data_files": str(path), "split": "train"})


def test_a_csv_column_of_numbers_names_the_column_and_the_fix(tmp_path):
    """A CSV's numeric answers are read as numbers (one empty cell: floats); the template
    wanted text. One line names the column and how to give the values as text."""
    cfg = _csv(tmp_path, lambda i: i)
    with pytest.raises(ConfigError, match=r"^dataset: column 'output' was read as int64, not text.*"
                                          r"a CSV column of numbers is read as numbers: give the "
                                          r"data as JSON Lines with those values as strings "
                                          r"\(dataset.source=json\)$"):
        build_dataset(cfg, tiny_tokenizer())


def test_csv_words_read_as_no_value_and_iso_dates_read_as_times_name_the_way_out(tmp_path):
    """pandas reads a CSV's None/NA cells as no value, and the JSON loader reads ISO dates as
    timestamps: each line says so, and keep_default_na=False keeps the words as text."""
    cfg = _csv(tmp_path, lambda i: "NA" if i == 5 else "yes")
    with pytest.raises(ConfigError, match=r"the first in example 5: fix or filter those rows; the "
                                          r"csv loader also reads the words None, NA, NaN and null as "
                                          r"no value: dataset.keep_default_na=False keeps them as text$"):
        build_dataset(cfg, tiny_tokenizer())
    cfg.keep_default_na = False
    assert len(build_dataset(cfg, tiny_tokenizer())) == 20
    lines = tmp_path / "dates.jsonl"  # (Arrow's JSON Lines reader takes ISO dates for times)
    lines.write_text("".join(json.dumps({"input": f"when is event {i}?", "output": "2021-03-01"}) + "\n"
                             for i in range(20)))
    cfg = OmegaConf.create({"_component_": "torchtune.datasets.instruct_dataset", "source": "json",
                            "data_files": str(lines), "split": "train"})
    with pytest.raises(ConfigError, match=r"^dataset: column 'output' was read as timestamp.*the loader "
                                          r"read every value of the column as a date or time"):
        build_dataset(cfg, tiny_tokenizer())


def test_a_missing_column_hint_maps_the_datas_own_columns(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(4)]
    with pytest.raises(ConfigError, match=r"has no column 'prompt' \(its columns: question, answer; "
                                          r"map them with dataset.column_map, e.g. "
                                          r"column_map=\{input: question, output: answer\}"):
        build_dataset(_instruct(tmp_path, rows, column_map={"input": "prompt", "output": "answer"}),
                      tiny_tokenizer())


def test_empty_responses_warn_with_their_count_and_all_empty_is_an_error(tmp_path, capsys):
    """An empty answer trains the model to answer with nothing (the assistant header and its
    end token are the labels): a warning counting them over every row; every answer empty is
    an error. A text-completion row of empty text likewise. Not printed off the main rank."""
    rows = [{"input": f"question {i}", "output": f"answer {i}"} for i in range(24)]
    rows[5]["output"] = rows[21]["output"] = ""
    assert len(build_dataset(_instruct(tmp_path, rows), tiny_tokenizer())) == 24
    assert ("warning: dataset: 2 of 24 examples have an empty response (column 'output', the "
            "first example 5): they train the model to answer with nothing") in capsys.readouterr().err
    build_dataset(_instruct(tmp_path, rows), tiny_tokenizer(), main=False)
    assert "warning" not in capsys.readouterr().err
    build_dataset(_instruct(tmp_path, rows), tiny_tokenizer(), key="dataset_val")
    assert ("dataset_val: 2 of 24 examples have an empty response (column 'output', the first "
            "example 5): the validation loss scores them as answers of nothing") in capsys.readouterr().err
    for row in rows:
        row["output"] = ""
    with pytest.raises(ConfigError, match=r"^dataset: every example's response \(column 'output'\) "
                                          r"is empty"):
        build_dataset(_instruct(tmp_path, rows), tiny_tokenizer())
    path = tmp_path / "text.json"
    path.write_text(json.dumps([{"body": f"some text {i}" if i != 3 else ""} for i in range(20)]))
    text = OmegaConf.create({"_component_": "torchtune.datasets.text_completion_dataset", "source": "json",
                             "data_files": str(path), "split": "train", "column": "body"})
    build_dataset(text, tiny_tokenizer())
    assert ("1 of 20 rows have empty text (column 'body', the first example 3): they train "
            "nothing") in capsys.readouterr().err


def test_a_text_completion_column_the_data_lacks_names_its_key(tmp_path):
    path = tmp_path / "text.json"
    path.write_text(json.dumps([{"body": f"some text {i}"} for i in range(20)]))
    text = OmegaConf.create({"_component_": "torchtune.datasets.text_completion_dataset", "source": "json",
                             "data_files": str(path), "split": "train"})
    with pytest.raises(ConfigError, match=r"^dataset: example 0 has no column 'text' \(its columns: "
                                          r"body\); name the text's column with dataset.column$"):
        build_dataset(text, tiny_tokenizer())


def test_some_first_examples_without_a_label_token_warn_with_the_cause(tmp_path, capsys):
    """Every third prompt too long for tokenizer.max_seq_len: those examples keep no label
    token and train nothing; a warning counts them among the first examples (all of them cut is
    the error above)."""
    rows = [{"input": ("long " * 300 if i % 3 == 0 else f"question {i}"), "output": f"answer {i}"}
            for i in range(24)]
    build_dataset(_instruct(tmp_path, rows), tiny_tokenizer(max_seq_len=256))
    err = capsys.readouterr().err
    assert ("warning: dataset: 6 of the first 16 examples keep no label token (6 cut before their "
            "response by tokenizer.max_seq_len=256): such examples train nothing") in err, err
    # Packed, every pack is max_seq_len long: counted as packs, the cause not guessed.
    build_dataset(_instruct(tmp_path, rows, packed=True), tiny_tokenizer(max_seq_len=256))
    err = capsys.readouterr().err
    assert "of the first 16 packs keep no label token: their examples train nothing" in err, err


def test_a_chat_row_with_a_role_the_style_does_not_know_names_the_value(tmp_path):
    """sharegpt's roles are system/human/gpt: a 'bot' turn is a value the template does not
    know, not a missing column; a field the style reads that the turns lack names the style
    whose fields they have."""
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yes"}]}] * 4
    cfg = _chat(tmp_path, rows, "conversations", "sharegpt")
    with pytest.raises(ConfigError, match=r"^dataset: example 0 holds 'bot' where the template "
                                          r"expects another value .*its columns: conversations"):
        build_dataset(cfg, tiny_tokenizer())
    cfg.conversation_style = "openai"
    with pytest.raises(ConfigError, match=r"^dataset: example 0's messages have no field 'role' "
                                          r"\(their fields: from, value\); set "
                                          r"dataset.conversation_style=sharegpt$"):
        build_dataset(cfg, tiny_tokenizer())


def test_a_row_the_template_refuses_for_another_reason_gets_no_not_text_hint(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yes"}]}] * 24
    rows[18] = {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}
    cfg = _chat(tmp_path, rows, "conversations", "sharegpt")
    dataset = build_dataset(cfg, tiny_tokenizer())
    with pytest.raises(ConfigError) as refused:
        dataset[18]
    line = str(refused.value)
    assert line.startswith("dataset: example 18 cannot be made into tokens (ValueError: ")
    assert "not text" not in line and line.endswith("fix or filter that row")


def test_a_bad_validation_row_anywhere_is_one_line_at_setup(tmp_path):
    """Validation runs at an epoch's end, before the epoch is saved: a row it cannot use is
    found when the run starts (one line), not after the epoch's training: a column's null by
    the column counts, a conversation the template refuses by making every example into
    tokens."""
    from tune_recipes.training.setup.data import build_validation_dataloader

    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(40)]
    rows[33]["output"] = None
    path = tmp_path / "val.json"
    path.write_text(json.dumps(rows))
    cfg = OmegaConf.create({"batch_size": 4, "dataset_val": {
        "_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
        "data_files": str(path), "split": "train"}})
    with pytest.raises(ConfigError, match=r"^dataset_val: column 'output' has no value in 1 of 40 "
                                          r"rows .*the first in example 33"):
        build_validation_dataloader(cfg, tiny_tokenizer(), ignore_index=-100)
    rows[33]["output"] = "a33"
    path.write_text(json.dumps(rows))
    assert len(list(build_validation_dataloader(cfg, tiny_tokenizer(), ignore_index=-100))) == 10
    chat = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(40)]
    chat[33]["conversations"][1]["from"] = "human"  # two user turns in a row: the template refuses
    path.write_text(json.dumps(chat))
    cfg.dataset_val = {"_component_": "torchtune.datasets.chat_dataset", "source": "json",
                       "data_files": str(path), "split": "train",
                       "conversation_column": "conversations", "conversation_style": "sharegpt"}
    with pytest.raises(ConfigError, match=r"^dataset_val: example 33 cannot be made into tokens "
                                          r"\(ValueError: .*\); fix or filter that row$"):
        build_validation_dataloader(cfg, tiny_tokenizer(), ignore_index=-100)


def test_a_data_file_under_home_written_with_a_tilde_loads(tmp_path, monkeypatch):
    """`dataset.data_files=~/data.json`: tune validate reads ~ as a shell does; the loaders
    took it as a folder's name ("Unable to find '<cwd>/~/data.json'"). The config, as loaded,
    holds the home folder written out."""
    from tune_recipes.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data.json").write_text(json.dumps([{"input": f"q {i}", "output": f"a {i}"}
                                                    for i in range(4)]))
    for files in ("~/data.json", ["~/data.json"], {"train": "~/data.json"}):
        (tmp_path / "run.yaml").write_text(OmegaConf.to_yaml({"dataset": {
            "_component_": "torchtune.datasets.instruct_dataset", "source": "json",
            "data_files": files, "split": "train"}}))
        cfg = load_config(tmp_path / "run.yaml").dataset
        assert len(build_dataset(cfg, tiny_tokenizer())) == 4
