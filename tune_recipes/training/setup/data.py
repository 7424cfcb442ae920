"""Dataset and dataloader, the same for every recipe."""

import sys
from functools import partial
from typing import Optional, Tuple
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config as tt_config
from torchtune.datasets import ConcatDataset

from tune_recipes.config import ConfigError, resolve_component
from tune_recipes.constants import CROSS_ENTROPY_IGNORE_INDEX, DEFAULT_COLLATE
from tune_recipes.data.collate import (FLEX_BLOCK, packed_collate, packed_padding_free_collate,
                                      padded_to_a_multiple, padding_free_collate)
from tune_recipes.modules.varlen_attention import flash_takes_heads, flash_varlen_available
from tune_recipes.validation import CHAT_MESSAGE_FIELDS, dataset_packed, local_data_files


def build_dataset(cfg_dataset, tokenizer, key: str = "dataset", main: bool = True) -> Dataset:
    """One dataset, or a list of them concatenated. ``key``: the config key, for errors;
    ``main``: this process prints the warnings (rank 0).

    What a user can fix is one ``ConfigError`` naming ``key``: a dataset that needs the
    network on a machine that cannot reach it, a data file that is missing or unreadable, a
    column the data lacks, a column the template reads that is empty in some rows or holds
    numbers (``check_columns``), and a ``tokenizer.max_seq_len`` that leaves no response token
    in the first examples (``check_first_examples``). Empty responses and first examples
    without a label token are warnings."""
    if isinstance(cfg_dataset, ListConfig):
        parts = [_instantiate(c, tokenizer, f"{key}[{i}]", main) for i, c in enumerate(cfg_dataset)]
        return ConcatDataset(datasets=parts)
    return _instantiate(cfg_dataset, tokenizer, key, main)


# Exception class names (anywhere in the cause chain) that mean "the network was needed and
# not reachable": huggingface_hub's offline/cache misses, requests/urllib3/httpx connection
# errors. By name: none of these packages is imported here for the sake of an isinstance.
_NETWORK_ERRORS = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectionError",
                   "ConnectTimeout", "ConnectError", "MaxRetryError", "NameResolutionError",
                   "ReadTimeout", "Timeout"}

# How many examples ``check_first_examples`` tokenizes (each one costs a tokenization).
EXAMPLES_CHECKED = 16


