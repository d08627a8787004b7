"""A token whose layout does not fit its byte range (a damaged pickle, or a receiver that
edits its own token) must be an UnpicklingError ("Bad input ... is an error, never a crash").
pyshm's own check (_fits) says no, but then hands the layout to np.ndarray(buffer=...,
strides=...), whose check numpy skips for an empty buffer and which wraps around for huge
negative strides: the array points outside the mapping (heap, arbitrary addresses)."""
import pickle, subprocess, sys
import numpy as np
import pyshm

a = pyshm.zeros(1 << 16, np.uint8, shared=True)
a[:] = 5
child = r'''
import sys, pickle, numpy as np, pyshm
from pyshm import reduction
t = bytes.fromhex(sys.stdin.read())
cap = []
real = reduction.rebuild_ndarray
reduction.rebuild_ndarray = lambda *args: cap.append(args)
pickle.loads(t)
reduction.rebuild_ndarray = real
batch, token, *_ = cap[0]
key, addr, size, off, nb, ro, sec, solo = token
for label, tok, shape, strides in [
        ("0-byte range", (key, addr, size, 0, 0, ro, sec, solo), (1 << 16,), (8,)),
        ("huge negative stride", token, (5,), (-(1 << 62),))]:
    try:
        arr = reduction.rebuild_ndarray(batch, tok, shape, np.dtype("f8"), strides, 0, True)
    except pickle.UnpicklingError as exc:
        print(label, "-> UnpicklingError (as promised):", exc, flush=True)
        continue
    m = reduction._cache.mappings.get(key)
    print(label, "-> an array at", hex(arr.ctypes.data), "; the memfd is mapped at",
          hex(m.data), "+", hex(m.size), "; writing it...", flush=True)
    arr[1] = 1.0  # (one element, outside the mapping)
    print("wrote outside the mapping", flush=True)
'''
out = subprocess.run([sys.executable, "-c", child], input=pickle.dumps(pyshm.ref(a)).hex(),
                     capture_output=True, text=True, timeout=20)
print(out.stdout, out.stderr[-1500:], "receiver exit status:", out.returncode)
