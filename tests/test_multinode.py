"""Two machines, emulated: each a network namespace of the emulated cluster (benchmarks/cluster.py), each running
``commfuse-dp launch --num_machines 2 --machine_rank i --main_process_ip ...`` with two ranks, joined by torchrun's
rendezvous over the bridge. The script is the unchanged Trainer script of tests/test_launch.py; the accelerate part
of the config asks for HSDP as accelerate users do (``parallelism_config_dp_replicate_size: 2``), which the launcher
turns into ``CommFuseConfig.replicate`` (a copy of the model per machine, sharded over its two ranks). Its losses,
grad norms and trained logits must match one process given the same batches (per device, W ranks' batches of 2:
what DDP over the W ranks computes, within 1e-6 here)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from benchmarks.cluster import EmulatedCluster
from harness import free_port
from test_launch import CPU_CONFIG, ROOT, TRAINER_SCRIPT, _env

needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="the emulated machines need root and iproute2 (ip, tc)")


def _machines(tmp_path, out, n_machines: int = 2, per_machine: int = 2, hsdp: bool = True, samples: int = 32) -> None:
    """The Trainer script on ``n_machines`` emulated machines of ``per_machine`` ranks. ``hsdp``: the accelerate
    config asks for a copy per machine; otherwise it says nothing and ``CommFuseConfig()``'s defaults choose."""
    config = tmp_path / "accel.yaml"
    parallelism = {"parallelism_config": {"parallelism_config_dp_replicate_size": n_machines,
                                          "parallelism_config_dp_shard_size": per_machine}} if hsdp else {}
    config.write_text(yaml.safe_dump({**CPU_CONFIG, "num_processes": n_machines * per_machine,
                                      "num_machines": n_machines, **parallelism,
                                      "commfuse": {"min_fuse_numel": 0}}))
    port = free_port()
    with EmulatedCluster(n_machines, 10000) as machines:
        procs = []
        for machine in range(n_machines):
            log = open(tmp_path / f"machine{machine}.log", "w+")
            argv = [sys.executable, "-m", "commfuse_dp.cli", "launch", "--config_file", str(config),
                    "--machine_rank", str(machine), "--main_process_ip", machines.address(0),
                    "--main_process_port", str(port), TRAINER_SCRIPT, str(out), "2", str(samples)]
            procs.append((machines.popen(machine, argv, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT),
                          log))
        failed = []
        for proc, log in procs:
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.seek(0)
            if proc.returncode != 0:
                failed.append(f"exit {proc.returncode}:\n{log.read()[-4000:]}")
        assert not failed, "\n".join(failed)