def _causes(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _raised_in_datasets(e: BaseException) -> bool:
    """Whether Hugging Face ``datasets`` raised ``e`` (its innermost frame is in that package):
    loading data files, their format, an empty split. NOTE: by where, not by type: its errors
    are many (DatasetGenerationError, EmptyDatasetError, plain ValueErrors) and all of them say
    what is wrong with the data a config names."""
    import datasets

    root = str(Path(datasets.__file__).parent)
    tb = e.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_code.co_filename.startswith(root)


def _instantiate(cfg_dataset, tokenizer, key: str, main: bool = True) -> Dataset:
    component = cfg_dataset.get("_component_", "?") if hasattr(cfg_dataset, "get") else "?"
    column_map = cfg_dataset.get("column_map", None) if hasattr(cfg_dataset, "get") else None
    if column_map is not None and not isinstance(column_map, DictConfig):
        raise ConfigError(f"{key}.column_map={column_map}: expected a mapping from the "
                          "template's names to the data's columns, e.g. "
                          f"{key}.column_map={{input: prompt, output: response}}")
    unset = [k for k, v in (column_map or {}).items() if v is None and ":" in str(k)]
    if unset:
        # YAML reads `{input:prompt}` (no space after the colon) as the key "input:prompt".
        raise ConfigError(f"{key}.column_map holds {unset[0]!r} with no value: write a space "
                          f"after the colon, {{{str(unset[0]).replace(':', ': ', 1)}}}")
    source = cfg_dataset.get("source") if hasattr(cfg_dataset, "get") else None
    packed = hasattr(cfg_dataset, "get") and cfg_dataset.get("packed", False) is True
    # Packing makes every row into tokens first: the columns are checked before that, on the
    # same rows built unpacked (one line naming the column, not the first row packing stops at,
    # minutes in); the same build names the example a failed packing stopped at.
    unpacked = _built_unpacked(cfg_dataset, tokenizer) if packed else None
    if unpacked is not None:
        check_columns(unpacked, key, main, source=source)
    try:
        dataset = tt_config.instantiate(cfg_dataset, tokenizer)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - sorted below: what a user can fix, or re-raised
        if any(isinstance(c, ConnectionError) or type(c).__name__ in _NETWORK_ERRORS
               for c in _causes(e)):
            raise ConfigError(
                f"{key}: {component} needs the network to fetch its data and cannot reach it "
                f"({_first_line(e)}); fetch it once while online (it is cached), or point "
                f"{key} at local files ({key}.source=json {key}.data_files=PATH)") from None
        if packed and (isinstance(e, _EXAMPLE_ERRORS) or _refused_an_example(e)) \
                and not _raised_in_datasets(e):
            # A packed dataset tokenizes every example as it is built, and its error names
            # none: find the example (raises its one line) ...
            if unpacked is not None:
                _name_the_failing_example(unpacked, key, chat=_is_chat(cfg_dataset))
            if isinstance(e, KeyError):  # ... or, should none fail alone, the column
                raise _no_column(key, e, chat=_is_chat(cfg_dataset)) from None
        if isinstance(e, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise ConfigError(f"{key}: {component}: {_first_line(e)}") from None
        if isinstance(e, ValueError) and not _raised_in_datasets(e):
            # A builder's refusal of its arguments (packed=True without max_seq_len, ...).
            raise ConfigError(f"{key}: {component}: {_first_line(e)}") from None
        empty = _empty_data_file(cfg_dataset)
        if empty is not None and _raised_in_datasets(e):
            # (the library's words: "Please pass `features` or at least one example")
            raise ConfigError(f"{key}.data_files={empty}: the file is empty") from None
        if _raised_in_datasets(e):
            cause = next((c for c in list(_causes(e))[1:]), None)
            detail = f"{_first_line(e)}" + (f": {_first_line(cause)}" if cause else "")
            hint = ("; is the file complete, UTF-8 JSON: one list of objects, or one object a "
                    "line?") if "JSON parse error" in detail else ""
            raise ConfigError(f"{key}: {component} cannot load its data ({detail}){hint}") from None
        raise
    if not packed:
        check_columns(dataset, key, main, source=source)
    if not is_packed(dataset):
        # (A packed dataset tokenized every example while it was built, above.)
        dataset = ExampleErrorsNamed(dataset, key, chat=_is_chat(cfg_dataset))
    check_first_examples(dataset, tokenizer, key, main)
    return dataset


def _built_unpacked(cfg_dataset, tokenizer) -> Optional[Dataset]:
    """The dataset a packed config packs, built unpacked (its rows loaded, none made into
    tokens), or None where that build fails: the packed build reports its own error."""
    try:
        return tt_config.instantiate(OmegaConf.merge(cfg_dataset, {"packed": False}), tokenizer)
    except Exception:  # noqa: BLE001 - the packed build reports its own error
        return None


def _empty_answers_effect(key: str) -> str:
    """What empty answers do to ``key``'s run: train the model to answer with nothing, or (a
    held-out set) score it as such."""
    return ("the validation loss scores them as answers of nothing" if key.startswith("dataset_val")
            else "they train the model to answer with nothing")


def _warn(main: bool, text: str) -> None:
    if main:
        print(f"warning: {text}", file=sys.stderr)


def _template_columns(dataset) -> Tuple[dict, Optional[str]]:
    """({the template's name: the data's column} for the text columns a torchtune dataset's
    template reads from each row, the column holding the response or None): torchtune's
    instruct, alpaca and text-completion transforms; {} for others (chat data: a column of
    messages; a custom dataset)."""
    column = getattr(dataset, "_column", None)
    if isinstance(column, str):  # TextCompletionDataset: the whole row is the text
        return {"text": column}, column
    transform = getattr(dataset, "_message_transform", None)
    column_map = getattr(transform, "column_map", None)
    wanted = ("instruction", "input", "output")
    if type(transform).__name__ == "AlpacaToMessages":
        column_map = {"instruction": "instruction", "output": "output", **(column_map or {})}
        # NOTE: alpaca's output only. Its input is read only when a row has one (a row without
        # it, null or empty, takes the prompt without input), and its instruction goes through
        # str.format, which writes a null or a number as text: torchtune trains on both.
        wanted = ("output",)
    if not isinstance(column_map, dict) or "output" not in column_map:
        return {}, None
    text = {name: col for name, col in column_map.items() if name in wanted}
    return text, column_map["output"]


# The roles torchtune 0.6.1's Message and chat templates know; an openai-style turn of another
# role is masked (the template trains only the assistant's) under a header of its own name.
_KNOWN_ROLES = ("system", "user", "assistant", "ipython")


def _check_conversations(dataset, table, key: str, main: bool) -> None:
    """A chat dataset's column of messages (torchtune's openai or sharegpt transform), over every
    row at once: a message without text (a null content or value) is one line naming the first
    such example; openai-style turns of a role the template does not know (e.g. ``bot``) are a
    warning with their count: they train nothing. (sharegpt's transform refuses an unknown role
    itself, named by ``ExampleErrorsNamed``.)"""
    import pyarrow as pa
    import pyarrow.compute as pc

    transform = getattr(dataset, "_message_transform", None)
    style = {"OpenAIToMessages": ("messages", "role", "content"),
             "ShareGPTToMessages": ("conversations", "from", "value")}.get(type(transform).__name__)
    column_map = getattr(transform, "_column_map", None)
    if style is None or not isinstance(column_map, dict) or column_map.get(style[0]) not in table.column_names:
        return
    column, role_field, text_field = column_map[style[0]], style[1], style[2]
    values = table.column(column)
    if values.null_count:
        first = pc.index(pc.is_null(values), True).as_py()
        raise ConfigError(f"{key}: column {column!r} has no conversation in {values.null_count} "
                          f"of {table.num_rows} rows (a row without that field), the first in "
                          f"example {first}: fix or filter those rows")
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)) \
            or not pa.types.is_struct(values.type.value_type):
        return
    fields = {values.type.value_type.field(i).name for i in range(values.type.value_type.num_fields)}
    if not {role_field, text_field} <= fields:
        return  # the other style's fields: ExampleErrorsNamed names the fix
    messages = pc.list_flatten(values)
    owner = pc.list_parent_indices(values)
    roles = pc.struct_field(messages, role_field)
    missing = pc.is_null(pc.struct_field(messages, text_field))
    if getattr(transform, "new_system_prompt", None) is not None:
        # the data's system turns are dropped for the config's prompt: their text is never read
        missing = pc.and_(missing, pc.invert(pc.equal(roles, "system")))
    count = pc.sum(missing).as_py() or 0
    if count:
        first = owner[pc.index(missing, True).as_py()].as_py()
        raise ConfigError(f"{key}: {count} message(s) of column {column!r} have no "
                          f"{text_field!r} (null), the first in example {first}: fix or filter "
                          "those rows")
    text = pc.struct_field(messages, text_field)
    if pa.types.is_string(text.type) or pa.types.is_large_string(text.type):
        answer = "assistant" if role_field == "role" else "gpt"
        empty = pc.and_(pc.equal(roles, answer), pc.equal(pc.binary_length(text), 0))
        count = pc.sum(empty).as_py() or 0
        if count:
            first = owner[pc.index(empty, True).as_py()].as_py()
            _warn(main, f"{key}: {count} {answer} turn(s) of column {column!r} are empty, the "
                        f"first in example {first}: {_empty_answers_effect(key)}; filter them "
                        "out of the data")
    if role_field != "role":
        return
    unknown = pc.invert(pc.is_in(roles, pa.array(_KNOWN_ROLES)))
    count = pc.sum(unknown).as_py() or 0
    if count:
        at = pc.index(unknown, True).as_py()
        _warn(main, f"{key}: {count} message(s) of column {column!r} have a role torchtune's "
                    f"messages do not know ({', '.join(_KNOWN_ROLES)}), the first "
                    f"{roles[at].as_py()!r} in example {owner[at].as_py()}: such turns are masked "
                    "(never trained on) and templated under their own name; an answer "
                    "so named trains nothing: rename those to assistant, or filter them")


