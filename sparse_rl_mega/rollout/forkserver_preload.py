"""Imported first by the engines' forkserver (``rollout/forkserver.py``), only there.

* The server asks for SIGKILL when the process that started it ends, however it ends (its engines'
  processes, which ask the same of the server, then follow): multiprocessing's own signal, EOF on a
  pipe, never comes while those processes live, as they inherit the pipe.
* It ignores SIGQUIT, which a failing SGLang process sends to its parent (the server): otherwise one
  engine's failure would end the server and with it every other engine it forked. Each forked process
  restores SIGQUIT's default before it runs (``EngineProcess.run``)."""
import signal

from sparse_rl_mega.runtime.jobs import die_with_parent

signal.signal(signal.SIGQUIT, signal.SIG_IGN)
die_with_parent()
