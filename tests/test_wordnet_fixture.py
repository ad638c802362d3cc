"""WordNet supersense parsing on the shipped 1/400 sample of Debian's wordnet-base."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_nvfp4.evaluation.finetune import FinetuneError, wordnet_examples

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "wordnet"


def test_parse_sample() -> None:
    train, test = wordnet_examples(FIXTURE)
    n = len(train) + len(test)
    assert 250 < n < 350 and 0.1 < len(test) / n < 0.3
    text, label = train[0]
    assert b": " in text and 0 <= label < 45


def test_missing_data_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(FinetuneError, match="apt-get install wordnet-base"):
        wordnet_examples(tmp_path)
