"""copy.copy() of a pyshm array's .base (its ArrayOwner, reachable by any user as a.base) makes
a second owner with the same storage handle but no reference of its own; arrays built on the
copy outlive the memory: once the original array is gone the storage is freed (the pages
unmapped), and reading through the copy's array faults (SIGSEGV).
Run: repro/run.sh repro/copy_array_owner.py"""
import copy
import gc

import numpy as np
import pyshm

a = pyshm.empty(4 << 20, np.uint8)   # 4 MiB: its own mapping, unmapped when freed
a[:] = 7
owner_copy = copy.copy(a.base)
b = np.asarray(owner_copy)           # an ndarray whose base chain is pyshm's owner type
print("refcount with the copy alive:", pyshm.storage_of(b).refcount)
del a
gc.collect()
print("reading the copy's array after the original is gone ...", flush=True)
print(int(b.sum()))                  # SIGSEGV: the storage was freed under it
