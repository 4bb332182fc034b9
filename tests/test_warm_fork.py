"""The one fork primitive (sparse_rl_mega/runtime/warm_fork.py): a child of the warm server behaves as the
fresh interpreter its caller would have started (argv, environment, working folder, output, exit code,
``atexit``, threads), from a server forked from a one-thread caller or started as a new interpreter from a
caller with threads; and it dies with its parent."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, alive

pytestmark = pytest.mark.unit

# a script as a user's tool: argv, a variable, the working folder, output on both streams, a thread that
# finishes before the end, an atexit handler, an exit code
SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    print("argv", sys.argv[1:], "var", os.environ.get("WARM_FORK_VAR"), "cwd", os.getcwd(), flush=True)
    print("to stderr", file=sys.stderr)
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
    atexit.register(lambda: print("atexit ran", flush=True))
    sys.exit(int(sys.argv[1]))
""")

# the caller: runs SCRIPT through the primitive (a WarmProcess running it as a script) and says how the
# server came to be; with "threads", another thread runs here first (the server is then a new interpreter)
CALLER = textwrap.dedent("""
    import os, sys, threading
    sys.path.insert(0, {root!r})
    from sparse_rl_mega.runtime import warm_fork

    if __name__ == "__main__":  # (multiprocessing imports the caller's main module in a child)
        if sys.argv[1] == "threads":
            threading.Thread(target=threading.Event().wait, daemon=True).start()
        assert warm_fork.start_server(["json"])
        os.environ["WARM_FORK_VAR"] = "set after the server"
        os.chdir(sys.argv[2])
        child = warm_fork.WarmProcess(target=warm_fork.run_script, args=(sys.argv[3], ["3", "x"]))
        child.start()
        child.join()
        print("how", warm_fork.how_started(), "exit", child.exitcode, file=sys.stderr, flush=True)
""")


def _run(command, cwd, env=None):
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode", ["forked", "started"])
def test_a_child_behaves_as_a_fresh_interpreter(tmp_path, mode):
    script, caller = tmp_path / "tool.py", tmp_path / "caller.py"
    script.write_text(SCRIPT)
    caller.write_text(CALLER.format(root=str(ROOT)))
    work = tmp_path / "work"
    work.mkdir()
    fresh = _run([sys.executable, script, "3", "x"], work, {"WARM_FORK_VAR": "set after the server"})
    assert fresh.returncode == 3
    forked = _run([sys.executable, caller, "threads" if mode == "started" else "one", work, script], tmp_path)
    how = f"how {mode} exit 3\n"
    assert forked.stderr.endswith(how), forked.stderr[-3000:]
    assert forked.stdout == fresh.stdout, (forked.stdout, fresh.stdout)
    assert forked.stderr[:-len(how)] == fresh.stderr
    assert fresh.stdout.splitlines()[-2:] == ["thread done", "atexit ran"]  # (threads joined, then atexit)


PARENT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from sparse_rl_mega.runtime import warm_fork

    if __name__ == "__main__":
        warm_fork.start_server()
        child = warm_fork.WarmProcess(target=time.sleep, args=(120,))
        child.start()
        print(warm_fork.server_pid(), child.pid, flush=True)
        time.sleep(120)
""")


def test_a_child_dies_with_its_parent(tmp_path):
    """The caller killed (SIGKILL: nothing of it runs): its server and the server's child end with it."""
    caller = tmp_path / "parent.py"
    caller.write_text(PARENT.format(root=str(ROOT)))
    with subprocess.Popen([sys.executable, caller], stdout=subprocess.PIPE, text=True) as parent:
        server, child = map(int, parent.stdout.readline().split())
        assert alive([server, child]) == [server, child]
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
    deadline = time.monotonic() + 10
    while alive([server, child]) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive([server, child])
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"outlived their parent: {left} (server {server}, child {child})"


# a test session that leaves an orphan: a process in a session of its own whose parent (bash) has ended
ORPHANING_TEST = textwrap.dedent("""
    import subprocess, sys, time

    import pytest

    @pytest.mark.unit  # (no warm server: tests/conftest.py)
    def test_orphan(tmp_path):
        subprocess.run(["bash", "-c", f"setsid {sys.executable} -c 'import time; time.sleep(300)' {TOKEN!r} &"])
        open({ready!r}, "w").close()
        time.sleep(300)
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_test_session_leaves_no_process(tmp_path, signum):
    """A session stopped by SIGTERM (a CI timeout) or SIGINT (Ctrl-C) ends every process it started, also one
    whose parent had ended (tests/conftest.py: the session's process is their subreaper)."""
    import psutil

    token, ready, log = f"orphan-{os.getpid()}-{int(signum)}", tmp_path / "ready", tmp_path / "session.log"
    (tmp_path / "test_orphan.py").write_text(ORPHANING_TEST.replace("{TOKEN!r}", repr(token)).replace(
        "{ready!r}", repr(str(ready))))
    orphans = []
    # the session as a terminal starts it: SIGINT handled by Python and not blocked, whatever this worker's
    # state (an ignored SIGINT is inherited through exec, and Python then leaves it ignored)
    start = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM]); "
             "sys.exit(pytest.main(sys.argv[1:]))")
    with open(log, "w") as out:
        session = subprocess.Popen([sys.executable, "-c", start, "-p", "tests.conftest", "-n", "0", "-q",
                                    "-p", "no:cacheprovider", str(tmp_path / "test_orphan.py")], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and session.poll() is None:
            time.sleep(0.05)
        orphans = [p.pid for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or [])]
        assert ready.exists() and len(orphans) == 1, log.read_text()[-3000:]
        assert psutil.Process(orphans[0]).ppid() == session.pid  # (re-parented to the session's process, not init)
        session.send_signal(signum)
        try:
            session.wait(timeout=60)
        except subprocess.TimeoutExpired:
            status = {k: v.strip() for k, _, v in (line.partition(":") for line in
                      Path(f"/proc/{session.pid}/status").read_text().splitlines()) if k in ("State", "SigBlk",
                                                                                             "SigIgn", "SigCgt")}
            raise AssertionError(f"the session did not end within 60 s of {signal.Signals(signum).name} "
                                 f"({status}): {log.read_text()[-3000:]}") from None
        time.sleep(0.2)
        assert alive(orphans) == [], log.read_text()[-3000:]
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
            session.wait()
        for pid in alive(orphans):
            os.kill(pid, signal.SIGKILL)
