"""Disk deltas: a new checkpoint written as its byte difference from a base snapshot.

When trainer and engines share a disk but no GPU fabric, writing a whole checkpoint every
step is wasteful if most bytes did not change. ``make_delta(base_dir, new_dir, out_path)``
writes one file holding, for each tensor of each safetensors file of the new checkpoint,
its raw bytes XOR the base's bytes for the same tensor name, compressed with zlib (an
unchanged element XORs to zeros, and runs of zeros compress to almost nothing). Other
files (``config.json``, the shard index) are stored whole, compressed. ``apply_delta``
reverses it and reproduces the new checkpoint directory byte for byte.

A delta is only meaningful against the exact base it was made from: XOR against other
bytes gives garbage that still looks like a valid checkpoint. So the delta records the
base's identity, a SHA-256 over every base tensor's name, dtype, shape and bytes (the
file layout and sharding do not matter), and optionally the base's weight version;
``apply_delta`` checks both before writing anything and refuses a mismatch. It also
records the new checkpoint's identity and checks the result against it (a corrupted
delta file is refused the same way).

File layout: ``MAGIC``, the compressed blobs one after another, then a JSON index, then
the index length as 8 little-endian bytes (written last, so blobs stream to disk).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"CLDELTA1"
FORMAT = 1


class DeltaError(ValueError):
    """A delta that cannot be made or applied; nothing was written."""


class BaseMismatchError(DeltaError):
    """The base snapshot is not the one the delta was made against."""


# ---- safetensors files, read at the byte level (no torch, no copies of whole files) ----------

def _st_header(path: Path) -> tuple[bytes, dict, int]:
    """(raw header bytes, parsed header, offset where the data region starts)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DeltaError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", prefix)
        raw = f.read(n)
    if len(raw) != n:
        raise DeltaError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DeltaError(f"{path}: unreadable safetensors header ({exc})") from exc
    return raw, header, 8 + n


def _tensor_entries(header: dict) -> list[tuple[str, dict]]:
    """Tensor entries in data-offset order (the order their bytes sit in the file)."""
    entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
    return sorted(entries, key=lambda kv: kv[1]["data_offsets"][0])


class _SafetensorsDir:
    """Byte-level access to every tensor of a checkpoint dir's safetensors files."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise DeltaError(f"{self.path}: no such checkpoint directory")
        self.files = sorted(p for p in self.path.glob("*.safetensors"))
        if not self.files:
            raise DeltaError(f"{self.path}: no safetensors files (deltas are made of safetensors checkpoints)")
        self.where: dict[str, tuple[Path, int, int, str, list[int]]] = {}
        for file in self.files:
            _, header, start = _st_header(file)
            for name, e in _tensor_entries(header):
                a, b = e["data_offsets"]
                self.where[name] = (file, start + a, b - a, e["dtype"], list(e["shape"]))

    def read(self, name: str) -> np.ndarray:
        """The tensor's raw bytes (a uint8 array)."""
        file, offset, length, _, _ = self.where[name]
        with open(file, "rb") as f:
            f.seek(offset)
            data = np.fromfile(f, dtype=np.uint8, count=length)
        if data.size != length:
            raise DeltaError(f"{file}: truncated: {name} needs {length} bytes")
        return data

    def identity(self) -> str:
        """SHA-256 over (name, dtype, shape, bytes) of every tensor, in name order."""
        h = hashlib.sha256()
        for name in sorted(self.where):
            _, _, _, dtype, shape = self.where[name]
            h.update(json.dumps([name, dtype, shape]).encode())
            h.update(self.read(name))
        return h.hexdigest()


def checkpoint_identity(path) -> str:
    """The content hash a delta records for its base (independent of sharding)."""
    return _SafetensorsDir(path).identity()


def _xor(a, b) -> np.ndarray:
    """Bytewise XOR of two equal-length byte buffers."""
    return np.bitwise_xor(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8))


# ---- making a delta ---------------------------------------------------------------------------

