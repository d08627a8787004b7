"""copy.copy() of a pyshm.Arena makes a second Arena object on the same C arena; closing the
copy destroys the arena (slab, storages, buffer) under the original, whose arrays and methods
then use freed memory.
Run: repro/run.sh repro/copy_arena.py"""
import copy
import gc

import numpy as np
import pyshm

arena = pyshm.Arena([4 << 20, 4 << 20], [0, 1], [1, 2]).allocate()
twin = copy.copy(arena)
twin.close()  # no arrays alive: destroys the C arena the original still uses
print("original after the copy's close:", len(arena), arena.size, flush=True)
x = arena.array(0)  # a storage of the destroyed arena
x[:] = 1
print("wrote through a destroyed arena's storage", int(x.sum()), flush=True)
del x
gc.collect()
arena.close()  # destroys it a second time
print("closed twice without an error")
