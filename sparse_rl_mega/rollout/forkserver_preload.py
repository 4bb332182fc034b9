"""Imported first by the engines' forkserver (``rollout/forkserver.py``), only there: the server
ignores SIGQUIT, which a failing SGLang process sends to its parent (the server). Without this, one
engine's failure would end the server, and with it (``PR_SET_PDEATHSIG``) every other engine it
forked. Each forked process restores SIGQUIT's default before it runs."""
import signal

signal.signal(signal.SIGQUIT, signal.SIG_IGN)
