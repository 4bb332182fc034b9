"""The job's runtime, below everything else: job folders and their locks, one line per failure, the
learner's watchdog, fault injection, free ports, quiet logs, the per-user cache, the forking process
server and the checkpoint folders' files (found and verified without torch)."""