def _one_process(out, world_size: int, samples: int = 32) -> None:
    """The same script in one process, taking W ranks' batches of 2 at once (2 x W a device)."""
    proc = subprocess.run([sys.executable, TRAINER_SCRIPT, str(out), str(2 * world_size), str(samples)], cwd=ROOT,
                          env={**_env(), "ACCELERATE_USE_CPU": "true"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]


@needs_netns
@pytest.mark.slow
def test_two_machines_hsdp_trainer_matches_one_process(tmp_path):
    ours, one = tmp_path / "hsdp.json", tmp_path / "one.json"
    _machines(tmp_path, ours)
    _one_process(one, 4)
    cf, plain = json.loads(ours.read_text()), json.loads(one.read_text())
    assert cf["world_size"] == 4 and plain["world_size"] == 1
    assert cf["callbacks"].count("CommFuseCallback") == 1 and cf["param_types"] == ["DTensor"]
    assert "(Replicate(), Shard(dim=0))" in cf["placements"], cf["placements"]  # a copy per machine (HSDP)
    assert cf["steps"] == plain["steps"] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(cf["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cf["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-4, atol=0)
    # The trained models' logits: 2 copies x 2 shards sum gradients in another order than one process, and the
    # fused GEMMs run in pieces. After 4 AdamW steps at lr 1e-2 that is within 1e-5 with torch's AVX2 kernels and up
    # to 2.3e-5 with its AVX-512 ones (ATEN_CPU_CAPABILITY=avx2 vs the default on an AMD EPYC); a
    # gradient lost or counted twice would move an Adam step's update by about lr.
    torch.testing.assert_close(torch.tensor(cf["logits"]), torch.tensor(plain["logits"]), rtol=1e-4, atol=1e-4)


@needs_netns
@pytest.mark.parametrize("n_machines,per_machine", [(3, 2), (2, 4)], ids=["3x2", "2x4"])
@pytest.mark.slow
def test_defaults_on_more_machines_match_one_process(tmp_path, n_machines, per_machine):
    """Nothing asked but the launch: the defaults read the machines off torchrun and choose HSDP or one flat
    sharding; the Trainer's losses and grad norms equal one process's given the same batches."""
    world = n_machines * per_machine
    samples = 4 * world * 2 if 32 % (4 * world) else 32  # whole optimizer steps in an epoch (2 a device, 2 micro-batches)
    ours, one = tmp_path / "defaults.json", tmp_path / "one.json"
    _machines(tmp_path, ours, n_machines, per_machine, hsdp=False, samples=samples)
    _one_process(one, world, samples)
    cf, plain = json.loads(ours.read_text()), json.loads(one.read_text())
    assert cf["world_size"] == world and plain["world_size"] == 1
    assert cf["steps"] == plain["steps"] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(cf["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cf["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(cf["logits"]), torch.tensor(plain["logits"]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block,accel,flag,replicate,error", [
    ({"replicate": 2}, {}, 1, 2, None),
    ({}, {"parallelism_config": {"parallelism_config_dp_replicate_size": 2}}, 1, 2, None),
    ({}, {}, 4, 4, None),
    ({"replicate": 2}, {"parallelism_config": {"parallelism_config_dp_replicate_size": 2}}, 2, 2, None),
    ({"replicate": 4}, {"parallelism_config": {"parallelism_config_dp_replicate_size": 2}}, 1, None,
     "disagrees with the commfuse: block's replicate=4"),
    ({}, {"parallelism_config": {"parallelism_config_dp_replicate_size": 2}}, 4, None, "disagrees with the config"),
    ({}, {"parallelism_config": {"parallelism_config_cp_size": 2}}, 1, None, "no context or sequence parallelism"),
    ({"tp_size": 4}, {"parallelism_config": {"parallelism_config_tp_size": 2}}, 1, None,
     "disagrees with the commfuse: block's tp_size=4"),
])
def test_accelerate_replicate_size_becomes_commfuse_replicate(tmp_path, block, accel, flag, replicate, error):
    from commfuse_dp.launch import config as launch_config

    config = tmp_path / "accel.yaml"
    config.write_text(yaml.safe_dump({**CPU_CONFIG, **accel, "commfuse": block}))
    if error:
        with pytest.raises(launch_config.LaunchError, match=error):
            launch_config.read_config(str(config), replicate_flag=flag)
        return
    accel_part, cfg, env = launch_config.read_config(str(config), replicate_flag=flag)
    assert cfg.replicate == replicate and env["COMMFUSE_REPLICATE"] == str(replicate)
    assert "parallelism_config" not in accel_part  # accelerate allows it only with FSDP2, which commfuse replaces


def test_accelerate_tp_size_becomes_commfuse_tp_size(tmp_path):
    from commfuse_dp.launch import config as launch_config

    config = tmp_path / "accel.yaml"
    config.write_text(yaml.safe_dump({**CPU_CONFIG, "commfuse": {}, "parallelism_config": {
        "parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 2}}))
    accel_part, cfg, env = launch_config.read_config(str(config))
    assert cfg.tp_size == 2 and env["COMMFUSE_TP_SIZE"] == "2" and cfg.replicate == "auto"
    assert "parallelism_config" not in accel_part
