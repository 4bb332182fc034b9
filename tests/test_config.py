"""Config validation: each bad config fails before any heavy work, naming its key."""
from pathlib import Path

import pytest
import yaml

from sparse_rl_mega.config import ConfigError, load_config
from tests.conftest import run_tool

ROOT = Path(__file__).resolve().parent.parent
CPU_TINY = ROOT / "examples" / "cpu_tiny.yaml"


def _write_variant(tmp_path, edit):
    raw = yaml.safe_load(CPU_TINY.read_text())
    raw["data"]["train_path"] = str(ROOT / raw["data"]["train_path"])
    raw["model"]["path"] = str(tmp_path / "no-model-yet")
    edit(raw)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_examples_load():
    for name in sorted(p.name for p in (ROOT / "examples").glob("*.yaml")):
        cfg = load_config(ROOT / "examples" / name)
        assert cfg.world_size % (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size) == 0


@pytest.mark.parametrize("edit, key, expected", [
    (lambda r: r["trainer"].update(stepz=3), "trainer.stepz", "unknown key"),
    (lambda r: r["parallel"].update(tensor_model_parallel_size=3), "parallel.tensor_model_parallel_size",
     "must divide model.arch.num_attention_heads=4"),
    (lambda r: r["rollout"]["kv_compression"].update(budget=6), "rollout.kv_compression.budget",
     "must exceed sink + window"),
    (lambda r: r["parallel"].update(nproc_per_node=3), "parallel", "not divisible by TP*PP*CP=1*2*1=2"),
    (lambda r: r["parallel"].update(virtual_pipeline_model_parallel_size=3), "parallel.virtual_pipeline_model_parallel_size",
     "x virtual stages 3 must divide model.arch.num_layers"),
    (lambda r: r["parallel"].update(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2),
     "parallel.virtual_pipeline_model_parallel_size", "needs pipeline_model_parallel_size > 1"),
    (lambda r: r["parallel"].update(virtual_pipeline_model_parallel_size=2) or r["trainer"].update(micro_batch_size=32),
     "trainer.micro_batch_size", "must be a multiple of 2"),
    (lambda r: r["parallel"].update(context_parallel_size=0), "parallel.context_parallel_size", "must be >= 1"),
    (lambda r: r["trainer"].update(lr="fast"), "trainer.lr", "expected float"),
    (lambda r: r["rollout"]["kv_compression"].update(policy="magic"), "rollout.kv_compression.policy", "expected one of"),
    (lambda r: r["rollout"]["kv_compression"].update(selection="per_token"), "rollout.kv_compression.selection",
     "expected one of"),
    (lambda r: r["rollout"]["kv_compression"].update(policy="streaming", selection="per_head"),
     "rollout.kv_compression.selection", "selects by position"),
    (lambda r: r["rollout"]["kv_compression"].update(per_head=True), "rollout.kv_compression.per_head", "unknown key"),
    (lambda r: r["rollout"]["kv_compression"].update(kernel=5), "rollout.kv_compression.kernel",
     "now go under rollout.kv_compression.params: write `params: {kernel: 5}`"),
    (lambda r: r["rollout"]["kv_compression"]["params"].update(lamb=0.2), "rollout.kv_compression.params.lamb",
     "no registered KV policy takes it; parameters: gqa_pool, kernel, lam"),
    (lambda r: r["rollout"]["kv_compression"]["params"].update(kernel=4), "rollout.kv_compression.params.kernel",
     "kernel must be odd"),
    (lambda r: r["rollout"]["kv_compression"]["params"].update(lam="high"), "rollout.kv_compression.params.lam",
     "expected float, got str"),
    (lambda r: r["rollout"]["kv_compression"].update(policy="none", params={"lamb": 0.2}),
     "rollout.kv_compression.params.lamb", "no registered KV policy takes it"),
    (lambda r: r["rollout"].update(engine_tensor_parallel_size=4) or r["parallel"].update(nproc_per_node=4),
     "rollout.engine_tensor_parallel_size",
     "exceeds model.arch.num_query_groups=2"),
    (lambda r: r["trainer"].update(global_batch_size=12), "trainer.global_batch_size", "must divide the samples"),
    (lambda r: r["parallel"].update(pipeline_model_parallel_size=3, nproc_per_node=3),
     "parallel.pipeline_model_parallel_size", "must divide model.arch.num_layers=4"),
    (lambda r: (r["model"]["arch"].update(vocab_size=383),
                r["parallel"].update(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)),
     "parallel.tensor_model_parallel_size",
     "must divide model.arch.vocab_size=383"),
    (lambda r: r["model"].update(fp8="e4m3"), "model.fp8", "transformer_engine"),
    (lambda r: r["rollout"].update(n_samples_per_prompt=1), "rollout.n_samples_per_prompt", "at least 2"),
    (lambda r: r["rollout"].update(top_k=1), "rollout.top_k", "1 is greedy"),
    (lambda r: r["model"]["create_tiny"].update(warmup_batch_size=0), "model.create_tiny.warmup_batch_size",
     "must be >= 1"),
    (lambda r: r["rollout"].update(top_k=0), "rollout.top_k", "must be -1 (off) or >= 2"),
    (lambda r: r["rollout"].update(min_p=0.05), "rollout.min_p", "cannot draw min-p with a per-request seed"),
    (lambda r: r["algorithm"]["correction"].update(reject_low=1.2), "algorithm.correction", "low < 1 < high"),
    (lambda r: r["algorithm"]["correction"].update(token_reject_low=0.5), "algorithm.correction.token_reject_low",
     "unknown key"),
    (lambda r: r["algorithm"]["correction"].update(preset="magic"), "algorithm.correction.preset", "expected one of"),
    (lambda r: r["algorithm"]["correction"].update(is_mode="clip"), "algorithm.correction.is_low",
     "clip mode needs 0 <= is_low < 1 < is_high"),
    (lambda r: r["algorithm"].update(dual_clip=0.5), "algorithm.dual_clip", "must be > 1"),
    (lambda r: r.update(eval={"path": r["data"]["train_path"], "kv": "dense,rkv"}), "eval.kv", "POLICY:BUDGET"),
    (lambda r: r.update(eval={"path": r["data"]["train_path"], "kv": "dense,dense"}), "eval.kv", "repeat"),
    (lambda r: r.update(eval={"path": r["data"]["train_path"], "kv": "snapkv:5"}), "eval.kv",
     "must exceed sink + window"),
    (lambda r: r.update(eval={"path": r["data"]["train_path"], "temperature": 0.0}), "eval.n_samples",
     "greedy decoding"),
])
def test_bad_config_names_key(tmp_path, edit, key, expected):
    path = _write_variant(tmp_path, edit)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{key}" in message and expected in message, message
    assert str(path) in message


