"""--data's folders checked for what tupe-prep writes and for one tokenizer, each with its
--index-cache folder."""

import argparse
import dataclasses
import os

from tupe_ds.data.sources import parse_sources
from tupe_ds.tools.files import file_digest
from tupe_ds.train.flags import fail


def data_sources(args: argparse.Namespace) -> list:
    """--data as sources.Source's, each with its index cache: folders that hold what tupe-prep
    writes, all encoded with one tokenizer."""
    try:
        sources = parse_sources(args.data)
    except ValueError as error:
        fail(str(error))
    for source in sources:
        for name in ("train.idx", "valid.idx", "tokenizer.json"):
            if not os.path.exists(os.path.join(source.folder, name)):
                fail(f"--data {source.folder}: no {name}; run tupe-prep --out "
                     f"{source.folder} first")
        for split in ("train", "valid"):
            if os.path.getsize(os.path.join(source.folder, f"{split}.bin")) == 0:
                fail(f"--data {source.folder}: its {split} split holds no document; prepare it "
                     "again with more text" + (" or a --valid-fraction above 0 (the default "
                                               "is 0.01)" if split == "valid" else ""))
    first = sources[0]
    vocabulary = file_digest(os.path.join(first.folder, "tokenizer.json"))
    for source in sources[1:]:
        if file_digest(os.path.join(source.folder, "tokenizer.json")) != vocabulary:
            fail(f"--data: {first.folder}/tokenizer.json and {source.folder}/tokenizer.json "
                 "differ; a blend needs every folder prepared with one tokenizer (tupe-prep "
                 f"--tokenizer {first.folder}/tokenizer.json)")
    return [dataclasses.replace(source, index_cache=index_cache(args, source.folder))
            for source in sources]


def index_cache_folder(args: argparse.Namespace, data: str) -> str:
    """--index-cache, else the data folder where this process may write, else OUT/index-cache."""
    return args.index_cache or (data if os.access(data, os.W_OK)
                                else os.path.join(args.out, "index-cache"))


def index_cache(args: argparse.Namespace, data: str) -> str:
    """index_cache_folder, created, and checked writable."""
    folder = index_cache_folder(args, data)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        fail(f"--index-cache {folder}: cannot create it ({error.strerror}); choose another "
             "folder with --index-cache")
    if not os.access(folder, os.W_OK):
        fail(f"--index-cache {folder}: not writable; choose another folder with --index-cache")
    return folder
