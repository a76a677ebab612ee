import shutil
import subprocess

import pytest

from launcher.slurm import TEMPLATES, main, render


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_templates_render_and_parse(template, tmp_path):
    text = render(template, nodes=1 if template == "single" else 4, gpus_per_node=8, partition="gpu",
                  account="proj", time="02:00:00")
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --account=proj" in text
    assert "launcher/main.py" in text
    p = tmp_path / "job.sbatch"
    p.write_text(text)
    subprocess.run(["bash", "-n", str(p)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    res = subprocess.run(["shellcheck", "-S", "warning", str(p)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_multi_node_uses_c10d_rendezvous_on_first_node():
    text = render("multi")
    assert "--rdzv_backend c10d" in text and "head_node" in text and "NCCL_NVLS_ENABLE=0" in text


def test_usage_error_without_config(tmp_path):
    p = tmp_path / "job.sbatch"
    p.write_text(render("multi"))
    res = subprocess.run(["bash", str(p)], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stderr


def test_cli_rejects_single_with_nodes(capsys):
    assert main(["--template", "single", "--nodes", "2"]) == 2


_TORCHRUN_SHIM = """#!/bin/bash
# plays torchrun + workers: records how it was started, then runs until the stop file appears
{{ echo "args: $*"; echo "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${{TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-}}";
   echo "HYBRIDRL_STOP_FILE=${{HYBRIDRL_STOP_FILE}}"; }} > {log}/torchrun.txt
touch {log}/started
for _ in $(seq 200); do
  if [ -e "${{HYBRIDRL_STOP_FILE}}" ]; then echo saw-stop-file >> {log}/torchrun.txt; exit 1; fi
  sleep 0.1
done
exit 3
"""


def _shims(tmp_path):
    import os
    import stat

    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    shims = {"torchrun": _TORCHRUN_SHIM.format(log=log),
             "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
             "scontrol": (f'#!/bin/bash\nif [ "$1" = show ]; then echo node1; '
                          f'else echo "$*" >> {log}/scontrol.txt; fi\n'),
             # the plan check before launch is the real one in test_usage_error / launcher.planning.plan's tests
             "python": f'#!/bin/bash\necho "$*" > {log}/python.txt\n'}
    for name, text in shims.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    for d in ("launcher", "conf"):
        (tmp_path / d).symlink_to(root / d)
    pythonpath = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=pythonpath, SLURM_JOB_ID="4242",
               SLURM_NNODES="1", SLURM_JOB_NODELIST="node1", GPUS_PER_NODE="2")
    env.pop("HYBRIDRL_STOP_FILE", None)
    return env, log


@pytest.mark.parametrize("template,sig", [("multi", "USR1"), ("single", "TERM")])
def test_preemption_signal_stops_the_run_and_usr1_requeues(tmp_path, template, sig):
    """`#SBATCH --signal=B:USR1@300` before the time limit: the stop file asks the run to checkpoint
    and stop, then the job is requeued with resume=auto. SIGTERM (scancel) stops without a requeue."""
    import signal
    import time

    env, log = _shims(tmp_path)
    job = tmp_path / "job.sbatch"
    job.write_text(render(template))
    proc = subprocess.Popen(["bash", str(job), "conf/ppo_tiny.yaml", "trainer.total_steps=7"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (log / "started").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    out, err = proc.communicate(timeout=30)
    assert (log / "python.txt").read_text().startswith("-m launcher.planning.plan conf/ppo_tiny.yaml")
    run = (log / "torchrun.txt").read_text()
    assert "saw-stop-file" in run and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in run
    assert "--max-restarts 3" in run and "trainer.resume=auto" in run
    assert run.index("trainer.resume=auto") < run.index("trainer.total_steps=7")  # the user's overrides win
    requeued = (log / "scontrol.txt").read_text() if (log / "scontrol.txt").exists() else ""
    if sig == "USR1":
        assert proc.returncode == 0 and requeued.strip() == "requeue 4242", err
    else:
        assert proc.returncode == 1 and requeued == "", err
    assert "asked the run to checkpoint and stop" in err
