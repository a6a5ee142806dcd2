"""``dartspec ngram build``: count n-grams of the target's regenerated answers (and optional text)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from dartspec.errors import DartspecError
from dartspec.ngram import NgramModel, tokenizer_identity


def build_ngram(args: argparse.Namespace, log: Callable[[str], None]) -> NgramModel:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from dartspec.data.shards import load_shards
    from dartspec.models import resolve_model

    if not args.data and not args.text:
        raise DartspecError("give at least one --data folder or --text file")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    vocab = len(tokenizer)

    def sequences() -> Iterator[np.ndarray]:
        for folder in args.data:
            for rec in tqdm(load_shards(folder), desc=f"counting {folder}", unit="seq"):
                yield np.asarray(rec.tokens[rec.prompt_len :], dtype=np.int64)  # the target's own words
        for path in args.text:
            try:
                text = Path(path).read_text(errors="replace")
            except OSError as err:
                raise DartspecError(f"cannot read {path}: {err.strerror}") from None
            yield np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    model, stats = NgramModel.build(
        sequences(), order=args.order, vocab=vocab, tokenizer=tokenizer_identity(tokenizer), min_count=args.min_count
    )
    if stats.entries == 0:  # an empty model saved with exit status 0 before: nothing would ever be drafted from it
        raise DartspecError(
            f"no n-grams to count ({stats.tokens} tokens in the data and text given, order {args.order}, "
            f"min count {args.min_count}); {args.out} not written"
        )
    size = model.save(args.out)
    log(
        f"n-gram order {args.order}: {stats.tokens} tokens, {stats.entries} entries, {size / 1e6:.1f} MB, "
        f"built in {stats.seconds:.1f} s -> {args.out}"
    )
    return model