def check_columns(dataset: Dataset, key: str = "dataset", main: bool = True,
                  source: Optional[str] = None) -> None:
    """The columns a torchtune dataset's template reads (``_template_columns``), checked over
    every loaded row at once (Arrow's counts, no tokenization): a column with no value in some
    rows (a row without that field, an empty cell), or read as numbers (a CSV column of
    numbers), fails here naming the column and the first such example, instead of mid-epoch
    when a batch reaches it. Responses that are empty train the model to answer with nothing:
    a warning with their count (an error when every one is); chat data by
    ``_check_conversations``. Datasets whose rows are not a plain table (one built with a
    ``filter_fn``: an indices mapping; a custom class) are not checked here."""
    import pyarrow.compute as pc
    import pyarrow.types as pat

    inner = getattr(dataset, "ds", dataset)  # a PackedDataset: the dataset it packed
    data = getattr(inner, "_data", None)
    table = getattr(getattr(data, "data", None), "table", None)
    if table is None or getattr(data, "_indices", None) is not None:
        return
    rows = table.num_rows
    _check_conversations(inner, table, key, main)
    columns, response = _template_columns(inner)
    for name, column in columns.items():
        if column not in table.column_names:
            continue  # check_first_examples names a missing column
        values = table.column(column)
        if values.null_count:
            first = pc.index(pc.is_null(values), True).as_py()
            words = (f"; the csv loader also reads the words None, NA, NaN and null as no "
                     f"value: {key}.keep_default_na=False keeps them as text"
                     if source == "csv" else "")
            raise ConfigError(
                f"{key}: column {column!r} has no value in {values.null_count} of {rows} rows "
                f"(a row without that field, or an empty cell), the first in example {first}: "
                f"fix or filter those rows{words}")
        if not (pat.is_string(values.type) or pat.is_large_string(values.type)):
            if pat.is_temporal(values.type):
                hint = ("; the loader read every value of the column as a date or time, not as "
                        "text: keep them as text by writing them otherwise (not ISO 8601), "
                        "or from a CSV (source=csv)")
            elif source == "csv":
                hint = (f"; a CSV column of numbers is read as numbers: give the data as JSON "
                        f"Lines with those values as strings ({key}.source=json)")
            else:
                hint = "; give those values as strings"
            raise ConfigError(f"{key}: column {column!r} was read as {values.type}, not text, "
                              f"and the template reads it as text{hint}")
    if response is None or response not in table.column_names:
        return
    values = table.column(response)
    if not (pat.is_string(values.type) or pat.is_large_string(values.type)):
        return
    is_empty = pc.equal(pc.binary_length(values), 0)  # from the offsets: no text is read
    empty = pc.sum(is_empty).as_py() or 0
    if not empty:
        return
    first = pc.index(is_empty, True).as_py()
    held_out = key.startswith("dataset_val")
    if "text" in columns:  # text completion: an empty row is an end-of-text token at most
        if empty == rows:
            raise ConfigError(f"{key}: every row's text (column {response!r}) is empty: nothing "
                              f"to {'score' if held_out else 'train on'}; check {key}.column")
        _warn(main, f"{key}: {empty} of {rows} rows have empty text (column {response!r}, the "
                    f"first example {first}): they {'score' if held_out else 'train'} nothing; "
                    "filter them out of the data")
        return
    if empty == rows:
        raise ConfigError(f"{key}: every example's response (column {response!r}) is empty, so "
                          f"{'the validation loss would score' if held_out else 'training would teach the model'} "
                          f"to answer with nothing; check {key}.column_map")
    _warn(main, f"{key}: {empty} of {rows} examples have an empty response (column "
                f"{response!r}, the first example {first}): {_empty_answers_effect(key)}; "
                "filter them out of the data")


