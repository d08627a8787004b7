"""An array of a zero-size dtype ('V0', itemsize 0: size 3, nbytes 0) of pyshm memory, sent to
a multiprocessing Pool worker: the receiver cannot rebuild it ("array does not fit its storage:
strides is incompatible"), the worker dies while unpickling the task, and apply() waits for
ever. numpy's own pickling of the same array works.
Run: repro/run.sh repro/zero_itemsize_to_pool.py"""
import multiprocessing as mp
import pickle

import numpy as np
import pyshm

if __name__ == "__main__":
    a = pyshm.empty(3, "V0")
    print("size", a.size, "nbytes", a.nbytes, "plain pickle:",
          pickle.loads(pickle.dumps(a)).shape)
    with mp.get_context("fork").Pool(1) as pool:
        try:
            print("worker got shape", pool.apply_async(np.shape, (a,)).get(timeout=20))
        except mp.TimeoutError:
            print("HANG: the worker died unpickling the task; apply() never returns")
            pool.terminate()
