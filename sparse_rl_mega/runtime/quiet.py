"""Known, harmless warnings of our dependencies on a machine without CUDA, filtered one by one at our
entry points (``tools/*.py``) and, through ``PYTHONWARNINGS``, in the processes they start (torchrun
workers, SGLang's scheduler and detokenizer). Any other warning still shows."""
from __future__ import annotations

import builtins
import os
import re
import warnings

# (start of the message, why it is harmless, category)
KNOWN_HARMLESS = (
    ("Apex is not installed", "Megatron falls back to torch's norms, which the local layer spec uses anyway",
     "UserWarning"),
    ("Transformer Engine and Apex are not installed",
     "Megatron falls back to its local multi-tensor ops and torch's optimizers (CPU, or a GPU without TE)",
     "UserWarning"),
    ("full scope is deprecated", "Megatron's own TransformerConfig default for cuda_graph_scope; the learner "
                                 "does not capture CUDA graphs", "UserWarning"),
    ("Only CUDA", "SGLang imports its AWQ and GGUF quantization modules on any platform; no quantized model "
                  "is served on CPU", "UserWarning"),
    ("Triton is not supported on current platform", "SGLang's linear-attention (FLA) kernels fall back to the "
                                                    "CPU; the models served here use softmax attention",
     "UserWarning"),
    # resuming: Megatron-Core's dist_checkpointing (pinned) still calls these torch APIs
    ("`load_state_dict` is deprecated", "Megatron-Core's torch_dist loader calls the old name of "
                                        "torch.distributed.checkpoint.load; same function", "FutureWarning"),
    ("Please use DTensor instead and we are deprecating ShardedTensor",
     "Megatron-Core's checkpoints are ShardedTensor-based in the pinned version", "FutureWarning"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", "Megatron-Core's TP / CP layers call the old "
                                                                 "name of the same collective", "FutureWarning"),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", "Megatron-Core's TP / CP layers call the old "
                                                                "name of the same collective", "FutureWarning"),
)


def quiet_known_warnings() -> None:
    """Ignore the warnings of :data:`KNOWN_HARMLESS` here and in every process started from here."""
    entries = [f"ignore:{prefix}:{category}" for prefix, _, category in KNOWN_HARMLESS]
    for prefix, _, category in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=re.escape(prefix), category=getattr(builtins, category))
    inherited = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(inherited + [e for e in entries if e not in inherited])
