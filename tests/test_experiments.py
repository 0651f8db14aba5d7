"""Experiments (one config per published table) expand into their jobs, the launcher configs compose, and a
sweep runs through a real launcher (submitit's local one: one process per job, no cluster)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from evaluation import models, speedup
from evaluation.build import build_drafter
from helpers import CONF, PROJECT_ROOT, tiny_checkpoint
from methods.drafter import Drafter

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def hydra_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def jobs(experiment: str) -> list[list[str]]:
    """The overrides of every job of an experiment's sweep, expanded by Hydra's own parser."""
    params = hydra_config(f"+experiment={experiment}").hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.key_or_group}={value}" for value in o.sweep_string_iterator()] for o in parsed]
    return [list(job) for job in itertools.product(*axes)]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_job_of_every_experiment_composes_and_instantiates(experiment):
    for job in jobs(experiment):
        cfg = hydra_config(f"+experiment={experiment}", *job)
        assert isinstance(build_drafter(cfg.method, vocab_size=64, device="cpu"), Drafter)


def test_readme_cpu_is_the_readme_table():
    assert [job for job in jobs("readme_cpu")] == [[f"method={m}"] for m in (
        "baseline", "recycling", "preset/recycling-paper-b4", "preset/recycling-paper-b3", "pld", "lookahead")]
    labels = [hydra_config("+experiment=readme_cpu", *job).method.label for job in jobs("readme_cpu")]
    assert labels[:4] == ["baseline", "recycling-paper-k8-hot", "recycling-paper-b4-k8-hot", "recycling-paper-b3-k8-hot"]
    cfg = hydra_config("+experiment=readme_cpu")
    assert (cfg.model.name, cfg.data.name, cfg.data.per_category, cfg.max_new_tokens, cfg.dtype, cfg.device) == (
        "smollm2-135m", "spec_bench", 10, 128, "float32", "cpu")


def test_specbench_vicuna7b_is_spec_bench_protocol():
    assert len(jobs("specbench_vicuna7b")) == 4 * 3  # every method, run.id 0,1,2
    cfg = hydra_config("+experiment=specbench_vicuna7b", "method=recycling")
    assert (cfg.model.name, cfg.data.name, cfg.max_new_tokens, cfg.dtype, cfg.device) == (
        "vicuna-7b", "spec_bench", 1024, "float16", "cuda")
    assert (cfg.data.per_category, cfg.data.limit, cfg.data.ids, cfg.data.categories) == (None,) * 4  # all 480
    assert cfg.method.label == "recycling-paper-k8-hot"  # the published tree and start


def test_launcher_configs(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    slurm = hydra_config("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.account=lab",
                         "hydra.launcher.timeout_min=30").hydra.launcher
    assert (slurm.gres, slurm.gpus_per_node, slurm.tasks_per_node, slurm.partition, slurm.account,
            slurm.timeout_min) == ("gpu:1", None, 1, "gpu", "lab", 30)
    assert slurm._target_.endswith("SlurmLauncher")
    assert slurm.max_num_timeout > 0  # a job that reaches its time limit is requeued (it resumes from its file)
    sbatch = _make_sbatch_string(command="run", folder=tmp_path, signal_delay_s=slurm.signal_delay_s,
                                 additional_parameters=dict(slurm.additional_parameters))
    assert f"#SBATCH --signal=USR2@{slurm.signal_delay_s}" in sbatch  # the warning the job stops cleanly on
    assert "#SBATCH --requeue" in sbatch  # requeued by SLURM after a preemption (PreemptMode=REQUEUE)
    joblib = hydra_config("hydra/launcher=joblib_gpus", "hydra.launcher.n_jobs=4").hydra.launcher
    assert joblib._target_.endswith("JoblibLauncher") and joblib.n_jobs == 4
    assert hydra_config().hydra.launcher._target_.endswith("BasicLauncher")  # one job after another by default


def test_a_sweep_runs_through_the_submitit_local_launcher(tmp_path, capsys):
    checkpoint = tiny_checkpoint(tmp_path / "tiny")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": ["a b c d a b c d"]}) + "\n"
                            for i in range(2)))
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "evaluation.run", "-m", "hydra/launcher=submitit_local", "method=baseline,pld",
         "model=hf", f"model.path={checkpoint}", "model.template=plain", f"data.path={data}", "max_new_tokens=4",
         "dtype=float32", "device=cpu", "threads=1", "warmup=0", f"run.dir={out}", "run.progress=false"],
        cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    folder = out / "hf" / "spec_bench_mini"
    for label in ("baseline", "pld-n1-3-k10"):
        records = [json.loads(line) for line in (folder / f"{label}-float32-cpu-run0.jsonl").read_text().splitlines()]
        assert [r["question_id"] for r in records] == [0, 1] and all("choices" in r for r in records)
    assert list(out.glob(".multirun/*/.submitit/*/*_log.out"))  # each job ran in its own process, logged here
    assert speedup.main([str(out), "--json", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["label"], r["group"], r["n_questions"]) for r in rows} == {("baseline", "QA", 2), ("baseline", "Overall", 2),
                                                                           ("pld-n1-3-k10", "QA", 2),
                                                                           ("pld-n1-3-k10", "Overall", 2)}


def test_cuda_free_takes_a_gpu_no_other_job_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(models, "_HELD_GPU", [])
    locks = tmp_path / "gpus"
    (locks / models.platform.node()).mkdir(parents=True)
    other_job = FileLock(locks / models.platform.node() / "cuda-0.lock")
    with other_job:
        assert models.resolve_device("cuda:free") == torch.device("cuda", 1)
    assert models.resolve_device("cuda:free") == torch.device("cuda", 1)  # kept for the next job of this worker
    models._HELD_GPU[0][1].release()


def sbatch(tmp_path: Path, monkeypatch, *overrides: str) -> list[str]:
    """The #SBATCH lines submitit writes for one job of hydra/launcher=slurm (a fake srun: no cluster here)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    params = dict(hydra_config("hydra/launcher=slurm", *overrides).hydra.launcher)
    for key in ("_target_", "submitit_folder", "name", "max_num_timeout"):  # what the launcher passes elsewhere
        params.pop(key)
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / "%j")
    shared = set(BaseQueueConf.__dataclass_fields__)  # as hydra_submitit_launcher's launch() maps them
    executor.update_parameters(**{k if k in shared else f"slurm_{k}": v for k, v in params.items()})
    text = executor._executor._make_submission_file_text("python -m evaluation.run", "0")
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


