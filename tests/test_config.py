import pytest
import torch

from commfuse_dp import CommFuseConfig


def test_defaults_and_keywords():
    cfg = CommFuseConfig(schedule="slicing", bucket_mb=4, param_dtype="bf16", reduce_dtype=torch.float32)
    assert cfg.schedule == "slicing"
    assert cfg.bucket_mb == 4.0 and cfg.bucket_bytes == 4 << 20
    assert cfg.param_dtype is torch.bfloat16 and cfg.reduce_dtype is torch.float32
    assert CommFuseConfig().schedule == "auto" and CommFuseConfig().piece_shards == "auto"


@pytest.mark.parametrize("field,value,fragment", [
    ("schedule", "zero3", "allowed values are ('auto', 'fused', 'slicing', 'fsdp2')"),
    ("piece_shards", "wide", "must be a number"),
    ("link_gbps", 0, "link_gbps=0.0: must be a number of GB/s > 0"),
    ("tokens_per_rank", 0, "tokens_per_rank=0: must be an integer >= 1"),
    ("bucket_mb", 0, "bucket_mb=0"),
    ("bucket_mb", "big", "must be a number"),
    ("direct_kb", -1, "direct_kb=-1.0: must be a number of KiB >= 0"),
    ("min_fuse_numel", -1, ">= 0"),
    ("min_fuse_numel", 1.5, "whole number"),
    ("timeout_s", -3, "timeout_s=-3"),
    ("prefetch_depth", 0, "prefetch_next=false"),
    ("prefetch_depth", 1.5, "whole number"),
    ("piece_shards", 0, "one per hop"),
    ("forward_bundles", "yes", 'must be "auto", true or false'),
    ("replicate", 0, "replicate=0: must be \"auto\" or an integer >= 1"),
    ("replicate", 1.5, "whole number"),
    ("param_dtype", "int8", "allowed values are None, float32, bfloat16, float16"),
    ("reduce_dtype", torch.int32, "reduce_dtype"),
    ("grad_divide", "middle", "'post', 'pre', 'split'"),
    ("stats", "yes", "true or false"),
    ("nonfinite_grads", "ignore", "allowed values are ('auto', 'raise', 'skip', 'off')"),
    ("nonfinite_grads", True, "allowed values are ('auto', 'raise', 'skip', 'off')"),
    ("feedback_dtype", "float16", "allowed values are ('float32', 'bfloat16')"),
    ("feedback_dtype", torch.int8, "allowed values are ('float32', 'bfloat16')"),
])
def test_bad_values_name_the_field(field, value, fragment):
    with pytest.raises(ValueError) as info:
        CommFuseConfig(**{field: value})
    assert f"CommFuseConfig.{field}" in str(info.value)
    assert fragment in str(info.value)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['buckt_mb'\]; known fields are"):
        CommFuseConfig.from_dict({"buckt_mb": 3})
    assert CommFuseConfig.from_dict({"bucket_mb": 3}).bucket_mb == 3.0


def test_from_yaml_flat_and_block(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("schedule: slicing\nbucket_mb: 8\nparam_dtype: bfloat16\n")
    assert CommFuseConfig.from_yaml(flat) == CommFuseConfig(schedule="slicing", bucket_mb=8, param_dtype="bf16")
    block = tmp_path / "accelerate.yaml"
    block.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\ncommfuse:\n  timeout_s: 30\n")
    assert CommFuseConfig.from_yaml(block).timeout_s == 30.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a YAML mapping"):
        CommFuseConfig.from_yaml(bad)


def test_env_round_trip():
    cfg = CommFuseConfig(schedule="slicing", bucket_mb=2.5, min_fuse_numel=10, param_dtype="fp16",
                         timeout_s=12, stats=False, grad_divide="split", prefetch_depth=3, replicate=2,
                         piece_shards=4, forward_bundles=False)
    env = cfg.to_env()
    assert env["COMMFUSE_FORWARD_BUNDLES"] == "false" and CommFuseConfig().to_env()["COMMFUSE_FORWARD_BUNDLES"] == "auto"
    assert CommFuseConfig.from_env({"COMMFUSE_FORWARD_BUNDLES": "auto"}).forward_bundles == "auto"
    assert env["COMMFUSE_PREFETCH_DEPTH"] == "3" and env["COMMFUSE_REPLICATE"] == "2"
    assert env["COMMFUSE_PIECE_SHARDS"] == "4"
    assert env["COMMFUSE_BUCKET_MB"] == "2.5" and env["COMMFUSE_STATS"] == "false"
    assert CommFuseConfig.from_env(env) == cfg
    assert CommFuseConfig.from_env({"COMMFUSE_TIMEOUT_S": "7"}, bucket_mb=1).timeout_s == 7.0


def test_env_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="COMMFUSE_BUCKET_MB='lots': must be a number"):
        CommFuseConfig.from_env({"COMMFUSE_BUCKET_MB": "lots"})
    with pytest.raises(ValueError, match="COMMFUSE_STATS='maybe'"):
        CommFuseConfig.from_env({"COMMFUSE_STATS": "maybe"})
    with pytest.raises(ValueError, match="CommFuseConfig.schedule='ring'"):
        CommFuseConfig.from_env({"COMMFUSE_SCHEDULE": "ring"})


