"""What the command-line tools use beside the loop: pre-flight checks, the memory planner, launches of
one config forked from one process."""
