"""The token embedding read a few rows at a time from a GGUF's quantized table (embedding.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from kvgen.engine.embedding import TokenEmbedding
from kvgen.engine.model_files import embedded_model_path


@pytest.fixture(scope="module")
def table():
    t = next(t for t in GGUFReader(embedded_model_path()).tensors if t.name == "token_embd.weight")
    assert t.tensor_type.name == "Q8_0"  # the embedded file's: quantized, so rows are dequantized at lookup
    return t


def test_rows_are_the_dequantized_tables_rows(table):
    emb = TokenEmbedding.quantized(table.data, table.tensor_type, int(table.shape[0]))
    ids = np.array([0, 1, 5, 49151, 5, 1234], np.int64)
    whole = dequantize(table.data, table.tensor_type)  # what a float copy of the table would hold
    assert np.array_equal(emb.rows(ids), whole[ids])
    got = emb[torch.tensor([[1, 5], [49151, 0]])]
    assert got.shape == (2, 2, 576) and got.dtype == torch.float32
    assert torch.equal(got[1, 0], torch.from_numpy(whole[49151]))
    assert emb.rows(np.zeros(0, np.int64)).shape == (0, 576)
    with pytest.raises(IndexError, match="outside"):
        emb.rows([49152])
    # the rows are the given (mapped) bytes: nothing of the table is copied
    assert emb.raw is table.data and emb.nbytes == table.data.nbytes


def test_a_float_table_is_indexed_and_moves_as_floats(table):
    floats = torch.from_numpy(dequantize(table.data[:100], table.tensor_type))
    emb = TokenEmbedding.floats(floats)
    assert torch.equal(emb[torch.tensor([3, 7])], floats[[3, 7]])
    quant = TokenEmbedding.quantized(table.data[:100], table.tensor_type, 576)
    moved = quant.to(torch.device("cpu"), torch.bfloat16)
    assert moved.table.dtype == torch.bfloat16 and torch.equal(moved.table, floats.to(torch.bfloat16))