def test_arch_must_match_existing_hf_config(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 128, '
                                           '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384}')
    path = _write_variant(tmp_path, lambda r: r["model"].update(path=str(model_dir)))
    with pytest.raises(ConfigError, match=r"model\.arch\.num_layers: 4 disagrees"):
        load_config(path)


def test_override_reaches_value_and_is_validated(tmp_path):
    cfg = load_config(CPU_TINY, ["trainer.iterations=7"])
    assert cfg.trainer.iterations == 7
    with pytest.raises(ConfigError, match="trainer.iterations: must be > 0"):
        load_config(CPU_TINY, ["trainer.iterations=0"])
    # YAML 1.1 reads 1e-3 (no dot) as a string: a float field takes it as the number it spells
    assert load_config(CPU_TINY, ["trainer.lr=1e-3"]).trainer.lr == 1e-3
    with pytest.raises(ConfigError, match="trainer.lr = 'fast': expected float"):
        load_config(CPU_TINY, ["trainer.lr=fast"])
    with pytest.raises(ConfigError, match="rollout.max_staleness: must be >= 0"):
        load_config(CPU_TINY, ["rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match=r"rollout.partial: 'stale' needs rollout.max_staleness >= 1"):
        load_config(CPU_TINY, ["rollout.partial=stale"])
    with pytest.raises(ConfigError, match=r"rollout.partial = False: expected one of 'none', 'stale'"):  # (YAML's off)
        load_config(CPU_TINY, ["rollout.partial=off", "rollout.max_staleness=1"])
    assert load_config(CPU_TINY, ["rollout.partial=reprefill", "rollout.max_staleness=1"]).rollout.partial == "reprefill"


def _launch(*args):
    return run_tool(ROOT / "tools" / "launch.py", *args, timeout=120, warm=False)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_dry_run_prints_layout(name):
    proc = _launch(f"examples/{name}", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "TP" in proc.stdout and "DP" in proc.stdout and "budget" in proc.stdout
    assert "config OK" in proc.stdout


HF_CONFIGS = ROOT / "tests" / "data" / "hf_configs"  # the hub's config.json of every model an example names
# the examples whose model is a cluster folder (an absolute model.path; the others are built or prepared here)
CLUSTER_EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml")
                          if yaml.safe_load(p.read_text())["model"]["path"].startswith("/"))


@pytest.mark.parametrize("name", CLUSTER_EXAMPLES)
def test_cluster_examples_dry_run_and_plan_with_their_models_config_json(tmp_path, name):
    """Each example that names a hub model, with its model folder there (the hub's config.json, shipped in
    tests/data/hf_configs; an empty weights file, which pre-flight only looks for, and a one-word tokenizer):
    --dry-run and --plan pass, model.arch as written agrees with the folder (RoPE scaling included: the 70B
    example's Llama-3.1 has llama3 scaling), and the arch the folder alone gives is the one written."""
    path = yaml.safe_load((ROOT / "examples" / name).read_text())["model"]["path"]
    shipped = HF_CONFIGS / Path(path).name / "config.json"
    assert shipped.is_file(), f"examples/{name} names {path}: ship its config.json as {shipped.relative_to(ROOT)}"
    folder = tmp_path / Path(path).name
    folder.mkdir()
    (folder / "config.json").write_bytes(shipped.read_bytes())
    (folder / "model.safetensors").write_bytes(b"")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    for flag, expected in (("--dry-run", "config OK"), ("--plan", "verdict    fits")):
        proc = _launch(f"examples/{name}", flag, "--set", f"model.path={folder}")
        assert proc.returncode == 0, (flag, proc.stdout[-3000:] + proc.stderr[-3000:])
        assert expected in proc.stdout, (flag, proc.stdout[-3000:])
    written = load_config(ROOT / "examples" / name, [f"model.path={folder}"]).model.arch
    raw = yaml.safe_load((ROOT / "examples" / name).read_text())
    del raw["model"]["arch"]  # every field from the folder
    raw["model"]["path"] = str(folder)
    from_folder = tmp_path / "from_folder.yaml"
    from_folder.write_text(yaml.safe_dump(raw))
    assert load_config(from_folder).model.arch == written
    if "Llama-3.1" in path:
        assert (written.rope_scaling.rope_type, written.rope_scaling.factor, written.rope_original_positions) == \
            ("llama3", 8.0, 8192)


def test_a_policy_of_another_package_is_configured_planned_and_checked(tmp_path):
    """``keynorm`` (tests/plugins: a few lines and an entry point, nothing in sparse_rl_mega) is read from
    YAML with its own parameter, shown by --plan (--dry-run's layout + memory), where its capabilities
    come from its class: it records no decode queries, so no side buffers and CUDA graphs stay on. Its
    own check of its parameter names the config key."""
    from sparse_rl_mega.kv.registry import policy_class

    assert policy_class("keynorm").__module__ == "keynorm_policy"  # the entry point, not a register call
    kv = {"policy": "keynorm", "budget": 12, "sink": 2, "window": 4, "interval": 2, "params": {"power": 1}}
    good = _write_variant(tmp_path, lambda r: r["rollout"].update(kv_compression=kv))
    proc = _launch(good, "--plan")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "keynorm: budget 12 tokens (sink 2, recent window 4, per_layer selection)" in proc.stdout
    assert "CUDA graphs off" not in proc.stdout and "query ring" not in proc.stdout, proc.stdout
    assert load_config(good).rollout.kv_compression.build_policy().power == 1
    bad = _write_variant(tmp_path, lambda r: r["rollout"].update(kv_compression={**kv, "params": {"power": 0}}))
    with pytest.raises(ConfigError, match=r"rollout\.kv_compression\.params\.power: keynorm: power must be >= 1"):
        load_config(bad)


def test_dry_run_says_how_rollouts_sample():
    """--dry-run's sampling line: the temperature the learner divides by, the truncation and the support
    it carries (bounded by top_k; top-p alone can carry the whole vocabulary per token)."""
    from sparse_rl_mega.cli.describe import sampling_line

    assert sampling_line(load_config(CPU_TINY).rollout) == "temperature 1"
    both = load_config(CPU_TINY, ["rollout.temperature=0.6", "rollout.top_k=5", "rollout.top_p=0.7"]).rollout
    assert sampling_line(both) == ("temperature 0.6, top_k 5, top_p 0.7; the learner's log-probabilities divide the "
                                   "logits by it; the learner renormalises over each token's support as the engines "
                                   "report it (at most 5 ids)")
    assert "up to the whole vocabulary: a top_k bounds it" in sampling_line(
        load_config(CPU_TINY, ["rollout.top_p=0.9"]).rollout)


def test_long_chain_example_plans_compressed_requests_at_a_quarter_of_dense():
    """examples/cpu_long_chain.yaml (the long-response setting) under --plan: a request holds at most its
    10-token prompt + budget 32 + interval 4 + 1 slots against 250 dense."""
    proc = _launch("examples/cpu_long_chain.yaml", "--plan", "--gpu-memory-gb", "80", "--prompt-tokens", "10")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "per request  dense 250 tokens" in proc.stdout and "sparse 47 (prompt" in proc.stdout, proc.stdout
    assert "verdict    fits" in proc.stdout


def test_dry_run_of_70b_shows_its_scale():
    out = _launch("examples/70b_math.yaml", "--dry-run").stdout
    assert "world 32 = 8 node(s) x 4; TP 4 x PP 8 (5 virtual stages each) x DP 1" in out
    assert "8 engine(s) x TP 4, separate, one batch ahead (max_staleness 1)" in out
    assert "FP8" in out and "transformer_engine" in out and "budget 512" in out


def test_missing_input_files_stop_the_launch_before_anything_starts(tmp_path):
    """--dry-run works without the data (cluster configs are checked on laptops); a real launch does not."""
    proc = _launch("examples/cpu_tiny.yaml", "--set", "eval.path=no/such/held_out.jsonl",
                   "--set", f"trainer.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "eval.path: no/such/held_out.jsonl is not a file" in proc.stderr
    assert not (tmp_path / "run").exists()
    assert _launch("examples/cpu_tiny.yaml", "--set", "eval.path=no/such/held_out.jsonl", "--dry-run").returncode == 0


def test_unknown_key_exits_nonzero_with_one_line():
    proc = _launch("examples/cpu_tiny.yaml", "--set", "trainer.stepz=3")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "trainer.stepz" in lines[0], proc.stderr


def test_the_configuration_reference_is_current_and_documents_every_key():
    """docs/config-reference.md is what sparse_rl_mega/config/reference.py generates (a key added or
    changed without regenerating it fails here), and every key says what it does: a comment at its
    field, or a mention in its section's docstring."""
    from sparse_rl_mega.config.reference import PAGE, render, sections
    from sparse_rl_mega.config.run import RunConfig

    assert PAGE.read_text() == render(), "regenerate it: python -m sparse_rl_mega.config.reference"
    undocumented = [key for _, cls, rows in sections(RunConfig) for key, _, _, comment in rows
                    if not comment and f"``{key.rsplit('.', 1)[-1]}``" not in (cls.__doc__ or "")]
    assert undocumented == [], "say what each does (a comment at the field)"


def test_every_accepted_batch_split_gives_each_data_parallel_rank_whole_groups_and_the_ranks_all_rows():
    """The trainer checks no split with a collective: for every layout the config accepts (DP 1-4, groups
    of 2-4, 1-3 optimizer steps), ``data_parallel_rows`` over the ranks is a partition of the batch in
    which every GRPO group (consecutive rows) lies whole on one rank, and step k's rows are the k-th global
    batch whatever the DP size. Plant: a rank's slice one row late, and this fails."""
    import copy

    import torch

    from sparse_rl_mega.batch import data_parallel_rows
    from sparse_rl_mega.config import config_from_dict

    base = yaml.safe_load((ROOT / "examples" / "cpu_tiny.yaml").read_text())
    checked = 0
    for dp in (1, 2, 3, 4):
        for group in (2, 3, 4):
            for prompts in range(1, 13):
                for steps in (1, 2, 3):
                    raw = copy.deepcopy(base)
                    raw["parallel"].update(nproc_per_node=dp, tensor_model_parallel_size=1,
                                           pipeline_model_parallel_size=1)
                    raw["rollout"]["n_samples_per_prompt"] = group
                    raw["data"]["prompts_per_iteration"] = prompts
                    if (prompts * group) % steps:
                        continue
                    raw["trainer"].update(global_batch_size=prompts * group // steps, micro_batch_size=1)
                    try:
                        cfg = config_from_dict(raw, "cpu_tiny.yaml")
                    except ConfigError:
                        continue
                    size, global_batch = prompts * group, cfg.trainer.global_batch_size
                    parts = [data_parallel_rows(size, global_batch, dp, r) for r in range(dp)]
                    assert sorted(torch.cat(parts).tolist()) == list(range(size))
                    for rows in parts:
                        groups = {row // group for row in rows.tolist()}
                        assert len(rows) == len(groups) * group, (dp, group, prompts, steps)
                    for k in range(size // global_batch):  # step k: the k-th global batch on every DP size
                        share = global_batch // dp
                        step_rows = torch.cat([p[k * share:(k + 1) * share] for p in parts])
                        assert sorted(step_rows.tolist()) == list(range(k * global_batch, (k + 1) * global_batch))
                    checked += 1
    assert checked >= 60, checked
