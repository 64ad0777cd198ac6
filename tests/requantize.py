"""Test helper: write a GGUF file again with its matrices in another type (F16, Q8_0 ...),
metadata unchanged, so that a model can be compared with itself at another precision."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize


def requantize(src: Path, dst: Path, qtype: GGMLQuantizationType) -> Path:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)  # (..., n_cols)
        if values.ndim == 1:  # norms and biases stay F32, as llama.cpp writes them
            writer.add_tensor(t.name, values)
        else:
            writer.add_tensor(t.name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
