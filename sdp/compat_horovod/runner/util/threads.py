"""``horovod.runner.util.threads`` on sdp: running functions in background threads.

- ``in_thread(target, args=(), name=None, daemon=True, silent=False) -> threading.Thread``: start
  ``target(*args)`` in a new thread; ``silent`` swallows its exceptions.  ``args`` must be a tuple
  (``ValueError`` otherwise).
- ``on_event(event, func, args=(), stop=None, check_stop_interval_s=1.0, daemon=True,
  silent=False) -> threading.Thread``: call ``func(*args)`` in a thread once ``event`` is set,
  unless ``stop`` is set first (checked every ``check_stop_interval_s`` seconds).  ``ValueError``
  for ``event=None``, non-tuple ``args``, or ``daemon=False`` without ``stop``.
- ``execute_function_multithreaded(fn, args_list, block_until_all_done=True,
  max_concurrent_executions=1000)``: call ``fn(*args)`` for every ``args`` of ``args_list``
  (a list of lists; each list gets its index appended, as in Horovod) on at most
  ``max_concurrent_executions`` threads; returns ``{index: result}`` when blocking (``RuntimeError``
  if some call raised), else ``None``.

Mirrors Horovod's functions of the same names.
"""
import queue
import threading

__all__ = ["execute_function_multithreaded", "in_thread", "on_event"]


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start ``target(*args)`` in a new thread and return the thread (see the module docstring)."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}, for a single argument use (arg,)")
    fn = target
    if silent:
        def fn(*a):
            try:
                target(*a)
            except Exception:
                pass
    thread = threading.Thread(target=fn, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event, func, args=(), stop=None, check_stop_interval_s=1.0, daemon=True, silent=False):
    """Call ``func(*args)`` in a thread once ``event`` is set, unless ``stop`` is set first
    (see the module docstring); returns the thread."""
    if event is None:
        raise ValueError("Event must not be None")
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}, for a single argument use (arg,)")
    if stop is None:
        if not daemon:
            raise ValueError("Stop event must be given for non-daemon event thread")

        def fn():
            event.wait()
            func(*args)
    else:
        def fn():
            while not event.is_set() and not stop.is_set():
                event.wait(timeout=check_stop_interval_s)
            if not stop.is_set():
                func(*args)
    return in_thread(fn, daemon=daemon, silent=silent)


def execute_function_multithreaded(fn, args_list, block_until_all_done=True, max_concurrent_executions=1000):
    """Run ``fn(*args)`` for each ``args`` of ``args_list`` on up to ``max_concurrent_executions``
    threads; ``{index: result}`` when ``block_until_all_done``, else ``None`` (see the module
    docstring)."""
    results_q = queue.Queue()
    work = queue.Queue()
    for i, arg in enumerate(args_list):
        arg.append(i)
        work.put(arg)

    def worker():
        while True:
            try:
                arg = work.get(block=False)
            except queue.Empty:
                return
            results_q.put((arg[-1], fn(*arg[:-1])))

    threads = [in_thread(worker, daemon=not block_until_all_done)
               for _ in range(min(max_concurrent_executions, len(args_list)))]
    if not block_until_all_done:
        return None
    for t in threads:
        while t.is_alive():  # join in slices so that signals (Ctrl-C) are handled
            t.join(0.1)
    results = {}
    while not results_q.empty():
        index, value = results_q.get()
        results[index] = value
    if len(results) != len(args_list):
        raise RuntimeError(f"Some threads for func {getattr(fn, '__name__', fn)} did not complete successfully.")
    return results
