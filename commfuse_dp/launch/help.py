"""The text of ``commfuse-dp launch --help`` (``commfuse_dp/launch/__init__.py``): the command, the ``commfuse:`` keys read
from ``CommFuseConfig``'s own field docstrings, an example config, what runs where."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re

_EXAMPLE = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU          # MULTI_CPU with use_cpu: true on a CPU machine
num_processes: 2
mixed_precision: 'no'
use_cpu: false
commfuse:                            # read by commfuse-dp launch, removed before accelerate sees the file
  bucket_mb: 25
  param_dtype: bf16
  reduce_dtype: fp32
  exclude: ["*.experts.*", "lm_head"]"""



def _field_docs() -> list[tuple[str, str, str]]:
    """(name, default, first sentence of its docstring) of each ``CommFuseConfig`` field, read from its source."""
    from commfuse_dp import config

    docs: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(config.fields))
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CommFuseConfig")
        body = cls.body
        for node, after in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                text = " ".join(after.value.value.split()).replace("``", "")
                docs[node.target.id] = re.split(r"\.\s+(?=[A-Z])", text)[0].rstrip(".") + "."
    except (OSError, StopIteration, SyntaxError):  # no source (frozen install): names and defaults only
        pass
    out = []
    for f in dataclasses.fields(config.CommFuseConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else (
            "[]" if default == () else str(default))
        out.append((f.name, shown, docs.get(f.name, "")))
    return out


def help_text() -> str:
    import textwrap

    lines = [
        "usage: commfuse-dp launch [ACCELERATE LAUNCH OPTIONS] [--config_file FILE] SCRIPT.py [SCRIPT ARGS]",
        "       commfuse-dp launch [ACCELERATE LAUNCH OPTIONS] -m MODULE [MODULE ARGS]",
        "       commfuse-dp launch [ACCELERATE LAUNCH OPTIONS] CONSOLE_SCRIPT [ARGS]",
        "       commfuse-dp launch [--config_file FILE] LAUNCHER [ARGS]   (trl sft ..., accelerate launch ..., torchrun ...)",
        "",
        "Runs an unchanged training script with commfuse sharding, the way a deepspeed_config block in an accelerate",
        "config enables DeepSpeed: `accelerate launch` plus a `commfuse:` block in the same config file.",
        "",
        "In the workers a plain `accelerate.Accelerator()` becomes "
        + "commfuse_dp.integrations.accelerate.CommFuseAccelerator",
        "(prepare() shards the model and points the optimizer at the shards), and `transformers.Trainer` becomes",
        "commfuse_dp.integrations.transformers.CommFuseTrainer, so every Trainer (TRL's too) shards the model before",
        "it prepares it and saves every rank's shards. Nothing else in the script changes.",
        "",
        "The config file (--config_file, else accelerate's default config if there is one) is an ordinary accelerate",
        "config plus a `commfuse:` block. The block is validated first: an unknown key or a bad value prints one",
        "line and exits with status 2 before any worker starts. The rest of the file goes to `accelerate launch`",
        "untouched; all other options are those of `accelerate launch` (see `accelerate launch --help`). Without a",
        "`commfuse:` block the defaults below apply.",
        "",
        "commfuse: keys (CommFuseConfig fields; default in brackets):",
    ]
    for name, default, doc in _field_docs():
        lines.append(f"  {name} [{default}]")
        if doc:
            lines.extend(textwrap.wrap(doc, width=108, initial_indent="      ", subsequent_indent="      "))
    lines += [
        "  Dtypes: float32/fp32, bfloat16/bf16, float16/fp16 or none. exclude: a list of fnmatch patterns of module",
        "  names, or one comma-separated string.",
        "",
        "Example accel.yaml:",
        *("  " + line for line in _EXAMPLE.splitlines()),
        "",
        "  commfuse-dp launch --config_file accel.yaml train.py --epochs 1",
        "",
        "Commands that start their own workers (a LAUNCHER: trl, accelerate, torchrun, or -m torch.distributed.run)",
        "run ONCE, with the activation in their environment: COMMFUSE_ENABLE=1, the COMMFUSE_<FIELD> variables and",
        "a folder with a sitecustomize.py first on PYTHONPATH, which hooks accelerate and transformers in every",
        "distributed worker beneath (RANK and WORLD_SIZE set). So every rank of",
        "  commfuse-dp launch --config_file accel.yaml trl sft --model_name_or_path ... --dataset_name ...",
        "  commfuse-dp launch --config_file accel.yaml accelerate launch train.py",
        "  commfuse-dp launch --config_file accel.yaml torchrun --nproc_per_node 2 train.py",
        "is sharded. An `accelerate launch` under commfuse-dp launch (also the one inside `trl sft`) is this command",
        "with its own options; what they leave out comes from accel.yaml (on CPU: num_processes ranks, not one).",
        "torchrun starts --nproc_per_node workers; one that differs from accel.yaml's num_processes is refused.",
        "Options other than --config_file go to the launcher, not before it. `trl sft --accelerate_config FILE`",
        "with a commfuse: block is refused by accelerate: run `commfuse-dp launch --config_file FILE trl sft ...`.",
        "A launcher started inside a rank (a script that runs `trl sft` itself) is refused with exit status 2.",
        "",
        "GPU: the workers are started by accelerate's own launcher, as `accelerate launch` would.",
        "CPU (use_cpu: true or --cpu, or no GPU on the machine): `accelerate launch` itself starts one process",
        "whatever num_processes says, so commfuse-dp launch starts the num_processes ranks itself with",
        "torch.distributed.run (gloo), with ACCELERATE_USE_CPU=true and the environment accelerate gives its",
        "workers; a free port unless main_process_port is set. A Trainer script on CPU needs nothing else.",
        "",
        "The workers receive COMMFUSE_ENABLE=1 and COMMFUSE_<FIELD> variables (CommFuseConfig.from_env() reads",
        "them). With a DeepSpeed config (GPUs only) DeepSpeed partitions the model and its ZeRO collectives run on",
        "the rings. FSDP and Megatron-LM configs are refused: commfuse shards the model itself.",
        "Exit status: the workers' (the first failed rank's); 2 for a wrong config or wrong options.",
    ]
    return "\n".join(lines)