def make_delta(base_dir, new_dir, out_path, base_version: str | None = None, new_version: str | None = None,
               level: int = 6) -> dict:
    """Write the delta that turns ``base_dir`` into ``new_dir``; returns a summary
    (``delta_bytes``, ``new_bytes``, ``changed_tensors``, the identities)."""
    base, new_dir = _SafetensorsDir(base_dir), Path(new_dir)
    new = _SafetensorsDir(new_dir)
    out_path = Path(out_path)
    index = {"format": FORMAT, "base": {"identity": base.identity(), "weight_version": base_version},
             "new": {"identity": new.identity(), "weight_version": new_version}, "files": []}
    changed, new_bytes = 0, 0
    tmp = out_path.with_name(out_path.name + ".partial")
    with open(tmp, "wb") as out:
        out.write(MAGIC)

        def blob(data) -> list[int]:
            packed = zlib.compress(data, level)
            at = out.tell()
            out.write(packed)
            return [at, len(packed)]

        for file in sorted(p for p in new_dir.iterdir() if p.is_file()):
            new_bytes += file.stat().st_size
            if file.suffix != ".safetensors":
                index["files"].append({"name": file.name, "kind": "raw", "blob": blob(file.read_bytes())})
                continue
            raw_header, header, start = _st_header(file)
            entry = {"name": file.name, "kind": "safetensors", "header": blob(raw_header), "tensors": []}
            cursor = 0
            for name, e in _tensor_entries(header):
                a, b = e["data_offsets"]
                if a != cursor:  # safetensors packs tensors back to back; anything else is not ours to guess
                    raise DeltaError(f"{file}: gap before {name} in the data region")
                cursor = b
                data = new.read(name)
                same_layout = name in base.where and base.where[name][2] == data.size
                if same_layout:
                    old = base.read(name)
                    if not np.array_equal(old, data):
                        changed += 1
                    data = _xor(data, old)
                else:
                    changed += 1
                entry["tensors"].append({"name": name, "xor": same_layout, "blob": blob(data)})
            if start + cursor != file.stat().st_size:
                raise DeltaError(f"{file}: bytes after the last tensor")
            index["files"].append(entry)
        raw_index = json.dumps(index).encode()
        out.write(raw_index)
        out.write(struct.pack("<Q", len(raw_index)))
    os.replace(tmp, out_path)
    return {"delta_bytes": out_path.stat().st_size, "new_bytes": new_bytes, "changed_tensors": changed,
            "base_identity": index["base"]["identity"], "new_identity": index["new"]["identity"]}


# ---- applying a delta -------------------------------------------------------------------------

def read_index(delta_path) -> dict:
    """The delta's JSON index (identities, versions, files), without reading the blobs."""
    path = Path(delta_path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise DeltaError(f"{path}: not a delta file (bad magic)")
            f.seek(size - 8)
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8 - len(MAGIC):
                raise DeltaError(f"{path}: truncated delta file")
            f.seek(size - 8 - n)
            index = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError) as exc:
        raise DeltaError(f"{path}: unreadable delta file ({exc})") from exc
    if index.get("format") != FORMAT:
        raise DeltaError(f"{path}: delta format {index.get('format')!r}, this code reads {FORMAT}")
    return index


def check_base(base_dir, delta_path, base_version: str | None = None) -> dict:
    """Raise ``BaseMismatchError`` unless ``base_dir`` is the delta's base; returns the index.

    ``base_version``: the label the caller believes the base has; refused if the delta
    recorded a different one (the content hash is checked in every case)."""
    index = read_index(delta_path)
    want = index["base"]
    if base_version is not None and want["weight_version"] is not None and str(base_version) != want["weight_version"]:
        raise BaseMismatchError(f"the delta was made against weight version {want['weight_version']!r}, "
                                f"not {base_version!r}")
    have = checkpoint_identity(base_dir)
    if have != want["identity"]:
        raise BaseMismatchError(f"{base_dir} is not the base this delta was made against (content hash "
                                f"{have[:12]}..., the delta needs {want['identity'][:12]}...): a delta applied to "
                                f"another base gives wrong weights, so it was refused")
    return index


def apply_delta(base_dir, delta_path, out_dir, base_version: str | None = None, checked: dict | None = None) -> dict:
    """Rebuild the new checkpoint from ``base_dir`` and the delta into ``out_dir`` (which
    must not exist yet). The base is checked first (unless ``checked``: the index
    ``check_base`` returned for it just before) and the result last; on any refusal
    ``out_dir`` is not created. Returns the delta's index (identities and versions)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise DeltaError(f"{out_dir} already exists; apply a delta into a new directory")
    index = checked or check_base(base_dir, delta_path, base_version)
    base = _SafetensorsDir(base_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        with open(delta_path, "rb") as f:
            def unblob(ref):
                f.seek(ref[0])
                try:
                    return zlib.decompress(f.read(ref[1]))
                except zlib.error as exc:
                    raise DeltaError(f"{delta_path}: corrupted blob ({exc})") from exc

            for entry in index["files"]:
                if Path(entry["name"]).name != entry["name"]:
                    raise DeltaError(f"{delta_path}: file name {entry['name']!r} is not a plain name")
                with open(work / entry["name"], "wb") as out:
                    if entry["kind"] == "raw":
                        out.write(unblob(entry["blob"]))
                        continue
                    raw_header = unblob(entry["header"])
                    out.write(struct.pack("<Q", len(raw_header)) + raw_header)
                    for t in entry["tensors"]:
                        data = unblob(t["blob"])
                        if t["xor"]:
                            old = base.read(t["name"])
                            if old.size != len(data):
                                raise DeltaError(f"{t['name']}: base has {old.size} bytes, the delta {len(data)}")
                            data = _xor(data, old)
                        out.write(data)
        got = checkpoint_identity(work)
        if got != index["new"]["identity"]:
            raise DeltaError(f"{delta_path}: the rebuilt checkpoint does not match the recorded new identity "
                             f"(a corrupted delta); nothing was written")
        os.replace(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return index
