#!/usr/bin/env python3
"""Reads a safetensors file from the format's specification alone (no dptrain code, no numpy):
8-byte little-endian header length N, N bytes of JSON header, then the raw tensor bytes.

    python3 benchmarks/read_safetensors.py FILE

prints one line per tensor, "name dtype shape sum", then the metadata. Where the `safetensors`
package is importable, it also loads the file with it and checks that both readers agree.
"""
import json
import struct
import sys
from array import array

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1}


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise SystemExit(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise SystemExit(f"{path}: header length {n} exceeds the file")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        count = 1
        for d in e["shape"]:
            count *= d
        if not (0 <= begin <= end <= len(data)) or end - begin != count * SIZES[e["dtype"]]:
            raise SystemExit(f"{path}: tensor {name} has bad offsets {begin}, {end}")
        if e["dtype"] != "F32":
            raise SystemExit(f"{path}: tensor {name}: only F32 is read here")
        values = array("f")
        values.frombytes(data[begin:end])
        if sys.byteorder != "little":
            values.byteswap()
        tensors[name] = (e["shape"], values)
    return tensors, meta


def main():
    tensors, meta = read(sys.argv[1])
    for name in sorted(tensors):
        shape, values = tensors[name]
        print(f"{name} F32 {shape} {sum(values):.6f}")
    for key in sorted(meta):
        print(f"meta {key} {meta[key]}")
    try:
        from safetensors.numpy import load_file  # optional: the package's own reader
    except ImportError:
        print("safetensors package: not installed (checked by this reader alone)")
        return
    theirs = load_file(sys.argv[1])
    for name, (shape, values) in tensors.items():
        t = theirs[name]
        assert list(t.shape) == list(shape) and abs(float(t.sum()) - sum(values)) < 1e-3, name
    print("safetensors package: agrees")


if __name__ == "__main__":
    main()
