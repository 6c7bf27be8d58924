"""KVLayout geometry pinned to real model numbers; full-size arenas only through jax.eval_shape."""
from __future__ import annotations

import json

import jax
import pytest

import arena_jax as aj

GIB = 2**30
MISTRAL_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
LLAMA3_70B = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


def test_mistral_7b_sizes_by_kv_heads():
    layout = aj.KVLayout.from_hf_config(MISTRAL_7B, num_pages=1024)
    assert layout.num_kv_heads == 8 and layout.head_dim == 128
    assert layout.bytes_per_token == 131_072
    assert layout.page_bytes == 131_072 * 16
    assert layout.arena_bytes == 131_072 * 16 * 1024


def test_llama3_70b_bytes_per_token():
    assert aj.KVLayout.from_hf_config(LLAMA3_70B, num_pages=8).bytes_per_token == 327_680


def test_mqa_and_fallbacks(tmp_path):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "multi_query": True,
           "num_key_value_heads": 1, "torch_dtype": "float32"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    layout = aj.KVLayout.from_hf_config(tmp_path, num_pages=4, page_size=16)  # a folder holding config.json
    assert (layout.num_kv_heads, layout.head_dim, layout.dtype.name) == (1, 64, "float32")
    assert layout.bytes_per_token == 2 * 2 * 1 * 64 * 4
    mha = dict(cfg)
    del mha["num_key_value_heads"]
    assert aj.KVLayout.from_hf_config(mha, num_pages=4).num_kv_heads == 4  # falls back to query heads


def test_memory_budget_picks_num_pages():
    layout = aj.KVLayout.from_hf_config(MISTRAL_7B, budget_bytes=40 * GIB, page_size=16)
    assert layout.num_pages == 40 * GIB // (131_072 * 16) == 20_480
    assert layout.arena_bytes <= 40 * GIB
    with pytest.raises(ValueError, match="exactly one"):
        aj.KVLayout.from_hf_config(MISTRAL_7B)
    with pytest.raises(ValueError, match="holds no page"):
        aj.KVLayout.for_memory_budget(32, 8, 128, budget_bytes=1000)


@pytest.mark.parametrize("cfg, bytes_per_token", [(MISTRAL_7B, 131_072), (LLAMA3_70B, 327_680)])
def test_full_size_arena_shapes_without_allocating(cfg, bytes_per_token):
    layout = aj.KVLayout.from_hf_config(cfg, budget_bytes=40 * GIB, max_seqs=256)
    shapes = jax.eval_shape(lambda: aj.create(layout))
    assert shapes.k.shape == (cfg["num_hidden_layers"], 8, layout.num_pages, 16, 128)
    assert shapes.k.dtype == layout.dtype and shapes.v.shape == shapes.k.shape
    arena = 2 * shapes.k.size * shapes.k.dtype.itemsize
    assert arena == layout.arena_bytes == layout.num_pages * 16 * bytes_per_token <= 40 * GIB
    assert shapes.table.page_map.shape == (256, layout.max_pages_per_seq)
    assert shapes.layout == layout  # geometry read back from shapes


@pytest.mark.parametrize(
    "head_dim, page_size, dtype",
    [(96, 1, "bfloat16"), (80, 3, "float16"), (256, 32, "bfloat16"), (20, 1, "float32"), (8, 1, "bfloat16"),
     (128, 256, "float32")],
)
def test_any_page_size_when_a_token_row_is_whole_16_byte_vectors(head_dim, page_size, dtype):
    """Page 1 of a Phi-3 head in bf16 is 192 bytes: legal (only a token row must be 16-byte aligned)."""
    layout = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=head_dim, page_size=page_size, num_pages=4,
                         max_seqs=1, max_pages_per_seq=4, dtype=dtype)
    assert layout.head_dim * layout.itemsize % aj.layout.ROW_ALIGN_BYTES == 0


@pytest.mark.parametrize("head_dim, dtype, row", [(100, "bfloat16", 200), (4, "float16", 8), (6, "float32", 24)])
def test_token_rows_not_whole_16_byte_vectors_are_rejected(head_dim, dtype, row):
    with pytest.raises(ValueError, match=rf"head_dim \* itemsize = {head_dim}\*\d = {row} bytes must be a multiple of 16"):
        aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=head_dim, page_size=16, num_pages=4, max_seqs=1,
                    max_pages_per_seq=4, dtype=dtype)