# What making one example into tokens raises for a row it cannot take (a missing column, a
# null or a number where text goes, bytes that are not UTF-8; torchtune's message transforms
# assert what they are given): not a builder's refusal of its arguments.
_EXAMPLE_ERRORS = (KeyError, AttributeError, TypeError, AssertionError, UnicodeDecodeError)


def _refused_an_example(e: BaseException) -> bool:
    """Whether ``e`` is a ValueError raised while an example was made into tokens (a dataset's
    ``__getitem__`` on its traceback: a chat template refusing a turn order), not a builder
    refusing its own arguments (``packed=True`` without ``max_seq_len``, raised before any)."""
    if not isinstance(e, ValueError):
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "__getitem__":
            return True
        tb = tb.tb_next
    return False


def _empty_data_file(cfg_dataset) -> Optional[str]:
    """The first of a dataset config's local ``data_files`` that is an empty file, or None."""
    return next((path for path, resolved in local_data_files(cfg_dataset)
                 if resolved.is_file() and resolved.stat().st_size == 0), None)


def _name_the_failing_example(unpacked: Dataset, key: str, chat: bool = False) -> None:
    """Once building a packed dataset failed: make the examples of the same dataset built
    unpacked (``_built_unpacked``) into tokens in order (the order packing takes them) until
    one fails, raised as ``ExampleErrorsNamed`` names it (index, what went wrong). Returns when
    none fails alone. Costs what the packing had done before it failed, and only on this error
    path."""
    named = ExampleErrorsNamed(unpacked, key, chat=chat)
    for index in range(len(named)):
        named[index]


def _is_chat(cfg_dataset) -> bool:
    """Whether a dataset config reads conversations (torchtune's chat_dataset and builders
    taking its keys), whose rows' messages have fields of their own."""
    from torchtune.datasets import chat_dataset

    if not hasattr(cfg_dataset, "get"):
        return False
    if cfg_dataset.get("conversation_style") is not None \
            or cfg_dataset.get("conversation_column") is not None:
        return True
    try:
        return resolve_component(str(cfg_dataset.get("_component_"))) is chat_dataset
    except ConfigError:
        return False


