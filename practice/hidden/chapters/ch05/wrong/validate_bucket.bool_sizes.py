# Checks each field's type itself, a shape's sizes with isinstance(d, int): True and False
# pass as sizes 1 and 0.
def _fields_ok(m):
    if not isinstance(m, FlattenedTensorMetadata):
        raise BucketError(f"metadata entries must be FlattenedTensorMetadata, got {type(m).__name__}")
    if not isinstance(m.name, str):
        raise BucketError(f"metadata name {m.name!r} is not a string")
    if not isinstance(m.dtype, torch.dtype):
        raise BucketError(f"{m.name}: dtype {m.dtype!r} is not a torch dtype")
    for field in ("start_idx", "end_idx", "numel"):
        if type(getattr(m, field)) is not int:
            raise BucketError(f"{m.name}: {field} is not an integer")
    if not isinstance(m.shape, (tuple, list)) or not all(isinstance(d, int) and d >= 0 for d in m.shape):
        raise BucketError(f"{m.name}: shape {m.shape!r} is not a tuple of integers")

if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
    raise BucketError("flattened_tensor must be a 1-D tensor")
if flat.device.type not in DEVICES:
    raise BucketError(f"flattened_tensor is on device {flat.device.type!r}; only {DEVICES} are accepted")
if not isinstance(metadata, (list, tuple)):
    raise BucketError(f"metadata must be a list, got {type(metadata).__name__}")
n = flat.numel()
byte_layout = flat.dtype == torch.uint8
seen = set()
for m in metadata:
    _fields_ok(m)
    if m.name in seen:  # two entries for one weight: which one wins would be an accident
        raise BucketError(f"{m.name}: appears more than once in the bucket")
    seen.add(m.name)
    if _numel(m.shape) != m.numel:
        raise BucketError(f"{m.name}: numel {m.numel} does not match shape {tuple(m.shape)}")
    if not (0 <= m.start_idx <= m.end_idx <= n):
        raise BucketError(f"{m.name}: offsets [{m.start_idx}, {m.end_idx}) overrun the buffer of {n} elements")
    span = m.end_idx - m.start_idx
    if byte_layout and m.dtype != torch.uint8:
        if span != m.numel * m.dtype.itemsize:
            raise BucketError(f"{m.name}: {span} bytes for {m.numel} {m.dtype} elements")
        if m.start_idx % m.dtype.itemsize:
            raise BucketError(f"{m.name}: start offset {m.start_idx} is not aligned to {m.dtype}")
    elif span != m.numel:
        raise BucketError(f"{m.name}: {span} elements for numel {m.numel}")