"""``reading_gguf_once``: inside the block a GGUF file is parsed once and gguf's tensor-name table
built once, with the same contents as without it; outside, gguf is as it was."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from multihead.integrations.transformers import reading_gguf_once  # noqa: E402


@pytest.fixture
def tiny_gguf(tmp_path):
    """A GGUF file of one metadata value and one float32 tensor, written with gguf's own writer."""
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", 7)
    writer.add_tensor("blk.0.attn_q.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _contents(reader):
    return ({name: field.parts[field.data[0]].tolist() for name, field in reader.fields.items() if field.data},
            {t.name: np.array(t.data).tolist() for t in reader.tensors})


def test_a_file_is_parsed_once_inside_the_block_with_the_same_contents(tiny_gguf):
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    alone = _contents(gguf.GGUFReader(str(tiny_gguf)))
    with reading_gguf_once():
        first = gguf.GGUFReader(str(tiny_gguf))
        assert gguf.GGUFReader(tiny_gguf) is first  # the same file by another spelling: parsed once
        assert _contents(first) == alone
        assert gguf.GGUFReader(str(tiny_gguf), "c") is not first  # another mode is another reader
        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is table
        assert table.get_name("model.layers.1.self_attn.q_proj") == original_map(gguf.MODEL_ARCH.LLAMA, 2).get_name(
            "model.layers.1.self_attn.q_proj")
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_map
    assert gguf.GGUFReader(str(tiny_gguf)) is not first


def test_gguf_is_restored_when_the_block_raises(tiny_gguf):
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="inside"):
        with reading_gguf_once():
            gguf.GGUFReader(str(tiny_gguf))
            raise RuntimeError("inside")
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_map