def _no_column(key: str, e: KeyError, index: Optional[int] = None,
               row: Optional[dict] = None, chat: bool = False, text: bool = False) -> ConfigError:
    """A KeyError while an example is made into tokens: a column the template reads that the
    data lacks, or (where the example's raw ``row`` shows it) a value the template does not
    know, such as a conversation role, or a field inside a column. ``text``: a text-completion
    dataset (one column, named by its ``column`` key)."""
    which = f"example {index}" if index is not None else "an example"
    missing = e.args[0] if e.args else e
    if isinstance(row, dict) and missing not in row:
        columns = ", ".join(map(str, row))
        if text:
            return ConfigError(f"{key}: {which} has no column {missing!r} (its columns: "
                               f"{columns}); name the text's column with {key}.column")
        if _holds_value(row, missing):
            return ConfigError(
                f"{key}: {which} holds {missing!r} where the template expects another value "
                f"(e.g. a role the conversation style does not know; its columns: {columns})")
        conversation, fields = _message_fields(row) if chat else (None, set())
        if fields and missing not in set().union(*CHAT_MESSAGE_FIELDS.values()):
            return ConfigError(
                f"{key}: {which} has no column {missing!r} (its columns: {columns}); chat data: "
                f"set {key}.conversation_column={conversation}, the column holding the messages")
        if fields:
            # A chat row's messages lack a field: a message's, not a column (sharegpt's
            # from/value against openai's role/content).
            style = next((name for name, want in CHAT_MESSAGE_FIELDS.items() if want <= fields), None)
            fix = (f"set {key}.conversation_style={style}" if style else
                   f"check {key}.conversation_style and {key}.conversation_column")
            return ConfigError(
                f"{key}: {which}'s messages have no field {missing!r} (their fields: "
                f"{', '.join(sorted(fields))}); {fix}")
        names = [str(c) for c in row]
        example = (f"{{input: {names[0]}, output: {names[1]}}}" if len(names) >= 2
                   else "{input: prompt, output: response}")
        return ConfigError(
            f"{key}: {which} has no column {missing!r} (its columns: {columns}; map them with "
            f"{key}.column_map, e.g. column_map={example}; chat data: "
            f"check {key}.conversation_style)")
    return ConfigError(f"{key}: {which} has no column {e} (map the data's columns with "
                       f"{key}.column_map, e.g. column_map={{input: prompt, output: response}})")


def _message_fields(row: dict):
    """(column, the keys of its messages) for a row's first column that holds a list of
    mappings (a chat row's conversation), or (None, an empty set)."""
    for column, value in row.items():
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            return column, set().union(*(m.keys() for m in value))
    return None, set()


def _holds_value(value, wanted) -> bool:
    if isinstance(value, dict):
        return any(_holds_value(v, wanted) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_value(v, wanted) for v in value)
    return value == wanted


def _raw_row(dataset, index) -> Optional[dict]:
    """The example's row as loaded (torchtune's SFTDataset keeps it in ``_data``), or None."""
    data = getattr(dataset, "_data", None)
    try:
        row = data[index] if data is not None else None
    except Exception:  # noqa: BLE001 - only for a better message
        return None
    return row if isinstance(row, dict) else None


