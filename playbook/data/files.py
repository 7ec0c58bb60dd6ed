"""Reading a dataset's rows: a .jsonl / .json / .parquet file, or a Hugging Face dataset id.

    rows = load_rows("examples/chat.jsonl")   # a list of dicts, as the file holds them

Which rows are usable, and what they become, is playbook/data/rows.py's business (`encode_rows`). Files are
read as UTF-8; a byte that is not UTF-8 raises DataError with its file, byte offset and line, and how
to convert the file (nothing is trained on replacement characters).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# How to convert a file that is not UTF-8 (cp1252 / Latin-1 is the usual other encoding).
_CONVERT_HINT = "convert it to UTF-8, e.g. `iconv -f cp1252 -t utf-8 {path} > {path}.utf8` (or the file's real encoding)"


class DataError(ValueError):
    """Input data that cannot be used: the message says what is wrong and what to do. `report`
    (a DataReport, when rows were already counted) is what became of the rows, for the data line."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class MissingPackage(ImportError):
    """An optional package a data source needs (pyarrow for .parquet, datasets for a hub id)."""


FILE_FORMATS = (".jsonl", ".json", ".parquet")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


_READ_AHEAD: dict = {}  # a local file's rows read before the model was built (keep=True), until read again


def load_rows(path_or_hub_id: str, keep: bool = False) -> list[dict]:
    """Rows of a local .jsonl / .json / .parquet file, or of a Hugging Face dataset id (split "train").

    A .json file holds a list of objects or {"data": [...]}. Rows are returned as they are; which
    ones are usable is decided (and counted) by `encode_rows`. keep: the rows of a local file are kept
    for the next call with the same file, unchanged since (the check before the model is built reads the
    file once for both).
    """
    source = str(path_or_hub_id)
    path = Path(source).expanduser()
    if path.is_file():
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        rows = _READ_AHEAD.pop(key, None)
        if rows is None:
            rows = _load_rows(source, path)
        if keep:
            _READ_AHEAD[key] = rows
        return rows
    return _load_rows(source, path)


def _load_rows(source: str, path: Path) -> list[dict]:
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give a {' / '.join(FILE_FORMATS)} file or a dataset id")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a regular file (a device or a pipe); give a {' / '.join(FILE_FORMATS)} file "
                         "or a dataset id")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            return _read_jsonl(path)
        if suffix == ".json":
            return _read_json(path)
        if suffix == ".parquet":
            return _read_parquet(path)
        raise ValueError(f"{path}: unknown data format '{suffix or '(no extension)'}'; use "
                         f"{', '.join(FILE_FORMATS)} (a raw text file is kind 'text', not 'dataset')")
    looks_like_file = path.suffix != "" or source.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(source)
    if looks_like_file:
        raise FileNotFoundError(f"data file {path} does not exist")
    return _load_hub_dataset(source)


def read_utf8(path: Path) -> str:
    """The file's text; a byte sequence that is not UTF-8 raises DataError with its offset and line. A
    byte-order mark at the start (Windows editors write one) is dropped."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")  # offsets in errors stay those of the file
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}: byte {err.start:,} (line {line}, value 0x{raw[err.start]:02x}) is not UTF-8 "
                        f"({err.reason}); {_CONVERT_HINT.format(path=path)}") from None


def _read_jsonl(path: Path) -> list:
    rows = []
    for number, line in enumerate(read_utf8(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}: not valid JSON ({err.msg} at column {err.colno})") from None
    return rows


def _read_json(path: Path) -> list:
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return data["data"]
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        keys = ", ".join(list(map(str, data))[:5]) + (", ..." if len(data) > 5 else "")
        found = f"one JSON object (keys: {keys})" if data else "an empty JSON object"
    else:
        found = f"a JSON {type(data).__name__.replace('str', 'string').replace('NoneType', 'null')}"
    raise DataError(f'{path} holds {found}, not a list of rows: a .json data file holds a list of rows, '
                    f'[{{...}}, {{...}}], or {{"data": [...]}}; put the row(s) in a list, or write one row per line '
                    f'in a .jsonl file')


def _read_parquet(path: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        return pq.read_table(path).to_pylist()
    try:
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    except ImportError:  # pandas absent, or present without a parquet engine
        raise MissingPackage(f"{path}: reading .parquet files needs the pyarrow package: pip install pyarrow") from None


def _load_hub_dataset(hub_id: str) -> list:
    try:
        import datasets
    except ImportError:
        raise MissingPackage(f"'{hub_id}' is not a local file; loading it as a Hugging Face dataset id needs the "
                             "datasets package: pip install datasets") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        rows = datasets.load_dataset(hub_id, split="train")  # datasets honours HF_HUB_OFFLINE itself
    except Exception as err:  # noqa: BLE001  (network, missing repo, bad split: one readable line)
        hint = " (HF_HUB_OFFLINE=1: only datasets already in the local cache can be loaded)" if offline else ""
        raise DataError(f"could not load the dataset '{hub_id}'{hint}: {type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200] if str(err) else ''}") from None
    return [dict(r) for r in rows]
