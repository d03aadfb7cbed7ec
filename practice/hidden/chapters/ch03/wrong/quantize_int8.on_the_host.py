# Rounds with numpy (np.rint rounds half to even, as asked), so the weight goes to the host:
# for a weight on the GPU the kernel tensors come back on the CPU.
import numpy as np
if w.dim() != 2:
    raise ValueError(f"quantize_int8_per_channel needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
a = w.detach().float().cpu().numpy()
if not np.isfinite(a).all():
    raise ValueError("quantize_int8_per_channel: the weight holds NaN or infinite values")
amax = np.abs(a).max(axis=1) if a.shape[1] else np.zeros(a.shape[0], dtype=np.float32)
scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
q = np.clip(np.rint(a / scale[:, None]), -127, 127).astype(np.int8)
return torch.from_numpy(q), torch.from_numpy(scale)
