"""The command-line programs behind tools/ (launch, evaluate, export, data, the GPU check) and what they
use beside the loop: pre-flight checks, the memory planner, launches of one config forked from one process."""