def test_exclude_patterns():
    cfg = CommFuseConfig(exclude=["*.experts.*", "lm_head"])
    assert cfg.exclude == ("*.experts.*", "lm_head") and cfg.exclude_data_dependent is True
    assert CommFuseConfig.from_dict({"exclude": " *.mlp.* , lm_head "}).exclude == ("*.mlp.*", "lm_head")
    assert CommFuseConfig().exclude == () and CommFuseConfig().to_dict()["exclude"] == []
    for bad, fragment in ((3, "list of module-name patterns"), ([1], "list of module-name patterns"),
                          (("a", ""), "empty or contain a comma"), (("a,b",), "empty or contain a comma")):
        with pytest.raises(ValueError, match=fragment):
            CommFuseConfig(exclude=bad)
    with pytest.raises(ValueError, match="CommFuseConfig.exclude_data_dependent"):
        CommFuseConfig(exclude_data_dependent="no")


def test_exclude_yaml_and_env_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("commfuse:\n  exclude: ['*.experts.*', lm_head]\n  exclude_data_dependent: false\n")
    cfg = CommFuseConfig.from_yaml(path)
    assert cfg == CommFuseConfig(exclude=("*.experts.*", "lm_head"), exclude_data_dependent=False)
    env = cfg.to_env()
    assert env["COMMFUSE_EXCLUDE"] == "*.experts.*,lm_head" and env["COMMFUSE_EXCLUDE_DATA_DEPENDENT"] == "false"
    assert CommFuseConfig.from_env(env) == cfg
    assert CommFuseConfig.from_env(CommFuseConfig().to_env()) == CommFuseConfig()
    assert CommFuseConfig.from_env({"COMMFUSE_EXCLUDE": "lm_head"}).exclude == ("lm_head",)
    path.write_text("exclude: '*.mlp.*,lm_head'\n")
    assert CommFuseConfig.from_yaml(path).exclude == ("*.mlp.*", "lm_head")


def test_env_rejects_unknown_variables():
    with pytest.raises(ValueError) as info:
        CommFuseConfig.from_env({"COMMFUSE_SCHEDUL": "fused", "PATH": "/bin"})
    message = str(info.value)
    assert message.startswith("COMMFUSE_SCHEDUL: unknown commfuse_dp environment variable")
    assert "did you mean COMMFUSE_SCHEDULE?" in message
    assert "'COMMFUSE_BUCKET_MB'" in message and "'COMMFUSE_ENABLE'" in message
    with pytest.raises(ValueError, match=r"COMMFUSE_BUCKETMB \(and 1 more: \['COMMFUSE_ZZZ'\]\).*COMMFUSE_BUCKET_MB"):
        CommFuseConfig.from_env({"COMMFUSE_BUCKETMB": "3", "COMMFUSE_ZZZ": "1"})
    # Reserved for the integrations: accepted and ignored.
    cfg = CommFuseConfig.from_env({"COMMFUSE_ENABLE": "1", "COMMFUSE_CONFIG": "/tmp/c.yaml", "COMMFUSE_STATS": "0"})
    assert cfg == CommFuseConfig(stats=False)


def test_nonfinite_grads_from_every_source(tmp_path):
    assert CommFuseConfig().nonfinite_grads == "auto"
    assert CommFuseConfig(nonfinite_grads="skip").nonfinite_grads == "skip"
    assert CommFuseConfig.from_dict({"nonfinite_grads": "raise"}).nonfinite_grads == "raise"
    path = tmp_path / "c.yaml"
    path.write_text("commfuse:\n  nonfinite_grads: off\n")  # YAML 1.1 reads an unquoted off as false
    assert CommFuseConfig.from_yaml(path).nonfinite_grads == "off"
    path.write_text("nonfinite_grads: skip\n")
    assert CommFuseConfig.from_yaml(path) == CommFuseConfig(nonfinite_grads="skip")
    cfg = CommFuseConfig(nonfinite_grads="off")
    assert cfg.to_env()["COMMFUSE_NONFINITE_GRADS"] == "off" and CommFuseConfig.from_env(cfg.to_env()) == cfg
    assert CommFuseConfig.from_env({"COMMFUSE_NONFINITE_GRADS": " skip "}).nonfinite_grads == "skip"
    with pytest.raises(ValueError, match="CommFuseConfig.nonfinite_grads='never'"):
        CommFuseConfig.from_env({"COMMFUSE_NONFINITE_GRADS": "never"})


def test_feedback_dtype_from_every_source(tmp_path):
    """``feedback_dtype``: a name, an alias or a torch dtype, kept as its name; from YAML's ``commfuse:`` block and
    the environment like every field."""
    assert CommFuseConfig().feedback_dtype == "bfloat16" and CommFuseConfig().feedback_torch_dtype is torch.bfloat16
    for value, name in (("bf16", "bfloat16"), ("FP32", "float32"), (torch.float32, "float32"),
                        ("torch.bfloat16", "bfloat16")):
        assert CommFuseConfig(feedback_dtype=value).feedback_dtype == name, value
    block = tmp_path / "accelerate.yaml"
    block.write_text("num_processes: 2\ncommfuse:\n  reduce_format: int8\n  error_feedback: true\n"
                     "  feedback_dtype: fp32\n")
    cfg = CommFuseConfig.from_yaml(block)
    assert cfg.feedback_dtype == "float32" and cfg.feedback_torch_dtype is torch.float32
    assert cfg.to_env()["COMMFUSE_FEEDBACK_DTYPE"] == "float32" and CommFuseConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(ValueError, match=r"CommFuseConfig\.feedback_dtype='int8': allowed values"):
        CommFuseConfig.from_env({"COMMFUSE_FEEDBACK_DTYPE": "int8"})
