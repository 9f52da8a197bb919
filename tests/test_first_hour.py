"""A new user's first hour (issue 26): the quick start's one-import script with ``opt.variables()``
on Keras 3 and tf_keras, ``--help`` of every example before TensorFlow loads, progress lines
within seconds of training, and a quiet Ctrl-C of a 2-rank MNIST run."""
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name not in ("common.py", "mnist_data.py"))

# The README's "change one import" script, as a Horovod user writes it (no --compat).
ONE_IMPORT = """\
import tensorflow as tf
import sdp.tensorflow as hvd          # was: import horovod.tensorflow as hvd

hvd.init()
hvd.init()                            # a no-op, as in Horovod
model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(2)])
opt = tf.keras.optimizers.Adam(0.001 * hvd.size())
tf.keras.utils.set_random_seed(hvd.rank())
x, y = tf.random.normal((8, 4)), tf.random.normal((8, 2))
with tf.GradientTape() as tape:
    loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
tape = hvd.DistributedGradientTape(tape)
opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
hvd.broadcast_variables(model.variables, root_rank=0)
hvd.broadcast_variables(opt.variables(), root_rank=0)     # Horovod's spelling
hvd.broadcast_variables(opt.variables, root_rank=0)       # Keras 3's
total = sum(float(tf.reduce_sum(v)) for v in model.variables + list(opt.variables))
print(f"rank {hvd.rank()}: {type(opt).__module__} {len(opt.variables())} optimizer variables, sum {total:.6f}")
"""


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.mark.parametrize("legacy", [False, True], ids=["keras3", "tf_keras"])
def test_one_import_script_with_opt_variables_called(tmp_path, legacy):
    pytest.importorskip("tensorflow")
    if legacy:
        pytest.importorskip("tf_keras")
    script = tmp_path / "train.py"
    script.write_text(ONE_IMPORT)
    env = _env(**({"TF_USE_LEGACY_KERAS": "1"} if legacy else {}))
    env.pop("SDP_COMPAT", None)
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, str(script)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = [ln.split(":", 1)[1] for ln in p.stdout.splitlines() if "optimizer variables" in ln]
    assert len(lines) == 2, p.stdout
    assert ("tf_keras." if legacy else "keras.") in lines[0]
    # after the broadcasts both ranks hold rank 0's model and optimizer state
    assert lines[0].split(":", 1)[1] == lines[1].split(":", 1)[1], lines


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_help_is_fast_and_shows_defaults(example):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(example), "--help"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    assert elapsed < 2.0, f"{example.name} --help took {elapsed:.1f} s"
    assert "tensorflow" not in p.stderr.lower()
    assert "(default:" in p.stdout
    # the description is the docstring's whole first paragraph, ending a sentence
    description = p.stdout.split("\n\n")[1].strip()
    assert description.endswith((".", ":", ")")), description


