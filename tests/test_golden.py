"""The stored golden corpus: intact, small, and reproduced bit for bit by the reference formats.

Entries produced by TransformerEngine on a GPU are the independent evidence; entries produced by
the reference formats pin them against silent regressions."""

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from qgather.tools import golden

MANIFEST = golden.load_manifest()
ENTRIES = MANIFEST["entries"]


def test_corpus_exists_and_is_small():
    assert ENTRIES, "golden/manifest.json has no entries: run `make golden`"
    assert golden.corpus_bytes() <= golden.MAX_CORPUS_BYTES
    producers = {e["producer"]["producer"] for e in ENTRIES}
    assert "reference" in producers


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_entry_reproduces_bit_for_bit(entry):
    assert golden.check_entry(entry) == []


def test_a_tampered_entry_is_caught(tmp_path):
    entry = next(e for e in ENTRIES if e["format"] == "nvfp4_2d")
    shutil.copytree(golden.GOLDEN_DIR, tmp_path / "golden")
    path = tmp_path / "golden" / entry["file"]
    tensors = load_file(str(path))
    tensors["rowwise_scale_inv"][0, 0] ^= 1  # one bit of one scale
    save_file(tensors, str(path))
    problems = golden.check_entry(entry, str(tmp_path / "golden"))
    assert any("sha256 differs" in p for p in problems)
    assert any("rowwise_scale_inv differs in 1 bytes" in p for p in problems)


def test_manifest_records_every_buffer():
    for entry in ENTRIES:
        stored = load_file(os.path.join(golden.GOLDEN_DIR, entry["file"]))
        assert set(stored) - {"input"} == set(entry["sha256"]), entry["file"]
        assert json.dumps(entry["producer"])  # producer, versions (and GPU for TE entries)
