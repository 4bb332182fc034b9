"""``torchrun --nproc-per-node N SCRIPT ARGS`` on this node (loopback rendezvous, a free port), its
ranks forked from this process after it imported what the learner helper scripts use once, as
``tools/launch.py`` runs a job's ranks (``sparse_rl_mega/train/forked_ranks.py``); exec'd where they cannot
be (a GPU machine). For the suite's torchrun sessions (``tests/conftest.py``: ``run_torchrun``).

    python tests/helpers/torchrun_forked.py N SCRIPT [ARGS...]
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # (before torch: else its OpenMP pool runs a thread here)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sparse_rl_mega.learner.cpu_shims import apply_if_cpu  # noqa: E402

apply_if_cpu()  # (the helpers' common.py applies them before Megatron; forks inherit them)

# the learner, its weights and transformers' models of the families the helpers compare against
HELPER_MODULES = ("sparse_rl_mega.learner.model", "sparse_rl_mega.learner.step", "sparse_rl_mega.learner.weights",
                  "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                  "transformers.models.qwen3.modeling_qwen3")


def main() -> int:
    from sparse_rl_mega.train.forked_ranks import run_script_ranks, start_rank_server

    nproc, script, *script_args = sys.argv[1:]
    return run_script_ranks(int(nproc), script, script_args, start_rank_server(HELPER_MODULES), "torchrun_forked")


if __name__ == "__main__":
    sys.exit(main())
