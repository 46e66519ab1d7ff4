"""The loader of the task YAMLs beside this file: their JSONL rows as a 'test' split, read from this
directory whatever the working directory (the harness's `dataset_path: json` would read data files
relative to it). The harness imports this file by its path (`custom_dataset: !function
local_files.load`) and calls `load` with the task's `dataset_kwargs` and metadata."""
from __future__ import annotations

import json
import os

import datasets


def load(data_file: str, **metadata) -> datasets.DatasetDict:
  """{'test': the rows of `data_file`, a JSONL file in this directory, one JSON object a line}."""
  del metadata  # the harness passes the task's and the model's metadata too; the rows do not depend on them
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), data_file), encoding='utf-8') as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return datasets.DatasetDict({'test': datasets.Dataset.from_list(rows)})