@pytest.mark.parametrize("overrides, gpu, constraint", [
    ((), "--gres=gpu:1", None),
    (("hydra.launcher.gres=gpu:a100:1",), "--gres=gpu:a100:1", None),
    (("hydra.launcher.constraint=a100",), "--gres=gpu:1", "--constraint=a100"),
])
def test_slurm_asks_for_exactly_one_gpu(tmp_path, monkeypatch, overrides, gpu, constraint):
    lines = sbatch(tmp_path, monkeypatch, "hydra.launcher.partition=gpu", *overrides)
    flags = [line.split("=")[0].removeprefix("#SBATCH --") for line in lines]
    requests = [line for line, flag in zip(lines, flags) if flag == "gres" or "gpu" in flag]  # --gpus-per-node...
    assert requests == [f"#SBATCH {gpu}"], lines
    assert [line for line in lines if "--constraint" in line] == ([f"#SBATCH {constraint}"] if constraint else [])
    assert "#SBATCH --ntasks-per-node=1" in lines and "#SBATCH --cpus-per-task=8" in lines


def test_under_joblib_gpus_an_unindexed_cuda_is_a_free_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(models, "_HELD_GPU", [])
    monkeypatch.delenv(models.GPU_ENV, raising=False)
    assert models.resolve_device("cuda") == torch.device("cuda") and not models._HELD_GPU  # GPU 0, as asked
    assert hydra_config("hydra/launcher=joblib_gpus").hydra.job.env_set == {models.GPU_ENV: "free"}
    monkeypatch.setenv(models.GPU_ENV, "free")
    assert models.resolve_device("cuda:1") == torch.device("cuda", 1) and not models._HELD_GPU  # pinned stays
    other_job = FileLock(tmp_path / "gpus" / models.platform.node() / "cuda-0.lock")
    (tmp_path / "gpus" / models.platform.node()).mkdir(parents=True)
    with other_job:
        assert models.resolve_device("cuda") == torch.device("cuda", 1)
    assert models.resolve_device("auto") == torch.device("cuda", 1)  # kept for this worker's next job
    models._HELD_GPU[0][1].release()


# A stand-in for evaluation.run under a real joblib sweep: every job resolves its device (CUDA faked: 4 GPUs) and
# waits until each job has, so that the jobs run at the same time in separate worker processes.
JOBLIB_APP = """
import json, os, sys, time
from pathlib import Path
import hydra

@hydra.main(config_path=sys.argv.pop(1), config_name="config", version_base=None)
def job(cfg):
    import torch  # in the worker only: the launching process has no use for them
    from evaluation import models

    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 4)
    out = Path(os.environ["OUT"])
    (out / f"{cfg.run.id}.json").write_text(json.dumps([os.getpid(), str(models.resolve_device(cfg.device))]))
    deadline = time.time() + 60
    while len(list(out.glob("*.json"))) < 2 and time.time() < deadline:
        time.sleep(0.05)

job()
"""


def test_joblib_gpus_gives_each_parallel_job_its_own_gpu(tmp_path):
    """The Spec-Bench experiment (device: cuda) under hydra/launcher=joblib_gpus, no device override."""
    (tmp_path / "app.py").write_text(JOBLIB_APP)
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "DRAFTBENCH_CACHE": str(tmp_path / "cache"),
           "OUT": str(tmp_path / "out")}
    env.pop(models.GPU_ENV, None)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "app.py"), str(CONF), "-m", "+experiment=specbench_vicuna7b",
         "hydra/launcher=joblib_gpus", "method=baseline", "run.id=0,1", f"run.dir={tmp_path / 'runs'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    jobs = [json.loads((tmp_path / "out" / f"{i}.json").read_text()) for i in range(2)]
    (pid0, gpu0), (pid1, gpu1) = jobs
    assert pid0 != pid1 and {gpu0, gpu1} <= {f"cuda:{i}" for i in range(4)} and gpu0 != gpu1