class ExampleErrorsNamed(Dataset):
    """``dataset`` whose examples, made into tokens only when a batch asks for them, fail as one
    line naming the config key, the example's index and what went wrong: a row further into
    the data than ``check_first_examples`` looks (a null, a number or a list where the template
    wants text; a missing column) would otherwise end a run mid-epoch in a tokenizer's
    traceback. Other attributes are the dataset's own."""

    def __init__(self, dataset: Dataset, key: str, chat: bool = False) -> None:
        self.dataset = dataset
        self.key = key
        self.chat = chat  # a chat dataset: a missing key may be a message's field

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        try:
            return self.dataset[index]
        except ConfigError:
            raise
        except KeyError as e:
            text = isinstance(getattr(self.dataset, "_column", None), str)  # text completion
            raise _no_column(self.key, e, index, _raw_row(self.dataset, index), self.chat, text) from None
        except (AttributeError, TypeError, ValueError, AssertionError) as e:
            # (torchtune's message transforms assert what they are given)
            text = _first_line(e)
            not_text = isinstance(e, (AttributeError, TypeError, AssertionError)) and (any(
                f"'{t}' object" in text for t in ("NoneType", "int", "float", "list", "dict", "bool"))
                or text.endswith("got None"))
            hint = ("; a value the template reads is not text (null, a number, a list): fix or "
                    "filter that row") if not_text else "; fix or filter that row"
            if isinstance(e, UnicodeDecodeError):
                # The loader kept the file's bytes as they were: the file is not UTF-8.
                hint = (f"; the data file is not UTF-8: re-encode it, or name its encoding "
                        f"({self.key}.encoding=latin-1 for the json and csv loaders)")
            raise ConfigError(f"{self.key}: example {index} cannot be made into tokens "
                              f"({type(e).__name__}: {text}){hint}") from None

    def __getattr__(self, name):
        # Only for what this class does not have (dataset, key, the methods above).
        if name in ("dataset", "key", "chat"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def check_first_examples(dataset: Dataset, tokenizer, key: str = "dataset", main: bool = True) -> None:
    """Tokenize the first ``EXAMPLES_CHECKED`` examples now, before any model is built: a
    column the data lacks (a ``column_map`` to set) is one line here rather than a traceback
    at the first batch, and if none of them keeps a label token (every one truncated before
    its response by ``tokenizer.max_seq_len``, or masked) no step could compute a loss. If
    some do not, a warning (with ``main``) says how many: such examples train nothing."""
    import torch

    n = min(len(dataset), EXAMPLES_CHECKED) if hasattr(dataset, "__len__") else 0
    if n == 0:
        raise ConfigError(f"{key}: the dataset is empty")
    masked = cut = 0
    max_seq_len = getattr(tokenizer, "max_seq_len", None)
    for i in range(n):
        example = dataset[i]  # an unpacked dataset's errors: ExampleErrorsNamed names them
        labels = example.get("labels") if isinstance(example, dict) else None
        if labels is None and isinstance(example, dict) and "chosen_input_ids" in example:
            # torchtune's PreferenceDataset (preference_dataset, stack_exchange_paired_dataset,
            # hh_rlhf_helpful_dataset): chosen/rejected pairs, which the collate of a supervised
            # recipe cannot batch (a KeyError 'tokens' at the first batch).
            raise ConfigError(
                f"{key}: its examples are preference pairs (chosen_input_ids, "
                "rejected_input_ids), made for DPO-style training, which these recipes do not "
                "do; a recipe here trains on examples of tokens and labels (e.g. "
                "torchtune.datasets.instruct_dataset or chat_dataset; for preference data, "
                "train on the chosen responses with one of those)")
        if labels is None:
            return  # not a labelled example (a custom dataset): nothing to check here
        labels = torch.as_tensor(labels)
        if not bool((labels != CROSS_ENTROPY_IGNORE_INDEX).any()):
            masked += 1
            cut += max_seq_len is not None and len(labels) >= max_seq_len
    if masked == n and cut == 0:
        # Not the length: every example's labels are masked whole (no turn the template
        # trains on, e.g. an assistant role spelt otherwise, or an empty response).
        raise ConfigError(
            f"{key}: none of the first {n} examples keeps a label token, and none is cut "
            f"(tokenizer.max_seq_len={max_seq_len}): each is masked whole (no response or "
            "assistant turn to train on: check the data's roles and the dataset's "
            f"conversation_style or column_map, or set {key}.train_on_input=True to train on "
            "every token)")
    if masked == n:
        raise ConfigError(
            f"tokenizer.max_seq_len={max_seq_len}: none of the first {n} examples of {key} "
            "keeps a label token (each is cut before its response, or fully masked), so no "
            "step has a loss; raise tokenizer.max_seq_len, or set "
            f"{key}.train_on_input=True to train on the prompts too")
    if masked and is_packed(dataset):
        # (every pack is max_seq_len long: its length says nothing of why)
        _warn(main, f"{key}: {masked} of the first {n} packs keep no label token: their "
                    "examples train nothing (each cut before its response by "
                    f"tokenizer.max_seq_len={max_seq_len}, or masked whole)")
    elif masked:
        causes = []
        if cut:
            causes.append(f"{cut} cut before their response by tokenizer.max_seq_len={max_seq_len}")
        if masked - cut:
            causes.append(f"{masked - cut} masked whole (no response or assistant turn the "
                          "template trains on, e.g. a role it does not know)")
        _warn(main, f"{key}: {masked} of the first {n} examples keep no label token "
                    f"({'; '.join(causes)}): such examples train nothing, and the rest of the "
                    "data is likely alike")


def padded_batch_multiple(device) -> int:
    """The multiple of tokens a padded batch's rows go on to on ``device``: 128 on a CUDA GPU
    (``data.collate.padded_to_a_multiple`` says why), 1 (the longest row) elsewhere, where no
    per-shape cost was measured and the padding would only add compute."""
    return FLEX_BLOCK if device is not None and torch.device(device).type == "cuda" else 1


def document_spans_wanted(device, dtype, *models) -> bool:
    """Whether a run on ``device`` in ``dtype`` (a config's ``dtype`` string or a torch dtype)
    gives its document-masked batches as ``DocumentSpans`` (flash attention's variable-length
    kernel: a CUDA GPU that runs it, bf16 or fp16, and a head size it takes in every attention
    of ``models``, the models fed the batches); else they carry a BlockMask or a dense mask
    (``data.collate.document_mask``)."""
    half = dtype in ("bf16", "fp16", torch.bfloat16, torch.float16)
    return (half and device is not None and torch.device(device).type == "cuda"
            and flash_varlen_available() and flash_takes_heads(*models))


def is_packed(dataset: Dataset) -> bool:
    """Whether ``dataset`` gives packs (torchtune's ``PackedDataset``, or a concatenation of
    them). NOTE: torchtune's PackedDataset has no ``packed`` attribute (only its ConcatDataset
    sets one): test the type too, or a single packed dataset is padded like an unpacked one and
    its examples attend to each other across pack boundaries, silently."""
    from torchtune.datasets import PackedDataset

    return isinstance(dataset, PackedDataset) or bool(getattr(dataset, "packed", False))


def packs_without_padding(cfg: DictConfig, device, spans: bool) -> bool:
    """Whether a packed dataset's batches go without each pack's padding (``padding_free``,
    ``data.collate.packed_padding_free_collate``), which changes their length from batch to
    batch: everywhere except compiled runs on a CUDA GPU where a new length was measured to
    cost minutes of compiling, where the packs keep their one length: FP8 products (a
    dynamic-shape recompile of the FP8 layers ran past 240 s on an H200) and the whole model
    compiled over flex attention's block mask, without document spans
    (``whole_model_dynamic_compile_warning``). ``spans``: ``document_spans_wanted``.

    NOTE: not a plain ``padding_free`` on packs. With document spans in bf16 the whole model
    compiles once, dynamic in the length, from the first batch, and compiled per layer over
    flex attention unpacked rows of changing length ran 220 steps in 95 s (both measured on
    Llama-3.2-1B); on the two paths above the packs' fixed length keeps the compile cheap."""
    if cfg.get("padding_free", False) is not True:
        return False
    if device is None or torch.device(device).type != "cuda" or cfg.get("compile", False) is not True:
        return True
    if cfg.get("enable_fp8_training", False) is True:
        return False
    return spans or cfg.get("compile_scope", None) != "model"


def training_padding_free(cfg: DictConfig, dataset: Dataset, device, spans: bool) -> bool:
    """The ``padding_free`` a training run's batches of ``dataset`` are collated with: the
    config's, and on packs ``packs_without_padding``'s."""
    if is_packed(dataset):
        return packs_without_padding(cfg, device, spans)
    return cfg.get("padding_free", False) is True


def whole_model_dynamic_compile_warning(cfg: DictConfig, device, spans: bool) -> Optional[str]:
    """The warning for a run whose padding-free batches (their length changes every batch) go
    through the whole model compiled as one graph on a CUDA GPU *without* document spans
    (``spans``: ``document_spans_wanted``), i.e. through flex attention's block mask; else None.

    Measured on an H200 (Llama-3.2-1B, docs/benchmarks.md): with flex attention that graph,
    compiled for the first length and again with dynamic shapes for the second, had not reached
    its fifth step after 160 s, while compiled per layer the 220-step run took 95 s. With
    document spans the graph compiles dynamic from the first batch (Inductor may compile it once
    more when a batch outgrows a length bound its code generation chose from the first batch)
    and is the fastest unpacked setting there. Packs keep their one length on this path
    (``packs_without_padding``)."""
    if not (cfg.get("padding_free", False) is True and cfg.get("compile", False) is True
            and cfg.get("compile_scope", None) == "model"):
        return None
    if dataset_packed(cfg.get("dataset", None)):
        return None  # packs keep their length here (``packs_without_padding``)
    if spans or device is None or torch.device(device).type != "cuda":
        return None
    return ("padding_free=True with compile_scope=model here runs flex attention (flash "
            "attention's variable-length kernel needs bf16 or fp16, compute capability 8.0+ and "
            "a head size that is a multiple of 8 up to 256): batch lengths change, so the whole "
            "model compiles for dynamic shapes, which took minutes on an H200 (a 1B model had "
            "not reached its fifth step after 160 s); compile_scope=layers compiles one layer's "
            "graph instead")


def make_collate(dataset: Dataset, *, pad_id: int, collate_fn: str, ignore_index: int,
                 padding_free: bool = False, max_seq_len: Optional[int] = None,
                 pad_to_multiple_of: int = 1, longest_row: Optional[int] = None,
                 spans: bool = False):
    """The batch collation for ``dataset``: packed sequences with their document masks
    (``data.collate.packed_collate``; ``padding_free``: each pack without its padding, the
    packs end to end, ``data.collate.packed_padding_free_collate``); an unpacked dataset's rows
    end to end with document masks (``padding_free``: ``data.collate.padding_free_collate``, its
    row padded on to 16 tokens over ``spans``, else 128); or padding by ``collate_fn``, then on
    to a multiple of ``pad_to_multiple_of`` tokens
    (``data.collate.padded_to_a_multiple``; see ``padded_batch_multiple``) but never past
    ``longest_row`` (the tokenizer's ``max_seq_len``) or ``max_seq_len`` (the most tokens the
    model takes in a row). ``spans``: document masks as ``DocumentSpans``
    (``document_spans_wanted``)."""
    if is_packed(dataset):
        pack = getattr(dataset, "max_seq_len", None)
        if max_seq_len is not None and isinstance(pack, int) and pack > max_seq_len:
            # Else the model's forward refuses the first pack with a traceback.
            raise ConfigError(
                f"a packed dataset (dataset.packed=True) packs rows of {pack} tokens "
                f"(tokenizer.max_seq_len), more than the model takes in a row ({max_seq_len}; "
                f"with a teacher, the shorter of the two): set tokenizer.max_seq_len="
                f"{max_seq_len} or less")
        if padding_free:
            # each pack without the padding that fills it to its length, the packs end to end
            return partial(packed_padding_free_collate, padding_idx=pad_id, ignore_idx=ignore_index,
                           max_seq_len=max_seq_len, spans=spans)
        return partial(packed_collate, spans=True) if spans else packed_collate
    if max_seq_len is not None and isinstance(longest_row, int) and longest_row > max_seq_len:
        # Else the first example longer than the model takes ends the run mid-epoch in the
        # model's traceback.
        raise ConfigError(
            f"tokenizer.max_seq_len={longest_row} lets an example hold more tokens than the "
            f"model takes in a row ({max_seq_len}; with a teacher, the shorter of the two): set "
            f"tokenizer.max_seq_len={max_seq_len} or less")
    if padding_free:
        # the row's multiple follows the mask: 16 over spans, 128 for flex's block mask
        collate = partial(padding_free_collate, padding_idx=pad_id, ignore_idx=ignore_index,
                          max_seq_len=max_seq_len, spans=spans)
    else:
        if "left_pad_sequence" in collate_fn:
            raise ConfigError("collate_fn: left_pad_sequence is for inference, not training")
        fn = resolve_component(collate_fn, "collate_fn")
        if pad_to_multiple_of <= 1:
            collate = partial(fn, padding_idx=pad_id, ignore_idx=ignore_index)
        else:
            caps = [n for n in (max_seq_len, longest_row) if n is not None]
            collate = partial(padded_to_a_multiple, collate=fn, padding_idx=pad_id,
                              ignore_idx=ignore_index, pad_to_multiple_of=pad_to_multiple_of,
                              max_seq_len=min(caps) if caps else None)
    if longest_row is None and max_seq_len is not None:
        # tokenizer.max_seq_len: null (torchtune's configs leave rows uncut): say which row,
        # if any, is longer than the model takes, when its batch comes.
        return partial(examples_within, collate=collate, max_seq_len=max_seq_len)
    return collate


def examples_within(batch, *, collate, max_seq_len: int):
    """``collate(batch)``, after checking that no example is longer than ``max_seq_len`` tokens
    (module level, with ``partial``: a dataloader worker pickles it)."""
    longest = max((len(x["tokens"]) for x in batch), default=0)
    if longest > max_seq_len:
        raise ConfigError(
            f"an example of {longest} tokens is longer than the model takes in a row "
            f"({max_seq_len}); tokenizer.max_seq_len=null leaves examples uncut: set "
            f"tokenizer.max_seq_len={max_seq_len} (or less) to cut them")
    return collate(batch)


def build_validation_dataloader(cfg, tokenizer, *, ignore_index: int, world_size: int = 1,
                                rank: int = 0, max_seq_len: Optional[int] = None, device=None,
                                spans: bool = False):
    """``dataset_val`` in a fixed order, each example on exactly one rank, nothing dropped;
    None when the config has no ``dataset_val``."""
    if cfg.get("dataset_val") is None:
        return None
    from tune_recipes.training.step.validation import shard_for_rank

    dataset = build_dataset(cfg.dataset_val, tokenizer, key="dataset_val", main=rank == 0)
    shard = shard_for_rank(dataset, world_size, rank)
    # NOTE: every example of this rank's shard made into tokens once now, not only the first
    # few: validation runs at an epoch's end before the epoch is saved, so a bad row found
    # there would cost the epoch's training (one line here instead).
    for index in range(len(shard)):
        shard[index]
    collate = make_collate(dataset, pad_id=tokenizer.pad_id, ignore_index=ignore_index,
                           collate_fn=cfg.get("collate_fn", DEFAULT_COLLATE), max_seq_len=max_seq_len,
                           pad_to_multiple_of=padded_batch_multiple(device),
                           longest_row=getattr(tokenizer, "max_seq_len", None), spans=spans)
    return DataLoader(shard,
                      batch_size=cfg.get("batch_size_val", None) or cfg.batch_size,
                      shuffle=False, collate_fn=collate, drop_last=False)


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    pad_id: int,
    collate_fn: str = DEFAULT_COLLATE,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    world_size: int = 1,
    rank: int = 0,
    drop_last: bool = True,
    padding_free: bool = False,
    max_seq_len: Optional[int] = None,
    pad_to_multiple_of: int = 1,
    longest_row: Optional[int] = None,
    spans: bool = False,
) -> StatefulDataLoader:
    """A dataloader whose order depends only on (seed, epoch, rank), so a resumed run sees
    exactly the batches an uninterrupted one would.

    torchdata's ``StatefulDataLoader`` with its ``StatefulDistributedSampler`` (the same order
    as torch's ``DistributedSampler``): ``state_dict()`` mid-epoch records how many samples
    this rank has drawn, and after ``sampler.set_epoch(epoch)`` and ``load_state_dict`` the
    next iterator continues after them (mid-epoch checkpoints, ``save_every_n_steps``).
    Plain ints and dicts, so the recipe state still loads with ``weights_only=True``.
    """
    collate = make_collate(dataset, pad_id=pad_id, collate_fn=collate_fn, ignore_index=ignore_index,
                           padding_free=padding_free, max_seq_len=max_seq_len,
                           pad_to_multiple_of=pad_to_multiple_of, longest_row=longest_row, spans=spans)
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
    )
    return StatefulDataLoader(
        dataset=dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate,
        drop_last=drop_last,
    )
