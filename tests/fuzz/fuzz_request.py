"""Coverage-guided fuzzer (atheris) for the fd server's request parser and its access rules.

    python tests/fuzz/fuzz_request.py [libFuzzer options] CORPUS_DIR_OR_FILES...

The process exports three memfds (two writable, one sealed read-only), and before each input
begins a batch (a pickled message) naming them. An input is either raw bytes sent as a request
or, through atheris' FuzzedDataProvider, a request built from real and fake keys, secrets and
batch proofs and then damaged (a flipped byte, a cut, junk appended). Properties, for any input:
  - pyshm._channel.serve answers or raises ValueError; nothing else escapes (the server thread
    catches nothing but that, and would die);
  - the reply has one status byte per fetch, a flags byte and whole extra records;
  - an fd is handed out only for an item whose secret was issued for that memfd (bound to
    this server's address: for_server), a read-only secret only for a memfd sealed against
    writes; extras only with the batch's own proof and only for that batch's memfds; a fetch
    with a proof that matches nothing gives no extras.
A broken property raises AssertionError, which atheris reports as a crash (input saved).
"""

import fcntl
import os
import sys

import atheris
import numpy as np

with atheris.instrument_imports(include=["pyshm._channel"]):
    import pyshm
    from pyshm import _channel as C
    from pyshm import reduction
    from pyshm._memory import owner_of as _owner_of

ARRAYS = [
    pyshm.share_memory_(pyshm.zeros(70_000, np.uint8)),
    pyshm.share_memory_(pyshm.zeros(80_000, np.uint8)),
    pyshm.share_readonly(pyshm.copy(np.zeros(90_000, np.uint8))),
]
TICKETS = [reduction._export(_owner_of(a)) for a in ARRAYS]
KEYS = [t.key for t in TICKETS]
ISSUED = {}  # (key, secret) -> read-only?
BOUND = {}  # (key, secret as a request to this server carries it) -> read-only?
for t in TICKETS:
    rw, ro = C.state.secrets[t.key][:2]
    ISSUED[(t.key, rw)] = False
    ISSUED[(t.key, ro)] = True
    BOUND[(t.key, C.for_server(rw, C.own_address()))] = False
    BOUND[(t.key, C.for_server(ro, C.own_address()))] = True
SEALED = {k: bool(fcntl.fcntl(pyshm.storage_of(a).fd, fcntl.F_GET_SEALS) & C.WRITE_SEALS)
          for k, a in zip(KEYS, ARRAYS)}
INODES = {k[1]: k for k in KEYS}


def new_batch():
    """A batch naming the three memfds, as pickling a message of them would make."""
    _, (_, batch_id, secret) = C.mark().__reduce__()
    batch = C.state.batches[batch_id]
    for t in TICKETS:
        batch.members[t.key] = [t.holder, t.readonly]
    return (batch_id, secret)


def build(fdp, proof):
    """A request from real and fake parts, maybe damaged."""
    secrets = [s for (_, s) in ISSUED] + [bytes(16), b"\xff" * 16]
    fetches = []
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        if fdp.ConsumeBool():
            key = KEYS[fdp.ConsumeIntInRange(0, len(KEYS) - 1)]
        else:
            key = (fdp.ConsumeIntInRange(0, 2**64 - 1), fdp.ConsumeIntInRange(0, 2**64 - 1))
        if fdp.ConsumeBool():
            secret = secrets[fdp.ConsumeIntInRange(0, len(secrets) - 1)]
        else:
            secret = fdp.ConsumeBytes(16).ljust(16, b"\0")
        fetches.append((key, secret))
    choice = fdp.ConsumeIntInRange(0, 3)
    use = {0: None, 1: proof, 2: (proof[0], bytes(16)),
           3: (fdp.ConsumeIntInRange(1, 2**64 - 1), fdp.ConsumeBytes(16).ljust(16, b"\0"))}
    acks = [proof] if fdp.ConsumeIntInRange(0, 7) == 0 else []
    request = C.build_request(use[choice], fetches, acks, fdp.ConsumeIntInRange(0, 2**32 - 1),
                              C.own_address())
    damage = fdp.ConsumeIntInRange(0, 3)
    if damage == 1 and request:
        i = fdp.ConsumeIntInRange(0, len(request) - 1)
        request = request[:i] + bytes([request[i] ^ fdp.ConsumeIntInRange(1, 255)]) + request[i + 1:]
    elif damage == 2:
        request = request[: fdp.ConsumeIntInRange(0, len(request))]
    elif damage == 3:
        request = request + fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 64))
    return request


def TestOneInput(data: bytes) -> None:
    proof = new_batch()
    fdp = atheris.FuzzedDataProvider(data)
    request = build(fdp, proof) if fdp.ConsumeBool() else fdp.ConsumeBytes(4096)
    try:
        reply, fds, _holders = C.serve(request)
    except ValueError:
        C.release_batch(*proof)
        return
    parsed_proof, fetches, _, max_extras = C.parse_request(request)
    n = len(fetches)
    assert len(reply) >= n + 1 and (len(reply) - n - 1) % C._EXTRA.size == 0, "reply shape"
    extras = [C._EXTRA.unpack_from(reply, n + 1 + i)
              for i in range(0, len(reply) - n - 1, C._EXTRA.size)]
    assert len(extras) <= max_extras
    expected = 0
    for status, item in zip(reply[:n], fetches):
        allowed = item in BOUND and (not BOUND[item] or SEALED[item[0]])
        assert status in (0, 1) and (status == 0 or allowed), f"fd for {item!r}"
        expected += status
    if extras:
        assert parsed_proof == proof and any(reply[:n]), "extras without the batch's proof"
        assert all((dev, ino) in KEYS for dev, ino, _ in extras), "extra outside the batch"
    assert len(fds) == expected + len(extras)
    for fd in fds:
        assert os.fstat(fd).st_ino in INODES
    C.release_batch(*proof)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
