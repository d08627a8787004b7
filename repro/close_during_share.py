"""Storage.close() on one thread while another thread is inside a C call on the same Storage
(share_memory_, copy_, resize_): close() drops the only reference at once, so libshm frees the
storage under the running call. Debug build: abort at storage.c:245 (assert in destroy);
release build: use-after-free of the struct and its pages.
Run: repro/run.sh repro/close_during_share.py [share|copy|resize]"""
import sys, threading, time
import pyshm

what = sys.argv[1] if len(sys.argv) > 1 else "share"
N = 64 << 20
for i in range(30):
    s = pyshm.Storage(N, resizable=(what == "resize"))
    other = pyshm.Storage(N)
    call = {"share": lambda: s.share_memory_(),
            "copy": lambda: s.copy_(other),
            "resize": lambda: s.resize_(2 * N)}[what]
    def run():
        try:
            call()
        except ValueError:
            pass  # "operation on a closed pyshm.Storage": the clean outcome
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.001 * (i % 6))
    s.close()  # any thread may close a Storage; it should never free memory in use
    t.join()
print("no crash")
