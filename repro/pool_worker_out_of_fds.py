"""A Pool worker with no fd left (RLIMIT_NOFILE) cannot receive the shared arrays of its task:
the DeliveryError kills the worker inside multiprocessing's get(), the task is lost and apply() waits for
ever (prints HANG). Run: repro/run.sh repro/pool_worker_out_of_fds.py fork|spawn"""
import numpy as np, pyshm, multiprocessing as mp, sys, os, resource
def init():
    n = len(os.listdir('/proc/self/fd'))
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
def f(*arrs): return [float(a.sum()) for a in arrs]
if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    arrs = [pyshm.empty(1 << 20, np.uint8, shared=True) for _ in range(8)]
    with ctx.Pool(1, initializer=init) as pool:
        r = pool.apply_async(f, tuple(arrs))
        try: print("got", r.get(timeout=30))
        except mp.TimeoutError: print("HANG: task lost (worker died unpickling it)")
        except Exception as e: print("ERR", type(e).__name__, str(e)[:300])
        pool.terminate()
