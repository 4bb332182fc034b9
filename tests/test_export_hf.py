"""tools/export_hf.py: a training checkpoint becomes an HF folder that transformers loads.

The checkpoints of the shared ``e2e_run`` (saved at PP2) are exported as a user runs the tool: the
newest one from the checkpoints folder at the default layout (one process, TP1 PP1, float32), and
iter_0000003 named directly at PP2 with two processes, bfloat16 and a small shard size (several
safetensors files and an index). Both equal, bit for bit (after the cast for bfloat16), a reading of
the checkpoint that shares no code with the tool: torch's own distributed-checkpoint reader in one
process and the Megatron -> HF layout written out in this test (fused q/k/v split by query group,
gate/up split, layers unstacked). transformers loads both, the weights differ from the initial model
(training moved them), config and tokenizer are the initial model's. The argument errors are checked
without starting torchrun."""
import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_tool

EXPORT = ROOT / "tools" / "export_hf.py"


def independent_hf_weights(checkpoint: Path, arch: dict, work: Path) -> dict:
    """The HF Llama weights of a checkpoint, read with torch.distributed.checkpoint (no process group,
    no Megatron) and laid out by hand: the checkpoint stacks each layer tensor over the layers
    (``decoder.layers.*`` of shape ``[layers, ...]``), fuses q/k/v as ``[groups x (q heads per group +
    2) x head_dim, hidden]`` (each group's query heads, then its key, then its value) and gate/up as
    ``[2 x ffn, hidden]``, and keeps the norms beside the matrices they feed (``layer_norm_weight``)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, work / "whole.pt")
    state = torch.load(work / "whole.pt", weights_only=False)
    layers, hidden, ffn = arch["num_hidden_layers"], arch["hidden_size"], arch["intermediate_size"]
    heads, groups = arch["num_attention_heads"], arch["num_key_value_heads"]
    head_dim = hidden // heads
    per_group = heads // groups
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"],
           "lm_head.weight": state["output_layer.weight"]}
    for i in range(layers):
        qkv = state["decoder.layers.self_attention.linear_qkv.weight"][i].view(groups, per_group + 2, head_dim, hidden)
        fc1 = state["decoder.layers.mlp.linear_fc1.weight"][i]
        prefix = f"model.layers.{i}."
        out.update({
            prefix + "input_layernorm.weight": state["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
            prefix + "self_attn.q_proj.weight": qkv[:, :per_group].reshape(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": qkv[:, per_group].reshape(groups * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": qkv[:, per_group + 1].reshape(groups * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": state["decoder.layers.self_attention.linear_proj.weight"][i],
            prefix + "post_attention_layernorm.weight": state["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i],
            prefix + "mlp.gate_proj.weight": fc1[:ffn],
            prefix + "mlp.up_proj.weight": fc1[ffn:],
            prefix + "mlp.down_proj.weight": state["decoder.layers.mlp.linear_fc2.weight"][i],
        })
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _export(*args, timeout: int = 300):
    return run_tool(EXPORT, *args, timeout=timeout)


def _read_folder(folder: Path) -> dict:
    from sparse_rl_mega.learner.weights import read_hf_state_dict

    return read_hf_state_dict(folder)


def test_export_checkpoint_to_hf(e2e_run, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    run_dir, proc = e2e_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    newest = checkpoints / "iter_0000003"
    assert (newest / "sparse_rl_mega.json").is_file()

    # the default export: the newest complete checkpoint of the folder, one process, float32
    out = tmp_path / "hf"
    done = _export(checkpoints, "--out", out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"{newest} -> {out}" in done.stdout and "iteration 3, saved at TP1 PP2" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja"])
    assert not list(tmp_path.glob(".hf.*"))  # no temporary folder left next to it

    # the sharded path: two processes at PP2, bfloat16, files of at most 0.15 MiB (the model has 0.4 MiB)
    # (into a folder that holds something already: --force replaces it)
    sharded = tmp_path / "hf-sharded"
    sharded.mkdir()
    (sharded / "stale.txt").write_text("from an earlier export")
    done = _export(newest, "--out", sharded, "--nproc", "2", "--pp", "2", "--dtype", "bfloat16",
                   "--max-shard-mb", "0.15", "--force")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    files = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    assert not (sharded / "model.safetensors").exists() and not (sharded / "stale.txt").exists()
    assert not list(tmp_path.glob(".hf-sharded.*"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert all(size.stat().st_size <= 0.15 * 2**20 + 4096 for size in sharded.glob("model-*.safetensors"))

    # the checkpoint read and laid out independently of the tool
    reference = independent_hf_weights(newest, json.loads((tiny_model_dir / "config.json").read_text()), tmp_path)

    exported = _read_folder(out)
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], tensor), name
    exported_bf16 = _read_folder(sharded)
    assert sorted(exported_bf16) == sorted(reference) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in exported_bf16.values())
    for name, tensor in reference.items():
        assert exported_bf16[name].dtype == torch.bfloat16 and torch.equal(exported_bf16[name], tensor.bfloat16()), name

    # training changed the weights: the export is not the initial model
    initial = _read_folder(tiny_model_dir)
    assert sorted(initial) == sorted(exported)
    changed = [name for name in initial if not torch.equal(initial[name], exported[name])]
    assert len(changed) > len(initial) // 2, changed

    # transformers loads both folders with exactly the exported weights
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    loaded = model.state_dict()
    for name, tensor in exported.items():
        assert torch.equal(loaded[name], tensor), name
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 2]])).logits).all()
    model_bf16 = AutoModelForCausalLM.from_pretrained(sharded)
    assert model_bf16.dtype == torch.bfloat16
    assert torch.equal(model_bf16.state_dict()["model.layers.3.mlp.down_proj.weight"],
                       exported_bf16["model.layers.3.mlp.down_proj.weight"])

    # config and tokenizer are the initial model's (the dtype follows the written weights)
    initial_config = json.loads((tiny_model_dir / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == initial_config
    assert json.loads((sharded / "config.json").read_text()) == {**initial_config, "dtype": "bfloat16"}
    ours, theirs = (AutoConfig.from_pretrained(folder).to_dict() for folder in (out, tiny_model_dir))
    assert ours.pop("_name_or_path") != theirs.pop("_name_or_path") and ours == theirs
    for name in ("generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    text = "What is 3 + 4? Answer: 7"
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] and len(ours) == len(theirs)

    # an existing, non-empty --out is refused before anything starts (without --force)
    done = _export(checkpoints / "iter_0000002", "--out", out)
    assert done.returncode == 2 and "is not empty (pass --force" in done.stderr, done.stderr[-2000:]


def test_export_verifies_checkpoints_as_a_resume_does(e2e_run, tmp_path):
    """A copy of the run's checkpoints whose newest has a cut shard: given the folder, the export skips it
    with one line naming the file and takes the newest that verifies, saying which; given the cut one, it
    stops with one line (no traceback). (The output folder is left non-empty so nothing is exported.)"""
    import shutil

    run_dir, _ = e2e_run
    copy = tmp_path / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", copy)
    newest = copy / "iter_0000003"
    shard = next(p for p in sorted(newest.rglob("*.distcp")))
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("")
    done = _export(copy, "--out", busy)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"[export] checkpoint iter_0000003 skipped: it does not verify: {shard}: " in done.stdout, done.stdout
    assert f"[export] iter_0000002: the newest of the 2 complete checkpoint(s) under {copy} that verifies" in \
        done.stdout, done.stdout
    assert f"--out {busy} is not empty" in done.stderr
    done = _export(newest, "--out", tmp_path / "out")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"export_hf.py: checkpoint {newest} does not verify: {shard}: "), lines


def _fake_checkpoint(root: Path, marker: dict) -> Path:
    folder = root / "checkpoints" / "iter_0000001"
    folder.mkdir(parents=True)
    (folder / "sparse_rl_mega.json").write_text(json.dumps(marker))
    return folder


def test_export_errors(tmp_path, capsys, monkeypatch):
    from sparse_rl_mega.cli.export_hf import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # (main() sets it as a user's process; this test's ends with it)

    # as a user runs it: no checkpoint at the path (an empty folder, and an unfinished iter_* folder)
    empty = tmp_path / "nothing"
    (empty / "iter_0000004").mkdir(parents=True)
    done = _export(empty, "--out", tmp_path / "out")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"export_hf.py: {empty}: no complete checkpoint there" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()

    def error_of(*argv) -> str:
        assert main([str(a) for a in argv]) == 2
        return capsys.readouterr().err

    missing = tmp_path / "missing"
    assert f"{missing}: no such checkpoint folder" in error_of(missing, "--out", tmp_path / "o")
    # the initial model folder recorded in the checkpoint is gone: named, with the --model hint
    gone = tmp_path / "moved-away-model"
    fake = _fake_checkpoint(tmp_path / "a", {"iteration": 1, "initial_model": str(gone),
                                             "config": {"model": {"path": str(gone)}}})
    message = error_of(fake.parent, "--out", tmp_path / "o")
    assert f"HF model folder {gone} (the run's initial model, recorded in {fake / 'sparse_rl_mega.json'}) " \
           "does not exist" in message and "pass --model HF_DIR" in message
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    message = error_of(fake, "--out", tmp_path / "o", "--model", no_config)
    assert f"HF model folder {no_config} (given by --model) has no config.json" in message
    # an HF model folder is not a checkpoint, even with a marker file of that name
    other = _fake_checkpoint(tmp_path / "b", {"built_by": "sparse_rl_mega.models.tiny"})
    assert "is not a training checkpoint's marker" in error_of(other, "--out", tmp_path / "o")

    # --help shows an example
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "python tools/export_hf.py runs/cpu_tiny/checkpoints --out" in capsys.readouterr().out