class _Lines:
    """The merged output of a process, line by line, with the time each line arrived."""

    def __init__(self, proc):
        self.q = queue.Queue()
        self.all = []
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, pipe):
        for line in iter(pipe.readline, ""):
            self.q.put((time.monotonic(), line.rstrip("\n")))
        self.q.put((time.monotonic(), None))

    def until(self, predicate, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t, line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                return None, None
            self.all.append((t, line))
            if predicate(line):
                return t, line
        raise AssertionError("no such line in time; got:\n" + "\n".join(ln for _, ln in self.all[-30:]))


def _mnist_dir():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from mnist_data import find_mnist_dir
    finally:
        sys.path.pop(0)
    return find_mnist_dir()


@pytest.mark.slow
def test_mnist_progress_then_quiet_ctrl_c(tmp_path):
    """2-rank MNIST: a progress line (images/s) within 15 s of "training on"; then SIGINT to
    sdprun: at most 6 lines after it (one "interrupted at step N" per rank), exit 130 within
    5 s, no rank process and no /dev/shm file of the job left."""
    pytest.importorskip("tensorflow")
    psutil = pytest.importorskip("psutil")
    mnist = _mnist_dir()
    if mnist is None:
        pytest.skip("MNIST not found: set SDP_MNIST_DIR or provide ../shared/data/mnist")
    proc = subprocess.Popen([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable,
                             "examples/tf2_mnist.py", "--data-dir", str(mnist)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out = _Lines(proc)
        t_train, _ = out.until(lambda ln: "training on 2 rank(s)" in ln, timeout=180)
        t_progress, line = out.until(lambda ln: "images/s" in ln, timeout=60)
        assert t_progress - t_train < 15, line
        out.until(lambda ln: "images/s" in ln and "/468" in ln, timeout=30)  # training goes on
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) >= 2
        job = ranks[0].environ()["SDP_JOB_ID"]
        before = len(out.all)
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        t_end = time.monotonic()
        while True:
            _, ln = out.q.get(timeout=10)
            if ln is None:
                break
            out.all.append((time.monotonic(), ln))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    after = [ln for _, ln in out.all[before:]]
    assert rc == 130, after
    assert t_end - t_sig < 5, f"{t_end - t_sig:.1f} s"
    assert len(after) <= 6, after
    for rank in (0, 1):
        assert any(f"rank {rank}: interrupted at step " in ln for ln in after), after
    assert not any("Traceback" in ln for ln in after), after
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not [f for f in os.listdir("/dev/shm") if job in f]  # (other jobs may run beside this one)


@pytest.mark.parametrize("family,line", [("horovod", "import horovod.tensorflow as hvd"),
                                          ("kungfu", "from kungfu.python import current_rank")])
def test_unmodified_script_without_compat_is_told_to_add_it(family, line):
    """Issue 54 item 7: a Horovod/KungFu import without ``--compat`` ends in one sdprun line that
    says which ``--compat`` to add; with the flag given, no such line."""
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, "-c", line],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"No module named '{family}" in p.stderr
    hints = [ln for ln in p.stderr.splitlines() if f"add --compat {family}" in ln]
    assert len(hints) == 1 and hints[0].startswith("sdprun ERROR:"), p.stderr[-3000:]
    assert p.stderr.rstrip().endswith(hints[0])  # the last thing the user reads


MISMATCH_IN_GRAPH = """\
import tensorflow as tf
import sdp.tensorflow as hvd
hvd.init()

@tf.function
def step(x):
    return hvd.allreduce(x, name="grad")

step(tf.ones([4 + hvd.rank()]))
"""


def test_an_error_is_one_line_per_rank(tmp_path):
    """Issue 54 item 9: a mismatch in a graph collective ends each rank with sdp's message once,
    naming the script's line, no traceback (TensorFlow's aborting-rendezvous warning left out);
    with SDP_LOG_LEVEL=debug the traceback is back (here: the numpy API, no TensorFlow)."""
    pytest.importorskip("tensorflow")
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH_IN_GRAPH)
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, str(script)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 1, p.stderr[-3000:]
    for rank in (0, 1):
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith(f"[{rank}]<stderr>:")]
        useful = [ln for ln in lines if "shape mismatch, rank 0 has [4], rank 1 has [5]" in ln]
        assert len(useful) == 1, p.stderr[-4000:]
        assert f"rank {rank}: FailedPreconditionError: allreduce of 'grad'" in useful[0]
        assert f"{script}, line 9" in useful[0] and "SDP_LOG_LEVEL=debug" in useful[0]
    assert "Traceback" not in p.stderr and "rendezvous" not in p.stderr, p.stderr[-3000:]
    numpy_script = tmp_path / "mismatch_np.py"
    numpy_script.write_text("import numpy as np, sdp\nsdp.init()\nsdp.allreduce(np.ones(4 + sdp.rank()), name='g')\n")
    p = subprocess.run([sys.executable, "-m", "sdp.launcher.cli", "-np", "2", sys.executable, str(numpy_script)],
                       cwd=ROOT, env=_env(SDP_LOG_LEVEL="debug"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.count("Traceback (most recent call last)") == 2, p.stderr[-3000:]


# ---------------------------------------------------------------- issue 54 item 2: MNIST offline

def _mnist_data(monkeypatch, tmp_path):
    """examples/mnist_data.py with Keras' cache in tmp_path, no IDX directory found, no proxy."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import mnist_data
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    monkeypatch.setattr(mnist_data, "find_mnist_dir", lambda: None)
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY", "all_proxy",
                "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    return mnist_data


def test_mnist_offline_says_in_one_line_what_to_pass_and_keeps_a_users_file(monkeypatch, tmp_path):
    mnist_data = _mnist_data(monkeypatch, tmp_path)
    # offline: the only way out is a proxy on a loopback port nothing listens on
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{closed_port}")
    with pytest.raises(SystemExit) as e:
        mnist_data.load_sharded(None, 0, 2)
    message = str(e.value.code)
    assert "\n" not in message and "--data-dir" in message and "SDP_MNIST_DIR" in message, message
    assert not list((tmp_path / "keras" / "datasets").iterdir())  # no partial file left
    # a file of the user's at Keras' path that is not Keras' MNIST: named, never replaced or deleted
    users = mnist_data.keras_cache_path()
    users.write_bytes(b"my own mnist.npz")
    with pytest.raises(SystemExit) as e:
        mnist_data.load_mnist(None)
    assert str(users) in str(e.value.code) and "--data-dir" in str(e.value.code)
    assert users.read_bytes() == b"my own mnist.npz"


def test_mnist_download_once_for_processes_sharing_the_cache(monkeypatch, tmp_path):
    import io
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import numpy as np
    mnist_data = _mnist_data(monkeypatch, tmp_path)
    buf = io.BytesIO()
    np.savez(buf, x_train=np.ones((4, 28, 28), np.uint8), y_train=np.arange(4, dtype=np.uint8),
             x_test=np.zeros((2, 28, 28), np.uint8), y_test=np.arange(2, dtype=np.uint8))
    body = buf.getvalue()
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            time.sleep(0.3)  # a slow download: the other callers arrive meanwhile
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        import hashlib
        monkeypatch.setattr(mnist_data, "MNIST_URL", f"http://127.0.0.1:{server.server_address[1]}/mnist.npz")
        monkeypatch.setattr(mnist_data, "MNIST_SHA256", hashlib.sha256(body).hexdigest())
        results = []
        callers = [threading.Thread(target=lambda: results.append(mnist_data.load_mnist(None))) for _ in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert len(requests) == 1 and len(results) == 3
    for (x, y), (xt, yt) in results:
        assert x.shape == (4, 28, 28) and list(yt) == [0, 1]
    assert [p.name for p in (tmp_path / "keras" / "datasets").iterdir()] == ["mnist.npz"]


def test_front_pages_quote_no_figures_that_go_stale():
    """Issue 54 item 3: no test-suite counts (they change with every test added) and no accuracy
    for the elastic example (it depends on when a worker is killed) on the pages a newcomer reads."""
    import re
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    for page in pages:
        text = page.read_text()
        counts = re.findall(r"\b\d+ (?:passed|skipped|failed|deselected|errors?)\b", text)
        assert not counts, (page.name, counts)
        for line in text.splitlines():
            if "tf2_mnist_elastic" in line or "trained once" in line:
                assert not re.search(r"accuracy:? 0\.\d", line), (page.name, line)
    # item 10: the calling-thread device route has run on GPUs (benchmarks/README.md records it)
    assert "first run on a\nGPU" in (ROOT / "benchmarks" / "README.md").read_text()
    assert "not yet run on a GPU" not in " ".join((ROOT / "docs" / "gpu.md").read_text().split())


def test_building_the_fast_lane_ahead_prints_only_its_path():
    """Issue 54 item 10: ``python -m sdp.engine.native`` without runpy's RuntimeWarning."""
    p = subprocess.run([sys.executable, "-m", "sdp.engine.native", "--print-path"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.strip().endswith(".so"), p.stdout


def _examples_module(name):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_progress_leaves_the_first_step_out_of_eta_and_rate():
    """Issue 54 items 4 and 10: a 20 s first step (tracing, building sdp's op) is reported on a
    line of its own and shows in no estimate; images/s is a whole number; the last line's rate
    agrees with the steps' time."""
    import io
    import re
    common = _examples_module("common")
    now = [0.0]
    out = io.StringIO()
    progress = common.Progress(100, 0, 64, clock=lambda: now[0], out=out)
    now[0] = 20.0
    progress.update(1, 2.3)
    for step in range(2, 101):
        now[0] += 0.1
        progress.update(step, 1.0)
    lines = [ln for ln in out.getvalue().replace("\r", "\n").splitlines() if ln.strip()]
    assert lines[0].startswith("first step: 20.0 s"), lines[:3]
    assert lines[1].lstrip().startswith("2/100"), lines[:3]
    for ln in lines[1:]:
        left = re.search(r"(\S+) left", ln)
        assert left is None or left.group(1).endswith("s") and int(left.group(1)[:-1]) <= 10, ln
        assert re.search(r" - 640 images/s$", ln), ln  # 64 images per 0.1 s, printed as a whole number
    assert lines[-1].lstrip().startswith("100/100") and out.getvalue().endswith("\n")
    quiet = io.StringIO()
    common.Progress(100, 1, 64, out=quiet).update(1, 1.0)  # other ranks print nothing
    assert quiet.getvalue() == ""


def test_building_the_tf_op_is_announced(monkeypatch, tmp_path, caplog):
    """Issue 54 item 4: the first graph collective's build of sdp's TensorFlow op (10-30 s) says
    so before it starts; a library already there is used without a word."""
    pytest.importorskip("tensorflow")
    import logging

    from sdp.common import native_build
    from sdp.tensorflow import build_ops
    target = tmp_path / "tf_ops" / "libsdp_ops.so"
    monkeypatch.setattr(build_ops, "library_path", lambda: target)
    monkeypatch.setattr(build_ops, "compiler", lambda: ["c++"])
    built = []

    def compile_it(out, argv, force=False):  # (the compiler's part; the build's own test is in test_tf_call_op)
        built.append(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"")
        return out

    monkeypatch.setattr(native_build, "build", compile_it)
    with caplog.at_level(logging.WARNING, logger="sdp.tensorflow"):
        assert build_ops.build() == target and built == [target]
        said = [r.getMessage() for r in caplog.records if "building sdp's TensorFlow op" in r.getMessage()]
        assert len(said) == 1 and "python -m sdp.tensorflow.build_ops" in said[0], said
        caplog.clear()
        assert build_ops.build() == target and built == [target]  # there: no build, no word
        assert not [r for r in caplog.records if "building" in r.getMessage()]
