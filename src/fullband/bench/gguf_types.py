"""A GGUF model rewritten with every tensor dequantized to F32 or F16, metadata kept: the same weights at the
precision fullband's float32 decode runs at, for a like-for-like llama.cpp benchmark (benchmarks/llamacpp_decode.py)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np

from fullband.errors import MissingPackage
from fullband.files import umask

DTYPES = {"F32": np.float32, "F16": np.float16}
FILE_TYPE_KEY = "general.file_type"


def _field_value(gguf, field):
    """A reader field's value as GGUFWriter.add_key_value takes it (strings as their raw bytes) and its sub-type."""
    types = field.types
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) != 2:
            raise ValueError(f"{field.name}: nested arrays are not supported")
        if len(field.data) == 0:
            raise ValueError(f"{field.name}: an empty array cannot be written by gguf's writer")
        if types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], types[1]
        return [field.parts[i][0].item() for i in field.data], types[1]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), None
    return field.parts[field.data[0]][0].item(), None


def retype_gguf(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "F32", *,
                overwrite: bool = False) -> Path:
    """Write `dst`: the model in `src` with every tensor dequantized (gguf.quants.dequantize) and stored as `dtype`
    ("F32" or "F16"; 1-D tensors such as norms stay F32, as llama.cpp expects), every key/value of `src` copied
    except general.file_type, which says the new type (0 all F32, 1 mostly F16). Written to a temporary file
    beside `dst` and renamed into place; an existing `dst` is replaced only with overwrite=True."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    try:
        import gguf
        import gguf.quants  # noqa: F401
    except ImportError as e:
        raise MissingPackage(f"retype_gguf needs the gguf package ({e}); pip install 'fullband[gguf]'") from e
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists; pass overwrite=True to replace it")
    reader = gguf.GGUFReader(src)
    fields = reader.fields
    if "split.count" in fields and _field_value(gguf, fields["split.count"])[0] > 1:
        raise ValueError(f"{src} is one shard of a split model; merge it first (llama-gguf-split --merge)")
    arch = _field_value(gguf, fields["general.architecture"])[0].decode("utf-8")
    file_type = gguf.LlamaFileType.ALL_F32 if dtype == "F32" else gguf.LlamaFileType.MOSTLY_F16

    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    writer = None
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 -> what a plain open would give
        os.close(fd)
        writer = gguf.GGUFWriter(tmp, arch)
        for name, field in fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":  # the header's; the writer adds them
                continue
            if name == FILE_TYPE_KEY:
                writer.add_uint32(FILE_TYPE_KEY, int(file_type))
                continue
            value, sub_type = _field_value(gguf, field)
            writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
            if name == "general.alignment":
                writer.data_alignment = int(value)
        if FILE_TYPE_KEY not in fields:
            writer.add_uint32(FILE_TYPE_KEY, int(file_type))

        plan = []  # (reader tensor, numpy shape, stored dtype)
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))
            out = np.dtype(DTYPES[dtype] if len(shape) > 1 else np.float32)
            writer.add_tensor_info(t.name, shape, out, int(np.prod(shape)) * out.itemsize)
            plan.append((t, shape, out))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t, shape, out in plan:  # one tensor in memory at a time
            try:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ValueError(f"{t.name}: cannot dequantize {t.tensor_type.name}") from e
            writer.write_tensor_data(np.ascontiguousarray(values.reshape(shape), dtype=out))
        writer.close()
        if dst.exists() and not overwrite:
            raise FileExistsError(f"{dst} appeared while it was written; pass overwrite=True to replace it")
        os.replace(tmp, dst)
    except BaseException:
        if writer is not None:
            writer.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return dst


def main(argv: list[str] | None = None) -> None:
    """`python -m fullband.bench.gguf_types SRC OUT_DIR`: OUT_DIR/NAME.F32.gguf and NAME.F16.gguf from SRC (a .gguf
    file or shipped:smollm2), each written unless it is already there."""
    import argparse

    from fullband.gguf_file import gguf_path

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("src")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    src = gguf_path(args.src)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = src.name.split(".")[0]
    for dtype in DTYPES:
        dst = out / f"{stem}.{dtype}.gguf"
        print(f"{dst} (kept)" if dst.exists() else retype_gguf(src, dst, dtype))


if __name__ == "__main__":
    main()
