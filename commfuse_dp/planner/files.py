"""What the planner's command line reads: a model's shape (``--model``: a known name, a Hugging Face ``config.json``
or a folder holding one) and a ``commfuse-dp bench`` results file (``--calibrate``)."""

from __future__ import annotations

import difflib
import json
import os
import sys
from typing import NamedTuple

from .costs import units_for
from .plan import KNOWN_MODELS


def load_model(spec: str) -> tuple:
    if spec in KNOWN_MODELS:
        return KNOWN_MODELS[spec]
    if os.path.isdir(spec):  # a model folder, as the recipes take: its config.json
        if not os.path.isfile(os.path.join(spec, "config.json")):
            print(f"commfuse-dp plan: --model {spec}: the folder holds no config.json (a Hugging Face model folder "
                  f"has one); give the model's folder, its config.json or a known shape ({', '.join(KNOWN_MODELS)})",
                  file=sys.stderr)
            raise SystemExit(2)
        spec = os.path.join(spec, "config.json")
    try:
        with open(spec) as f:
            c = json.load(f)
    except OSError:
        close = difflib.get_close_matches(spec, KNOWN_MODELS, n=1)
        print(f"commfuse-dp plan: --model {spec!r} is neither a known shape ({', '.join(KNOWN_MODELS)}) nor a "
              f"readable HF config.json (or a folder holding one)" + (f"; did you mean {close[0]!r}?" if close else ""),
              file=sys.stderr)
        raise SystemExit(2) from None
    try:
        hidden = c.get("hidden_size", c.get("n_embd"))
        heads = c.get("num_attention_heads", c.get("n_head"))
        return (hidden, c.get("intermediate_size", c.get("n_inner") or 4 * hidden),
                c.get("num_hidden_layers", c.get("n_layer")), heads, c.get("num_key_value_heads", heads),
                c["vocab_size"])
    except (KeyError, TypeError, AttributeError):
        print(f"commfuse-dp plan: --model {spec} lacks hidden_size / num_hidden_layers / num_attention_heads / "
              f"vocab_size", file=sys.stderr)
        raise SystemExit(2) from None


BENCH_MIN_FUSE_NUMEL = 1 << 16  # what `commfuse-dp bench` ran with before its files recorded it (its default then)


class Bench(NamedTuple):
    """What ``calibrate`` reads of a ``commfuse-dp bench`` file: the run's shape and the planner's units of it."""
    world: int
    tokens: int
    direct_bytes: int  # bucketed collectives this small took one round (0: the file does not say; all went round)
    rows_ring: bool  # the ring embedding's rows went round a ring (``Unit.exchange``)
    min_fuse_numel: int
    units: list
    flops: float  # the model FLOPs of one step
    zero3_bytes: float  # what the bench's comm_only moves per rank and step
    names: dict[str, str]  # the planner's schedule -> the bench's record of it
    by_rate: dict[float, dict[str, dict]]  # the bench's records per link rate (Mbit/s) and schedule


BENCH_KEYS = ("model", "world_size", "records")  # what every `commfuse-dp bench --json` file holds


def read_bench_file(path: str) -> dict:
    """A ``commfuse-dp bench --json`` file's contents; ``ValueError`` saying so for a file that is not JSON or not
    such a file (``OSError`` where it cannot be read)."""
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"--calibrate {path}: not JSON ({err.msg}, line {err.lineno}); give the file that "
                             f"`commfuse-dp bench --json FILE` wrote") from None
    missing = [k for k in BENCH_KEYS if not isinstance(raw, dict) or k not in raw]
    if missing:
        raise ValueError(f"--calibrate {path}: not a `commfuse-dp bench --json` results file (it has no "
                         f"{', '.join(missing)}); give the file that `commfuse-dp bench --json FILE` wrote")
    return raw


def read_bench(bench: dict) -> Bench:
    m = bench["model"]
    model = (m["hidden"], m["intermediate"], m["layers"], m["heads"], m.get("kv_heads") or m["heads"], m["vocab"])
    tokens, seq, world = m["batch"] * m["seq"], m["seq"], bench["world_size"]
    rows_ring = m.get("embedding_rows") != "direct"  # a file without it: the rows went round a ring
    units = units_for(*model, tokens=tokens, seq=seq)
    # What the bench's comm_only moves per rank: every unit gathered twice and reduce-scattered once, except the ring
    # embedding's two exchanges.
    zero3_bytes = sum(2 * u.exchange(world, rows_ring)[1] * 4 if u.table else
                      3 * (u.fused_numel + u.other_numel) * 4 * (world - 1) / world for u in units)
    # no_overlap has no measured twin: stock FSDP2 is unoverlapped on CPU but runs gloo's own collectives, which
    # are slower than the rings the planner models.
    names = {"fused": "fused", "fsdp2": "fsdp2_overlap", "fsdp2_coarse": "fsdp2_coarse", "slicing": "slicing",
             "lockstep": "fused_lockstep"}
    if m.get("peer_units") != "torchtitan":  # a file from before the peer took torchtitan's units: it ran the coarse
        names = {**{k: v for k, v in names.items() if k != "fsdp2"}, "fsdp2_coarse": "fsdp2_overlap"}
    by_rate: dict[float, dict[str, dict]] = {}
    for r in bench["records"]:
        by_rate.setdefault(r["rate_mbit"], {})[r["schedule"]] = r
    return Bench(world, tokens, m.get("direct_kb", 0) * 1024,  # runs that do not record it went round the ring
                  rows_ring, m.get("min_fuse_numel", BENCH_MIN_FUSE_NUMEL), units,
                  3 * sum(u.flops for u in units), zero3_bytes, names, by_rate)
