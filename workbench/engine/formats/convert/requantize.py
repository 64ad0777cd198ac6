"""`requantize_gguf`: write a GGUF file again with its matrices in another type.

    requantize_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.q8_0.gguf", "q8_0")

Metadata is copied unchanged; 1-D tensors (norms, biases) stay F32, as llama.cpp
writes them; matrices are dequantized (`gguf.quants`) and quantized to `qtype`.
Going up in precision does not bring back what the source format lost: a Q4_1
file written as Q8_0 holds the same numbers, more precisely stored. It makes a
same-vocabulary model of another format (a speculative-decoding target, a
kernel comparison), or a smaller file from an F16/F32 one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

TYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
         "bf16": GGMLQuantizationType.BF16, "q8_0": GGMLQuantizationType.Q8_0,
         "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
         "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1}


def requantize_gguf(src: str | os.PathLike, dst: str | os.PathLike,
                    qtype: str | GGMLQuantizationType) -> Path:
    """Copy GGUF `src` to `dst` with its matrices in `qtype` ("f16", "q8_0" ... or a
    `GGMLQuantizationType`); returns `dst`."""
    if isinstance(qtype, str):
        try:
            qtype = TYPES[qtype.lower()]
        except KeyError:
            raise ValueError(f"qtype must be one of {', '.join(TYPES)}, not {qtype!r}") from None
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("write the requantized file to another path")
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = {"sub_type": field.types[-1]} if kind == GGUFValueType.ARRAY else {}
        writer.add_key_value(field.name, field.contents(), kind, **sub)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)  # (..., n_cols)
        if values.ndim == 1:
            writer.add_tensor(t.name, values)
        else:
            writer.add_tensor(t.name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
